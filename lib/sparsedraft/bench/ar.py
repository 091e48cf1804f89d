"""The ``ar`` benchmark: plain autoregressive decoding, our engine against Hugging Face transformers.

Both engines run in the same process, on the same weights and the same essay
prompt, after identical warm-up runs, with the device synchronised around
each timed region. Both run the same greedy loop: one prefill forward (ours
in chunks of :data:`~sparsedraft.engine.prefill.PREFILL_CHUNK` tokens, transformers in one call with its default
``DynamicCache``), the first token from the prefill logits, then one forward
per further token. Time per token is :attr:`DecodeResult.ms_per_token` for
both: decode seconds over the ``new_tokens - 1`` tokens the decode phase
emitted. Each engine prefills the prompt once per dtype, and every run
decodes from a copy of that prefill (an 8K prefill costs as much as hundreds
of decode steps; seven of them per dtype made the bench take tens of minutes
on a 2-core machine), so ``prefill_s`` is that one prefill's time. The bench also times a ``verify_tokens``-token forward against the
full cache (a speculative verification of gamma + 1 tokens, rolled back after
each) against a one-token forward at the same context, and at further
contexts over a cache of random keys and values (``verify_contexts``: the work
of a step does not depend on the values, so 32K needs no 6-minute prefill),
and turns the decode time into achieved bandwidth and a multiple of the read
floor (bytes per token over the bandwidth measured here with a >= 1 GiB read,
the only speed reference that carries across machines) with the byte counts
of :mod:`sparsedraft.engine.roofline`. Each dtype is timed in turn in the same
process, with its own model copy: fp32, and bf16 by default only where it
computes natively (a GPU, or a CPU with AVX512-BF16 or AMX; without them
torch's bf16 GEMMs run several times slower than fp32, see
:mod:`sparsedraft.engine.machine`). Every timed step (prefill, decode, decode-1 and
verify-k) also gets its roofline time and ratio (:mod:`.steps`), judged by
the read bandwidth and the per-dtype matmul peak measured in this process,
and the table and JSON say which path ran (``isa``).
"""

from __future__ import annotations

import copy
import inspect
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..engine import machine, weights
from ..engine.cache import StaticCache
from ..engine.data import SPLITS, bench_prompt
from ..engine.model import Transformer
from ..engine.prefill import PREFILL_CHUNK, prefill_spans
from ..engine.prefill_store import prefill_prompt
from ..engine.roofline import (MIB, bytes_per_token, chunk_cost, kv_bytes, measure_read_bandwidth, step_cost,
                               weight_bytes)
from ..engine.runtime import DTYPES, device_name, resolve_device, synchronize
from ..engine.tiny import tiny_hf_config
from ..errors import require
from ..progress import bar
from ..report import format_table
from ..speculative.decoding import DecodeResult, decode
from .gpu_levels import fill_random
from .steps import StepRow, step_row, steps_table
from .timing import interleaved_runs

GB = 1e9


