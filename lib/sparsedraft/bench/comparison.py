"""``compare``: the AR baseline and any registered methods on one prompt, in one process.

Everything a user can get wrong is checked before the model loads: the
config's values, each method's options (:func:`~sparsedraft.speculative.methods.method_options`),
the context against the model's limit (read from its config alone) and each
method's prompt-dependent checks at that context. Then the target loads once
(quantised once with ``quant="int8"``, so the baseline and every truncated
draft share the lever), the essay prompt is built and prefilled once (after an
untimed forward of its first chunk when ``warmup`` > 0; read from a disk cache
instead with ``prefill_cache``, :mod:`sparsedraft.engine.prefill_store`), each named
draft is loaded once, and every method runs through :func:`sparsedraft.decode`
from a copy of that one prefill -- warm-up runs first, then timed rounds that
take turns (:func:`~.timing.interleaved_runs`).

Ratios use :attr:`DecodeResult.ms_per_token` (the one definition of time per
token): ``speedup`` is the baseline's ms/token over the method's,
``end_to_end`` the baseline's prefill + decode seconds over the method's. Each
row's ``prefill_s`` is the shared prefill's seconds (:attr:`CompareResult.prefill_s`,
the time it took to compute, also when read from disk) plus the row's own
``setup_s``, measured in each run: copying the prefill, selecting a retrieval
cache, a draft model's own prefill. Per-level stats come from the median run.
Each row also puts its steps beside their rooflines (:mod:`.steps`: the
baseline's decode, the full target's verification, a draft step where a
level is the target itself), judged by the read bandwidth and the matmul peak
of ``dtype`` measured in this process after the runs; the JSON leads with
the path that ran (``isa``, :mod:`sparsedraft.engine.machine`), ``read_gb_s`` and
``peak_gflops``.

From Python::

    result = compare(CompareConfig(model="tiny-llama", context=200, new_tokens=16,
                                   methods=(("retrieval", {"budget": 64}), ("triforce", {"budget": 64}))))
    result.frame()  # one row per method, baseline first
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..analysis.costmodel import predicted_speedup, stop_acceptance
from ..engine import machine, weights
from ..engine.data import SPLITS, bench_prompt
from ..engine.model import Transformer
from ..engine.prefill_store import GiB, PrefillStore, prefill_prompt
from ..engine.quant import quantize_int8
from ..engine.roofline import measure_read_bandwidth, step_cost
from ..engine.runtime import DTYPES, device_name, peak_rss_gb, resolve_device
from ..engine.sampling import SamplingConfig
from ..errors import require
from ..report import format_table
from ..speculative.batching import batch_bytes, check_memory
from ..speculative.decoding import DecodeResult, decode
from ..speculative.feature import feature_layers_of
from ..speculative.loading import check_trained_for, drafter_kind
from ..speculative.stats import TARGET
from ..speculative.methods import load_draft, method_options
from .steps import StepRow, method_steps, step_row, steps_table
from .timing import interleaved_runs, median_run

QUANTS = ("none", "int8")
BASELINE = "ar"


def _entry(spec: str | tuple[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    """A method as ``name`` or ``(name, options)``, normalised to ``(name, dict)``."""
    if isinstance(spec, str):
        return spec, {}
    require(isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[1], Mapping),
            f"each method is a name or a (name, options mapping) pair, got {spec!r}")
    return spec[0], dict(spec[1])


def _label(name: str, options: dict[str, Any], repeated: bool) -> str:
    """The row name: the method, plus its options when the same method is listed more than once."""
    if not repeated:
        return name
    return f"{name}({', '.join(f'{k}={_plain(v)}' for k, v in options.items())})"


def _plain(value: Any) -> Any:
    """An option value as JSON can hold it: a model object by the spec it was loaded from, else its type."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return getattr(value, "source", None) or type(value).__name__


