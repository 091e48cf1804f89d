"""``gpu-check``: the GPU path in one prepared run of at most ~8 minutes (``make TORCH=torch gpu-check``).

Three parts, in one process, each skipped with a note when the time budget
(``time_limit_s``, 7.5 minutes by default) would not cover it:

1. **Fig. 1's levels** (:mod:`.gpu_levels`) at the paper's shapes with
   random weights: Llama-2-7B-128K in fp16 over a 122K full cache and over a
   4K retrieval cache, llama-68m over a 256-token StreamingLLM cache; each
   step eager over the library's cache, eager over its static-shape
   counterpart and under a CUDA graph, beside the roofline from the device's
   measured read bandwidth (and its datasheet) and the paper's milliseconds.
   The full cache shrinks, with a note, when the device's free memory cannot
   hold it (an A100-80GB holds about 114K tokens beside the weights).
   The retrieval level also times gathering the selection into the budget
   buffer against FlashInfer's indexed decode (when importable).
2. **SmolLM2 at 8K**: AR and TriForce through :func:`~.comparison.compare`
   on the GPU; greedy tokens must be equal, the speedup is recorded.
3. **The record**: ``<out_dir>/<YYYY-MM-DD>-<device>.json`` with the device,
   versions, bandwidth, every timing and prediction, notes and skips.

Without CUDA the command refuses with one ``error:`` line (exit status 2)
before any work. A part that fails is recorded under ``errors`` and the rest
still run; the exit status is then 1. The library function
:func:`run_gpu_check` also runs on CPU tensors (the tests drive it with tiny
models and a fake :class:`~.gpu_levels.Backend`).

``python -m sparsedraft gpu-check`` is the command; ``python -m
sparsedraft.bench.gpu`` runs the same parser without importing the notebook
runner, for a bare GPU image that lacks nbformat (README, "GPU check").
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from importlib import metadata
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..cliopts import add_config_options, config_from_args
from ..engine.config import ModelConfig
from ..engine.roofline import HARDWARE, MODELS, Hardware, kv_bytes
from ..engine.runtime import DTYPES, device_name
from ..errors import SparsedraftError, exit_with, require
from ..report import format_table
from .comparison import CompareConfig, compare
from .gpu_levels import Backend, DeviceBackend, LevelRow, LevelTimer, StepTiming, draft_level, fit_context, \
    target_levels

HELP = "the GPU check: Fig. 1's levels with and without CUDA graphs, AR vs TriForce on SmolLM2; writes data/gpu/"
NO_CUDA = ("gpu-check needs a CUDA GPU, and torch.cuda.is_available() is False here (torch {torch}): nothing was "
           "run and nothing written. Run it on a GPU machine with a CUDA build of torch: make TORCH=torch gpu-check")
# Rough seconds each part takes on an H200/A100 (model build, cache fill, graph captures, timings), generous;
# a part starts only when the budget has this much left ("static full cache" is the target part's last step).
PART_SECONDS = {"draft": 30, "target": 120, "static full cache": 40, "smollm2": 150}


@dataclass(frozen=True)
class GpuCheckConfig:
    device: str = field(default="cuda", metadata={"help": "CUDA device (cuda or cuda:N)"})
    dtype: str = field(default="fp16", metadata={"help": "Fig. 1 levels: weights and KV dtype",
                                                 "choices": tuple(DTYPES)})
    target: str = field(default="llama2-7b-128k", metadata={"help": "Fig. 1 target shape (roofline.MODELS)"})
    draft: str = field(default="llama-68m", metadata={"help": "Fig. 1 draft shape (roofline.MODELS)"})
    context: int = field(default=122 * 1024, metadata={"help": "full-cache tokens (scaled down if memory is short)"})
    budget: int = field(default=4096, metadata={"help": "retrieval cache tokens"})
    chunk_size: int = field(default=8, metadata={"help": "retrieval chunk size"})
    gamma1: int = field(default=2, metadata={"help": "level-1 draft tokens per round: the streaming cache's "
                                                     "speculative slots (rounded up to align its buffer)"})
    gamma2: int = field(default=6, metadata={"help": "level-2 tokens per round: the retrieval cache has gamma2 + 1 "
                                                     "speculative slots (rounded up to align its buffer)"})
    sink: int = field(default=16, metadata={"help": "draft cache sink tokens"})
    window: int = field(default=240, metadata={"help": "draft cache window (sink + window = TriForce's 256)"})
    draft_prompt: int = field(default=1024, metadata={"help": "random tokens prefilled into the draft's cache"})
    fill_chunk: int = field(default=4096, metadata={"help": "tokens per step when filling the full cache"})
    warmup: int = field(default=3, metadata={"help": "untimed steps per measurement"})
    repeats: int = field(default=10, metadata={"help": "timed groups per measurement (median reported)"})
    inner: int = field(default=10, metadata={"help": "steps per timed group"})
    smollm2: bool = field(default=True, metadata={"help": "run part 2 (AR vs TriForce on SmolLM2)"})
    smollm2_model: str = field(default="smollm2-135m", metadata={"help": "part 2 model"})
    smollm2_dtype: str = field(default="fp32", metadata={"help": "part 2 dtype (fp32 keeps greedy tokens equal)",
                                                         "choices": tuple(DTYPES)})
    smollm2_context: int = field(default=7936, metadata={"help": "part 2 prompt tokens"})
    smollm2_new_tokens: int = field(default=256, metadata={"help": "part 2 generated tokens"})
    smollm2_repeats: int = field(default=3, metadata={"help": "part 2 timed runs per method"})
    smollm2_budget: int = field(default=1024, metadata={"help": "part 2 TriForce retrieval budget (its other "
                                                               "options are the CLI defaults)"})
    time_limit_s: float = field(default=450.0, metadata={"help": "skip parts that would end past this many seconds"})
    out_dir: str = field(default="data/gpu", metadata={"help": "folder of the JSON record"})
    seed: int = field(default=0, metadata={"help": "random weights, caches and prompts"})

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES and self.smollm2_dtype in DTYPES,
                f"dtype and smollm2_dtype must be in {tuple(DTYPES)}, got {self.dtype!r}, {self.smollm2_dtype!r}")
        for name in ("context", "budget", "chunk_size", "gamma1", "gamma2", "window", "draft_prompt", "fill_chunk",
                     "repeats", "inner", "smollm2_context", "smollm2_repeats", "smollm2_budget"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        require(self.sink >= 0 and self.warmup >= 1, f"need sink >= 0 and warmup >= 1 (the graph is captured "
                                                     f"during warm-up), got {self.sink} and {self.warmup}")
        require(self.budget % self.chunk_size == 0 and self.budget < self.context,
                f"budget ({self.budget}) must be a multiple of chunk_size ({self.chunk_size}) and below the context "
                f"({self.context})")
        require(self.smollm2_new_tokens >= 2, f"smollm2_new_tokens must be >= 2, got {self.smollm2_new_tokens}")
        require(self.time_limit_s > 0, f"time_limit_s must be > 0 seconds, got {self.time_limit_s}")

    @property
    def timing(self) -> StepTiming:
        return StepTiming(self.warmup, self.repeats, self.inner)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def aligned_slots(used: int, need: int, multiple: int = 8) -> int:
    """Speculative slots >= ``need`` that make ``used + slots`` a multiple of ``multiple``, so the static buffers'
    rows stay aligned for the attention kernels (extra slots only allow longer rollbacks)."""
    return need + (-(used + need)) % multiple


class Deadline:
    """Seconds left of the check's budget, on an injectable clock."""

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic):
        self.limit_s, self.clock, self.start = limit_s, clock, clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def allows(self, seconds: float) -> bool:
        return self.elapsed() + seconds <= self.limit_s


