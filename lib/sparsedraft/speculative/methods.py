"""The decoding methods :func:`sparsedraft.decode` knows, registered in one place.

Each method is an options dataclass (validated on construction, with a
``check`` for what depends on the model and the prompt length) and a run
function over the library's decoders (each can start from a shared
:class:`~sparsedraft.engine.prefilled.PrefilledPrompt`). The CLI and the benchmarks derive their
options from the same dataclasses (:mod:`sparsedraft.cliopts`), so a method
added to :data:`METHODS` is reachable from Python, the bench and the command
line at once.

Defaults are the best settings measured on a 2-core CPU with SmolLM2 at 8K
(README); the underlying functions keep the papers' defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..caches import rebuild_policy
from ..caches.budget import SCORINGS
from ..caches.kv_quant import DRAFT_KV, check_draft_kv
from ..caches.retrieval import GROUP_REDUCTIONS
from ..caches.streaming import POSITION_MODES
from ..engine.config import ModelConfig
from ..engine.generate import GenerationResult, generate
from ..engine.model import Transformer
from ..engine.prefilled import PrefilledPrompt
from ..engine.quant import DRAFT_WEIGHTS, check_draft_weights, draft_copy
from ..engine.sampling import SamplingConfig
from ..errors import SparsedraftError, require
from .budget import BudgetDrafter
from .drafters import Drafter, ModelDrafter, NgramDrafter, check_confidence
from .drivers import SpecResult, retrieval, speculative, streaming_drafter, triforce
from .feature import FeatureHead
from .feature_drafter import FeatureDrafter
from .lookup_first import LookupFirst, check_override
from .loading import SLICE, check_trained_for, drafter_kind, load_trained, read_state, trained_scoring
from .truncate import truncated_draft
from .vocab import frequent_tokens_of, restrict_head

DRAFT_CACHES = ("full", "streaming", "budget")
SELF = "self"  # the target drafts for itself over a sparse cache of its own (prefilled through it)


def _check_draft(draft: Any) -> None:
    if isinstance(draft, (Transformer, Drafter, FeatureHead)):
        return
    require(isinstance(draft, str), f"draft must be a model source string, a Transformer, a FeatureHead or a Drafter, "
                                    f"got {type(draft).__name__}")
    require(not draft.startswith("truncated:") or draft.removeprefix("truncated:").isdigit(),
            f"draft {draft!r}: write truncated:K with K the number of target layers kept")


def _check_trained_budget(draft: Any, budget: int) -> None:
    """A BudgetDraft run folder drafts only at budgets its drafter was trained on (and with this view version)."""
    if not (isinstance(draft, str) and drafter_kind(draft) == SLICE):
        return
    trained = read_state(draft)["config"]["budgets"]
    require(budget in trained, f"budget {budget} was not among the budgets {list(trained)} the drafter in {draft} "
                               "was trained on; pick one of those or train with this budget")


CHUNK_SCORINGS = ("", *SCORINGS)  # "": the drafter's training rule (attention for anything but a run folder)


def _check_chunk_scoring(chunk_scoring: str) -> None:
    require(chunk_scoring in CHUNK_SCORINGS,
            f"chunk_scoring must be one of {CHUNK_SCORINGS} (empty: the drafter's own), got {chunk_scoring!r}")


def _chunk_scoring(draft: Any, chunk_scoring: str) -> str:
    """The budget cache's chunk rule: the one asked for, else the one the run folder's drafter trained with."""
    if chunk_scoring:
        return chunk_scoring
    if isinstance(draft, str) and drafter_kind(draft):
        return trained_scoring(draft)
    return "attention"


def _check_draft_source(draft: Any, cfg: ModelConfig) -> None:
    """A draft named by a string must be findable before anything loads (an HF id may download here); a
    trained drafter's folder must be readable and trained for this verifier."""
    require(draft != DEFAULT_DRAFTER or Path(draft).is_dir(),
            f"no drafter in {DEFAULT_DRAFTER} (budgetdraft's default): `make reproduce` copies the committed one "
            f"there, or pass draft {COMMITTED_DRAFTER} (a feature drafter for smollm2-135m-yarn32k)")
    if isinstance(draft, str) and drafter_kind(draft):
        check_trained_for(draft, cfg)
        return
    if not isinstance(draft, str) or draft in ("ngram", SELF) or draft.startswith("truncated:"):
        return
    from ..engine.weights import resolve
    try:
        resolve(draft)
    except SparsedraftError as exc:
        raise SparsedraftError(f"draft {draft!r} is not ngram, truncated:K, a BudgetDraft run folder "
                               f"(train-drafter writes one) or a model: {exc}") from exc


