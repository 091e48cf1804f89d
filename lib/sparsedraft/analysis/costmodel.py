"""Cost model of two- and three-level speculation, and the hand-computed walkthroughs.

Levels. Level 1 is the tiny draft (StreamingLLM cache), one forward per
drafted token. Level 2 is the target on its retrieval cache: one forward
verifies the γ1 drafts of a round. Level 3 is the target on its full cache:
one forward verifies everything level 2 holds. Every forward of a level costs
the same (``LevelCosts``): decoding is memory bound, so checking a few tokens
costs one read of weights + cache.

Iteration rule (used by both the explicit schedules and the expectation):
1. Level 2 runs rounds. A round is γ1 level-1 draft forwards plus one level-2
   verify that accepts k of the γ1 drafts and adds one token of its own (the
   correction after a rejection, or the bonus token when all pass), so a round
   emits k + 1 tokens.
2. Rounds repeat until level 2 holds at least γ2 tokens (it may overshoot by
   up to γ1).
3. One level-3 verify accepts a of the held tokens and emits a + 1 tokens; only
   these reach the output. Vanilla decoding costs one level-3 forward per token.

Expected tokens per verify. With i.i.d. acceptance α per drafted token and γ
drafts, E[accepted + 1] = 1 + α + … + α^γ = (1 − α^(γ+1)) / (1 − α) (γ + 1 when
α = 1). Two levels: ms/token = (γ·c_draft + c_target) / that. Three levels:
:func:`predict_ms_per_token` takes the expectation of the rule above exactly
(a small dynamic programme over how many tokens level 2 holds, including the
overshoot) and divides E[ms per iteration] by E[tokens per iteration]
(renewal–reward: the long-run ms/token of repeated independent iterations).

The hand-computed walkthroughs (γ1 = 2, γ2 = 6, costs 0.45 / 14 / 56 ms, the
paper's Fig. 1) give totals but no step list. With one level-3 verify per
iteration, 100.7 = 56 + 14·k2 + 0.45·k1 has the single whole-number solution
k2 = 3, k1 = 6: three rounds of two drafts. Three rounds reach ≥ 6 held tokens
only if the first two emit fewer than 6, so one round must stop at a
rejection: emitted 3 + 1 + 3 = 7 held, all accepted at level 3 plus its bonus
= 8 tokens (:func:`walkthrough_normal_schedule`). Had every draft passed,
level 2 would hold 6 after two rounds: 85.8 ms for 7 tokens (12.3 ms/token).
The collapse case (:func:`walkthrough_collapse_schedule`): every round rejects
its first draft, so six rounds (12 drafts, 6 verifies) fill γ2 = 6; stale
retrieval makes level 3 accept 2 of 6 and add a correction, 3 tokens;
12·0.45 + 6·14 + 56 = 145.4 ms plus a cache rebuild. Costs exclude retrieval,
cache updates and kernel overheads (``overhead_ms`` adds them per iteration).

Scaling with context (Fig. 5 style, :func:`speedup_vs_context`): each level's
cost is its ideal read time (:mod:`sparsedraft.engine.roofline`): the tiny draft
reads its weights and a fixed StreamingLLM cache, the retrieval level the
target's weights and a fixed budget of KV, the full level the target's
weights and the whole context. Acceptance rates are held fixed across
context, so the bound rises with context only because the full target slows
down while the drafts do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import pandas as pd

from ..engine.config import ModelConfig
from ..engine.roofline import Hardware, bytes_per_token, ideal_latency_ms
from ..errors import require
from ..speculative.stats import DRAFT, RETRIEVAL_LEVEL, TARGET, VERIFY, region
from .acceptance import Rounds, fit_alpha


@dataclass(frozen=True)
class LevelCosts:
    """Milliseconds of one forward at each level."""

    draft_ms: float  # level 1: the tiny draft on its StreamingLLM cache
    retrieval_ms: float  # level 2: the target on its retrieval cache
    target_ms: float  # level 3: the target on its full cache (= vanilla ms/token)

    def __post_init__(self) -> None:
        for name in ("draft_ms", "retrieval_ms", "target_ms"):
            value = getattr(self, name)
            require(math.isfinite(value) and value > 0, f"LevelCosts.{name} must be a positive ms value, got {value}")


WALKTHROUGH_COSTS = LevelCosts(draft_ms=0.45, retrieval_ms=14.0, target_ms=56.0)  # the paper's Fig. 1
LEVEL_NAMES = {1: "tiny draft", 2: "retrieval target", 3: "full target", 0: "cache rebuild"}


@dataclass(frozen=True)
class Step:
    """One forward (or a rebuild) in an iteration."""

    level: int  # 1, 2, 3, or 0 for a retrieval-cache rebuild
    action: str  # "draft", "verify" or "rebuild"
    verified: int  # drafts this step checks (0 when drafting)
    accepted: int  # of those, accepted
    emitted: int  # tokens handed up: level 2 -> held for level 3; level 3 -> output
    ms: float


@dataclass(frozen=True)
class Schedule:
    """An explicit iteration: the notebook prints :meth:`table`."""

    name: str
    gamma1: int
    gamma2: int
    steps: tuple[Step, ...]
    vanilla_ms: float  # one full-cache forward per token without speculation

    @property
    def total_ms(self) -> float:
        return sum(s.ms for s in self.steps)

    @property
    def tokens(self) -> int:
        return sum(s.emitted for s in self.steps if s.level == 3)

    @property
    def ms_per_token(self) -> float:
        return self.total_ms / self.tokens

    @property
    def speedup(self) -> float:
        return self.vanilla_ms / self.ms_per_token

    def table(self) -> pd.DataFrame:
        """One row per step with the running time and the tokens level 2 holds."""
        rows, clock, held = [], 0.0, 0
        for i, s in enumerate(self.steps, 1):
            clock += s.ms
            held = held + s.emitted if s.level == 2 else (0 if s.level == 3 else held)
            rows.append({"step": i, "level": s.level, "model": LEVEL_NAMES[s.level], "action": s.action,
                         "verified": s.verified, "accepted": s.accepted, "emitted": s.emitted,
                         "held": held, "ms": s.ms, "clock_ms": clock})
        return pd.DataFrame(rows)

    def summary(self) -> dict[str, float | int | str]:
        return {"name": self.name, "gamma1": self.gamma1, "gamma2": self.gamma2, "total_ms": self.total_ms,
                "tokens": self.tokens, "ms_per_token": self.ms_per_token, "speedup": self.speedup}


def _check_gammas(gamma1: int, gamma2: int) -> None:
    require(gamma1 >= 1, f"gamma1 (drafts per level-2 round) must be >= 1, got {gamma1}")
    require(gamma2 >= 1, f"gamma2 (tokens level 2 collects for level 3) must be >= 1, got {gamma2}")


def build_schedule(costs: LevelCosts, gamma1: int, gamma2: int, level2_accepted: Sequence[int],
                   level3_accepted: int, rebuild_ms: float | None = None, name: str = "") -> Schedule:
    """Spell out one iteration from the outcome of each verification (see the module rule).

    ``level2_accepted[r]`` is how many of round r's γ1 drafts level 2 accepts;
    it must hold exactly the rounds needed to reach γ2 tokens.
    ``level3_accepted`` counts the held tokens level 3 accepts. ``rebuild_ms``
    appends a retrieval-cache rebuild (the collapse case triggers one).
    """
    _check_gammas(gamma1, gamma2)
    steps: list[Step] = []
    held = 0
    for r, accepted in enumerate(level2_accepted):
        require(held < gamma2, f"level 2 already holds {held} >= gamma2={gamma2} tokens after {r} rounds; "
                               f"drop the extra level2_accepted entries {list(level2_accepted[r:])}")
        require(0 <= accepted <= gamma1, f"level2_accepted[{r}]={accepted} must lie in [0, gamma1={gamma1}]")
        steps += [Step(1, "draft", 0, 0, 0, costs.draft_ms)] * gamma1
        steps.append(Step(2, "verify", gamma1, accepted, accepted + 1, costs.retrieval_ms))
        held += accepted + 1
    require(held >= gamma2, f"level2_accepted {list(level2_accepted)} leaves level 2 holding {held} < "
                            f"gamma2={gamma2} tokens; add rounds until it holds at least gamma2")
    require(0 <= level3_accepted <= held, f"level3_accepted={level3_accepted} must lie in [0, {held}] "
                                          "(the tokens level 2 holds)")
    steps.append(Step(3, "verify", held, level3_accepted, level3_accepted + 1, costs.target_ms))
    if rebuild_ms is not None:
        require(rebuild_ms >= 0, f"rebuild_ms must be >= 0, got {rebuild_ms}")
        steps.append(Step(0, "rebuild", 0, 0, 0, rebuild_ms))
    return Schedule(name, gamma1, gamma2, tuple(steps), costs.target_ms)


def walkthrough_normal_schedule(costs: LevelCosts = WALKTHROUGH_COSTS) -> Schedule:
    """The walkthrough's normal case: 100.7 ms for 8 tokens (one level-2 rejection, level 3 accepts all)."""
    return build_schedule(costs, 2, 6, level2_accepted=(2, 0, 2), level3_accepted=7, name="normal")


