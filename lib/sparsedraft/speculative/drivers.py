"""Speculative decoding drivers: a drafter proposes, the full-cache target verifies.

:func:`speculative` is the whole loop; the hierarchy lives in the drafter:
TriForce (:func:`triforce`) is :func:`speculative` over a
:class:`~.hierarchy.SpeculativeDrafter` whose verifier is the target over a
retrieval cache (:class:`~.hierarchy.RetrievalDrafter`) and whose own drafter
is a small model with a streaming cache; "retrieval without hierarchy"
(:func:`retrieval`) is :func:`speculative` over a RetrievalDrafter. The plain
autoregressive baseline is :func:`sparsedraft.engine.generate.generate`.

The target prefills the whole prompt once and the drafters start from it (a
retrieval cache is selected by the last prompt token's query over every
prompt key, its own included, as in TriForce). Then the target forgets the
last prompt token (``rollback(1)``): every round feeds ``[pending,
drafts...]``, so the first generated token is verified like every other.
Given a :class:`~sparsedraft.engine.prefilled.PrefilledPrompt`, the target starts
from a copy of its cache, logits and queries instead of a prompt forward, and
the drafters start from that copy (the prefill is never written). A run holds
one sequence, since acceptance lengths differ per sequence; a batch runs one
such run per row in lockstep (:mod:`sparsedraft.speculative.lockstep`, through
:func:`sparsedraft.decode` with a list of prompts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from ..caches import MovingAverage, RebuildPolicy, RetrievalCache, StreamingCache, rebuild_policy
from ..caches.kv_quant import QuantizedRetrievalCache, check_draft_kv
from ..engine.model import Capture, Transformer
from ..engine.prefill import check_prompt, prefill
from ..engine.quant import draft_copy
from ..engine.runtime import synchronize
from ..engine.sampling import SamplingConfig, probabilities
from ..errors import require
from .drafters import DraftContext, Drafter, ModelDrafter, TargetState, check_confidence
from .hierarchy import RetrievalDrafter, SpeculativeDrafter
from .stats import DRAFT, REBUILD, RETRIEVAL_LEVEL, SYNC, TARGET, VERIFY, LevelStats, SpecStats, Stopwatch
from .verify import AcceptanceRule, standard_acceptance, verify

if TYPE_CHECKING:
    from ..engine.prefilled import PrefilledPrompt


@dataclass
class SpecResult:
    tokens: torch.Tensor  # [1, N] generated ids (prompt excluded), on the CPU
    stats: SpecStats


def check_run(target: Transformer, drafter: Drafter, prompt: torch.Tensor, max_new_tokens: int, gamma: int,
              prefilled: PrefilledPrompt | None = None) -> None:
    """Every check that can fail before the prefill."""
    require(gamma >= 1, f"gamma (draft tokens per verification) must be >= 1, got {gamma}")
    check_prompt(target, prompt, max_new_tokens)
    require(prompt.shape[0] == 1, f"a speculative run holds one sequence, got batch {prompt.shape[0]}; pass the "
                                  "prompts to sparsedraft.decode as a list (its rows run in lockstep)")
    require(drafter.vocab_size == target.cfg.vocab_size,
            f"the drafter's vocabulary has {drafter.vocab_size} tokens but the target's has "
            f"{target.cfg.vocab_size}; the draft must use the target's tokenizer")
    drafter.check(prompt.shape[1] + max_new_tokens)
    if prefilled is not None:
        prefilled.check(target, prompt)
        require(not drafter.needs_target_features or prefilled.features is not None,
                "this prefill holds no prompt features, which a feature drafter starts from; prefill again with "
                "this version of sparsedraft (prefill_prompt) or pass no prefilled=")
        if drafter.needs_target_features:
            prefilled.features_of(drafter.feature_layers)  # fails, naming the fix, if it lacks those layers


@torch.inference_mode()
def prefill_target(target: Transformer, prompt: torch.Tensor, max_new_tokens: int, capture: bool,
                   prefilled: PrefilledPrompt | None = None, features: bool = False,
                   feature_layers: tuple[int, ...] = ()) -> TargetState:
    """Full cache holding ``prompt`` [1, T], the logits after it, its last token's queries if ``capture`` and
    every prompt token's features if ``features`` (after ``feature_layers``' outputs); copied from
    ``prefilled`` when given (checked by the caller), which stays as it was."""
    cache = target.new_cache(prompt.shape[1] + max_new_tokens)
    if prefilled is not None:
        prefilled.seed(cache)
        queries = {layer: q.clone() for layer, q in prefilled.queries.items()} if capture else {}
        return TargetState(cache, queries, prefilled.logits[0].clone(),
                           prefilled.features_of(feature_layers)[0] if features else None)
    last = Capture(layers=set(range(target.cfg.num_layers)) if capture else set(), hidden=features,
                   hidden_layers=feature_layers) if capture or features else None
    logits = prefill(target, cache, prompt, capture=last)
    queries = {layer: q[:, :, -1] for layer, q in last.queries.items()} if capture else {}
    return TargetState(cache, queries, logits[0], last.features[0] if features else None)


@torch.inference_mode()
def speculative(target: Transformer, drafter: Drafter, prompt: torch.Tensor, max_new_tokens: int,
                gamma: int = 4, sampling: SamplingConfig = SamplingConfig(), *,
                rebuild: RebuildPolicy | str = "never", acceptance: AcceptanceRule = standard_acceptance,
                eos_token_id: int | None = None, prefilled: PrefilledPrompt | None = None) -> SpecResult:
    """Generate ``max_new_tokens`` with ``drafter`` proposing ``gamma`` tokens per target forward.

    The output has exactly the law of :func:`~sparsedraft.engine.generate.generate`
    with the same ``sampling`` (token for token when greedy). ``rebuild``
    decides when a drafter whose cache follows the target (one that
    ``needs_target_queries``) is rebuilt from the newest token's queries;
    ``acceptance`` exists to test that a wrong rule is caught. ``prefilled``
    (``prefill_prompt(target, prompt)``) replaces the prompt forward by a copy.
    """
    policy = rebuild_policy(rebuild) if isinstance(rebuild, str) else rebuild
    check_run(target, drafter, prompt, max_new_tokens, gamma, prefilled)
    prompt = prompt.to(target.device)
    generator = sampling.generator(target.device)
    watch = Stopwatch(target.device)
    synchronize(target.device)
    t0 = time.perf_counter()
    state = prefill_target(target, prompt, max_new_tokens, drafter.needs_target_queries, prefilled,
                           drafter.needs_target_features, drafter.feature_layers)
    drafter.start(prompt[0], state, DraftContext(sampling, generator, watch))
    full = state.cache
    full.rollback(1)  # re-fed by the first verification (module docstring)
    state.logits = None  # they follow the last prompt token, which the full cache no longer holds
    synchronize(target.device)
    t1 = time.perf_counter()

    level = LevelStats(TARGET)
    queries, features = drafter.needs_target_queries, drafter.needs_target_features
    capture = Capture(layers=set(range(target.cfg.num_layers)) if queries else set(), hidden=features,
                      hidden_layers=drafter.feature_layers) if queries or features else None
    recent, since_build, rebuilds = MovingAverage(policy.acceptance_window), 0, 0
    out: list[int] = []
    pending = prompt[:, -1:]
    while len(out) < max_new_tokens:
        with watch(DRAFT):
            proposal = drafter.propose(min(gamma, max_new_tokens - len(out) - 1))  # never overshoot
        g = proposal.tokens.numel()
        with watch(VERIFY):
            state.features_start = full.length
            positions = torch.arange(full.length, full.length + g + 1, device=target.device)
            logits = target(torch.cat((pending, proposal.tokens[None]), 1), positions, full, capture=capture)
            verdict = verify(proposal.tokens, proposal.q, probabilities(logits[0], sampling),
                             sampling.greedy, generator, acceptance)
            full.rollback(g - verdict.accepted)
        level.record(g, verdict.accepted)
        new = proposal.tokens[:verdict.accepted].tolist() + [verdict.token]
        out += new
        pending = torch.tensor([[verdict.token]], device=target.device)
        if queries:
            state.queries = {layer: q[:, :, verdict.accepted] for layer, q in capture.queries.items()}
        if features:
            state.features = capture.features[0]
        with watch(SYNC):
            drafter.commit(verdict.accepted, verdict.token, state)
        since_build += len(new)
        if g:
            recent.add(verdict.accepted / g)
        if policy.should_rebuild(since_build, recent.value):
            with watch(REBUILD):
                if drafter.rebuild(state):
                    rebuilds, since_build = rebuilds + 1, 0
                    recent.reset()
        if eos_token_id is not None and eos_token_id in new:
            out = out[:len(out) - len(new) + new.index(eos_token_id) + 1]
            break
    synchronize(target.device)
    t2 = time.perf_counter()
    shared = prefilled.seconds if prefilled is not None else 0.0
    stats = SpecStats(drafter.levels() + [level], len(out), level.verifications, rebuilds,
                      shared + t1 - t0, t2 - t1, dict(watch.seconds))
    return SpecResult(torch.tensor([out], dtype=torch.long), stats)


def retrieval_drafter(target: Transformer, gamma: int, budget: int, chunk_size: int,
                      group_reduce: str = "sum", draft_weights: str = "same",
                      draft_kv: str = "same") -> RetrievalDrafter:
    """The target drafting for itself over a retrieval cache (at most ``gamma`` level-2 tokens between syncs),
    with its weights as ``draft_weights`` (:func:`~sparsedraft.engine.quant.draft_copy`; the cache still follows the
    full-precision target's) and the cache's values stored as ``draft_kv``
    (:class:`~sparsedraft.caches.kv_quant.QuantizedRetrievalCache`, quantised from the target's own KV)."""
    check_draft_kv(draft_kv, target.cfg)
    kind = RetrievalCache if draft_kv == "same" else partial(QuantizedRetrievalCache, draft_kv=draft_kv)
    cache = kind(target.cfg, budget, chunk_size, spec_slots=gamma, dtype=target.dtype, device=target.device,
                 group_reduce=group_reduce)
    return RetrievalDrafter(draft_copy(target, draft_weights), cache)


def retrieval(target: Transformer, prompt: torch.Tensor, max_new_tokens: int,
              sampling: SamplingConfig = SamplingConfig(), *, gamma: int = 6, budget: int = 4096,
              chunk_size: int = 8, rebuild: RebuildPolicy | str = "never", group_reduce: str = "sum",
              acceptance: AcceptanceRule = standard_acceptance, eos_token_id: int | None = None,
              prefilled: PrefilledPrompt | None = None, draft_weights: str = "same",
              draft_kv: str = "same", draft_confidence: float = 0.0) -> SpecResult:
    """Retrieval without hierarchy: target + retrieval cache drafts ``gamma`` tokens for the full target, ending a
    proposal after a token it is less sure of than ``draft_confidence`` (see :func:`~.drafters.sure`)."""
    _check_budget(prompt, budget)
    check_confidence(draft_confidence)
    drafter = retrieval_drafter(target, gamma, budget, chunk_size, group_reduce, draft_weights, draft_kv)
    drafter.confidence = draft_confidence
    return speculative(target, drafter, prompt, max_new_tokens, gamma, sampling, rebuild=rebuild,
                       acceptance=acceptance, eos_token_id=eos_token_id, prefilled=prefilled)


def streaming_drafter(model: Transformer, rollback: int, sink: int, window: int,
                      positions: str = "cache") -> ModelDrafter:
    """``model`` over a StreamingLLM cache of ``sink`` + ``window`` slots that can take back ``rollback`` tokens:
    TriForce's level 1 (a level-3 rejection undoes a whole level-2 proposal plus the round in flight)."""
    return ModelDrafter(model, StreamingCache(model.cfg, sink, window, spec_slots=rollback, dtype=model.dtype,
                                              device=model.device, rotary=model.rotary, positions=positions))


def triforce_drafter(target: Transformer, draft_model: Transformer | Drafter, gamma1: int, gamma2: int, budget: int,
                     chunk_size: int, sink: int, window: int, group_reduce: str = "sum",
                     draft_positions: str = "cache", acceptance: AcceptanceRule = standard_acceptance,
                     draft_weights: str = "same", draft_kv: str = "same") -> SpeculativeDrafter:
    """Levels 1 and 2 of TriForce as one drafter for the full-cache target.

    Level 1 is ``draft_model`` over a StreamingLLM cache, or any ready
    :class:`Drafter` (e.g. prompt lookup, which needs no model). It may roll
    back up to ``gamma1 + gamma2`` tokens (a level-3 rejection undoes a whole
    level-2 proposal plus the round in flight); level 2 holds at most
    ``gamma2`` speculative tokens between syncs. Level 2 reads the target's weights as ``draft_weights`` and
    its retrieval cache as ``draft_kv``.
    """
    require(gamma1 >= 1 and gamma2 >= 1, f"gamma1 and gamma2 must be >= 1, got gamma1={gamma1}, gamma2={gamma2}")
    level1 = draft_model if isinstance(draft_model, Drafter) else \
        streaming_drafter(draft_model, gamma1 + gamma2, sink, window, draft_positions)
    level2 = retrieval_drafter(target, gamma2, budget, chunk_size, group_reduce, draft_weights, draft_kv)
    return SpeculativeDrafter(level2, level1, gamma1, acceptance, RETRIEVAL_LEVEL)


def triforce(target: Transformer, draft_model: Transformer | Drafter, prompt: torch.Tensor, max_new_tokens: int,
             sampling: SamplingConfig = SamplingConfig(), *, gamma1: int = 2, gamma2: int = 6,
             budget: int = 4096, chunk_size: int = 8, sink: int = 16, window: int = 240,
             rebuild: RebuildPolicy | str = "never", group_reduce: str = "sum", draft_positions: str = "cache",
             acceptance: AcceptanceRule = standard_acceptance, eos_token_id: int | None = None,
             prefilled: PrefilledPrompt | None = None, draft_weights: str = "same",
             draft_kv: str = "same", draft_confidence: float = 0.0) -> SpecResult:
    """Three levels: draft + streaming cache (gamma1) -> target + retrieval cache (gamma2) -> full target.

    Defaults follow the paper (gamma1 = 2, gamma2 = 6, budget 4096 in chunks of
    8, a 16 + 240 streaming cache of 256 slots). With ``draft_confidence``,
    level 2 hands its tokens to level 3 as soon as it emits one it is less sure
    of than that (the target's own top-1 probability over its retrieval
    cache), instead of always ``gamma2``.
    """
    _check_budget(prompt, budget)
    check_confidence(draft_confidence)
    drafter = triforce_drafter(target, draft_model, gamma1, gamma2, budget, chunk_size, sink, window,
                               group_reduce, draft_positions, acceptance, draft_weights, draft_kv)
    drafter.confidence = draft_confidence
    return speculative(target, drafter, prompt, max_new_tokens, gamma2, sampling, rebuild=rebuild,
                       acceptance=acceptance, eos_token_id=eos_token_id, prefilled=prefilled)


def _check_budget(prompt: torch.Tensor, budget: int) -> None:
    context = prompt.shape[-1]  # the retrieval cache is built from the whole prompt
    require(budget < context, f"retrieval budget ({budget}) must be smaller than the cached context ({context} "
                              f"tokens: the whole prompt); use a longer prompt or budget < {context}")