def _check_draft_vocab(draft: Any, draft_vocab: int) -> None:
    require(draft_vocab >= 0, f"draft_vocab must be >= 0 (0 keeps the draft's full head), got {draft_vocab}")
    require(not draft_vocab or (draft != "ngram" and not isinstance(draft, Drafter)),
            f"draft_vocab {draft_vocab} restricts a draft model's head; this draft ({draft!r}) has no head of its "
            "own: pass a draft model or drop draft_vocab")


def _check_draft_confidence(draft: Any, confidence: float) -> None:
    check_confidence(confidence)
    require(not confidence or (draft != "ngram" and not isinstance(draft, Drafter)),
            f"draft_confidence {confidence} stops a draft model's proposals by its own probabilities; this draft "
            f"({draft!r}) has none: pass a draft model or drop draft_confidence (a Drafter object takes it as "
            "its .confidence)")


def _check_draft_lookup(draft: Any, lookup: float) -> None:
    require(lookup == 0 or draft != "ngram",
            f"draft_lookup {lookup} weighs a draft model against prompt lookup; this draft is prompt lookup itself "
            "(ngram): pass a draft model or drop draft_lookup")
    if lookup:
        check_override(lookup)


def _check_draft_vocab_size(draft_vocab: int, cfg: ModelConfig) -> None:
    require(draft_vocab < cfg.vocab_size, f"draft_vocab ({draft_vocab}) must be smaller than the model's vocabulary "
                                          f"({cfg.vocab_size}); 0 keeps the full head")


# budgetdraft drafts with the trained feature drafter by default: the committed one (make drafter), which make
# reproduce copies to where benches and notebooks look
COMMITTED_DRAFTER = "data/drafters/feature"
DEFAULT_DRAFTER = "outputs/drafters/feature"
DRAFT_KV_HELP = ("values of the retrieval cache a self-draft level reads: same (the target's dtype), int8 (a scale "
                 "per token and KV head) or int4 (a scale per 32 values), quantised from the target's own KV; the "
                 "verifier's cache keeps its precision")
DRAFT_WEIGHTS_HELP = ("weights of a draft level that is the target itself: same (the target's), bf16, int8, w8a8 "
                      "(int8, and each row of x rounded to int8 too; CPU) or int4 (group-wise; CPU): a copy made once "
                      "per model; the verifier keeps its own, so greedy tokens stay the target's")

CHUNK_SCORING_HELP = ("how a budget draft cache ranks chunks: attention (observation window, per layer), keys (mean "
                      "key vs last key, per KV head); empty: the drafter's training rule")

DRAFT_CONFIDENCE_HELP = ("end a proposal to the full target after a token its proposer was less sure of than "
                         "this (its own top-1 probability: the draft model's; in retrieval and triforce the target's "
                         "over its retrieval cache), saving verification rows the target would likely reject; still "
                         "lossless; 0: always gamma (gamma2) tokens")

DRAFT_LOOKUP_HELP = ("prompt lookup first: each round proposes what followed the last tokens' newest earlier "
                     "occurrence in the context, unless the draft model is at least this sure (its own top-1 "
                     "probability) of another first token, or there is none; then the draft model's tokens. "
                     "1: the draft model drafts only where lookup finds nothing, and is not run elsewhere. Still "
                     "lossless; 0: the draft model alone")

DRAFT_VOCAB_HELP = ("score only the N tokens most frequent in the essays' train split in the draft's head (q = 0 "
                    "elsewhere: still lossless, a cheaper draft step); 0: the full head")