def walkthrough_collapse_schedule(rebuild_ms: float = 0.0, costs: LevelCosts = WALKTHROUGH_COSTS) -> Schedule:
    """The walkthrough's collapse case: 145.4 ms + ``rebuild_ms`` for 3 tokens (locality broken)."""
    return build_schedule(costs, 2, 6, level2_accepted=(0,) * 6, level3_accepted=2,
                          rebuild_ms=rebuild_ms, name="collapse")


def expected_tokens_per_verify(alpha: float, gamma: int) -> float:
    """E[accepted + 1] for γ drafts accepted i.i.d. with probability α: (1 − α^(γ+1)) / (1 − α)."""
    require(0.0 <= alpha <= 1.0, f"acceptance rate alpha must lie in [0, 1], got {alpha}")
    require(gamma >= 0, f"gamma must be >= 0 drafts, got {gamma}")
    return gamma + 1.0 if alpha == 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def needed_acceptance(speedup: float, gamma: int, draft_ratio: float, verify_ratio: float) -> float:
    """The per-draft acceptance α at which two-level decoding runs ``speedup`` times faster than plain decoding,
    when a draft step costs ``draft_ratio`` and a (γ+1)-token verification ``verify_ratio`` plain decode steps:
    the α solving E[tokens](α, γ) = speedup · (γ · draft_ratio + verify_ratio). NaN when even α = 1 falls short."""
    require(speedup > 0 and gamma >= 1 and draft_ratio >= 0 and verify_ratio > 0,
            f"need speedup > 0, gamma >= 1, draft_ratio >= 0, verify_ratio > 0; got {speedup}, {gamma}, "
            f"{draft_ratio}, {verify_ratio}")
    want = speedup * (gamma * draft_ratio + verify_ratio)
    if want > gamma + 1:
        return float("nan")
    low, high = 0.0, 1.0
    for _ in range(60):  # E[tokens] grows with alpha
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens_per_verify(mid, gamma) < want else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class Prediction:
    """Long-run cost of repeated iterations."""

    ms_per_iteration: float  # expected
    tokens_per_iteration: float  # expected
    vanilla_ms: float

    @property
    def ms_per_token(self) -> float:
        return self.ms_per_iteration / self.tokens_per_iteration

    @property
    def speedup(self) -> float:
        return self.vanilla_ms / self.ms_per_token


