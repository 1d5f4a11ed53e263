"""Security properties that must not regress: loopback by default, no pickle/eval/exec and no
outbound fetches in the package, safetensors only, the engine's sockets private to the server."""

from __future__ import annotations

import argparse
import ast
import asyncio
import stat
from pathlib import Path

import pytest
import torch
import zmq
from safetensors.torch import save_file
from test_async_engine import one_omp_thread

from kdaserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kdaserve.engine.async_engine import AsyncEngine
from kdaserve.model.loader import load_model
from kdaserve.server.cli import add_serve_arguments

PACKAGE = Path(__file__).resolve().parents[2] / "kdaserve"
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}
BANNED_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "ftplib", "socketserver"}
NETWORK_CLIENTS = {"httpx", "urllib.request", "requests", "http.client"}
# Clients by design: the load generator talks to the URL its user gives it; image_io fetches
# http(s) images only from hosts on an opt-in allow-list, never following redirects; the
# disaggregation proxy talks to the prefill and decode instances its user lists.
CLIENT_MODULES = {"bench/serve.py", "image_io.py", "disagg/proxy.py", "disagg/backends.py"}


def _python_files():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        yield rel, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_no_eval_exec_pickle_or_network_clients_in_the_package():
    found = []
    for rel, tree in _python_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in BANNED_CALLS:
                found.append(f"{rel}:{node.lineno} {node.func.id}()")
            if isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(
                    node.value, ast.Name) and node.value.id in ("torch", "pickle"):
                found.append(f"{rel}:{node.lineno} {node.value.id}.load")
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name in BANNED_MODULES or (name in NETWORK_CLIENTS
                                              and rel not in CLIENT_MODULES):
                    found.append(f"{rel}:{node.lineno} import {name}")
    assert not found, found


def test_binds_loopback_by_default():
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args([]).host == "127.0.0.1"


def test_pickled_checkpoints_are_not_loaded(tmp_path, hf_checkpoint):
    path, _ = hf_checkpoint
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pickled checkpoints are not loaded"):
        load_model(tmp_path, progress=False)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor 'x'"):
        load_model(tmp_path, progress=False)


def test_engine_sockets_are_private_ipc(tiny_model_dir):
    """The command/result sockets are ipc:// files in a fresh 0700 directory, so only the
    server's user can reach the engine; nothing listens on TCP."""
    cfg = EngineConfig(model=str(tiny_model_dir), cache=CacheConfig(cache_memory_bytes=16 << 20),
                       scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=256))

    async def scenario():
        eng = AsyncEngine(cfg)
        with one_omp_thread():
            await eng.start()
        try:
            folder = Path(eng._child._tmpdir)
            mode = stat.S_IMODE(folder.stat().st_mode)
            endpoints = [s.getsockopt_string(zmq.LAST_ENDPOINT)
                         for s in (eng._child._cmd, eng._child.out)]
            return mode, endpoints, folder
        finally:
            await eng.shutdown()

    mode, endpoints, folder = asyncio.run(scenario())
    assert mode == 0o700
    assert all(e.startswith(f"ipc://{folder}/") for e in endpoints), endpoints
    assert not folder.exists()                 # removed at shutdown