def _check_budget(budget: int, chunk_size: int, prompt_len: int) -> None:
    require(chunk_size >= 1, f"chunk_size must be >= 1, got {chunk_size}")
    require(budget >= chunk_size and budget % chunk_size == 0,
            f"budget ({budget}) must be a positive multiple of chunk_size ({chunk_size})")
    context = prompt_len - 1  # the full cache holds the prompt minus its pending last token
    require(budget < context, f"budget ({budget}) must be smaller than the cached context ({context} tokens: the "
                              f"prompt minus its last); use a longer prompt or a budget < {context}")


@dataclass(frozen=True)
class ArOptions:
    """Plain autoregressive decoding over a full cache: the baseline."""

    def check(self, cfg: ModelConfig, prompt_len: int) -> None:
        """Nothing beyond the prompt checks every method shares."""


@dataclass(frozen=True)
class StreamingDraftOptions:
    """A draft model's StreamingLLM cache (sink + recent window), shared by ``spec`` and ``triforce``."""

    sink: int = field(default=16, metadata={"help": "streaming draft cache: sink tokens"})
    window: int = field(default=240, metadata={"help": "streaming draft cache: recent-window tokens"})
    draft_positions: str = field(default="cache", metadata={"help": "streaming draft cache RoPE positions",
                                                            "choices": POSITION_MODES})

    def __post_init__(self) -> None:
        require(self.draft_positions in POSITION_MODES,
                f"draft_positions must be one of {POSITION_MODES}, got {self.draft_positions!r}")
        require(self.sink >= 0 and self.window >= 1, f"need sink >= 0 and window >= 1, got {self.sink}, {self.window}")


@dataclass(frozen=True)
class SpecOptions(StreamingDraftOptions):
    """A draft proposes ``gamma`` tokens per full-target verification."""

    draft: str = field(default="ngram", metadata={
        "help": "ngram (prompt lookup), self (the target itself over a sparse draft cache it prefills; "
                "retrieval --group-reduce recent gets StreamingLLM self-speculation by a copy instead), "
                "truncated:K (the target's first K layers), a model source, a BudgetDraft run folder or a feature "
                "drafter folder (train-drafter --kind feature); from Python also a Transformer or Drafter"})
    draft_cache: str = field(default="full", metadata={
        "help": "the draft model's cache: full, streaming (sink + window) or budget (BudgetDraft, --budget tokens)",
        "choices": DRAFT_CACHES})
    gamma: int = field(default=4, metadata={"help": "draft tokens per full-target verification"})
    budget: int = field(default=1024, metadata={"help": "tokens of a budget draft cache (multiple of chunk_size)"})
    chunk_size: int = field(default=8, metadata={"help": "chunk size of a budget draft cache"})
    draft_vocab: int = field(default=0, metadata={"help": DRAFT_VOCAB_HELP})
    chunk_scoring: str = field(default="", metadata={"help": CHUNK_SCORING_HELP, "choices": CHUNK_SCORINGS})
    draft_weights: str = field(default="same", metadata={"help": DRAFT_WEIGHTS_HELP, "choices": DRAFT_WEIGHTS})
    draft_confidence: float = field(default=0.0, metadata={"help": DRAFT_CONFIDENCE_HELP})
    draft_lookup: float = field(default=0.0, metadata={"help": DRAFT_LOOKUP_HELP})

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_draft(self.draft)
        _check_draft_confidence(self.draft, self.draft_confidence)
        _check_draft_lookup(self.draft, self.draft_lookup)
        check_draft_weights(self.draft_weights)
        require(self.draft_weights == "same" or self.draft == SELF,
                f"draft_weights {self.draft_weights!r} quantises the target drafting for itself; this draft is "
                f"{self.draft!r}: add draft self or drop draft_weights")
        _check_draft_vocab(self.draft, self.draft_vocab)
        _check_chunk_scoring(self.chunk_scoring)
        require(not self.chunk_scoring or self.draft_cache == "budget",
                f"chunk_scoring {self.chunk_scoring!r} ranks the chunks of a budget draft cache; this draft cache is "
                f"{self.draft_cache!r}: add draft_cache budget or drop chunk_scoring")
        require(self.draft_cache in DRAFT_CACHES, f"draft_cache must be one of {DRAFT_CACHES}, got {self.draft_cache!r}")
        require(self.gamma >= 1, f"gamma (draft tokens per verification) must be >= 1, got {self.gamma}")
        require(not (self.draft == SELF and self.draft_cache == "full"),
                "draft self over a full cache drafts what the target verifies at the target's own cost; give it a "
                "sparse cache: draft_cache streaming (StreamingLLM self-speculation) or budget")
        require(self.draft_cache == "full" or self.draft != "ngram",
                f"draft_cache {self.draft_cache!r} needs a draft model; prompt lookup (ngram) has no cache")

    def check(self, cfg: ModelConfig, prompt_len: int) -> None:
        _check_draft_source(self.draft, cfg)
        _check_draft_vocab_size(self.draft_vocab, cfg)
        check_draft_weights(self.draft_weights, cfg)
        if self.draft_cache == "budget":
            _check_budget(self.budget, self.chunk_size, prompt_len)
            _check_trained_budget(self.draft, self.budget)
        if isinstance(self.draft, str) and self.draft.startswith("truncated:"):
            k = int(self.draft.removeprefix("truncated:"))
            require(1 <= k <= cfg.num_layers, f"truncated:{k} needs 1 <= K <= {cfg.num_layers} (the target's layers)")