@dataclass(frozen=True)
class ArBenchConfig:
    model: str = field(default="smollm2-135m", metadata={"help": "short name, .gguf, folder or HF id"})
    dtypes: tuple[str, ...] = field(default=(), metadata={
        "help": "weights and KV cache dtypes, each timed in turn in this process; none given: fp32, plus bf16 on a "
                "GPU or a CPU with bf16 instructions (AVX512-BF16, AMX)", "choices": tuple(DTYPES)})
    device: str = field(default="auto", metadata={"help": "auto (CUDA if present), cpu, cuda, cuda:N"})
    context: int = field(default=8000, metadata={"help": "prompt tokens (essay text)"})
    new_tokens: int = field(default=128, metadata={"help": "greedy tokens generated per run (>= 2)"})
    warmup: int = field(default=1, metadata={"help": "untimed runs per engine before timing"})
    repeats: int = field(default=3, metadata={"help": "timed runs per engine; medians are reported"})
    verify_tokens: int = field(default=7, metadata={"help": "tokens per verification forward (gamma + 1)"})
    hf: bool = field(default=True, metadata={"help": "also time transformers on the same weights"})
    split: str = field(default="all", metadata={"help": "essay split the prompt comes from", "choices": SPLITS})
    variant: int = field(default=0, metadata={"help": "which prompt window of the corpus"})
    read_mib: int = field(default=1024, metadata={"help": "MiB read to measure memory bandwidth (>= 1024)"})
    peak_s: float = field(default=machine.PEAK_SECONDS, metadata={
        "help": "seconds spent measuring each dtype's matmul peak (the roofline's compute side)"})
    verify_contexts: tuple[int, ...] = field(default=(), metadata={
        "help": "further contexts at which decode-1 and verify-k are timed over a cache of random keys and values "
                "(no prefill: the work does not depend on the values), up to the model's maximum context"})

    def __post_init__(self) -> None:
        require(all(d in DTYPES for d in self.dtypes) and len(set(self.dtypes)) == len(self.dtypes),
                f"dtypes must be distinct names among {tuple(DTYPES)} (none: the machine's default), "
                f"got {self.dtypes!r}")
        require(all(c >= self.verify_tokens for c in self.verify_contexts),
                f"verify_contexts must each be >= verify_tokens ({self.verify_tokens}), got {self.verify_contexts}")
        require(self.split in SPLITS, f"split must be one of {SPLITS}, got {self.split!r}")
        require(self.context > 0, f"context must be > 0 tokens, got {self.context}")
        require(self.new_tokens >= 2, f"new_tokens must be >= 2 (one prefill token plus decode steps), "
                                      f"got {self.new_tokens}")
        require(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}")
        require(self.repeats >= 1, f"repeats must be >= 1, got {self.repeats}")
        require(2 <= self.verify_tokens <= self.context,
                f"verify_tokens must be in [2, context={self.context}], got {self.verify_tokens}")
        require(self.variant >= 0, f"variant must be >= 0, got {self.variant}")
        require(self.read_mib > 0, f"read_mib must be > 0, got {self.read_mib}")
        require(self.peak_s > 0, f"peak_s must be > 0 seconds, got {self.peak_s}")


@dataclass(frozen=True)
class EngineRow:
    engine: str
    prefill_s: float  # the one prefill every run of this engine and dtype decoded from
    ms_per_token: float  # median DecodeResult.ms_per_token (decode seconds / tokens the decode phase emitted)
    tokens_per_s: float  # 1000 / ms_per_token
    bandwidth_gbps: float  # bytes_per_token at the mean decode context / decode time per token
    bandwidth_fraction: float  # of the measured read bandwidth


@dataclass(frozen=True)
class VerifyRow:
    context: int
    tokens: int  # tokens in the verification forward
    decode1_ms: float  # one-token forward against the full cache
    verify_ms: float  # ``tokens``-token forward against the same cache
    cost_ratio: float  # verify_ms / decode1_ms (1.0 = verification is free)
    filled: str  # "prefill" (the essay prompt) or "random" (keys and values drawn at random, no prefill)
    model_cache_mib: float  # the model's parameters plus this full cache's buffers
    resident_mib: float | None  # the process's resident set while this cache is held (Linux), after the steps


@dataclass
class DtypeRun:
    """One dtype's timings: both engines' decode and prefill, the read floor, verification cost."""

    dtype: str
    weight_bytes: int
    kv_bytes_at_context: int
    bytes_per_token: int  # at the mean decode context, context + new_tokens // 2
    floor_ms: float  # bytes_per_token / measured read bandwidth: no decode step can be faster
    engines: list[EngineRow]
    verify: list[VerifyRow]  # at the prompt first, then at each of config.verify_contexts
    ours_over_floor: float  # our ms/token / floor_ms (1.0 = at the read bandwidth)
    hf_ms_over_ours: float | None  # transformers ms/token / ours (> 1: we are faster)
    hf_prefill_over_ours: float | None  # transformers prefill s / ours
    tokens_match: bool | None  # greedy tokens identical across engines
    matching_prefix: int | None  # leading tokens the engines agree on
    steps: list[StepRow] = field(default_factory=list)  # each timed step of ours beside its roofline