@dataclass(frozen=True)
class CompareConfig:
    model: str = field(default="smollm2-135m", metadata={"help": "target: short name, .gguf, folder or HF id"})
    dtype: str = field(default="fp32", metadata={"help": "weights and KV cache dtype", "choices": tuple(DTYPES)})
    quant: str = field(default="none", metadata={
        "help": "weight-only quantisation of the target (and so of the baseline and truncated drafts)",
        "choices": QUANTS})
    device: str = field(default="auto", metadata={"help": "auto (CUDA if present), cpu, cuda, cuda:N"})
    context: int = field(default=4000, metadata={"help": "prompt tokens (essay text)"})
    new_tokens: int = field(default=128, metadata={"help": "tokens generated per run (>= 2)"})
    warmup: int = field(default=1, metadata={"help": "untimed runs per method before timing"})
    repeats: int = field(default=1, metadata={"help": "timed runs per method; medians are reported"})
    split: str = field(default="all", metadata={"help": "essay split the prompt comes from", "choices": SPLITS})
    variant: int = field(default=0, metadata={"help": "which prompt window of the corpus"})
    offset: int = field(default=0, metadata={"help": "corpus tokens skipped before the prompt windows (keeps "
                                                     "timed prompts apart from ones used to tune settings)"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy (tokens must match the baseline)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (temperature > 0)"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    prefill_cache: str = field(default="", metadata={
        "help": "folder of a disk cache of prefilled prompts, e.g. data/cache/prefill (git-ignored); empty: off"})
    prefill_cache_gib: float = field(default=4.0, metadata={
        "help": "size cap of the prefill cache in GiB (least recently used entries go first)"})
    batch: int = field(default=1, metadata={
        "help": "sequences decoded together (lockstep, one forward per step): the prompts are the corpus windows "
                "variant .. variant + batch - 1; tok/s is over the batch"})
    peak_s: float = field(default=machine.PEAK_SECONDS, metadata={
        "help": "seconds spent measuring the dtype's matmul peak (the roofline's compute side)"})
    max_memory: str = field(default="", metadata={
        "help": "with --batch: refuse a batch whose caches and weights exceed this (e.g. 8GB); empty: the free "
                "memory where the caches live (the GPU's on CUDA)"})
    # Methods compared with the baseline: names or (name, options) pairs; the CLI sets one from its flags.
    methods: tuple = field(default=(), metadata={"cli": False})

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        require(self.quant in QUANTS, f"quant must be one of {QUANTS}, got {self.quant!r}")
        require(self.split in SPLITS, f"split must be one of {SPLITS}, got {self.split!r}")
        require(self.context >= 2, f"context must be >= 2 tokens (speculative methods hold one back), "
                                   f"got {self.context}")
        require(self.new_tokens >= 2, f"new_tokens must be >= 2, got {self.new_tokens}")
        require(self.warmup >= 0 and self.repeats >= 1,
                f"warmup must be >= 0 and repeats >= 1, got {self.warmup} and {self.repeats}")
        require(self.variant >= 0 and self.offset >= 0,
                f"variant and offset must be >= 0, got {self.variant} and {self.offset}")
        require(self.batch >= 1, f"batch must be >= 1 sequence, got {self.batch}")
        require(self.prefill_cache_gib > 0, f"prefill_cache_gib must be > 0, got {self.prefill_cache_gib}")
        require(self.peak_s > 0, f"peak_s must be > 0 seconds, got {self.peak_s}")
        require(isinstance(self.methods, (tuple, list)),
                f"methods must be a tuple of names or (name, options) pairs, got {type(self.methods).__name__}")
        entries = tuple(_entry(m) for m in self.methods)
        for name, options in entries:
            require(name != BASELINE, f"{BASELINE!r} is the baseline every comparison runs; list only other methods")
            method_options(name, **options)
        labels = self.labels(entries)
        require(len(set(labels)) == len(labels), f"a method is listed twice with the same options: {labels}")
        object.__setattr__(self, "methods", entries)
        self.sampling  # validates temperature, top_p and seed

    @staticmethod
    def labels(entries: tuple[tuple[str, dict[str, Any]], ...]) -> list[str]:
        names = [name for name, _ in entries]
        return [_label(name, options, names.count(name) > 1) for name, options in entries]

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_p, seed=self.seed)

    def to_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "methods"}
        methods = [[name, {k: _plain(v) for k, v in options.items()}] for name, options in self.methods]
        return {**values, "methods": methods}


