"""Everything notebook 04's sliders show, computed from one set of slider values.

The sliders should redraw figures, not hold logic, so :func:`explore` takes
the values (γ1, γ2, α1, α2, context, retrieval budget, hardware, and either
hand-set level costs or ``None`` for the roofline costs of that context,
budget and hardware) and returns an :class:`Exploration`: the costs used, the
prediction, explicit schedules for the current γ pair, the acceptance sweep
and the speedup-vs-context bound. :func:`explore_figures` draws them; the
notebook only displays. Because the same functions build the notebook's
static tables, a slider left at the notebook's values redraws what the run
saved.

A schedule needs an outcome for every verification, which acceptance rates
alone do not give. :func:`typical_schedule` takes the expected number of
accepted drafts per verification, rounded to a whole number: with γ drafts
accepted i.i.d. with probability α the expected count is α + α² + … + α^γ.
It is an illustration of one likely iteration, not the expectation itself
(that is :func:`predict_ms_per_token`, which the one-line summary reports).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import pandas as pd

from ..engine.roofline import HARDWARE, MODELS, Hardware
from ..errors import require
from .costmodel import (HierarchySetup, LevelCosts, Prediction, Schedule, acceptance_sweep, build_schedule,
                        expected_tokens_per_verify, level_costs, predict_ms_per_token, speedup_vs_context)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CONTEXT_DOUBLINGS = range(-3, 3)  # the bound is drawn from context / 8 to context * 4 ...
# ... but never past the target's longest supported context (unless the chosen context already is)


@dataclass(frozen=True)
class Exploration:
    """What one position of the sliders shows."""

    source: str  # "roofline" (costs from context, budget, hardware) or "manual" (costs as given)
    costs: LevelCosts
    prediction: Prediction  # expected ms/token of the three levels at alpha1, alpha2
    schedules: dict[str, Schedule]  # "typical" and "all accepted" iterations for the chosen gammas
    sweep: pd.DataFrame  # acceptance_sweep with the chosen gamma pair added when missing
    bound: pd.DataFrame  # speedup_vs_context around the chosen context
    setup: HierarchySetup
    hardware: Hardware
    context: int


def _expected_accepted(alpha: float, drafts: int) -> int:
    """α + α² + … + α^drafts (expected tokens per verify less the verifier's own), rounded half up."""
    return math.floor(expected_tokens_per_verify(alpha, drafts) - 1.0 + 0.5)


def typical_schedule(costs: LevelCosts, gamma1: int, gamma2: int, alpha1: float, alpha2: float,
                     name: str = "typical") -> Schedule:
    """One iteration in which every verification accepts its expected number of tokens (rounded).

    Level 2 runs rounds of γ1 drafts until it holds γ2 tokens, each round
    accepting the same rounded expectation; level 3 then accepts the rounded
    expectation over everything held. α1 = α2 = 1 gives the all-accepted
    iteration.
    """
    per_round = _expected_accepted(alpha1, gamma1)
    rounds = math.ceil(gamma2 / (per_round + 1))  # each round hands up its accepted drafts plus one token
    held = rounds * (per_round + 1)
    return build_schedule(costs, gamma1, gamma2, level2_accepted=(per_round,) * rounds,
                          level3_accepted=_expected_accepted(alpha2, held), name=name)


def _contexts_around(context: int, longest: int) -> list[int]:
    grid = {context * 2 ** k if k >= 0 else context // 2 ** -k for k in CONTEXT_DOUBLINGS}
    return sorted(c for c in grid if 1 <= c <= max(context, longest))


def explore(costs: LevelCosts | None, *, gamma1: int, gamma2: int, alpha1: float, alpha2: float, context: int,
            retrieval_budget: int, hardware: str, alpha_tiny: float, gamma_pairs: Sequence[Sequence[int]],
            alpha_points: int, target: str = "llama2-7b-128k", draft: str = "llama-68m") -> Exploration:
    """The slider view: ``costs=None`` takes each level's ideal read time (:func:`level_costs`) for
    ``target`` and ``draft`` on ``HARDWARE[hardware]`` at ``context`` with a ``retrieval_budget``-token
    retrieval cache; given costs are used as they are for the prediction, schedules and sweep.

    The speedup-vs-context bound always uses roofline costs (hand-set costs have no context to vary),
    with the chosen acceptance rates, gammas and budget; ``alpha_tiny`` is the tiny-draft baseline's
    acceptance rate there.
    """
    require(hardware in HARDWARE, f"unknown hardware {hardware!r}; pick one of {sorted(HARDWARE)}")
    for role, name in (("target", target), ("draft", draft)):
        require(name in MODELS, f"unknown {role} model {name!r}; pick one of {sorted(MODELS)}")
    require(context >= 1, f"context must be >= 1 token, got {context} (e.g. 131072 for 128K)")
    require(retrieval_budget >= 1,
            f"retrieval_budget must be >= 1 KV token, got {retrieval_budget} (e.g. 4096, TriForce's budget)")
    setup = HierarchySetup(alpha1, alpha2, alpha_tiny, gamma1, gamma2, retrieval_budget=retrieval_budget)
    profile, target_cfg, draft_cfg = HARDWARE[hardware], MODELS[target], MODELS[draft]
    source = "roofline" if costs is None else "manual"
    if costs is None:
        costs = level_costs(target_cfg, draft_cfg, profile, context, setup)
    pairs = [list(pair) for pair in gamma_pairs]
    if [gamma1, gamma2] not in pairs:
        pairs.append([gamma1, gamma2])
    contexts = _contexts_around(context, target_cfg.max_position_embeddings)
    return Exploration(
        source=source, costs=costs, prediction=predict_ms_per_token(costs, gamma1, gamma2, alpha1, alpha2),
        schedules={"typical": typical_schedule(costs, gamma1, gamma2, alpha1, alpha2),
                   "all accepted": typical_schedule(costs, gamma1, gamma2, 1.0, 1.0, name="all accepted")},
        sweep=acceptance_sweep(costs, pairs, alpha_points),
        bound=speedup_vs_context(target_cfg, draft_cfg, profile, contexts, setup),
        setup=setup, hardware=profile, context=context)


def explore_figures(result: Exploration, size: tuple[float, float] = (6.0, 3.0)) -> dict[str, Figure]:
    """Figures of ``result`` by name: the schedules (as the notebook draws them), and at ``size`` the
    acceptance sweep with the chosen gamma pair drawn in black and the speedup-vs-context bound with the
    chosen context marked.

    Loads matplotlib (hence imported here, not at module level); never shows or closes a figure.
    """
    from .plots import plot_acceptance_sweep, plot_schedules, plot_speedup_vs_context

    schedules = plot_schedules({name: s.table() for name, s in result.schedules.items()})
    sweep = plot_acceptance_sweep(result.sweep, size)
    setup = result.setup
    chosen = result.sweep[(result.sweep.gamma1 == setup.gamma1) & (result.sweep.gamma2 == setup.gamma2)]
    ax = sweep.axes[0]
    ax.plot(chosen.alpha, chosen.speedup, color="black", lw=2.5, ls="--",
            label=f"chosen γ1={setup.gamma1}, γ2={setup.gamma2}")
    ax.legend(fontsize="small")

    bound = plot_speedup_vs_context(result.bound)
    bound.set_size_inches(*size)
    ax = bound.axes[0]
    ax.axvline(result.context, color="gray", ls="--", lw=1, label=f"chosen context {result.context:,}")
    ax.legend(fontsize="small")
    ax.set_title(f"{result.hardware.name}, retrieval budget {setup.retrieval_budget:,}", fontsize="medium")
    bound.tight_layout()
    return {"schedules": schedules, "acceptance_sweep": sweep, "speedup_vs_context": bound}