@dataclass
class ArBenchResult:
    config: ArBenchConfig
    device: str
    prompt_len: int
    read_bandwidth_gbps: float
    runs: list[DtypeRun]
    versions: dict[str, str] = field(default_factory=dict)
    cpu_threads: int = field(default_factory=torch.get_num_threads)  # CPU timings depend on it
    isa: dict[str, Any] = field(default_factory=dict)  # the path that ran (sparsedraft.engine.machine.MachineReport)
    peak_gflops: dict[str, float] = field(default_factory=dict)  # dtype -> matmul peak measured here

    def to_dict(self) -> dict[str, Any]:
        return {"bench": "ar", "isa": self.isa, "read_gb_s": self.read_bandwidth_gbps,
                "peak_gflops": self.peak_gflops, **asdict(self)}

    def table(self) -> str:
        peaks = ", ".join(f"{k} {v:.1f}" for k, v in self.peak_gflops.items())
        lines = [f"ar bench: {self.config.model} on {self.device}, prompt {self.prompt_len} tokens, "
                 f"{self.config.new_tokens} new tokens, median of {self.config.repeats}; read bandwidth "
                 f"{self.read_bandwidth_gbps:.1f} GB/s, matmul peak GFLOP/s {peaks}",
                 f"path: {machine.MachineReport(**self.isa)}" if self.isa else "path: not recorded"]
        for run in self.runs:
            lines.append(f"\n{run.dtype}: bytes/token {run.bytes_per_token / 1e6:.1f} MB (weights "
                         f"{run.weight_bytes / 1e6:.1f} MB, KV at prompt {run.kv_bytes_at_context / 1e6:.1f} MB): "
                         f"floor {run.floor_ms:.1f} ms/token")
            rows = [[r.engine, f"{r.prefill_s:.3f}", f"{r.ms_per_token:.2f}", f"{r.tokens_per_s:.1f}",
                     f"{r.bandwidth_gbps:.1f}", f"{100 * r.bandwidth_fraction:.0f}%"] for r in run.engines]
            lines.append(format_table(["engine", "prefill s", "decode ms/tok", "tok/s", "GB/s", "of read"], rows))
            lines.append(f"ours / floor: {run.ours_over_floor:.2f}x")
            if run.hf_ms_over_ours is not None:
                lines.append(f"transformers / ours: decode {run.hf_ms_over_ours:.2f}x, prefill "
                             f"{run.hf_prefill_over_ours:.2f}x; greedy tokens "
                             f"{'match' if run.tokens_match else 'differ'} (first {run.matching_prefix} agree)")
            for v in run.verify:
                resident = "" if v.resident_mib is None else f", process resident {v.resident_mib:.0f} MiB"
                lines.append(f"verify-{v.tokens} / decode-1 at context {v.context} ({v.filled}): "
                             f"{v.verify_ms:.2f} ms / {v.decode1_ms:.2f} ms = {v.cost_ratio:.2f}x; model + cache "
                             f"{v.model_cache_mib:.0f} MiB{resident}")
            if run.steps:
                lines.append(steps_table(run.steps))
        return "\n".join(lines)