@dataclass(frozen=True)
class BudgetDraftOptions:
    """A BudgetDraft drafter over its budgeted sparse cache drafts for the full target."""

    draft: str = field(default=DEFAULT_DRAFTER, metadata={
        "help": "a feature drafter folder (default: the committed one, which make reproduce copies to "
                f"{DEFAULT_DRAFTER}) or a BudgetDraft run folder (train-drafter), a model source, or from "
                "Python a Transformer"})
    budget: int = field(default=1024, metadata={"help": "drafter KV budget in tokens (multiple of chunk_size)"})
    chunk_size: int = field(default=8, metadata={"help": "chunk size of the budget cache"})
    gamma: int = field(default=4, metadata={"help": "draft tokens per full-target verification"})
    draft_vocab: int = field(default=0, metadata={"help": DRAFT_VOCAB_HELP})
    chunk_scoring: str = field(default="", metadata={"help": CHUNK_SCORING_HELP, "choices": CHUNK_SCORINGS})
    draft_confidence: float = field(default=0.0, metadata={"help": DRAFT_CONFIDENCE_HELP})
    draft_lookup: float = field(default=0.0, metadata={"help": DRAFT_LOOKUP_HELP})

    def __post_init__(self) -> None:
        _check_draft(self.draft)
        require(self.draft != "ngram", "budgetdraft needs a draft model, not prompt lookup (ngram)")
        _check_draft_confidence(self.draft, self.draft_confidence)
        _check_draft_lookup(self.draft, self.draft_lookup)
        _check_draft_vocab(self.draft, self.draft_vocab)
        _check_chunk_scoring(self.chunk_scoring)
        require(self.gamma >= 1, f"gamma must be >= 1, got {self.gamma}")

    def check(self, cfg: ModelConfig, prompt_len: int) -> None:
        _check_draft_source(self.draft, cfg)
        _check_draft_vocab_size(self.draft_vocab, cfg)
        _check_budget(self.budget, self.chunk_size, prompt_len)
        _check_trained_budget(self.draft, self.budget)


