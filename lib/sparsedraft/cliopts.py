"""Command-line options derived from a config dataclass, so every command validates in one place.

Each field becomes ``--field-name`` typed and defaulted from the field;
booleans get ``--name/--no-name``, tuples take several values. With
``given_only`` a flag left off the command line leaves no value at all (its
help still names the dataclass default), so a command can tell the options a
user gave from the ones it may fill in itself. ``options_from_pairs`` reads
the same fields from ``name=value`` pairs (``bench ... --also``). A field whose
metadata says ``cli=False`` (a value no flag can spell, such as a list of
methods with their options) gets no flag; the command supplies it. The
dataclass's own ``__post_init__`` then validates the values.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from .errors import SparsedraftError, require


def _flagged(config: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(config) if f.metadata.get("cli", True)]


def add_config_options(parser: argparse.ArgumentParser, config: type, given_only: bool = False,
                       exclude: typing.Collection[str] = ()) -> None:
    """One ``--option`` per dataclass field (``given_only``: no value unless the flag is given), except the
    fields named in ``exclude`` (another config's options already spell them)."""
    hints = typing.get_type_hints(config)
    for f in _flagged(config):
        if f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        default = argparse.SUPPRESS if given_only else f.default
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(flag, dest=f.name, type=typing.get_args(kind)[0], nargs="+",
                                default=default, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=default,
                                choices=f.metadata.get("choices"), help=help_text)


def values_from_args(config: type, args: argparse.Namespace) -> dict[str, Any]:
    """The flagged fields of ``config`` that have a value (lists from ``nargs`` become tuples)."""
    values = {f.name: getattr(args, f.name) for f in _flagged(config) if hasattr(args, f.name)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


def config_from_args(config: type, args: argparse.Namespace, **unflagged: Any) -> Any:
    """Build ``config`` from parsed options plus the values of fields that have no flag."""
    return config(**values_from_args(config, args), **unflagged)


def options_from_pairs(config: type, text: str) -> dict[str, Any]:
    """``name=value[,name=value...]`` as typed values of ``config``'s flagged fields (a name as the field or its
    flag spells it: ``draft_lookup`` or ``draft-lookup``); an unknown name or a value that is not of the field's
    type is one error naming what would do."""
    hints = typing.get_type_hints(config)
    fields = {f.name: hints[f.name] for f in _flagged(config)}
    out: dict[str, Any] = {}
    for pair in filter(None, text.split(",")):
        name, sep, value = pair.partition("=")
        key = name.strip().lstrip("-").replace("-", "_")
        require(sep and key in fields, f"{pair!r} is not OPTION=VALUE with OPTION one of {sorted(fields)}")
        kind = fields[key]
        require(kind in (int, float, str, bool), f"option {key} ({kind}) cannot be given as OPTION=VALUE")
        if kind is bool:
            require(value in ("true", "false", "1", "0"), f"option {key} takes true or false, got {value!r}")
            out[key] = value in ("true", "1")
            continue
        try:
            out[key] = kind(value)
        except ValueError:
            raise SparsedraftError(f"option {key} takes a value of type {kind.__name__}, got {value!r}") from None
    require(out, f"no OPTION=VALUE pair in {text!r}")
    return out