def predict_two_level(draft_ms: float, target_ms: float, gamma: int, alpha: float,
                      overhead_ms: float = 0.0) -> Prediction:
    """Standard speculative decoding: γ draft forwards + one target verify per iteration."""
    require(gamma >= 1, f"gamma must be >= 1 drafts, got {gamma}")
    require(overhead_ms >= 0, f"overhead_ms must be >= 0, got {overhead_ms}")
    return Prediction(gamma * draft_ms + target_ms + overhead_ms, expected_tokens_per_verify(alpha, gamma), target_ms)


def round_lengths(rounds: Rounds) -> dict[int, int]:
    """{draft length: rounds} of a level's rounds (histograms of accepted counts per length), rounds that
    drafted nothing left out."""
    return {int(g): sum(counts) for g, counts in rounds.items() if int(g) and sum(counts)}


def confidence_alphas(rounds: Rounds, gamma: int) -> tuple[float, float]:
    """(α_sure, α_unsure) of a run whose proposer ended each proposal after a token it was unsure of
    (``draft_confidence``), by maximum likelihood over its rounds: a round shorter than ``gamma`` ended on the
    unsure token, every other token was one its proposer was sure of. A class with no judged token gets 1
    (sure) or 0 (unsure). Two rates because the stop is placed exactly where acceptance drops: one rate for
    every token underpredicts what such a run keeps."""
    kept = {"sure": 0, "unsure": 0}
    lost = {"sure": 0, "unsure": 0}
    for g, counts in rounds.items():
        g = int(g)
        stopped = 0 < g < gamma
        sure_len = g - 1 if stopped else g  # the sure tokens at the front of the round
        for k, n in enumerate(counts):
            kept["sure"] += n * min(k, sure_len)
            if k < sure_len:
                lost["sure"] += n
            elif stopped:
                (kept if k == g else lost)["unsure"] += n
    rate = {c: kept[c] / (kept[c] + lost[c]) if kept[c] + lost[c] else float(c == "sure") for c in kept}
    return rate["sure"], rate["unsure"]