@dataclass(frozen=True)
class RetrievalCacheOptions:
    """The target's retrieval cache (TriForce's level 2), shared by ``retrieval`` and ``triforce``."""

    budget: int = field(default=1024, metadata={"help": "retrieval cache tokens (multiple of chunk_size)"})
    chunk_size: int = field(default=8, metadata={"help": "retrieval chunk size in tokens"})
    rebuild: str = field(default="never", metadata={"help": "retrieval rebuild policy: never, every:N, accept<T[:W]"})
    group_reduce: str = field(default="sum", metadata={"help": "how chunks are chosen: sum or max of a KV head's "
                                                               "query-group scores, or recent (no query: the sink "
                                                               "chunk and the latest chunks, StreamingLLM as a view "
                                                               "of the full cache: MagicDec's self-speculation)",
                                                       "choices": GROUP_REDUCTIONS})
    draft_weights: str = field(default="same", metadata={"help": DRAFT_WEIGHTS_HELP, "choices": DRAFT_WEIGHTS})
    draft_kv: str = field(default="same", metadata={"help": DRAFT_KV_HELP, "choices": DRAFT_KV})
    draft_confidence: float = field(default=0.0, metadata={"help": DRAFT_CONFIDENCE_HELP})

    def __post_init__(self) -> None:
        check_draft_weights(self.draft_weights)
        check_draft_kv(self.draft_kv)
        check_confidence(self.draft_confidence)
        require(self.group_reduce in GROUP_REDUCTIONS,
                f"group_reduce must be one of {GROUP_REDUCTIONS}, got {self.group_reduce!r}")
        rebuild_policy(self.rebuild)  # raises on a malformed policy

    def check(self, cfg: ModelConfig, prompt_len: int) -> None:
        _check_budget(self.budget, self.chunk_size, prompt_len)
        check_draft_weights(self.draft_weights, cfg)
        check_draft_kv(self.draft_kv, cfg)


@dataclass(frozen=True)
class RetrievalOptions(RetrievalCacheOptions):
    """The target over a retrieval cache drafts for itself (no hierarchy)."""

    gamma: int = field(default=6, metadata={"help": "draft tokens per full-target verification"})

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.gamma >= 1, f"gamma must be >= 1, got {self.gamma}")


@dataclass(frozen=True)
class TriforceOptions(RetrievalCacheOptions, StreamingDraftOptions):
    """Level 1 (draft, gamma1) -> level 2 (target + retrieval cache, gamma2) -> level 3 (full target)."""

    draft: str = field(default="ngram", metadata={
        "help": "level 1: ngram (prompt lookup), truncated:K, a model source, a BudgetDraft run folder or a feature "
                "drafter folder (streaming cache); from Python also a Transformer or Drafter"})
    gamma1: int = field(default=4, metadata={"help": "level-1 draft tokens per level-2 verification"})
    gamma2: int = field(default=8, metadata={"help": "level-2 tokens per full-target verification"})
    draft_vocab: int = field(default=0, metadata={"help": DRAFT_VOCAB_HELP})
    draft_lookup: float = field(default=0.0, metadata={"help": "level 1: " + DRAFT_LOOKUP_HELP})

    def __post_init__(self) -> None:
        RetrievalCacheOptions.__post_init__(self)
        StreamingDraftOptions.__post_init__(self)
        _check_draft(self.draft)
        _check_draft_lookup(self.draft, self.draft_lookup)
        _check_draft_vocab(self.draft, self.draft_vocab)
        require(self.gamma1 >= 1 and self.gamma2 >= 1,
                f"gamma1 and gamma2 must be >= 1, got gamma1={self.gamma1}, gamma2={self.gamma2}")

    def check(self, cfg: ModelConfig, prompt_len: int) -> None:
        """The retrieval budget is level 2's; a BudgetDraft drafter at level 1 drafts over a streaming cache,
        so its trained budgets do not constrain it."""
        _check_draft_source(self.draft, cfg)
        _check_draft_vocab_size(self.draft_vocab, cfg)
        super().check(cfg, prompt_len)


def load_draft(draft: str | Transformer | Drafter | FeatureHead, target: Transformer,
               draft_vocab: int = 0) -> Transformer | Drafter | FeatureHead | None:
    """A draft made concrete, its head restricted to ``draft_vocab`` frequent tokens when that is not 0 (see
    :mod:`sparsedraft.speculative.vocab`; the target's tokenizer counts them)."""
    model = _load_draft(draft, target)
    if not draft_vocab:
        return model
    source = getattr(target, "source", None)
    require(source is not None, "draft_vocab counts tokens with the target's tokenizer, but this target does not say "
                                "where it was loaded from; load it with sparsedraft.load_model")
    ids = frequent_tokens_of(source, draft_vocab, target.cfg.vocab_size)
    if isinstance(model, FeatureHead):
        return model.restricted(ids)
    return restrict_head(model, ids)


