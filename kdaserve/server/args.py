"""`kdaserve serve`'s flags: the server's own (listening, limits, auth, parsers) and the engine's,
generated from `EngineArgs`. Kept apart from server/cli.py so that building the parser (and
`kdaserve serve --help`) imports neither torch nor the web stack."""

from __future__ import annotations

import argparse
import os

from kdaserve import arg_types
from kdaserve.engine.engine_flags import add_engine_arguments
from kdaserve.engine.waiting_bounds import DEFAULT_MAX_QUEUED_TOKENS, DEFAULT_MAX_WAITING
from kdaserve.image_io import ImageLimits
from kdaserve.server.reasoning import REASONING_FORMATS
from kdaserve.server.tool_parsers import TOOL_PARSERS

DEMO_MODEL_NAME = "kdaserve-demo"
API_KEY_ENV = "KDASERVE_API_KEY"
# server/app.py's DEFAULT_MAX_BODY_BYTES, repeated: importing the app here would load FastAPI
# and numpy for `--help` (tests/engine/test_engine_args.py checks they agree).
DEFAULT_MAX_BODY_SIZE = "16MiB"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    arg_types.add_listen_arguments(p)
    p.add_argument("--served-model-name", default=None,
                   help="model name clients send and see in /v1/models (default: "
                        f"{DEMO_MODEL_NAME!r} for the bundled model, else the directory name)")
    p.add_argument("--max-waiting", type=arg_types.non_negative_int, default=DEFAULT_MAX_WAITING,
                   help="most sequences (n per prompt) waiting for their first token; beyond "
                        "it requests get HTTP 503 with Retry-After (default: %(default)s)")
    p.add_argument("--max-queued-tokens", type=arg_types.positive_int,
                   default=DEFAULT_MAX_QUEUED_TOKENS,
                   help="most prompt tokens waiting for their first token (default: "
                        "%(default)s)")
    p.add_argument("--max-seqs-per-request", type=arg_types.positive_int, default=128,
                   help="most sequences (prompts x n) one request may ask for (default: "
                        "%(default)s)")
    p.add_argument("--default-max-tokens", type=arg_types.positive_int, default=1024,
                   help="max_tokens of chat requests that give none (default: %(default)s; "
                        "completions default to 16 as in OpenAI's API)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may run before it is aborted (HTTP 504 or an error "
                        "event); 0: no limit (default: %(default)s)")
    p.add_argument("--health-timeout", type=float, default=10.0,
                   help="/health turns 503 when the engine has not reported for this many "
                        "seconds (default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=4.0,
                   help="seconds a connection may take to send a request's headers; then a "
                        "408 and the close (default: %(default)s)")
    p.add_argument("--body-timeout", type=float, default=4.0,
                   help="seconds a request's body may stall between reads; then a 408 and "
                        "the close (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running streams get to finish before they are "
                        "ended with an error event (default: %(default)s)")
    p.add_argument("--max-image-bytes", type=arg_types.parse_size, default=ImageLimits.max_bytes,
                   help="largest encoded image accepted, e.g. 20MiB (default: %(default)s)")
    p.add_argument("--max-image-pixels", type=arg_types.positive_int,
                   default=ImageLimits.max_pixels,
                   help="most pixels (width x height) of one image; larger ones, decompression "
                        "bombs included, are refused from their header (default: %(default)s)")
    p.add_argument("--max-images-per-request", type=arg_types.positive_int,
                   default=ImageLimits.max_images,
                   help="most images in one chat request (default: %(default)s)")
    p.add_argument("--allow-image-urls", default=None, metavar="HOST,...",
                   help="fetch http(s) image URLs from these hosts ('.example.com' matches "
                        "its subdomains); by default only inline data URLs are accepted")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set; "
                        "/health stays open)")
    p.add_argument("--allow-special-tokens-in-prompt", action="store_true",
                   help="encode special tokens typed in prompts and messages as control tokens "
                        "(default: as text, so a user cannot forge chat turns)")
    p.add_argument("--public-metrics", action="store_true",
                   help="with --api-key, leave /metrics open too")
    p.add_argument("--max-body-size", type=arg_types.parse_size, default=DEFAULT_MAX_BODY_SIZE,
                   help=f"largest request body; bigger ones get HTTP 413 (default: "
                        f"{DEFAULT_MAX_BODY_SIZE})")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="read tool calls in this model format (tool_choice auto); "
                        "required/named tool_choice work without one (default: none)")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_FORMATS), default=None,
                   help="move thinking text to reasoning_content (default: none)")
    p.add_argument("--open-json-objects", action="store_true",
                   help="compile JSON schemas (response_format, guided_json, tool parameters) "
                        "with JSON Schema's open objects: keys a schema does not declare are "
                        "allowed unless it says additionalProperties false; by default they are "
                        "not, unless a request says \"strict\": false "
                        "(docs/structured-outputs.md)")
    add_engine_arguments(p.add_argument_group("engine (the same settings as LLM(...))"))