@dataclass(frozen=True)
class MethodRow:
    method: str  # the method's name (with its options when one method is listed twice)
    prefill_s: float  # median over repeats: the shared prefill's seconds + setup_s
    setup_s: float  # median prefill-phase seconds of the run's own: copying the shared prefill, cache builds, drafts
    ms_per_token: float  # median DecodeResult.ms_per_token
    tokens_per_s: float  # 1000 / ms_per_token
    speedup: float  # baseline ms_per_token / this ms_per_token (1.0 for the baseline)
    end_to_end: float  # baseline (prefill + decode) / this (prefill + decode), medians
    tokens_match: bool | None  # greedy: every timed run's tokens equal the baseline's; None when sampling
    tokens_per_iteration: float | None = None  # tokens per full-target forward (None for the baseline)
    acceptance: dict[str, float] = field(default_factory=dict)  # verifier level -> acceptance rate
    mean_accepted: dict[str, float] = field(default_factory=dict)  # verifier level -> drafts kept per round
    histogram: dict[str, list[int]] = field(default_factory=dict)  # verifier level -> rounds keeping n drafts
    rounds: dict[str, dict[int, list[int]]] = field(default_factory=dict)  # level -> g -> rounds of g keeping n
    verifications: dict[str, int] = field(default_factory=dict)  # verifier level -> its forwards
    drafted: dict[str, int] = field(default_factory=dict)  # verifier level -> draft tokens it checked
    rebuilds: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # decode seconds per region (inclusive)
    decode_s: float = 0.0  # the median run's decode seconds (regions plus untimed bookkeeping)
    options: dict[str, Any] = field(default_factory=dict)  # the options given (JSON-ready)
    steps: list[StepRow] = field(default_factory=list)  # timed steps beside their rooflines (batch 1)
    # The cost model's speedup from this run's own parts (analysis.costmodel.predicted_speedup; batch 1, with drafts)
    predicted_speedup: float | None = None
    # With draft_confidence: the target's acceptance of the tokens the proposer was sure of ("sure") and of the one
    # each stopped proposal ended on ("stopped_after"), the two rates the cost model takes (batch 1)
    stop_acceptance: dict[str, float] | None = None