@dataclass
class GpuCheckResult:
    config: GpuCheckConfig
    date: str  # YYYY-MM-DD
    device: str
    versions: dict[str, str | None]
    memory_gb: float | None  # device memory, GB
    read_bandwidth_gb_s: float  # measured (roofline.measure_read_bandwidth)
    datasheet: dict[str, Any] | None  # the matching roofline.HARDWARE entry, if any
    levels: list[LevelRow] = field(default_factory=list)
    retrieval_kernels: dict[str, Any] | None = None
    smollm2: dict[str, Any] | None = None  # compare's record plus speedup and tokens_match
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    path: str | None = None  # where the JSON was written

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["config"] = self.config.to_dict()
        return {"bench": "gpu-check", **record}

    def table(self) -> str:
        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x:.3f}"
        head = (f"gpu-check on {self.device} ({self.date}), torch {self.versions.get('torch')}, CUDA "
                f"{self.versions.get('cuda')}; read bandwidth {self.read_bandwidth_gb_s:.0f} GB/s\n")
        cells = [[r.level, r.model, str(r.context), ms(r.eager_ms), ms(r.static_ms), ms(r.graph_ms),
                  ms(r.roofline_ms), ms(r.datasheet_ms), f"{r.paper_ms:g}"] for r in self.levels]
        lines = [head + format_table(["level", "model", "tokens", "eager ms", "static ms", "graph ms", "roofline ms",
                                      "datasheet ms", "paper ms"], cells)]
        k = self.retrieval_kernels
        if k:
            lines.append(f"retrieval, {k['selected_tokens']} tokens x all layers: gather {ms(k['gather_ms'])} ms, "
                         f"dense attention {ms(k['dense_attention_ms'])} ms, FlashInfer indexed "
                         f"{ms(k['flashinfer_ms'])} ms" + (f" ({k['note']})" if k.get("note") else ""))
        if self.smollm2:
            lines.append(self.smollm2["table"])
        lines += [f"note: {n}" for n in self.notes] + [f"skipped: {s}" for s in self.skipped]
        lines += [f"ERROR: {e}" for e in self.errors]
        if self.path:
            lines.append(f"wrote {self.path}")
        return "\n".join(lines)