def stop_acceptance(options: Mapping[str, Any], rounds: Rounds) -> dict[str, float] | None:
    """For a run with ``draft_confidence`` in its ``options``: the full target's acceptance of the tokens the
    proposer was sure of (``sure``) and of the one each stopped proposal ended on (``stopped_after``), from its
    ``rounds`` at that level (:func:`confidence_alphas`, γ the proposals' own: ``gamma2`` for three levels);
    None for any other run or one without drafts."""
    if not options.get("draft_confidence") or not round_lengths(rounds):
        return None
    sure, unsure = confidence_alphas(rounds, _outer_gamma(options))
    return {"sure": sure, "stopped_after": unsure}


def _outer_gamma(options: Mapping[str, Any]) -> int:
    """γ of the proposals the full target verifies: ``gamma2`` for three levels, else ``gamma``."""
    return int(options["gamma2"] if "gamma2" in options else options["gamma"])


def stopped_tokens_per_verify(rounds: Rounds, gamma: int) -> float:
    """E[accepted + 1] per verification of such a run: each round at the length it had, its sure tokens
    accepted i.i.d. at α_sure and the token it stopped after at α_unsure (:func:`confidence_alphas`)."""
    sure, unsure = confidence_alphas(rounds, gamma)
    mix = round_lengths(rounds)
    require(mix, "no round drafted a token, so there is nothing to model; pass a run with drafts")

    def tokens(g: int) -> float:
        if g >= gamma:
            return expected_tokens_per_verify(sure, g)
        return sum(sure ** k * (1 - sure) * (k + 1) for k in range(g - 1)) + sure ** (g - 1) * (g + unsure)
    return sum(tokens(g) * n for g, n in mix.items()) / sum(mix.values())


def _emitted(alpha: float, drafts: int) -> dict[int, float]:
    """Law of tokens a verify emits (accepted + 1) over ``drafts`` i.i.d. drafts."""
    emit = {k + 1: alpha ** k * (1 - alpha) for k in range(drafts)}
    emit[drafts + 1] = alpha ** drafts
    return emit


