"""The command-line flags of EngineArgs: one per field, for `kdaserve serve`, `generate` and
the benches, built from the fields' metadata (kdaserve/engine/args.py `_arg`), so a setting
added to EngineArgs is a flag everywhere with the same name, default and help."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, fields
from typing import Any

from kdaserve.engine.args import EngineArgs


def _value_type(hint: Any) -> Callable[[str], Any]:
    """int, float or str from an annotation such as `int | None`."""
    options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    for kind in (int, float, str):
        if kind in options:
            return kind
    raise TypeError(f"no command-line type for {hint!r}: give the field a `parse`")


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                         exclude: Iterable[str] = ()) -> None:
    """One flag per EngineArgs field (`exclude`: fields a command spells its own way)."""
    skip = set(exclude)
    hints = typing.get_type_hints(EngineArgs)
    for f in fields(EngineArgs):
        if f.name in skip:
            continue
        meta = f.metadata
        default = f.default if f.default is not MISSING else None
        help_text = meta["help"]
        if "default" not in help_text and default is not None:
            shown = ("on" if default else "off") if isinstance(default, bool) else default
            help_text += f" (default: {meta['shown'] or shown})"
        names = (flag_name(f.name), *meta["aliases"])
        if isinstance(default, bool):           # --flag and --no-flag
            parser.add_argument(*names, dest=f.name, default=default, help=help_text,
                                action=argparse.BooleanOptionalAction)
            continue
        parser.add_argument(*names, dest=f.name, default=default, help=help_text,
                            type=meta["parse"] or _value_type(hints[f.name]),
                            choices=meta["choices"], metavar=meta["metavar"])