@dataclass
class CompareResult:
    config: CompareConfig
    device: str
    prompt_len: int
    rows: list[MethodRow]  # baseline first, then the methods in config order
    prefill_s: float  # seconds of the one prefill every run started from (when computed, also if read from disk)
    prefill_loaded_from: str | None = None  # the disk cache file it was read from; None when computed here
    peak_rss_gb: float = float("nan")  # the process's peak resident memory after the runs (prefills included)
    read_gb_s: float = float("nan")  # this machine's read bandwidth, a 1 GiB read measured in this process after
                                     # the runs (and after peak_rss_gb): the floor the figures are judged against
    isa: dict[str, Any] = field(default_factory=dict)  # the path that ran (sparsedraft.engine.machine.MachineReport)
    peak_gflops: dict[str, float] = field(default_factory=dict)  # config.dtype -> matmul peak measured here

    def row(self, method: str) -> MethodRow:
        """The row named ``method`` (see :attr:`MethodRow.method`)."""
        found = [r for r in self.rows if r.method == method]
        require(len(found) == 1, f"no row {method!r}; rows are {[r.method for r in self.rows]}")
        return found[0]

    def records(self) -> list[dict[str, Any]]:
        """One dict per row (a data frame's records)."""
        return [dataclasses.asdict(r) for r in self.rows]

    def frame(self):
        """The rows as a pandas DataFrame, one row per method, baseline first."""
        import pandas as pd
        return pd.DataFrame(self.records())

    def to_dict(self) -> dict[str, Any]:
        return {"bench": "compare", "isa": self.isa, "read_gb_s": self.read_gb_s, "peak_gflops": self.peak_gflops,
                "config": self.config.to_dict(), "device": self.device, "prompt_len": self.prompt_len,
                "prefill_s": self.prefill_s, "prefill_loaded_from": self.prefill_loaded_from,
                "peak_rss_gb": self.peak_rss_gb, "rows": self.records()}

    def table(self) -> str:
        c = self.config
        quant = "" if c.quant == "none" else f" {c.quant}"
        law = "greedy" if c.sampling.greedy else f"temperature {c.temperature}, top_p {c.top_p}"
        batch = f"batch {c.batch} x " if c.batch > 1 else ""
        head = (f"compare: {', '.join(r.method for r in self.rows[1:]) or 'baseline only'} vs {BASELINE}, "
                f"{c.model} {c.dtype}{quant} on {self.device}, {batch}prompt {self.prompt_len} tokens, "
                f"{c.new_tokens} new ({law}), median of {c.repeats}, peak RSS {self.peak_rss_gb:.2f} GB, "
                f"read bandwidth {self.read_gb_s:.1f} GB/s (1 GiB, this process)\n")
        where = f"read from {self.prefill_loaded_from}" if self.prefill_loaded_from else "computed here"
        one = "one prefill per row" if c.batch > 1 else "one prefill"
        head += f"{one} for every run: {self.prefill_s:.3f} s ({where}); prefill s = that + setup s\n"
        cells = [[r.method, f"{r.prefill_s:.3f}", f"{r.setup_s:.3f}", f"{r.ms_per_token:.2f}",
                  f"{r.tokens_per_s:.1f}", f"{r.speedup:.2f}x",
                  "-" if r.predicted_speedup is None else f"{r.predicted_speedup:.2f}x", f"{r.end_to_end:.2f}x",
                  "-" if r.tokens_per_iteration is None else f"{r.tokens_per_iteration:.2f}",
                  " ".join(f"{k}={v:.2f}" for k, v in r.acceptance.items()) or "-",
                  {True: "yes", False: "NO", None: "-"}[r.tokens_match]] for r in self.rows]
        lines = [head + format_table(["method", "prefill s", "setup s", "decode ms/tok", "tok/s", "speedup",
                                      "model", "end-to-end", "tok/iter", "acceptance", "tokens = ar"], cells)]
        for r in self.rows[1:]:
            if r.decode_s > 0:
                lines.append(f"{r.method} decode time: " + ", ".join(
                    f"{k} {100 * v / r.decode_s:.0f}%" for k, v in sorted(r.seconds.items())))
            if r.stop_acceptance:
                lines.append(f"{r.method} stopping below {r.options.get('draft_confidence')}: the target kept "
                             f"{r.stop_acceptance['sure']:.0%} of the tokens the proposer was sure of and "
                             f"{r.stop_acceptance['stopped_after']:.0%} of those it stopped after")
        if self.isa:
            peaks = ", ".join(f"{k} {v:.1f}" for k, v in self.peak_gflops.items())
            lines.append(f"path: {machine.MachineReport(**self.isa)}; matmul peak GFLOP/s {peaks}")
        steps = [dataclasses.replace(s, step=f"{r.method}: {s.step}") for r in self.rows for s in r.steps]
        if steps:
            lines.append(steps_table(steps))
        return "\n".join(lines)


