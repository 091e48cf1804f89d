"""``python -m sparsedraft train-drafter``: options derived from :class:`TrainConfig`.

Hook into :data:`sparsedraft.__main__.COMMANDS` as
``"train-drafter": (HELP, add_train_parser, run_train_drafter)``. Every config
field becomes ``--field-name`` (booleans get ``--name/--no-name``, so
``--no-teacher`` forbids computing teacher targets; the budget set takes
several values: ``--budgets 64 128 256 512``). The run prints a summary and
then one JSON object as the last line of stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from .config import TrainConfig
from .train import train_drafter

HELP = "train a BudgetDraft drafter (L_A + lambda * L_C) against a frozen verifier"


def add_train_parser(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=help_text)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(flag, dest=f.name, type=typing.get_args(kind)[0], nargs="+", default=f.default,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=f.default, choices=f.metadata.get("choices"),
                                help=help_text)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    values["budgets"] = tuple(values["budgets"])
    return TrainConfig(**values)


def run_train_drafter(args: argparse.Namespace) -> None:
    cfg = config_from_args(args)
    result = train_drafter(cfg)
    agreement = result.final.get("agreement", {})
    print(f"run folder: {result.run_dir}  steps: {result.step}  training tokens/s: {result.tokens_per_s:.1f}")
    print("held-out top-1 agreement with the teacher: "
          + "  ".join(f"{view}={value:.3f}" for view, value in agreement.items()))
    for row in result.final.get("acceptance", []):
        print(f"  context {row['context']} budget {row['budget']}: acceptance {row['acceptance_rate']:.3f}, "
              f"{row['tokens_per_verification']:.2f} tokens/verification")
    print(json.dumps({"run_dir": str(result.run_dir), "step": result.step, "tokens_per_s": result.tokens_per_s,
                      "config": cfg.to_dict(), **result.final}))