def _load_draft(draft: str | Transformer | Drafter | FeatureHead,
                target: Transformer) -> Transformer | Drafter | FeatureHead | None:
    """``ngram`` -> None (prompt lookup), ``self`` -> the target, ``truncated:K`` -> the target's first K layers
    (shared weights), a BudgetDraft run folder -> its drafter (checked against the target first), a feature
    drafter folder -> its head attached to the target (checked against it first), any other model source -> a
    loaded model; objects pass through. Models land on the target's device and dtype."""
    if not isinstance(draft, str):
        return draft
    if draft == "ngram":
        return None
    if draft == SELF:
        return target
    if draft.startswith("truncated:"):
        return truncated_draft(target, int(draft.removeprefix("truncated:")))
    if drafter_kind(draft):
        return load_trained(draft, target)
    from ..engine.weights import load_model
    return load_model(draft, target.dtype, target.device)


def _level1(draft: Transformer | Drafter | FeatureHead | None, target: Transformer,
            opts: TriforceOptions) -> Transformer | Drafter:
    """TriForce's level 1 as its driver takes it: prompt lookup for ``None``, a feature head over a streaming cache
    of its own (it rolls back up to gamma1 + gamma2 entries, as a draft model's streaming cache does), either
    behind prompt lookup with ``draft_lookup``."""
    if draft is None:
        return NgramDrafter(target.cfg.vocab_size)
    if isinstance(draft, FeatureHead):
        draft = FeatureDrafter.create(draft, "streaming", 0, gamma=opts.gamma1 + opts.gamma2, sink=opts.sink,
                                      window=opts.window, positions=opts.draft_positions)
    elif isinstance(draft, Transformer) and opts.draft_lookup:  # built here so that lookup can wrap it
        draft = streaming_drafter(draft, opts.gamma1 + opts.gamma2, opts.sink, opts.window, opts.draft_positions)
    return LookupFirst(draft, opts.draft_lookup) if opts.draft_lookup else draft


Outcome = GenerationResult | SpecResult


def run_ar(target: Transformer, prompt: torch.Tensor, n: int, sampling: SamplingConfig, opts: ArOptions,
           eos: int | None, prefilled: PrefilledPrompt | None = None) -> Outcome:
    return generate(target, prompt, n, sampling, eos_token_id=eos, prefilled=prefilled)


def run_spec(target: Transformer, prompt: torch.Tensor, n: int, sampling: SamplingConfig, opts: SpecOptions,
             eos: int | None, prefilled: PrefilledPrompt | None = None) -> Outcome:
    own = draft_copy(target, opts.draft_weights) if opts.draft == SELF else opts.draft  # made once per model
    draft = load_draft(own, target, opts.draft_vocab)
    if draft is None:
        drafter = NgramDrafter(target.cfg.vocab_size)
    elif isinstance(draft, Drafter):
        drafter = draft
    elif isinstance(draft, FeatureHead):
        drafter = FeatureDrafter.create(draft, opts.draft_cache, prompt.shape[1] + n, gamma=opts.gamma, sink=opts.sink,
                                        window=opts.window, budget=opts.budget, chunk_size=opts.chunk_size,
                                        scoring=_chunk_scoring(opts.draft, opts.chunk_scoring),
                                        positions=opts.draft_positions)
    elif opts.draft_cache == "budget":
        drafter = BudgetDrafter.create(draft, opts.budget, prompt.shape[1] + n, opts.chunk_size,
                                       scoring=_chunk_scoring(opts.draft, opts.chunk_scoring))
    elif opts.draft_cache == "streaming":
        drafter = streaming_drafter(draft, opts.gamma, opts.sink, opts.window, opts.draft_positions)
    else:
        drafter = ModelDrafter(draft, draft.new_cache(prompt.shape[1] + n))
    if opts.draft_confidence:  # checked: not a Drafter the caller made
        drafter.confidence = opts.draft_confidence
    if opts.draft_lookup:
        drafter = LookupFirst(drafter, opts.draft_lookup)
    return speculative(target, drafter, prompt, n, opts.gamma, sampling, eos_token_id=eos, prefilled=prefilled)


