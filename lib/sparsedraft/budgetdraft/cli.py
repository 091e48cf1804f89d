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
import json

from ..cliopts import add_config_options, config_from_args
from .config import TrainConfig
from .train import train_drafter

HELP = "train a BudgetDraft drafter (L_A + lambda * L_C) against a frozen verifier"


def add_train_parser(parser: argparse.ArgumentParser) -> None:
    add_config_options(parser, TrainConfig)


def run_train_drafter(args: argparse.Namespace) -> None:
    cfg = config_from_args(TrainConfig, args)
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