def predict_ms_per_token(costs: LevelCosts, gamma1: int, gamma2: int, alpha1: float, alpha2: float,
                         overhead_ms: float = 0.0, overshoot: bool = True) -> Prediction:
    """Three-level prediction from per-level costs and acceptance rates (exact expectation of the rule).

    ``alpha1``: chance level 2 accepts a level-1 draft; ``alpha2``: chance
    level 3 accepts a held token; ``overhead_ms``: per-iteration extras
    (retrieval, cache updates, amortised rebuilds) to compare with measurements.
    ``overshoot=True`` is the module's rule (every round drafts γ1, level 2
    may end up holding up to γ2 + γ1 tokens). ``overshoot=False`` is what
    :class:`sparsedraft.speculative.SpeculativeDrafter` does: a round holding
    h tokens drafts only min(γ1, γ2 − h − 1), so level 2 hands exactly γ2
    tokens to level 3 -- use it to predict runs of this library.
    """
    _check_gammas(gamma1, gamma2)
    require(overhead_ms >= 0, f"overhead_ms must be >= 0, got {overhead_ms}")
    expected_tokens_per_verify(alpha1, gamma1)  # validates alpha1
    reach = [0.0] * gamma2  # probability that a round starts with this many tokens held
    reach[0] = 1.0
    final: dict[int, float] = {}  # held tokens when level 3 verifies -> probability
    round_ms = 0.0  # expected level-1 + level-2 time over all rounds
    for held in range(gamma2):
        drafts = gamma1 if overshoot else min(gamma1, gamma2 - held - 1)
        round_ms += reach[held] * (drafts * costs.draft_ms + costs.retrieval_ms)
        for tokens, p in _emitted(alpha1, drafts).items():
            after = held + tokens
            if after < gamma2:
                reach[after] += reach[held] * p
            else:
                final[after] = final.get(after, 0.0) + reach[held] * p
    tokens = sum(p * expected_tokens_per_verify(alpha2, held) for held, p in final.items())
    return Prediction(round_ms + costs.target_ms + overhead_ms, tokens, costs.target_ms)


def acceptance_sweep(costs: LevelCosts, gamma_pairs: Sequence[Sequence[int]], alpha_points: int) -> pd.DataFrame:
    """Predicted speedup as one acceptance rate α (both levels) runs over [0, 1], per (γ1, γ2) pair.

    Long format: alpha, gammas (a legend label), gamma1, gamma2, speedup.
    ``alpha_points`` evenly spaced rates include both ends.
    """
    require(alpha_points >= 2, f"alpha_points must be >= 2 (both ends of [0, 1]), got {alpha_points}")
    require(len(gamma_pairs) > 0 and all(len(pair) == 2 for pair in gamma_pairs),
            f"gamma_pairs must be a non-empty list of [gamma1, gamma2] pairs, got {list(gamma_pairs)}")
    alphas = [i / (alpha_points - 1) for i in range(alpha_points)]
    return pd.DataFrame([
        {"alpha": a, "gammas": f"γ1={g1}, γ2={g2}", "gamma1": g1, "gamma2": g2,
         "speedup": predict_ms_per_token(costs, g1, g2, a, a).speedup}
        for g1, g2 in gamma_pairs for a in alphas])