def _row(label: str, runs: list[DecodeResult], baseline: list[DecodeResult], check_tokens: bool,
         options: dict[str, Any]) -> MethodRow:
    ms = statistics.median(r.ms_per_token for r in runs)
    total = statistics.median(r.total_s for r in runs)
    match = all(torch.equal(r.tokens, baseline[0].tokens) for r in runs) if check_tokens else None
    base_ms = statistics.median(r.ms_per_token for r in baseline)
    base_total = statistics.median(r.total_s for r in baseline)
    common = dict(method=label, prefill_s=statistics.median(r.prefill_s for r in runs),
                  setup_s=statistics.median(r.setup_s for r in runs), ms_per_token=ms,
                  tokens_per_s=runs[0].tokens.shape[0] * 1000 / ms, speedup=base_ms / ms,  # tok/s over the batch
                  end_to_end=base_total / total, tokens_match=match,
                  options={k: _plain(v) for k, v in options.items()})
    run = median_run(runs, key=lambda r: r.decode_s)
    if run.rows is not None and run.levels:  # a batch: every row's counts added up, regions of its slowest row
        slowest = max(run.rows, key=lambda r: r.decode_s).stats
        median = dataclasses.replace(slowest, levels=run.levels, generated=sum(r.stats.generated for r in run.rows),
                                     target_forwards=sum(r.stats.target_forwards for r in run.rows),
                                     rebuilds=sum(r.stats.rebuilds for r in run.rows))
    else:
        median = run.stats
    if median is None:
        return MethodRow(**common)
    levels = median.levels
    return MethodRow(**common, tokens_per_iteration=median.tokens_per_iteration,
                     acceptance={lvl.name: lvl.acceptance_rate for lvl in levels},
                     mean_accepted={lvl.name: lvl.mean_accepted for lvl in levels},
                     histogram={lvl.name: list(lvl.histogram) for lvl in levels},
                     rounds={lvl.name: {g: list(n) for g, n in lvl.rounds.items()} for lvl in levels},
                     verifications={lvl.name: lvl.verifications for lvl in levels},
                     drafted={lvl.name: lvl.drafted for lvl in levels}, rebuilds=median.rebuilds,
                     seconds=dict(median.seconds), decode_s=median.decode_s)


