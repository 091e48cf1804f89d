"""Where a prompt's prefill spends its time, ours beside transformers', by torch operator.

The AR bench says how long each engine's prefill takes; this says why. It
runs one prefill of the same prompt through each engine under torch's
profiler (after an untimed warm-up on the first chunk) and records every
operator's self time, its share of the profiled total and its call count,
largest first. On a 2-core CPU an 8K prefill is mostly attention and
matmuls, so the table shows which of those a faster prefill would have to
beat (docs/engine.md, "On an AMX machine"). Where a bf16 prefill runs its
attention through the kernel's slices (``model.sliced_prefill``), ours is
profiled a second time with torch's flash kernel instead (``sparsedraft,
torch flash``), so the two stand side by side from one process; the kernel's
calls show as ``sparsedraft::attend_slices``.

Not a test: ``python -m sparsedraft.bench.prefill_profile --context 8000 --dtype bf16
--record docs/results/prefill-profile-8k-bf16.json``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from ..engine import machine
from ..engine.data import bench_prompt
from ..engine.machine import provenance
from ..engine.model import prefill_slices, sliced_prefill
from ..engine.prefill import PREFILL_CHUNK
from ..engine.prefill_store import prefill_prompt
from ..engine.roofline import measure_read_bandwidth
from ..engine.runtime import DTYPES
from ..engine.weights import load_model
from ..errors import exit_with, require
from .ar import hf_prefill, load_hf_oracle
from .record import finish_module


def profile_ops(run: Callable[[], Any], top: int) -> dict[str, Any]:
    """``run`` once, timed, then once under torch's CPU profiler: its seconds and its ``top`` operators by self
    time (``op``, ``self_s``, ``share`` of the profiled self time, ``calls``)."""
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total,
            "calls": e.count} for e in events[:top]]
    return {"seconds": seconds, "profiled_s": total / 1e6, "ops": ops}


def flash_prefill(model, prompt: torch.Tensor) -> Any:
    """Our prefill of ``prompt`` with torch's flash kernel where it would slice (``model.prefill_slices``)."""
    before = prefill_slices(False)
    try:
        return prefill_prompt(model, prompt)
    finally:
        prefill_slices(before)


def measure(model_name: str, context: int, dtype: str, top: int = 8, hf: bool = True) -> dict[str, Any]:
    """The profile of each engine's prefill of a ``context``-token essay prompt in ``dtype``."""
    model = load_model(model_name, dtype=DTYPES[dtype]).eval()
    prompt = bench_prompt(model_name, context)
    engines: dict[str, Callable[[], Any]] = {"sparsedraft": lambda: prefill_prompt(model, prompt)}
    if sliced_prefill(model.dtype, model.device, model.cfg.head_dim):
        engines["sparsedraft, torch flash"] = lambda: flash_prefill(model, prompt)
    if hf:
        oracle = load_hf_oracle(model_name, model, DTYPES[dtype], torch.device("cpu"))
        engines["transformers"] = lambda: hf_prefill(oracle, prompt)
    warm = prompt[:, :PREFILL_CHUNK + 1]
    prefill_prompt(model, warm)
    if hf:
        hf_prefill(oracle, warm)
    rows = []
    for engine, run in engines.items():
        measured = profile_ops(run, top)
        rows += [{"engine": engine, "seconds": measured["seconds"], "profiled_s": measured["profiled_s"], **op}
                 for op in measured["ops"]]
    return {"bench": "prefill_profile", "model": model_name, "context": context, "dtype": dtype,
            "threads": torch.get_num_threads(), "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="short name, .gguf, folder, HF id or tiny-<arch>")
    parser.add_argument("--context", type=int, default=8000, help="prompt tokens")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"], help="both engines' dtype")
    parser.add_argument("--top", type=int, default=8, help="operators kept per engine, by self time")
    parser.add_argument("--no-hf", action="store_true", help="profile our prefill alone")
    parser.add_argument("--record", default="", metavar="PATH.json", help="also write a results record")
    args = parser.parse_args(argv)
    require(not args.record or args.record.endswith(".json"), f"--record takes a .json path, got {args.record!r}")
    require(args.context >= 2 and args.top >= 1, f"--context >= 2 and --top >= 1, got {args.context}, {args.top}")
    started = provenance()
    path = machine.report("cpu")
    read = measure_read_bandwidth("cpu")
    result = {"isa": path.to_dict(), **measure(args.model, args.context, args.dtype, args.top, not args.no_hf)}
    print(f"{path}; read {read / 1e9:.1f} GB/s")
    for engine in dict.fromkeys(r["engine"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["engine"] == engine]
        print(f"{engine}: prefill of {args.context:,} tokens in {args.dtype}, {rows[0]['seconds']:.2f} s")
        for r in rows:
            print(f"  {r['share']:6.1%}  {r['self_s']:7.3f} s  {r['calls']:6d} calls  {r['op']}")
    finish_module(args.record, "prefill_profile", argv, result, started, read / 1e9)


if __name__ == "__main__":
    exit_with(main)
