"""Speculative decoding benchmark: a method and the autoregressive baseline, same process, same prompt.

Both run after identical warm-up runs, with the device synchronised around
every timed region, and report prefill and decode separately. The speedup is
a ratio of decode time *per generated token*: the baseline's first token
comes out of its prefill, so its decode covers ``new_tokens - 1`` forwards,
while a speculative run re-feeds the last prompt token in its first
verification and its decode covers all ``new_tokens``. The end-to-end ratio
(prefill + decode) is reported too, since a retrieval build sits in the
speculative prefill.

Methods (``decoder``): ``spec`` (a draft proposes for the full target; the
draft is ``truncated:K`` -- the target's first K layers --, ``ngram`` -- prompt
lookup --, a BudgetDraft run folder, or any model spec
:func:`~sparsedraft.weights.load_model` accepts; with ``--draft-cache budget``
it drafts over BudgetDraft's cache), ``retrieval`` (the target over a retrieval
cache drafts for itself) and ``triforce`` (draft + streaming cache, or prompt
lookup -> target + retrieval cache -> target). ``--quant int8`` quantises the
target's linear layers once, so the baseline and every truncated draft get the
same lever.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .bench import DTYPES, bench_prompt, format_table, resolve_device, time_runs
from .budgetdraft.checkpoint import has_checkpoint, load_drafter
from .budgetdraft.drafter import BudgetDrafter
from .caches import StreamingCache, rebuild_policy
from .caches.streaming import POSITION_MODES
from .caches.retrieval import GROUP_REDUCTIONS
from .data import SPLITS
from .errors import require
from .generate import GenerationResult, generate
from .model import Transformer
from .quant import quantize_int8
from .sampling import SamplingConfig
from .speculative import (Drafter, ModelDrafter, NgramDrafter, SpecResult, retrieval, speculative, triforce,
                          truncated_draft)
from .weights import load_model

DECODERS = ("spec", "retrieval", "triforce")
DRAFT_CACHES = ("full", "streaming", "budget")
QUANTS = ("none", "int8")


@dataclass(frozen=True)
class SpecBenchConfig:
    model: str = field(default="smollm2-135m", metadata={"help": "target: short name, .gguf, folder or HF id"})
    decoder: str = field(default="triforce", metadata={"help": "speculative method", "choices": DECODERS})
    draft: str = field(default="ngram", metadata={
        "help": "draft for spec/triforce: truncated:K (target's first K layers), ngram (prompt lookup), a model spec, "
                "or a BudgetDraft run folder (train-drafter)"})
    draft_cache: str = field(default="full", metadata={
        "help": "spec: the draft's cache (streaming uses sink/window, budget is BudgetDraft's cache of --budget tokens)",
        "choices": DRAFT_CACHES})
    dtype: str = field(default="fp32", metadata={"help": "weights and KV cache dtype", "choices": tuple(DTYPES)})
    quant: str = field(default="none", metadata={
        "help": "weight-only quantisation of the target (and so of the baseline and truncated drafts)",
        "choices": QUANTS})
    device: str = field(default="auto", metadata={"help": "auto (CUDA if present), cpu, cuda, cuda:N"})
    context: int = field(default=4000, metadata={"help": "prompt tokens (essay text)"})
    new_tokens: int = field(default=128, metadata={"help": "tokens generated per run (>= 2)"})
    gamma: int = field(default=6, metadata={"help": "draft tokens per full-target verification (TriForce gamma2)"})
    gamma1: int = field(default=2, metadata={"help": "triforce: level-1 draft tokens per level-2 verification"})
    budget: int = field(default=512, metadata={
        "help": "retrieval cache tokens, or the draft's BudgetCache with --draft-cache budget (multiple of chunk_size)"})
    chunk_size: int = field(default=8, metadata={"help": "retrieval chunk size in tokens"})
    sink: int = field(default=16, metadata={"help": "streaming draft cache: sink tokens"})
    window: int = field(default=240, metadata={"help": "streaming draft cache: recent-window tokens"})
    draft_positions: str = field(default="cache", metadata={"help": "streaming cache RoPE positions",
                                                            "choices": POSITION_MODES})
    rebuild: str = field(default="never", metadata={"help": "retrieval rebuild policy: never, every:N, accept<T[:W]"})
    group_reduce: str = field(default="sum", metadata={"help": "GQA chunk scoring over a KV head's query group",
                                                       "choices": GROUP_REDUCTIONS})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy (tokens must match the baseline)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (temperature > 0)"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    warmup: int = field(default=1, metadata={"help": "untimed runs per decoder before timing"})
    repeats: int = field(default=1, metadata={"help": "timed runs per decoder; medians are reported"})
    split: str = field(default="all", metadata={"help": "essay split the prompt comes from", "choices": SPLITS})
    variant: int = field(default=0, metadata={"help": "which prompt window of the corpus"})

    def __post_init__(self) -> None:
        require(self.decoder in DECODERS, f"decoder must be one of {DECODERS}, got {self.decoder!r}")
        require(self.draft_cache in DRAFT_CACHES,
                f"draft_cache must be one of {DRAFT_CACHES}, got {self.draft_cache!r}")
        require(self.dtype in DTYPES, f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        require(self.quant in QUANTS, f"quant must be one of {QUANTS}, got {self.quant!r}")
        require(self.context >= 2, f"context must be >= 2 tokens, got {self.context}")
        require(self.new_tokens >= 2, f"new_tokens must be >= 2, got {self.new_tokens}")
        require(self.gamma >= 1 and self.gamma1 >= 1, f"gamma and gamma1 must be >= 1, got {self.gamma}, {self.gamma1}")
        require(self.draft_cache != "budget" or (self.decoder == "spec" and self.draft != "ngram"),
                "--draft-cache budget is for --decoder spec with a draft model (BudgetDraft's inference setting)")
        require((self.decoder == "spec" and self.draft_cache != "budget") or self.budget < self.context - 1,
                f"budget ({self.budget}) must be smaller than the context ({self.context}) minus one")
        require(not self.draft.startswith("truncated:") or self.draft.removeprefix("truncated:").isdigit(),
                f"draft {self.draft!r}: write truncated:K with K the number of target layers kept")
        require(self.warmup >= 0 and self.repeats >= 1,
                f"warmup must be >= 0 and repeats >= 1, got {self.warmup} and {self.repeats}")
        rebuild_policy(self.rebuild)  # raises on a malformed policy
        SamplingConfig(self.temperature, self.top_p, seed=self.seed)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_p, seed=self.seed)


@dataclass(frozen=True)
class SpecRow:
    decoder: str
    prefill_s: float  # median over repeats
    decode_ms: float  # median decode time per generated token
    tokens_per_s: float
    speedup: float  # baseline decode ms / this decode ms (1.0 for the baseline)
    end_to_end: float  # baseline (prefill + decode) / this (prefill + decode)
    tokens_per_iteration: float | None  # tokens per full-target forward (None for the baseline)
    acceptance: dict[str, float] = field(default_factory=dict)  # verifier level -> acceptance rate
    mean_accepted: dict[str, float] = field(default_factory=dict)  # verifier level -> draft tokens kept per round
    histogram: dict[str, list[int]] = field(default_factory=dict)  # verifier level -> rounds keeping n drafts
    rebuilds: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # decode time per region (inclusive), median run
    drafted: dict[str, int] = field(default_factory=dict)  # verifier level -> draft tokens it checked, median run
    verifications: dict[str, int] = field(default_factory=dict)  # verifier level -> its forwards, median run
    decode_s: float = 0.0  # the median run's decode seconds (``seconds`` regions plus untimed bookkeeping)


@dataclass
class SpecBenchResult:
    config: SpecBenchConfig
    device: str
    prompt_len: int
    rows: list[SpecRow]  # baseline first
    tokens_match: bool | None  # greedy: method tokens == baseline tokens

    def to_dict(self) -> dict[str, Any]:
        return {"bench": "spec", **asdict(self)}

    def table(self) -> str:
        c = self.config
        quant = "" if c.quant == "none" else f" {c.quant}"
        head = (f"spec bench: {c.decoder} ({c.draft if c.decoder != 'retrieval' else 'self'}) vs ar, {c.model} "
                f"{c.dtype}{quant} on {self.device}, prompt {self.prompt_len} tokens, "
                f"{c.new_tokens} new, gamma {c.gamma}"
                f"{f', gamma1 {c.gamma1}' if c.decoder == 'triforce' else ''}"
                f"{f', budget {c.budget}/{c.chunk_size}' if c.decoder != 'spec' else ''}, "
                f"median of {c.repeats}\n")
        rows = [[r.decoder, f"{r.prefill_s:.3f}", f"{r.decode_ms:.2f}", f"{r.tokens_per_s:.1f}", f"{r.speedup:.2f}x",
                 f"{r.end_to_end:.2f}x", "-" if r.tokens_per_iteration is None else f"{r.tokens_per_iteration:.2f}",
                 " ".join(f"{k}={v:.2f}" for k, v in r.acceptance.items()) or "-"] for r in self.rows]
        lines = [head + format_table(["decoder", "prefill s", "decode ms/tok", "tok/s", "speedup", "end-to-end",
                                      "tok/iter", "acceptance"], rows)]
        method = self.rows[-1]
        decode_s = method.decode_ms * c.new_tokens / 1000
        if decode_s > 0:
            lines.append("decode time: " + ", ".join(f"{k} {100 * v / decode_s:.0f}%"
                                                     for k, v in sorted(method.seconds.items())))
        if self.tokens_match is not None:
            lines.append(f"greedy tokens {'match' if self.tokens_match else 'DIFFER FROM'} the baseline")
        return "\n".join(lines)


def make_draft(spec: str, target: Transformer, dtype: torch.dtype, device: torch.device) -> Transformer | None:
    """``truncated:K`` -> the target's first K layers (shared weights); ``ngram`` -> None; a BudgetDraft run
    folder -> its trained drafter; else a loaded model."""
    if spec == "ngram":
        return None
    if spec.startswith("truncated:"):
        return truncated_draft(target, int(spec.removeprefix("truncated:")))
    if has_checkpoint(Path(spec)):
        return load_drafter(spec, dtype, device)
    return load_model(spec, dtype, device)


def spec_runner(cfg: SpecBenchConfig, target: Transformer, draft: Transformer | None,
                prompt: torch.Tensor) -> Callable[[], SpecResult]:
    """A zero-argument run of the configured method (fresh caches each call)."""
    sampling, n = cfg.sampling, cfg.new_tokens
    if cfg.decoder == "retrieval":
        return lambda: retrieval(target, prompt, n, sampling, gamma=cfg.gamma, budget=cfg.budget,
                                 chunk_size=cfg.chunk_size, rebuild=cfg.rebuild, group_reduce=cfg.group_reduce)
    if cfg.decoder == "triforce":
        return lambda: triforce(target, NgramDrafter(target.cfg.vocab_size) if draft is None else draft, prompt, n,
                                sampling, gamma1=cfg.gamma1, gamma2=cfg.gamma,
                                budget=cfg.budget, chunk_size=cfg.chunk_size, sink=cfg.sink, window=cfg.window,
                                rebuild=cfg.rebuild, group_reduce=cfg.group_reduce,
                                draft_positions=cfg.draft_positions)

    def drafter() -> Drafter:
        if draft is None:
            return NgramDrafter(target.cfg.vocab_size)
        if cfg.draft_cache == "budget":
            return BudgetDrafter.create(draft, cfg.budget, prompt.shape[1] + n, cfg.chunk_size)
        if cfg.draft_cache == "streaming":
            return ModelDrafter(draft, StreamingCache(draft.cfg, cfg.sink, cfg.window, cfg.gamma, dtype=draft.dtype,
                                                      device=draft.device, rotary=draft.rotary,
                                                      positions=cfg.draft_positions))
        return ModelDrafter(draft, draft.new_cache(prompt.shape[1] + n))
    return lambda: speculative(target, drafter(), prompt, n, cfg.gamma, sampling)


def ar_row(runs: list[GenerationResult]) -> tuple[SpecRow, float]:
    """The baseline's row and its median end-to-end seconds."""
    decode_ms = statistics.median(1000 * r.decode_s / (r.tokens.shape[1] - 1) for r in runs)
    total_s = statistics.median(r.prefill_s + r.decode_s for r in runs)
    return SpecRow("ar", statistics.median(r.prefill_s for r in runs), decode_ms, 1000 / decode_ms, 1.0, 1.0,
                   None), total_s