def compare(config: CompareConfig, progress: bool = False, target: Transformer | None = None) -> CompareResult:
    """Time the baseline and ``config.methods`` on one essay prompt, all from one prefill; returns rows
    (baseline first).

    ``target`` reuses a model already loaded from ``config.model`` in ``config.dtype`` on ``config.device``
    (a notebook comparing at several contexts loads it once); ``quant`` then must be ``none``.
    """
    device = resolve_device(config.device)
    if target is not None:
        require(getattr(target, "source", None) == config.model and target.dtype == DTYPES[config.dtype]
                and target.device.type == device.type,
                f"the target passed to compare was not loaded as {config.model} {config.dtype} on {device}; "
                "pass the matching model or none")
        require(config.quant == "none", "compare quantises the model it loads; with a preloaded target use quant none")
    model_cfg = weights.load_config(config.model)
    limit = model_cfg.max_position_embeddings
    require(config.context + config.new_tokens <= limit,
            f"context {config.context} + {config.new_tokens} new tokens exceeds the maximum context of "
            f"{config.model} ({limit}); lower --context or --new-tokens"
            f"{weights.longer_context_hint(config.model, config.context + config.new_tokens)}")
    options = [method_options(name, **opts) for name, opts in config.methods]
    for opts in options:
        opts.check(model_cfg, config.context)
        draft = getattr(opts, "draft", None)
        if isinstance(draft, str) and drafter_kind(draft):  # a slice drafter's tokenizer too, before the prefill
            check_trained_for(draft, model_cfg, config.model)
    store = PrefillStore(config.prefill_cache, int(config.prefill_cache_gib * GiB)) if config.prefill_cache else None

    target = target if target is not None else weights.load_model(config.model, DTYPES[config.dtype], device)
    if config.quant == "int8":  # before any draft is cut from it: baseline, methods and truncated drafts share it
        quantize_int8(target)
    if config.batch > 1:  # refuse a batch that cannot fit before any prefill (decode checks again, with drafts)
        for (name, _), opts in zip(config.methods, options):
            draft = target if getattr(opts, "draft", None) == "self" else None  # a loaded draft is checked by decode
            check_memory(batch_bytes(target, draft, [config.context] * config.batch, config.new_tokens, name, opts,
                                     prefilled=not config.prefill_cache), config.max_memory or None, target.device)
    prompts = [bench_prompt(config.model, config.context, config.split, config.variant + b, config.offset).to(device)
               for b in range(config.batch)]
    layers = feature_layers_of(*(getattr(opts, "draft", None) for opts in options))  # what feature drafters read
    prefills = [prefill_prompt(target, p, store=store, warmup=config.warmup > 0 and b == 0,
                               on_disk=config.batch > 1,  # a batch's prefills wait in the store, not in memory
                               feature_layers=layers)
                for b, p in enumerate(prompts)]
    if config.batch == 1:
        prompt, prefilled, batch = prompts[0], prefills[0], {}
    else:
        prompt, prefilled = [p[0] for p in prompts], prefills
        batch = {"max_memory": config.max_memory or None}
    drafts: dict[str, Any] = {}
    runners = {BASELINE: lambda: decode(target, prompt, BASELINE, config.new_tokens, sampling=config.sampling,
                                        prefilled=prefilled, **batch)}
    labels = config.labels(config.methods)
    for label, (name, _), opts in zip(labels, config.methods, options):
        values = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
        draft = values.get("draft")
        if isinstance(draft, str) and draft != "ngram":  # load each named draft once, not once per run
            if draft not in drafts:
                drafts[draft] = load_draft(draft, target)
            values["draft"] = drafts[draft]
        runners[label] = (lambda name=name, values=values:
                          decode(target, prompt, name, config.new_tokens, sampling=config.sampling,
                                 prefilled=prefilled, **batch, **values))
    runs = interleaved_runs(runners, config.warmup, config.repeats, progress)
    given = {BASELINE: {}, **{label: opts for label, (_, opts) in zip(labels, config.methods)}}
    rows = [_row(label, runs[label], runs[BASELINE], config.sampling.greedy, given[label]) for label in runners]
    loaded = sorted({p.loaded_from for p in prefills if p.loaded_from is not None})  # the files read; none computed
    rss = peak_rss_gb()  # before the bandwidth read's 1 GiB buffer
    path = machine.report(device)
    read_bw, peaks = measure_read_bandwidth(device), machine.peak_gflops([config.dtype], device, config.peak_s)
    if config.batch == 1:  # a batch's regions are its slowest row's, its counts every row's: no model for that
        rows = [dataclasses.replace(row, predicted_speedup=_predicted(row, opts, rows[0].ms_per_token),
                                    stop_acceptance=None if opts is None else stop_acceptance(
                                        _model_options(opts), row.rounds.get(TARGET, {})))
                for row, opts in zip(rows, [None, *options])]
    if config.batch == 1 and config.quant == "none":  # int8 weights: roofline.py counts bytes at the dtype's width
        rows = [dataclasses.replace(row, steps=_steps(target, config, row, opts, read_bw, peaks[config.dtype]))
                for row, opts in zip(rows, [None, *options])]
    return CompareResult(config, device_name(device), prompts[0].shape[1], rows, sum(p.seconds for p in prefills),
                         ", ".join(loaded) or None, rss, read_bw / 1e9, path.to_dict(), peaks)


def _model_options(opts: Any) -> dict[str, Any]:
    """The options the cost model reads, from a method's options object."""
    return {k: getattr(opts, k) for k in ("gamma", "gamma1", "gamma2", "draft_confidence") if hasattr(opts, k)}


def _predicted(row: MethodRow, opts: Any, baseline_ms: float) -> float | None:
    if opts is None:
        return None
    return predicted_speedup(_model_options(opts), row.seconds, row.drafted, row.verifications, row.rounds,
                             row.decode_s, baseline_ms)


def _steps(target: Transformer, config: CompareConfig, row: MethodRow, opts: Any, read_bw: float,
           peak: float) -> list[StepRow]:
    """The baseline's decode step, or a method's steps (:func:`~.steps.method_steps`), at the mean decode
    context."""
    context = config.context + config.new_tokens // 2
    if opts is None:
        cost = step_cost(target.cfg, context, 1, DTYPES[config.dtype].itemsize)
        return [step_row("decode", config.dtype, row.ms_per_token, cost, read_bw, peak)]
    method = row.method.split("(")[0]
    return method_steps(target.cfg, config.dtype, method, opts, context, row, read_bw, peak)