def run_budgetdraft(target: Transformer, prompt: torch.Tensor, n: int, sampling: SamplingConfig,
                    opts: BudgetDraftOptions, eos: int | None, prefilled: PrefilledPrompt | None = None) -> Outcome:
    return run_spec(target, prompt, n, sampling,
                    SpecOptions(draft=opts.draft, draft_cache="budget", gamma=opts.gamma, budget=opts.budget,
                                chunk_size=opts.chunk_size, chunk_scoring=opts.chunk_scoring,
                                draft_vocab=opts.draft_vocab, draft_confidence=opts.draft_confidence,
                                draft_lookup=opts.draft_lookup), eos, prefilled)


def run_retrieval(target: Transformer, prompt: torch.Tensor, n: int, sampling: SamplingConfig,
                  opts: RetrievalOptions, eos: int | None, prefilled: PrefilledPrompt | None = None) -> Outcome:
    return retrieval(target, prompt, n, sampling, gamma=opts.gamma, budget=opts.budget, chunk_size=opts.chunk_size,
                     rebuild=opts.rebuild, group_reduce=opts.group_reduce, eos_token_id=eos, prefilled=prefilled,
                     draft_weights=opts.draft_weights, draft_kv=opts.draft_kv, draft_confidence=opts.draft_confidence)


def run_triforce(target: Transformer, prompt: torch.Tensor, n: int, sampling: SamplingConfig,
                 opts: TriforceOptions, eos: int | None, prefilled: PrefilledPrompt | None = None) -> Outcome:
    level1 = _level1(load_draft(opts.draft, target, opts.draft_vocab), target, opts)
    return triforce(target, level1, prompt, n, sampling, gamma1=opts.gamma1, gamma2=opts.gamma2, budget=opts.budget,
                    chunk_size=opts.chunk_size, sink=opts.sink, window=opts.window, rebuild=opts.rebuild,
                    group_reduce=opts.group_reduce, draft_positions=opts.draft_positions, eos_token_id=eos,
                    prefilled=prefilled, draft_weights=opts.draft_weights, draft_kv=opts.draft_kv,
                    draft_confidence=opts.draft_confidence)


@dataclass(frozen=True)
class Method:
    options: type  # frozen dataclass: fields are the method's options (CLI flags too), validated on construction
    # (target, prompt [B, T], new tokens, sampling, options, eos id, a shared prefill or None) -> outcome
    run: Callable[[Transformer, torch.Tensor, int, SamplingConfig, Any, int | None, PrefilledPrompt | None], Outcome]
    help: str


METHODS: dict[str, Method] = {
    "ar": Method(ArOptions, run_ar, "plain autoregressive decoding (the baseline)"),
    "spec": Method(SpecOptions, run_spec, "two-level speculative decoding: a draft proposes for the full target"),
    "retrieval": Method(RetrievalOptions, run_retrieval, "the target over a retrieval cache drafts for itself"),
    "triforce": Method(TriforceOptions, run_triforce, "TriForce: draft -> target + retrieval cache -> full target"),
    "budgetdraft": Method(BudgetDraftOptions, run_budgetdraft,
                          "BudgetDraft: a trained drafter over its budget cache drafts for the full target"),
}


def method_options(method: str, **options: Any) -> Any:
    """The validated options object of ``method`` (unknown names and bad values fail here, before any work)."""
    require(method in METHODS, f"unknown method {method!r}; choose one of {sorted(METHODS)}")
    kind = METHODS[method].options
    known = set(kind.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    require(not unknown, f"method {method!r} has no option(s) {unknown}; its options are {sorted(known) or 'none'}")
    return kind(**options)