def spec_row(decoder: str, runs: list[SpecResult], ar_decode_ms: float, ar_total_s: float) -> SpecRow:
    decode_ms = statistics.median(1000 * r.stats.decode_s / r.stats.generated for r in runs)
    total_s = statistics.median(r.stats.prefill_s + r.stats.decode_s for r in runs)
    median = sorted(runs, key=lambda r: r.stats.decode_s)[len(runs) // 2].stats
    levels = median.levels
    return SpecRow(decoder, statistics.median(r.stats.prefill_s for r in runs), decode_ms, 1000 / decode_ms,
                   ar_decode_ms / decode_ms, ar_total_s / total_s, median.tokens_per_iteration,
                   {lvl.name: lvl.acceptance_rate for lvl in levels}, {lvl.name: lvl.mean_accepted for lvl in levels},
                   {lvl.name: list(lvl.histogram) for lvl in levels}, median.rebuilds, dict(median.seconds),
                   {lvl.name: lvl.drafted for lvl in levels}, {lvl.name: lvl.verifications for lvl in levels},
                   median.decode_s)


def run_spec_bench(cfg: SpecBenchConfig, progress: bool = False) -> SpecBenchResult:
    """Time the baseline and ``cfg.decoder`` on one essay prompt; returns rows (baseline first)."""
    device = resolve_device(cfg.device)
    dtype = DTYPES[cfg.dtype]
    target = load_model(cfg.model, dtype, device)
    if cfg.quant == "int8":  # before the draft is cut from it: baseline, method and truncated draft share it
        quantize_int8(target)
    prompt = bench_prompt(cfg.model, cfg.context, cfg.split, cfg.variant).to(device)
    draft = None if cfg.decoder == "retrieval" else make_draft(cfg.draft, target, dtype, device)
    run_method = spec_runner(cfg, target, draft, prompt)
    ar_runs = time_runs(lambda: generate(target, prompt, cfg.new_tokens, cfg.sampling), cfg.warmup, cfg.repeats,
                        "ar", progress)
    runs = time_runs(run_method, cfg.warmup, cfg.repeats, cfg.decoder, progress)
    baseline, ar_total_s = ar_row(ar_runs)
    row = spec_row(cfg.decoder, runs, baseline.decode_ms, ar_total_s)
    match = torch.equal(ar_runs[-1].tokens, runs[-1].tokens) if cfg.sampling.greedy else None
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return SpecBenchResult(cfg, device_name, prompt.shape[1], [baseline, row], match)
