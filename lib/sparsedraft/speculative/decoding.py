"""One door to every decoder: ``decode(model, prompt, method=..., max_new_tokens=..., **options)``.

The methods live in :data:`sparsedraft.speculative.methods.METHODS`; this module turns a
prompt (text or ids) into token ids, validates everything before the first
forward, runs the method and returns one :class:`DecodeResult`, whatever the
method.

Time per token is defined once, here: decode seconds divided by the tokens
the decode phase emitted (:attr:`DecodeResult.decode_tokens`). Plain decoding
takes its first token from the prefill logits, so its decode phase emits
``N - 1`` of ``N`` tokens; a speculative run rolls the last prompt token back
after its prefill and verifies the first generated token like every other, so
its decode phase emits all ``N``. Each ratio therefore compares the cost of one
emitted token in steady state.

One prefill can serve many runs: ``decode(..., prefilled=prefill_prompt(model,
ids))`` starts every method from a copy of it (:mod:`sparsedraft.engine.prefilled`).
``prefill_s`` then still counts that prefill's seconds, plus what the run spent
itself (:attr:`DecodeResult.setup_s`: the copy, a retrieval cache's selection,
a draft model's own prefill), so ratios of prefill + decode stay honest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..engine.cache import StaticCache
from ..engine.data import Tokenizer, model_tokenizer
from ..engine.generate import GenerationResult
from ..engine.model import Transformer
from ..engine.prefill import check_prompt
from ..engine.prefilled import PrefilledPrompt
from ..engine.sampling import SamplingConfig
from ..errors import require
from .feature import FeatureHead
from .methods import METHODS, method_options
from .stats import LevelStats, SpecStats

Prompt = str | Sequence[str] | Sequence[int] | torch.Tensor


@dataclass
class DecodeResult:
    method: str
    tokens: torch.Tensor  # [batch, new] generated ids (prompt excluded), on the CPU
    prompt_len: int
    prefill_s: float  # wall time of the prompt forward(s), including a sparse cache's build (and a shared prefill)
    decode_s: float  # wall time of the generation loop
    decode_tokens: int  # tokens the decode phase emitted per sequence (see the module docstring)
    levels: list[LevelStats] = field(default_factory=list)  # verifier levels, draft-most first; [] for ar
    stats: SpecStats | None = None  # a speculative run's full record (time per region, rebuilds)
    text: list[str] | None = None  # decoded tokens per sequence when a tokenizer is known
    shared_prefill_s: float = 0.0  # the part of prefill_s a shared prefill spent (its seconds); 0 without one
    rows: list["DecodeResult"] | None = None  # a batch: each row's own result (its levels, times, stats)
    lockstep: Any = None  # a batch: what the batching did (:class:`~sparsedraft.speculative.lockstep.LockstepStats`)

    @property
    def ms_per_token(self) -> float:
        """Decode milliseconds per emitted token: the one definition every ratio uses."""
        return 1000 * self.decode_s / self.decode_tokens if self.decode_tokens else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput over the batch."""
        return self.tokens.shape[0] * 1000 / self.ms_per_token if self.decode_tokens else float("nan")

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def setup_s(self) -> float:
        """Prefill-phase seconds this run spent itself: all of them without a shared prefill, else the copy of
        it, a retrieval cache's selection and a draft model's own prefill."""
        return self.prefill_s - self.shared_prefill_s

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "tokens": self.tokens.tolist(), "prompt_len": self.prompt_len,
                "prefill_s": self.prefill_s, "decode_s": self.decode_s, "decode_tokens": self.decode_tokens,
                "ms_per_token": self.ms_per_token, "shared_prefill_s": self.shared_prefill_s,
                "levels": [lvl.to_dict() for lvl in self.levels],
                "stats": self.stats.to_dict() if self.stats else None, "text": self.text}


def tokenizer_for(model: Transformer) -> Tokenizer:
    """The tokenizer that belongs to a model loaded by name (UTF-8 bytes for the tiny random models)."""
    source = getattr(model, "source", None)
    require(source is not None, "this model was not loaded by name, so its tokenizer is unknown; pass tokenizer=")
    return model_tokenizer(source)