def load_hf_oracle(spec: str, model: Transformer, dtype: torch.dtype, device: torch.device):
    """The same weights as a transformers ``AutoModelForCausalLM`` (eval mode, on ``device``)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    where = weights.resolve(spec)
    if isinstance(where, str):  # tiny random model: same config dict, our weights copied in
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_hf_config(where[5:])), dtype=dtype)
        state = {k if k == "lm_head.weight" else f"model.{k}": v for k, v in model.state_dict().items()}
        hf.load_state_dict(state)
    elif where.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(where.parent), gguf_file=where.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(where), dtype=dtype)
    return hf.to(device).eval()


def _cache_kw(hf) -> str:
    """transformers 5 renamed ``past_key_values`` to ``cache``; the old name takes a slow deprecated path."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_prefill(hf, prompt: torch.Tensor, warmup: bool = False) -> tuple[Any, float]:
    """transformers' prompt forward (its output, with the cache) and its seconds; ``warmup`` runs the first
    :data:`PREFILL_CHUNK` tokens once untimed before it."""
    if warmup:
        hf(input_ids=prompt[:, :PREFILL_CHUNK], use_cache=True, logits_to_keep=1)
    # one forward, so the bar can only say what runs (an 8K prompt takes minutes on two cores)
    with bar(total=prompt.shape[1], desc="transformers prefill", unit="tok", unit_scale=True,
             show=prompt.shape[1] > PREFILL_CHUNK) as progress:
        synchronize(prompt.device)
        start = time.perf_counter()
        out = hf(input_ids=prompt, use_cache=True, logits_to_keep=1)
        synchronize(prompt.device)
        seconds = time.perf_counter() - start
        progress.update(prompt.shape[1])
    return out, seconds


@torch.inference_mode()
def hf_generate(hf, prompt: torch.Tensor, max_new_tokens: int, prefilled: tuple[Any, float] | None = None
                ) -> DecodeResult:
    """Greedy decoding with transformers in the loop of our ``ar`` method: the first token from the prefill
    logits, so the decode phase emits ``max_new_tokens - 1`` tokens and ``ms_per_token`` means the same.
    ``prefilled`` (:func:`hf_prefill` of this prompt) starts from a copy of its cache instead of a prompt
    forward; the result's prefill seconds are then that prefill's."""
    device = prompt.device
    cache_kw = _cache_kw(hf)
    if prefilled is None:
        out, prefill_s = hf_prefill(hf, prompt)
    else:
        out, prefill_s = copy.copy(prefilled[0]), prefilled[1]
        out[cache_kw] = copy.deepcopy(prefilled[0][cache_kw])  # decoding appends to it
    synchronize(device)
    t1 = time.perf_counter()
    tokens = []
    for _ in range(max_new_tokens):
        tokens.append(out.logits[:, -1].argmax(-1))
        if len(tokens) == max_new_tokens:
            break
        out = hf(input_ids=tokens[-1][:, None], use_cache=True, **{cache_kw: out[cache_kw]})
    synchronize(device)
    t2 = time.perf_counter()
    return DecodeResult("transformers", torch.stack(tokens, 1).cpu(), prompt.shape[1], prefill_s, t2 - t1,
                        max_new_tokens - 1)


def engine_row(engine: str, runs: list[DecodeResult], bytes_read: int, read_bandwidth: float,
               prefill_s: float) -> EngineRow:
    ms = statistics.median(r.ms_per_token for r in runs)
    bandwidth = bytes_read / (ms / 1000)
    return EngineRow(engine, prefill_s, ms, 1000 / ms, bandwidth / GB, bandwidth / read_bandwidth)


@torch.inference_mode()
def time_verify(model: Transformer, cache: StaticCache, tokens: int, iters: int, filled: str) -> VerifyRow:
    """Mean time of a ``tokens``-token forward vs a 1-token forward over ``cache`` (left as it was).

    Each forward is rolled back at once, so every one sees the same cache
    length and the ratio isolates the extra query tokens.
    """
    batch = torch.randint(0, model.cfg.vocab_size, (cache.batch, tokens), generator=torch.Generator().manual_seed(0))
    batch = batch.to(model.device)

    def mean_ms(n: int) -> float:
        model(batch[:, :n], cache=cache)  # warm-up at this shape
        cache.rollback(n)
        synchronize(model.device)
        start = time.perf_counter()
        for _ in bar(range(iters), desc=f"{n}-token steps at {cache.length}", show=iters > 1):
            model(batch[:, :n], cache=cache)
            cache.rollback(n)
        synchronize(model.device)
        return 1000 * (time.perf_counter() - start) / iters

    decode1, verify = mean_ms(1), mean_ms(tokens)
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *cache.k, *cache.v, cache.pos))
    return VerifyRow(cache.length, tokens, decode1, verify, verify / decode1, filled, held / MIB, resident_mib())


