"""Command-line options derived from a config dataclass, so every command validates in one place.

Each field becomes ``--field-name`` typed and defaulted from the field;
booleans get ``--name/--no-name``, tuples take several values. The dataclass's
own ``__post_init__`` then validates the values.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any


def add_config_options(parser: argparse.ArgumentParser, config: type) -> None:
    """One ``--option`` per dataclass field."""
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=help_text)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(flag, dest=f.name, type=typing.get_args(kind)[0], nargs="+",
                                default=f.default, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=f.default,
                                choices=f.metadata.get("choices"), help=help_text)


def config_from_args(config: type, args: argparse.Namespace) -> Any:
    """Build ``config`` from parsed options (lists from ``nargs`` become tuples)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config)}
    return config(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
