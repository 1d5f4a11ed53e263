"""Command-line value types: byte sizes ("256MiB"), bounded integers, fractions, offload tiers.

Shared by the engine flags (engine/args.py) and the server's own flags (server/args.py); plain
Python, so building a parser stays free of torch.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20,
               "mib": 1 << 20, "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
               "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_size(text: str) -> int:
    """Bytes from "1073741824", "256MiB", "1GiB", "1.5G" (K/M/G/T are binary, KB/MB/... not)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes or e.g. 256MiB, 1GiB")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
port = int_at_least(0, 65535)


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def slowdown(text: str) -> float:
    """A factor >= 1, or 0 for none."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value != 0.0 and not value >= 1.0:
        raise argparse.ArgumentTypeError(f"must be >= 1 (or 0: no limit), got {text}")
    return value


def size_or_fraction(text: str) -> float | int:
    """A fraction in [0, 1) (of some other budget), else a byte size."""
    try:
        frac = float(text)
    except ValueError:
        return parse_size(text)
    if 0 <= frac < 1:
        return frac
    return parse_size(text)


def offload_tiers(text: str) -> tuple[str, ...]:
    tiers = tuple(t.strip() for t in text.split(",") if t.strip())
    if tiers not in (("host",), ("disk",), ("host", "disk")):
        raise argparse.ArgumentTypeError(f"use host, disk or host,disk, got {text!r}")
    return tiers


def offload_sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(t) for t in text.split(","))


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_listen_arguments(p: argparse.ArgumentParser, default_port: int = 8000) -> None:
    """--host, --port and --log-level, as every kdaserve HTTP service takes them (serve,
    proxy)."""
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=port, default=default_port,
                   help="port to listen on (default: %(default)s)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="log level (default: %(default)s)")