def device_slug(name: str) -> str:
    """A device name as a file name part: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def datasheet(name: str) -> Hardware | None:
    """The roofline.HARDWARE entry a device name matches (an A100 only when it says 80GB), else None."""
    lower = name.lower()
    for needle, key in (("h200", "h200"), ("h100", "h100-sxm"), ("l40", "l40"), ("4090", "rtx-4090")):
        if needle in lower:
            return HARDWARE[key]
    return HARDWARE["a100-80gb"] if "a100" in lower and "80" in lower else None


def versions() -> dict[str, str | None]:
    """torch, CUDA, cuDNN, the optional kernels and this checkout's commit (None when absent)."""
    found: dict[str, str | None] = {"python": sys.version.split()[0], "torch": torch.__version__,
                                    "cuda": torch.version.cuda}
    found["cudnn"] = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
    packages = {"flash_attn": ("flash-attn", "flash_attn"), "flashinfer": ("flashinfer-python", "flashinfer"),
                "transformers": ("transformers",)}  # import name -> distribution names
    for key, distributions in packages.items():
        found[key] = None
        for distribution in distributions:
            try:
                found[key] = metadata.version(distribution)
                break
            except metadata.PackageNotFoundError:
                continue
    try:
        found["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                         cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        found["commit"] = None
    return found


def write_record(result: GpuCheckResult, out_dir: str | Path) -> Path:
    """``out_dir/<date>-<device>.json`` (a rerun on the same day overwrites it)."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{result.date}-{device_slug(result.device)}.json"
    result.path = str(path)
    path.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    return path


def _part(name: str, result: GpuCheckResult, deadline: Deadline, run: Callable[[], None],
          log: Callable[[str], None]) -> None:
    """Run one part if the budget allows; record a skip or an error instead of stopping the check."""
    need = PART_SECONDS[name]
    if not deadline.allows(need):
        result.skipped.append(f"{name}: {max(0.0, deadline.limit_s - deadline.elapsed()):.0f} s left of the "
                              f"{deadline.limit_s:.0f} s budget, the part needs about {need} s")
        return
    log(f"gpu-check: {name} ({deadline.elapsed():.0f} s so far)")
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - one failed part (CUDA OOM, a kernel error) must not lose the others
        result.errors.append(f"{name}: {type(exc).__name__}: {exc}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_gpu_check(config: GpuCheckConfig, *, backend: Backend | None = None,
                  models: Mapping[str, ModelConfig] = MODELS, clock: Callable[[], float] = time.monotonic,
                  log: Callable[[str], None] = lambda message: None) -> GpuCheckResult:
    """Run the check's parts on ``config.device`` and write the JSON record; returns the result.

    ``backend``, ``models`` and ``clock`` are for tests (a fake machine, tiny
    configs, a fake clock); on a CPU device the graph timings stay None.
    """
    device = torch.device(config.device)
    require(device.type != "cuda" or torch.cuda.is_available(), NO_CUDA.format(torch=torch.__version__))
    for name in (config.target, config.draft):
        require(name in models, f"unknown model shape {name!r}: choose one of {sorted(models)}")
    deadline = Deadline(config.time_limit_s, clock)
    backend = backend or DeviceBackend()
    name = device_name(device)
    sheet = datasheet(name)
    memory = torch.cuda.get_device_properties(device).total_memory / 1e9 if device.type == "cuda" else None
    bandwidth = backend.bandwidth(device)
    result = GpuCheckResult(config, datetime.date.today().isoformat(), name, versions(), memory, bandwidth / 1e9,
                            None if sheet is None else dataclasses.asdict(sheet))
    if device.type != "cuda":
        result.notes.append("no CUDA device: graph timings not taken (the same code ran eagerly on CPU tensors)")
    if result.versions["flash_attn"] is None:
        result.notes.append("flash-attn not importable: every step's attention ran through torch SDPA")
    else:
        result.notes.append("flash-attn importable: the model uses it for steps without a mask (the full cache's "
                            "one-token decode), SDPA for the rest (static-shape caches always pass a mask)")
    timer = LevelTimer(backend, device, config.timing, bandwidth, None if sheet is None else sheet.bandwidth_gb_s)
    dtype = DTYPES[config.dtype]

    def draft() -> None:
        spec = aligned_slots(config.sink + config.window, config.gamma1)
        result.levels.append(draft_level(timer, config.draft, models[config.draft], dtype, config.sink,
                                         config.window, spec, config.draft_prompt, config.seed))

    def target() -> None:
        cfg, spec = models[config.target], aligned_slots(config.budget, config.gamma2 + 1)
        scratch = kv_bytes(cfg, config.context, 4) // cfg.num_layers  # fp32 keys of one layer while selecting
        extra = 2 * kv_bytes(cfg, config.budget + spec, dtype.itemsize) + scratch
        context, note = fit_context(cfg, config.context, backend.free_bytes(device), dtype.itemsize, extra)
        if note:
            result.notes.append(note)
        static_full = deadline.allows(PART_SECONDS["target"] + PART_SECONDS["static full cache"])
        rows, kernels = target_levels(timer, config.target, cfg, dtype, context, config.budget, config.chunk_size,
                                      spec, config.fill_chunk, static_full, config.seed)
        result.levels[:0] = rows
        result.retrieval_kernels = kernels

    def smollm2() -> None:
        compared = compare(CompareConfig(model=config.smollm2_model, dtype=config.smollm2_dtype,
                                         device=config.device, context=config.smollm2_context,
                                         new_tokens=config.smollm2_new_tokens, repeats=config.smollm2_repeats,
                                         seed=config.seed,
                                         methods=(("triforce", {"budget": config.smollm2_budget}),)))
        row = compared.row("triforce")
        result.smollm2 = {"speedup": row.speedup, "end_to_end": row.end_to_end, "tokens_match": row.tokens_match,
                          "table": compared.table(), "compare": compared.to_dict()}
        if not row.tokens_match:
            result.errors.append("smollm2: TriForce's greedy tokens differ from AR's")

    _part("draft", result, deadline, draft, log)
    _part("target", result, deadline, target, log)
    if config.smollm2:
        _part("smollm2", result, deadline, smollm2, log)
    else:
        result.skipped.append("smollm2: turned off (--no-smollm2)")
    result.elapsed_s = deadline.elapsed()
    write_record(result, config.out_dir)
    return result


def add_gpu_check_parser(parser: argparse.ArgumentParser) -> None:
    add_config_options(parser, GpuCheckConfig)


def run_gpu_check_command(args: argparse.Namespace) -> int:
    """Refuse without CUDA; else run, print the table and the JSON record as the last line; 1 if a part failed."""
    require(torch.cuda.is_available(), NO_CUDA.format(torch=torch.__version__))
    config = config_from_args(GpuCheckConfig, args)
    require(torch.device(config.device).type == "cuda", f"gpu-check runs on a CUDA device, got {config.device!r}")
    result = run_gpu_check(config, log=lambda message: print(message, file=sys.stderr, flush=True))
    print(result.table())
    print(json.dumps(result.to_dict()))
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsedraft.bench.gpu", description=HELP)
    add_gpu_check_parser(parser)
    try:
        return run_gpu_check_command(parser.parse_args(argv))
    except SparsedraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_with(main)