def measured_level_costs(seconds: dict[str, float], drafted: dict[str, int], verifications: dict[str, int],
                         decode_s: float) -> tuple[LevelCosts, float]:
    """Per-forward costs of a TriForce run and its per-iteration overhead, from the run's own records.

    ``seconds`` are the driver's timed regions (``level2_draft``: level-1
    forwards, ``level2_verify``: level-2 forwards, ``verify``: full-target
    forwards); ``drafted`` / ``verifications`` are per verifier level
    (``level2``, ``target``): level 1 makes one forward per token it drafts.
    The overhead is the decode time outside those forwards (cache syncs,
    rebuilds, Python) per full-target verification.
    """
    level1, level2, level3 = region(RETRIEVAL_LEVEL, DRAFT), region(RETRIEVAL_LEVEL, VERIFY), VERIFY
    for key in (level1, level2, level3):
        require(key in seconds, f"no {key!r} region in the run's seconds {sorted(seconds)}: pass a TriForce run")
    require(drafted.get(RETRIEVAL_LEVEL, 0) > 0 and verifications.get(RETRIEVAL_LEVEL, 0) > 0
            and verifications.get(TARGET, 0) > 0,
            f"a TriForce run with level-1 drafts is needed, got drafted={drafted}, verifications={verifications}")
    costs = LevelCosts(draft_ms=1000 * seconds[level1] / drafted[RETRIEVAL_LEVEL],
                       retrieval_ms=1000 * seconds[level2] / verifications[RETRIEVAL_LEVEL],
                       target_ms=1000 * seconds[level3] / verifications[TARGET])
    forwards_s = seconds[level1] + seconds[level2] + seconds[level3]
    return costs, max(0.0, 1000 * (decode_s - forwards_s) / verifications[TARGET])


def predicted_speedup(options: Mapping[str, Any], seconds: Mapping[str, float], drafted: Mapping[str, int],
                      verifications: Mapping[str, int], rounds: Mapping[str, Rounds], decode_s: float,
                      baseline_ms_per_token: float) -> float | None:
    """What the cost model predicts for one measured speculative run, from that run's own parts: its per-forward
    costs (timed regions / forward counts, as :func:`measured_level_costs`), its per-iteration overhead (decode
    time outside those forwards), and α per level fitted from its rounds (:func:`~.acceptance.fit_alpha`),
    under the rule this library runs (``overshoot=False``); as a speedup over ``baseline_ms_per_token``.
    ``options`` gives γ (``gamma``, or ``gamma1``/``gamma2`` for three levels). With ``draft_confidence`` the
    proposals to the full target have the lengths the proposer stopped them at: the model takes the run's own
    drafting work per verification (for three levels its level-1 and level-2 work) and models only the tokens
    each verification keeps, with one acceptance rate for the tokens the proposer was sure of and one for the
    token it stopped after (:func:`stopped_tokens_per_verify`). None for a run without drafts
    (plain decoding, or a level that drafted nothing): there is no α to fit. Beside the measured speedup it
    says whether the run did what its parts imply; a gap is time the model does not see."""
    if not drafted.get(TARGET) or not verifications.get(TARGET):
        return None
    if RETRIEVAL_LEVEL in drafted:
        if not drafted[RETRIEVAL_LEVEL]:
            return None
        costs, overhead = measured_level_costs(seconds, drafted, verifications, decode_s)
        if options.get("draft_confidence"):  # level 2 stopped on its own confidence: its work per level-3 round
            outer = verifications[TARGET]     # is the run's own, the tokens those rounds keep are modelled
            inner_ms = (drafted[RETRIEVAL_LEVEL] * costs.draft_ms
                        + verifications[RETRIEVAL_LEVEL] * costs.retrieval_ms) / outer
            prediction = Prediction(inner_ms + costs.target_ms + overhead,
                                    stopped_tokens_per_verify(rounds[TARGET], _outer_gamma(options)),
                                    costs.target_ms)
        else:
            prediction = predict_ms_per_token(costs, int(options["gamma1"]), int(options["gamma2"]),
                                              fit_alpha(rounds[RETRIEVAL_LEVEL]), fit_alpha(rounds[TARGET]),
                                              overhead_ms=overhead, overshoot=False)
    else:
        forwards = verifications[TARGET]
        draft_s, verify_s = seconds.get(DRAFT, 0.0), seconds[VERIFY]
        overhead = max(0.0, 1000 * (decode_s - draft_s - verify_s) / forwards)
        if options.get("draft_confidence"):  # proposals ended early: the run's own drafting per round
            verify_ms = 1000 * verify_s / forwards
            prediction = Prediction(1000 * draft_s / forwards + verify_ms + overhead,
                                    stopped_tokens_per_verify(rounds[TARGET], _outer_gamma(options)), verify_ms)
        else:
            prediction = predict_two_level(1000 * draft_s / drafted[TARGET], 1000 * verify_s / forwards,
                                           int(options["gamma"]), fit_alpha(rounds[TARGET]), overhead_ms=overhead)
    return baseline_ms_per_token / prediction.ms_per_token


