"""`kdaserve serve`: the OpenAI-compatible HTTP server, with the engine in a child process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kdaserve.arg_types import parse_size
from kdaserve.assets import DEMO_MODEL_DIR, default_model_path
from kdaserve.config import EngineConfig
from kdaserve.engine.args import EngineArgs
from kdaserve.engine.async_engine import AsyncEngine
from kdaserve.engine.engine_errors import EngineStartupError
from kdaserve.generation_defaults import generation_defaults
from kdaserve.model.registry import load_config
from kdaserve.request import SamplingParams
from kdaserve.server.args import API_KEY_ENV, DEMO_MODEL_NAME, add_serve_arguments
from kdaserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kdaserve.server.lifecycle import DrainingServer

# the flag parsing lives in server/args.py (no web stack); these names stay importable here
__all__ = [
    "API_KEY_ENV",
    "DEMO_MODEL_NAME",
    "add_serve_arguments",
    "load_generation_defaults",
    "main",
    "parse_size",
    "run_serve",
    "served_model_name",
]

logger = logging.getLogger("kdaserve")


def load_generation_defaults(model_dir: Path) -> dict[str, Any]:
    """generation_config.json sampling defaults, checked now rather than on every request."""
    defaults = generation_defaults(model_dir)
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{model_dir / 'generation_config.json'}: {exc}") from None
    return defaults


def served_model_name(model_dir: Path, override: str | None = None) -> str:
    if override:
        return override
    if model_dir.resolve() == DEMO_MODEL_DIR.resolve():
        return DEMO_MODEL_NAME
    return model_dir.resolve().name


@contextlib.contextmanager
def _exit_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


async def _serve(args: argparse.Namespace, config: EngineConfig, tokenizer: Tokenizer,
                 defaults: dict[str, Any], name: str) -> int:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    server: DrainingServer | None = None

    def on_dead(why: str) -> None:
        if server is not None:
            server.engine_died(why)

    engine = AsyncEngine(config, max_waiting=args.max_waiting,
                         max_queued_tokens=args.max_queued_tokens,
                         log_level=getattr(logging, args.log_level.upper()), on_dead=on_dead)
    try:
        # While the model loads, SIGINT/SIGTERM cancel us (and so stop the engine).
        with _exit_signals(lambda *_: loop.call_soon_threadsafe(main.cancel)):
            try:
                starting = asyncio.ensure_future(engine.start())
                await asyncio.sleep(0)       # start() has spawned the engine process
                # the web stack's imports (~0.6 s of CPU) while the engine loads its model
                import uvicorn

                from kdaserve.image_io import ImageLimits
                from kdaserve.server.app import build_app
                from kdaserve.server.guards import ServerLimits
                from kdaserve.server.lifecycle import DrainingServer
                from kdaserve.server.read_timeouts import timed_protocol
                from kdaserve.vision_input import VisionInput

                info = await starting
            except EngineStartupError as exc:
                logger.error("the engine failed to start: %s", exc)
                return 1
        logger.info("cache plan: %s", info.plan)
        limits = ServerLimits(
            max_seqs_per_request=args.max_seqs_per_request,
            default_max_tokens=args.default_max_tokens,
            request_timeout_s=args.request_timeout or None,
            health_timeout_s=args.health_timeout, shutdown_timeout_s=args.shutdown_timeout,
            max_token_bytes=tokenizer.max_token_bytes(),
            allow_special_tokens=args.allow_special_tokens_in_prompt)
        hosts = tuple(h.strip() for h in (args.allow_image_urls or "").split(",") if h.strip())
        image_limits = ImageLimits(
            max_bytes=args.max_image_bytes, max_pixels=args.max_image_pixels,
            max_images=args.max_images_per_request, allow_remote=bool(hosts),
            allowed_hosts=hosts)
        vision = VisionInput.for_model(config.model, tokenizer)
        if vision is not None:
            logger.info("vision: images accepted (placeholder %r, %d pixel patches)",
                        vision.placeholder, vision.processor.patch_size)
        app = build_app(engine, tokenizer, name, info.max_model_len, api_key=args.api_key,
                        max_body_bytes=args.max_body_size, generation_defaults=defaults,
                        limits=limits, public_metrics=args.public_metrics,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser, vision=vision,
                        strict_schemas=not args.open_json_objects,
                        image_limits=image_limits, kv_transfer=config.kv_transfer)
        server = DrainingServer(uvicorn.Config(
            app, host=args.host, port=args.port, log_config=None, lifespan="off",
            log_level=args.log_level, timeout_graceful_shutdown=5,
            http=timed_protocol(args.header_timeout, args.body_timeout)),
            app.state.serving, args.shutdown_timeout)
        logger.info("serving %r on http://%s:%d/v1", name, args.host, args.port)
        # uvicorn handles the signals while serving and re-raises them once it has stopped; the
        # no-op handler lets the engine shut down cleanly after that.
        with _exit_signals(lambda *_: None):
            try:
                await server.serve()
            except SystemExit as exc:        # uvicorn exits like this when it cannot bind
                return exc.code if isinstance(exc.code, int) and exc.code else 1
        if engine.died:
            return 1
        return server.exit_code if server.started else 1
    except asyncio.CancelledError:
        logger.info("interrupted")
        return 130
    finally:
        with _exit_signals(lambda *_: None):
            await engine.shutdown()


def run_serve(args: argparse.Namespace) -> int:
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)       # also when the caller configured logging first
    try:
        model_dir = Path(args.model) if args.model else default_model_path()
        load_config(model_dir)        # fail fast on a bad path or config
        tokenizer = Tokenizer.from_pretrained(model_dir)
        defaults = load_generation_defaults(model_dir)
        config = replace(EngineArgs.from_cli(args), model=str(model_dir)).to_engine_config()
        # torchrun.py imports torch (its ranks' loop): only a torchrun rank needs it here, the
        # server process of any other layout never imports torch (its engine process does)
        worker = False
        if config.parallel.executor == "torchrun":
            from kdaserve.engine.executor.torchrun import is_torchrun_worker

            worker = is_torchrun_worker(config.parallel)
    except (OSError, ValueError) as exc:
        logger.error("%s", exc)
        return 2
    if worker:                       # a torchrun rank > 0: the worker loop, no server
        from kdaserve.engine.executor.torchrun import run_torchrun_rank

        return run_torchrun_rank(config)
    if defaults:
        logger.info("sampling defaults from generation_config.json: %s", defaults)
    name = served_model_name(model_dir, args.served_model_name)
    return asyncio.run(_serve(args, config, tokenizer, defaults, name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kdaserve serve",
                                     description="OpenAI-compatible server for kdaserve models")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