def prompt_ids(prompt: Prompt, tokenizer: Tokenizer | None) -> torch.Tensor:
    """``prompt`` as ids ``[batch, tokens]``: a text, a list of equally long texts, ids, or a tensor."""
    if isinstance(prompt, torch.Tensor):
        require(prompt.dim() in (1, 2), f"a prompt tensor must be [tokens] or [batch, tokens], got {prompt.dim()}-D")
        return prompt.long() if prompt.dim() == 2 else prompt.long()[None]
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    require(len(texts) > 0, "the prompt is empty; pass text or token ids")
    if not isinstance(texts[0], str):
        return torch.tensor([texts], dtype=torch.long)
    require(tokenizer is not None, "a text prompt needs a tokenizer: pass tokenizer=, or load the model by name")
    rows = [tokenizer.encode(text) for text in texts]
    lengths = sorted({len(r) for r in rows})
    require(len(lengths) == 1, f"the texts tokenize to different lengths {lengths}; one [batch, tokens] tensor "
                               "cannot hold them: pass them to decode as a list (each row keeps its length)")
    return torch.tensor(rows, dtype=torch.long)


def is_batch(prompt: Prompt, attention_mask: torch.Tensor | None) -> bool:
    """Whether ``prompt`` is several prompts: a list of texts or id rows, or a [B > 1, T] tensor."""
    if attention_mask is not None:
        return True
    if isinstance(prompt, torch.Tensor):
        return prompt.dim() == 2 and prompt.shape[0] > 1
    if isinstance(prompt, str) or not isinstance(prompt, Sequence) or len(prompt) == 0:
        return False
    first = prompt[0]
    return len(prompt) > 1 and (isinstance(first, str) or not isinstance(first, (int, float)))


def decode(model: Transformer, prompt: Prompt, method: str = "ar", max_new_tokens: int = 64, *,
           sampling: SamplingConfig | None = None, temperature: float | None = None, top_p: float | None = None,
           seed: int | None = None, tokenizer: Tokenizer | None = None, eos_token_id: int | None = None,
           prefilled: PrefilledPrompt | Sequence[PrefilledPrompt] | None = None,
           attention_mask: torch.Tensor | None = None, max_memory: int | str | None = None,
           **options: Any) -> DecodeResult:
    """Generate ``max_new_tokens`` with ``method`` (see :data:`~.methods.METHODS` for each one's options).

    ``sampling`` (or the ``temperature``/``top_p``/``seed`` shortcuts) sets
    the law; temperature 0 is greedy, where every method returns exactly the
    tokens of ``method="ar"``. ``prefilled`` (:func:`~sparsedraft.engine.prefill_store.prefill_prompt`
    of this model and prompt) replaces the prompt forward by a copy of it and is
    left as it was. Every option, the prompt and the prefill are checked before
    the first forward.

    A batch -- a list of prompts of any lengths, or a ``[B, T]`` tensor (with
    ``attention_mask`` when padded) -- runs every row through the method at
    batch 1 in lockstep, one forward per step for all rows
    (:mod:`sparsedraft.speculative.batching`); ``prefilled`` is then one prefill per row,
    ``max_memory`` caps what the batch may hold (default: the available memory),
    and the result's ``rows`` hold each row's own result. Plain decoding of a
    ``[B, T]`` tensor (rows of one length) keeps one batched cache instead, so
    a batched ``prefill_prompt`` of it can seed the run; its rows are the same.
    """
    opts = method_options(method, **options)
    shortcuts = {k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("seed", seed)) if v is not None}
    require(sampling is None or not shortcuts, "give either sampling= or temperature/top_p/seed, not both")
    sampling = sampling or SamplingConfig(**shortcuts)
    texts = isinstance(prompt, str) or (isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], str))
    if tokenizer is None and texts:
        tokenizer = tokenizer_for(model)
    if isinstance(prompt, torch.Tensor) and attention_mask is None:
        from .batching import check_unpadded
        check_unpadded(prompt, tokenizer)
    native = method == "ar" and isinstance(prompt, torch.Tensor) and attention_mask is None and (
        prefilled is None or isinstance(prefilled, PrefilledPrompt))  # equal rows, one batched cache (and prefill)
    if is_batch(prompt, attention_mask) and not native:
        from .batching import prompt_rows
        return _decode_batch(model, prompt_rows(prompt, tokenizer, attention_mask), method, max_new_tokens,
                             sampling, opts, tokenizer, eos_token_id, prefilled, max_memory)
    require(prefilled is None or isinstance(prefilled, PrefilledPrompt),
            "one prompt takes one prefill (a PrefilledPrompt), not a list")
    ids = prompt_ids(prompt, tokenizer).to(model.device)
    _check_run(model, ids, method, max_new_tokens, opts)
    if prefilled is not None:
        prefilled.check(model, ids)
    outcome = METHODS[method].run(model, ids, max_new_tokens, sampling, opts, eos_token_id, prefilled)
    return _result(method, outcome, ids.shape[1], tokenizer, prefilled.seconds if prefilled is not None else 0.0)