@dataclass(frozen=True)
class HierarchySetup:
    """What the Fig. 5-style bound assumes besides the hardware and the models."""

    alpha1: float  # level 2 accepts a tiny-draft token
    alpha2: float  # level 3 accepts a retrieval-level token
    alpha_tiny: float  # the full target accepts a tiny-draft token (two-level baseline)
    gamma1: int = 2  # paper App. B.3 optimum
    gamma2: int = 6
    tiny_gamma: int = 2  # drafts per verify of the tiny-draft baseline
    retrieval_budget: int = 4096  # KV tokens of the retrieval cache
    draft_budget: int = 256  # KV tokens of the tiny draft's StreamingLLM cache
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("alpha1", "alpha2", "alpha_tiny"):
            value = getattr(self, name)
            require(0.0 <= value <= 1.0, f"HierarchySetup.{name} must lie in [0, 1], got {value}")
        _check_gammas(self.gamma1, self.gamma2)
        for name in ("tiny_gamma", "retrieval_budget", "draft_budget", "dtype_bytes"):
            require(getattr(self, name) >= 1, f"HierarchySetup.{name} must be >= 1, got {getattr(self, name)}")


def level_costs(target: ModelConfig, draft: ModelConfig, hardware: Hardware, context: int,
                setup: HierarchySetup) -> LevelCosts:
    """Ideal per-forward ms of the three levels at one context length."""
    def read_ms(cfg: ModelConfig, cached: int) -> float:
        return ideal_latency_ms(bytes_per_token(cfg, cached, setup.dtype_bytes), hardware)
    return LevelCosts(draft_ms=read_ms(draft, min(setup.draft_budget, context)),
                      retrieval_ms=read_ms(target, min(setup.retrieval_budget, context)),
                      target_ms=read_ms(target, context))


def speedup_vs_context(target: ModelConfig, draft: ModelConfig, hardware: Hardware, contexts: Sequence[int],
                       setup: HierarchySetup) -> pd.DataFrame:
    """Theoretical speedup over vanilla as the context grows, for TriForce and its two-level parts.

    Long format, one row per (context, method); methods: "triforce" (three
    levels), "retrieval self-spec" (retrieval target drafts γ2 for the full
    target) and "tiny draft" (the tiny model drafts for the full target).
    """
    require(len(contexts) > 0 and all(c >= 1 for c in contexts),
            f"contexts must be a non-empty list of token counts >= 1, got {list(contexts)}")
    rows = []
    for context in contexts:
        c = level_costs(target, draft, hardware, int(context), setup)
        predictions = {
            "triforce": predict_ms_per_token(c, setup.gamma1, setup.gamma2, setup.alpha1, setup.alpha2),
            "retrieval self-spec": predict_two_level(c.retrieval_ms, c.target_ms, setup.gamma2, setup.alpha2),
            "tiny draft": predict_two_level(c.draft_ms, c.target_ms, setup.tiny_gamma, setup.alpha_tiny),
        }
        for method, p in predictions.items():
            rows.append({"context": int(context), "method": method, "draft_ms": c.draft_ms,
                         "retrieval_ms": c.retrieval_ms, "target_ms": c.target_ms,
                         "ms_per_token": p.ms_per_token, "speedup": p.speedup})
    return pd.DataFrame(rows)