def resident_mib() -> float | None:
    """This process's resident set size in MiB (``/proc/self/statm``), or None where that file is missing."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / MIB


def random_cache(model: Transformer, context: int, room: int) -> StaticCache:
    """A full cache holding ``context`` tokens of random keys and values at positions 0..context-1, appended
    through the cache protocol a chunk at a time (no prompt forward, no second copy of the cache)."""
    cache = model.new_cache(context + room)
    fill_random(cache, model.cfg, context, PREFILL_CHUNK, model.dtype, model.device)
    return cache


def time_verify_random(model: Transformer, contexts: Sequence[int], tokens: int, iters: int) -> list[VerifyRow]:
    """:func:`time_verify` at each of ``contexts`` over a cache of random keys and values.

    The work of a step does not depend on the cached values, so this times a
    32K context without a 6-minute prefill. One cache is held at a time (a
    32K fp32 SmolLM2-135M cache is 1.5 GB); every context is checked against
    the model's limit before the first cache is filled.
    """
    room = max(contexts, default=0) + tokens
    require(all(c >= 1 for c in contexts) and room <= model.cfg.max_position_embeddings,
            f"contexts {list(contexts)} must be >= 1 and leave room for {tokens} verified tokens within the "
            f"model's maximum of {model.cfg.max_position_embeddings} positions")
    rows = []
    for context in contexts:
        cache = random_cache(model, context, tokens)
        rows.append(time_verify(model, cache, tokens, iters, "random"))
        del cache
    return rows


def matching_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of leading positions where token rows ``a`` and ``b`` ([1, N]) agree."""
    same = (a[0, :b.shape[1]] == b[0, :a.shape[1]]).long()
    return int(same.cumprod(0).sum())


def run_ar_bench(cfg: ArBenchConfig, progress: bool = False) -> ArBenchResult:
    """Time our engine (and transformers unless ``cfg.hf`` is False) on one essay prompt, in each dtype."""
    device = resolve_device(cfg.device)
    limit = weights.load_config(cfg.model).max_position_embeddings
    longest = max((cfg.context, *cfg.verify_contexts))
    total = longest + max(cfg.new_tokens, cfg.verify_tokens)
    require(total <= limit,
            f"context {longest} + {max(cfg.new_tokens, cfg.verify_tokens)} new "
            f"tokens = {total} exceeds the maximum context of {cfg.model} ({limit}); lower --context, "
            f"--verify-contexts or --new-tokens{weights.longer_context_hint(cfg.model, total)}")
    require(not (cfg.hf and cfg.model in weights.EXTENDED),
            f"{cfg.model} is a config extension of {weights.EXTENDED.get(cfg.model, ('',))[0]} that transformers "
            "would load without its RoPE scaling; pass --no-hf (or time the base model against transformers)")
    prompt = bench_prompt(cfg.model, cfg.context, cfg.split, cfg.variant).to(device)
    path = machine.report(device)
    dtypes = cfg.dtypes or default_dtypes(path, device)
    machine.warn_slow(path, [DTYPES[d] for d in dtypes], device)
    read_bw = measure_read_bandwidth(device, cfg.read_mib * MIB)
    peaks = machine.peak_gflops(dtypes, device, cfg.peak_s)
    versions = {"torch": torch.__version__}
    if cfg.hf:
        import transformers
        versions["transformers"] = transformers.__version__
    runs = [_dtype_run(cfg, name, prompt, device, read_bw, peaks[name], progress) for name in dtypes]
    return ArBenchResult(cfg, device_name(device), prompt.shape[1], read_bw / GB, runs, versions,
                         isa=path.to_dict(), peak_gflops=peaks)


def default_dtypes(path: machine.MachineReport, device: torch.device) -> tuple[str, ...]:
    """fp32, plus bf16 where it computes natively: a GPU, or a CPU with bf16 instructions."""
    return ("fp32", "bf16") if device.type != "cpu" or path.bf16_native else ("fp32",)