def _check_run(model: Transformer, ids: torch.Tensor, method: str, max_new_tokens: int, opts: Any) -> None:
    check_prompt(model, ids, max_new_tokens)
    if method != "ar":
        require(ids.shape[1] >= 2, f"speculative methods need a prompt of >= 2 tokens, got {ids.shape[1]}")
    opts.check(model.cfg, ids.shape[1])


def _result(method: str, outcome: Any, prompt_len: int, tokenizer: Tokenizer | None, shared: float) -> DecodeResult:
    text = None if tokenizer is None else [tokenizer.decode(row.tolist()) for row in outcome.tokens]
    if isinstance(outcome, GenerationResult):
        return DecodeResult(method, outcome.tokens, prompt_len, outcome.prefill_s, outcome.decode_s,
                            max(outcome.tokens.shape[1] - 1, 0), text=text, shared_prefill_s=shared)
    s = outcome.stats
    return DecodeResult(method, outcome.tokens, prompt_len, s.prefill_s, s.decode_s, s.generated, s.levels, s,
                        text, shared)


def _decode_batch(model: Transformer, rows: list[torch.Tensor], method: str, max_new_tokens: int,
                  sampling: SamplingConfig, opts: Any, tokenizer: Tokenizer | None, eos: int | None,
                  prefilled: Sequence[PrefilledPrompt] | None, max_memory: int | str | None) -> DecodeResult:
    """Every check (each row's prompt and prefill, the memory), then the rows in lockstep; one result."""
    from .batching import batch_bytes, check_memory, run_batch
    from .methods import load_draft

    if prefilled is not None:
        require(isinstance(prefilled, Sequence) and len(prefilled) == len(rows),
                f"a batch of {len(rows)} prompts takes one prefill per row (a list of {len(rows)})")
    for b, row in enumerate(rows):
        _check_run(model, row[None], method, max_new_tokens, opts)
        if prefilled is not None:
            prefilled[b].check(model, row[None])
    draft = load_draft(opts.draft, model, getattr(opts, "draft_vocab", 0)) if hasattr(opts, "draft") else None  # once
    require(draft is None or isinstance(draft, (Transformer, FeatureHead)),
            "a Drafter object follows one sequence; for a batch pass the draft as a model, a feature head or a "
            "source string")
    held = prefilled is not None and any(isinstance(p.cache, StaticCache) for p in prefilled)  # not on disk
    check_memory(batch_bytes(model, draft, [row.numel() for row in rows], max_new_tokens, method, opts, held),
                 max_memory, model.device)
    run = run_batch(model, rows, method, max_new_tokens, sampling, opts, eos, prefilled, draft)
    results = [_result(method, outcome, row.numel(), tokenizer, prefilled[b].seconds if prefilled else 0.0)
               for b, (outcome, row) in enumerate(zip(run.outcomes, rows))]
    width = max(r.tokens.shape[1] for r in results)
    fill = eos if eos is not None else -1
    tokens = torch.full((len(rows), width), fill, dtype=torch.long)
    for b, r in enumerate(results):
        tokens[b, :r.tokens.shape[1]] = r.tokens[0]
    levels = merge_levels([r.levels for r in results])
    slowest = max(results, key=lambda r: r.decode_s)
    text = None if tokenizer is None else [t for r in results for t in r.text]
    return DecodeResult(method, tokens, max(row.numel() for row in rows), max(r.prefill_s for r in results),
                        slowest.decode_s, max(r.decode_tokens for r in results), levels, None, text,
                        max(r.shared_prefill_s for r in results), rows=results, lockstep=run.lockstep)


def merge_levels(per_row: list[list[LevelStats]]) -> list[LevelStats]:
    """One list of levels whose counts add up every row's."""
    if not per_row or not per_row[0]:
        return []
    merged = []
    for level_rows in zip(*per_row):
        total = LevelStats(level_rows[0].name)
        for level in level_rows:
            total.drafted += level.drafted
            total.accepted += level.accepted
            total.verifications += level.verifications
            for g, counts in level.rounds.items():
                mine = total.rounds.setdefault(g, [0] * len(counts))
                total.rounds[g] = [a + b for a, b in zip(mine, counts)]
        merged.append(total)
    return merged
