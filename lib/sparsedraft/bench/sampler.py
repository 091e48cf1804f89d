"""How fast a batch of decodes makes training text: the row-exact few-row kernel against torch's GEMM.

The feature drafter's sampled continuations (``budgetdraft.feature_data``) are a batch of decodes. Speculative
decoding sends such a batch through the few-row kernel 16 rows a call, so every row gets the bits of its
batch-1 run; making data needs no such promise, and :func:`~sparsedraft.engine.model.gemm_batches` hands the
linear layers to torch's GEMM instead. This times one batched decode step both ways, taking turns in one
process, over a cache of ``context`` tokens per row, and prints each path's ms per step, tokens/s, achieved
GFLOP/s against this machine's measured fp32 matmul peak, and the ratio.

Not a test: ``python -m sparsedraft.bench.sampler --batch 16 32 --record docs/results/sampler-batch.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from ..engine.machine import peak_gflops, provenance
from ..engine.model import Transformer, gemm_batches
from ..engine.roofline import attention_flops, weight_flops
from ..engine.weights import load_model
from ..errors import exit_with, require
from .record import finish_module
from .timing import interleaved_runs, median_ms

PATHS = {"row-exact kernel": contextlib.nullcontext, "torch GEMM": gemm_batches}


@torch.inference_mode()
def time_batch(model: Transformer, batch: int, context: int, warmup: int = 2, repeats: int = 7) -> list[dict]:
    """One row per path: the median of ``repeats`` single-token steps of ``batch`` rows over ``context`` cached
    tokens (random; the work does not depend on them), each step rolled back."""
    require(batch >= 1 and context >= 1, f"batch and context must be >= 1, got {batch} and {context}")
    cfg = model.cfg
    cache = model.new_cache(context + 1, batch)
    for k, v in zip(cache.k, cache.v):  # a prompt forward of batch x context tokens would take minutes
        k.normal_()
        v.normal_()
    cache.pos[:, :context] = torch.arange(context)
    cache.length = context
    tokens = torch.randint(cfg.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0))

    def step(path):
        def run() -> float:
            with PATHS[path]():
                start = time.perf_counter()
                model(tokens, cache=cache)
                elapsed = time.perf_counter() - start
            cache.rollback(1)
            return elapsed
        return run

    runs = interleaved_runs({path: step(path) for path in PATHS}, warmup, repeats)
    flops = batch * (weight_flops(cfg) + attention_flops(cfg, context + 1))
    rows = []
    for path, seconds in runs.items():
        ms = median_ms(seconds)
        rows.append({"batch": batch, "context": context, "path": path, "ms": round(ms, 2),
                     "tokens_per_s": round(batch / ms * 1e3, 1), "gflop_s": round(flops / ms / 1e6, 1)})
    exact, gemm = rows
    gemm["speedup"] = round(exact["ms"] / gemm["ms"], 2)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-yarn32k", help="model name, HF id or folder")
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 32], help="rows decoded together")
    parser.add_argument("--context", type=int, default=640, help="cached tokens per row (the middle of a "
                                                                 "256 + 768-token sampled window)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--record", default="", metavar="PATH.json", help="also write a results record")
    args = parser.parse_args(argv)
    require(not args.record or args.record.endswith(".json"), f"--record takes a .json path, got {args.record!r}")
    require(all(b >= 1 for b in args.batch) and args.context >= 1 and args.repeats >= 3,
            f"--batch and --context must be >= 1 and --repeats >= 3, got {args.batch}, {args.context}, "
            f"{args.repeats}")
    started = provenance()
    model = load_model(args.model)
    require(model.dtype == torch.float32 and model.device.type == "cpu",
            f"this bench times the CPU fp32 path; {args.model} loaded as {model.dtype} on {model.device}")
    peak = peak_gflops(["fp32"])["fp32"]
    rows = [row for batch in args.batch for row in time_batch(model, batch, args.context, repeats=args.repeats)]
    print(f"fp32 matmul peak measured here: {peak:.1f} GFLOP/s; {torch.get_num_threads()} threads")
    print(f"{'batch':>5} {'path':>17} {'ms/step':>8} {'tok/s':>7} {'GFLOP/s':>8} {'of peak':>7}")
    for row in rows:
        print(f"{row['batch']:>5} {row['path']:>17} {row['ms']:>8.1f} {row['tokens_per_s']:>7.1f} "
              f"{row['gflop_s']:>8.1f} {row['gflop_s'] / peak:>7.0%}" +
              (f"   {row['speedup']:.2f}x the kernel" if "speedup" in row else ""))
    result = {"bench": "sampler", "model": args.model, "threads": torch.get_num_threads(),
              "peak_gflops": {"fp32": round(peak, 1)}, "rows": rows}
    finish_module(args.record, 'sampler', argv, result, started)


if __name__ == "__main__":
    exit_with(main)
