"""`kdaserve proxy --prefill URL [URL ...] --decode URL [URL ...] --port P`."""

from __future__ import annotations

import argparse
import logging

from kdaserve import arg_types


def add_arguments(p: argparse.ArgumentParser) -> None:
    arg_types.add_listen_arguments(p)
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instances (kdaserve serve --role prefill), e.g. "
                   "http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instances (kdaserve serve --role decode --kv-transfer-port P)")
    p.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="seconds a prefill instance has to compute the prompt and push its "
                   "cache (default: 60); past it the client gets a 504")
    p.add_argument("--probe-timeout", type=float, default=1.0,
                   help="seconds an instance's /metrics has to answer the load probe before "
                   "it is ranked last (default: 1)")
    p.add_argument("--hit-query-timeout", type=float, default=2.0,
                   help="seconds a decode instance has to say how much of a prompt it holds "
                   "(the hit query) before the whole prompt is sent (default: 2)")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kdaserve.disagg.proxy import Proxy
    from kdaserve.disagg.proxy_app import build_proxy_app

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = Proxy(args.prefill, args.decode, prefill_timeout_s=args.prefill_timeout,
                  probe_timeout_s=args.probe_timeout,
                  hit_query_timeout_s=args.hit_query_timeout)
    logging.getLogger("kdaserve").info("proxy on http://%s:%d/v1: prefill %s, decode %s",
                                       args.host, args.port, args.prefill, args.decode)
    uvicorn.run(build_proxy_app(proxy), host=args.host, port=args.port, log_config=None,
                log_level=args.log_level)
    return 0