def _dtype_run(cfg: ArBenchConfig, name: str, prompt: torch.Tensor, device: torch.device, read_bw: float,
               peak_gflops: float, progress: bool) -> DtypeRun:
    dtype = DTYPES[name]
    model = weights.load_model(cfg.model, dtype, device)
    dtype_bytes = dtype.itemsize
    bytes_read = bytes_per_token(model.cfg, cfg.context + cfg.new_tokens // 2, dtype_bytes)
    prefilled = prefill_prompt(model, prompt, warmup=cfg.warmup > 0)  # every run decodes from a copy of it
    runners = {"sparsedraft": lambda: decode(model, prompt, "ar", cfg.new_tokens, prefilled=prefilled)}
    prefill_s = {"sparsedraft": prefilled.seconds}
    if cfg.hf:
        hf = load_hf_oracle(cfg.model, model, dtype, device)
        hf_start = hf_prefill(hf, prompt, warmup=cfg.warmup > 0)
        prefill_s["transformers"] = hf_start[1]
        runners["transformers"] = lambda: hf_generate(hf, prompt, cfg.new_tokens, hf_start)
    runs = interleaved_runs(runners, cfg.warmup, cfg.repeats, progress)
    if cfg.hf:
        del hf, hf_start, runners["transformers"]
    engines = [engine_row(engine, results, bytes_read, read_bw, prefill_s[engine]) for engine, results in runs.items()]
    cache = model.new_cache(prompt.shape[1] + cfg.verify_tokens)
    prefilled.seed(cache)
    del prefilled
    verify = [time_verify(model, cache, cfg.verify_tokens, cfg.new_tokens, "prefill")]
    del cache
    verify += time_verify_random(model, cfg.verify_contexts, cfg.verify_tokens, cfg.new_tokens)
    floor_ms = 1000 * bytes_read / read_bw
    ratio = prefill_ratio = match = prefix = None
    if cfg.hf:
        ratio = engines[1].ms_per_token / engines[0].ms_per_token
        prefill_ratio = engines[1].prefill_s / engines[0].prefill_s
        prefix = matching_prefix(runs["sparsedraft"][-1].tokens, runs["transformers"][-1].tokens)
        match = prefix == cfg.new_tokens
    steps = _steps(model.cfg, name, prompt.shape[1], engines[0], cfg.new_tokens, verify, read_bw, peak_gflops)
    return DtypeRun(name, weight_bytes(model.cfg, dtype_bytes), kv_bytes(model.cfg, cfg.context, dtype_bytes),
                    bytes_read, floor_ms, engines, verify, engines[0].ms_per_token / floor_ms, ratio, prefill_ratio,
                    match, prefix, steps)


def _steps(model_cfg, dtype: str, prompt_len: int, ours: EngineRow, new_tokens: int, verify: list[VerifyRow],
           read_bw: float, peak_gflops: float) -> list[StepRow]:
    """Our prefill (all its chunks), decode (at the mean decode context) and each decode-1 / verify-k beside
    their rooflines."""
    size = DTYPES[dtype].itemsize
    chunks = [chunk_cost(model_cfg, a, b, size) for a, b in prefill_spans(prompt_len, PREFILL_CHUNK)]
    rows = [step_row("prefill", dtype, 1000 * ours.prefill_s, chunks, read_bw, peak_gflops),
            step_row("decode", dtype, ours.ms_per_token, step_cost(model_cfg, prompt_len + new_tokens // 2, 1, size),
                     read_bw, peak_gflops)]
    for v in verify:
        rows.append(step_row("decode-1", dtype, v.decode1_ms, step_cost(model_cfg, v.context, 1, size), read_bw,
                             peak_gflops))
        rows.append(step_row(f"verify-{v.tokens}", dtype, v.verify_ms, step_cost(model_cfg, v.context, v.tokens, size),
                             read_bw, peak_gflops))
    return rows
