"""``python -m sparsedraft train-drafter``: options derived from the training configs.

Hook into :data:`sparsedraft.__main__.COMMANDS` as
``"train-drafter": (HELP, add_train_parser, run_train_drafter)``. ``--kind``
picks the drafter: ``slice`` (BudgetDraft's drafter made of the verifier's
first layers, :class:`TrainConfig`, the default) or ``feature`` (a one-layer
EAGLE-style head over the target's features, :class:`FeatureTrainConfig`).
Every config field becomes ``--field-name`` (booleans get ``--name/--no-name``,
so ``--no-teacher`` forbids computing teacher targets; the budget set takes
several values: ``--budgets 64 128 256 512``); a field both kinds have keeps
its meaning, and a flag only the other kind has is refused before any model
loads. The run prints a summary and then one JSON object as the last line of
stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..cliopts import add_config_options, values_from_args
from ..errors import require
from .config import TrainConfig
from .feature_config import FeatureTrainConfig
from .train import train_drafter

HELP = "train a drafter against a frozen verifier: BudgetDraft's slice drafter or a feature head (--kind)"
KINDS = {"slice": TrainConfig, "feature": FeatureTrainConfig}


def _names(config: type) -> set[str]:
    return {f.name for f in dataclasses.fields(config)}


def add_train_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=sorted(KINDS), default="slice",
                        help="slice: the verifier's first layers, trained with L_A + lambda * L_C (defaults "
                             "shown below); feature: a one-layer head over the target's features (EAGLE), "
                             "whose defaults are FeatureTrainConfig's (default: slice)")
    add_config_options(parser, TrainConfig, given_only=True)
    add_config_options(parser, FeatureTrainConfig, given_only=True, exclude=_names(TrainConfig))


def config_of(args: argparse.Namespace) -> TrainConfig | FeatureTrainConfig:
    """The chosen kind's validated config from the flags given (the others keep the dataclass defaults)."""
    config = KINDS[args.kind]
    given = {**values_from_args(TrainConfig, args), **values_from_args(FeatureTrainConfig, args)}
    foreign = sorted(set(given) - _names(config))
    require(not foreign, f"--kind {args.kind} has no option(s) {', '.join('--' + n.replace('_', '-') for n in foreign)}"
                         f"; they belong to the other kind of drafter (see train-drafter -h)")
    return config(**given)


def run_train_drafter(args: argparse.Namespace) -> None:
    cfg = config_of(args)
    if isinstance(cfg, FeatureTrainConfig):
        run_feature(cfg)
        return
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


def run_feature(cfg: FeatureTrainConfig) -> None:
    from .feature_train import train_feature_drafter
    from .feature_eval import final_report
    result = train_feature_drafter(cfg, evaluate=final_report(cfg) if cfg.final_context else None)
    record = result.record
    print(f"run folder: {result.run_dir}  steps: {result.step}  training tokens/s: {record['train_tokens_per_s']}  "
          f"wall: {record['wall_seconds']} s  peak RSS: {record['peak_rss_mb']} MB")
    print("held-out teacher-forced agreement (a): "
          + "  ".join(f"{k}={v:.3f}" for k, v in record["held_out_agreement"].items()))
    measured = record.get("measured", {})
    for name in ("", "_vocab"):
        if f"first_draft{name}" in measured:
            print(f"greedy continuations at {measured['prompt_len']} ({measured['positions']} positions), head"
                  f"{' (draft vocab)' if name else ''}: first draft (b) {measured[f'first_draft{name}']:.3f}; "
                  "tokens per round (c) " + "  ".join(f"g{g}={v['tokens_per_round']:.2f}"
                                                      for g, v in measured[f"gamma{name}"].items()))
    print(json.dumps({"run_dir": str(result.run_dir), "step": result.step, **record}, default=str))
