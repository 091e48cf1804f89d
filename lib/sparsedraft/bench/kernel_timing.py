"""Time the C++ attention kernel against torch SDPA on SmolLM2-135M-shaped decode attention, and the kernel as
it runs (keys as lanes for steps of at most ``kernels.KEY_ROWS`` rows per KV head) against its rows-as-lanes
path alone.

Not a test (a test never asserts a wall-clock time): ``python -m sparsedraft.bench.kernel_timing``.
Each step attends ``layers`` separate caches (so the KV comes from memory, as in a real forward),
with q folded to [B, KV, g*T, D] and, for T > 1, the bool mask model.attention builds; the kernel
gets the same q and cache views. Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import torch
import torch.nn.functional as F

from ..engine.kernels import attend, available, path
from ..engine.machine import provenance
from ..engine.roofline import measure_read_bandwidth
from ..errors import require
from .record import write_record
from .timing import interleaved_runs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _caches(layers: int, kv: int, context: int, d: int, dtype: torch.dtype):
    slots = context + 64  # views into bigger buffers, like StaticCache
    return [(torch.randn(1, kv, slots, d, dtype=dtype)[:, :, :context],
             torch.randn(1, kv, slots, d, dtype=dtype)[:, :, :context]) for _ in range(layers)]


def time_step(layers: int = 30, heads: int = 9, kv: int = 3, d: int = 64, context: int = 8000, t: int = 1,
              dtype: str = "fp32", warmup: int = 2, repeats: int = 5) -> list[dict]:
    """Median ms of one step's attention over ``layers`` layers, SDPA vs kernel, and KV GB/s read."""
    torch.manual_seed(0)
    g, scale = heads // kv, d ** -0.5
    caches = _caches(layers, kv, context, d, DTYPES[dtype])
    q = torch.randn(1, t, heads, d, dtype=DTYPES[dtype]).transpose(1, 2)  # [B, H, T, D] as the model has it
    qg = q.reshape(1, kv, g * t, d)
    positions = torch.arange(context)
    mask = (positions[None, :] <= positions[-t:, None])[None, None] if t > 1 else None  # [B, 1, T, S]

    def sdpa():
        mg = None if mask is None else mask[:, :, None].expand(-1, -1, g, -1, -1).reshape(1, 1, g * t, -1)
        return [F.scaled_dot_product_attention(qg, k, v, attn_mask=mg, scale=scale) for k, v in caches]

    def kernel():
        return [attend(qg, k, v, scale, t) for k, v in caches]

    def row_lanes():  # the kernel with every step on its rows-as-lanes path (KEY_ROWS picks per step)
        return [attend(qg, k, v, scale, t, key_rows=0) for k, v in caches]

    def timed(fn):
        def run():
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        return run

    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(sdpa(), kernel()))
    runs = interleaved_runs({"sdpa": timed(sdpa), "kernel": timed(kernel), "kernel, rows as lanes": timed(row_lanes)},
                            warmup, repeats)
    kv_bytes = layers * 2 * kv * context * d * caches[0][0].element_size()
    rows = []
    for name, seconds in runs.items():
        ms = sorted(seconds)[len(seconds) // 2] * 1e3
        rows.append({"context": context, "T": t, "dtype": dtype, "method": name, "ms": round(ms, 2),
                     "kv_gb_s": round(kv_bytes / ms / 1e6, 1), "kv_mb": round(kv_bytes / 1e6, 1),
                     "max_abs_diff": diff})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[8000, 32000])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--record", default="", metavar="PATH.json",
                        help="also write the rows as a results record (docs/results/), with this process's read "
                             "bandwidth, the ISA and the commit")
    args = parser.parse_args(argv)
    require(not args.record or args.record.endswith(".json"), f"--record takes a .json path, got {args.record!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not available():
        raise SystemExit("the C++ kernel is unavailable here; nothing to time")
    rows = [row for context in args.context for dtype in args.dtype for t in args.tokens
            for row in time_step(context=context, t=t, dtype=dtype, repeats=args.repeats)]
    print(f"kernels: {path()}")
    print(f"{'context':>8} {'T':>3} {'dtype':>5} {'method':>21} {'ms':>8} {'KV GB/s':>8} {'KV MB':>7}")
    for row in rows:
        print(f"{row['context']:>8} {row['T']:>3} {row['dtype']:>5} {row['method']:>21} {row['ms']:>8.2f} "
              f"{row['kv_gb_s']:>8.1f} {row['kv_mb']:>7.1f}")
    result = {"bench": "kernel_timing", "threads": torch.get_num_threads(), "kernels": path(), "rows": rows}
    if args.record:
        started = provenance()
        read = measure_read_bandwidth() / 1e9
        result["read_gb_s"] = read
        command = "python -m sparsedraft.bench.kernel_timing " + shlex.join(argv if argv is not None else sys.argv[1:])
        print(f"record written to {write_record(args.record, result, read, command, started)}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
