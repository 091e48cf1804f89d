"""Time the C++ attention kernel against torch SDPA on SmolLM2-135M-shaped decode attention, and the kernel as
it runs (keys as lanes for steps of at most ``kernels.KEY_ROWS`` rows per KV head) against its rows-as-lanes
path alone, and, where bf16 attention runs on AMX tiles, against the same build's vector code. With
``--linear``, time instead the few-row linear kernel over every weight matrix of a SmolLM2-135M forward (30
layers' projections and the head, each its own matrix, so the weights come from memory) for steps of 1-16
rows of each ``--dtype``: torch's ``F.linear``, the kernel as it runs, on AVX2+FMA each of its two layouts past
eight rows forced (rows in pairs, all rows at once: ``kernels.use_pairs``), and for bf16 on AMX tiles the same
build's vector code, each beside its roofline time
max(weight bytes / read bandwidth, FLOPs / the dtype's peak), both measured in this process.

Not a test (a test never asserts a wall-clock time): ``python -m sparsedraft.bench.kernel_timing``.
Each step attends ``layers`` separate caches (so the KV comes from memory, as in a real forward),
with q folded to [B, KV, g*T, D] and, for T > 1, the bool mask model.attention builds; the kernel
gets the same q and cache views. Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ..engine.cpuinfo import cpu_flags
from ..engine.kernels import (KEY_ROWS, MAX_LINEAR_ROWS, attend, available, linear, on_tiles, pair_from, path,
                              use_pairs, use_tiles)
from ..engine.machine import best_isa, peak_gflops, provenance
from ..engine.roofline import measure_read_bandwidth
from ..errors import SparsedraftError, exit_with, require
from .kernels_at import kernels_at, revision
from .record import finish_module
from .timing import interleaved_runs, median_ms, seconds_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Against = tuple  # (module, commit): the kernels at another revision (kernels_at), timed beside these


def _caches(layers: int, kv: int, context: int, d: int, dtype: torch.dtype):
    slots = context + 64  # views into bigger buffers, like StaticCache
    return [(torch.randn(1, kv, slots, d, dtype=dtype)[:, :, :context],
             torch.randn(1, kv, slots, d, dtype=dtype)[:, :, :context]) for _ in range(layers)]


def time_step(layers: int = 30, heads: int = 9, kv: int = 3, d: int = 64, context: int = 8000, t: int = 1,
              dtype: str = "fp32", warmup: int = 2, repeats: int = 5, against: Against | None = None) -> list[dict]:
    """Median ms of one step's attention over ``layers`` layers, SDPA vs kernel (and the kernel at the
    ``against`` revision, taking turns with it), and KV GB/s read."""
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

    def vector_code():  # bf16 on the same build's vector code instead of AMX tiles
        before = use_tiles(False)
        try:
            return kernel()
        finally:
            use_tiles(before)

    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(sdpa(), kernel()))
    paths = {"sdpa": seconds_of(sdpa), "kernel": seconds_of(kernel), "kernel, rows as lanes": seconds_of(row_lanes)}
    same = None
    if against is not None:
        old, sha = against
        def kernel_then():
            return [old.attend(qg, k, v, scale, t, KEY_ROWS) for k, v in caches]
        same = all(torch.equal(a, b) for a, b in zip(kernel(), _called(kernel_then, sha, "attend")))
        paths[then_label(sha)] = seconds_of(kernel_then)
    if DTYPES[dtype] == torch.bfloat16 and on_tiles():
        paths["kernel, no tiles"] = seconds_of(vector_code)
    runs = interleaved_runs(paths, warmup, repeats)
    kv_bytes = layers * 2 * kv * context * d * caches[0][0].element_size()
    rows = []
    for name, seconds in runs.items():
        ms = median_ms(seconds)
        rows.append({"context": context, "T": t, "dtype": dtype, "method": name, "ms": round(ms, 2),
                     "kv_gb_s": round(kv_bytes / ms / 1e6, 1), "kv_mb": round(kv_bytes / 1e6, 1),
                     "max_abs_diff": diff, **({} if same is None else {"same_bits_as_against": same})})
    return rows


def then_label(sha: str) -> str:
    """The method name of the kernels at commit ``sha`` in a table built with ``--against``."""
    return f"kernel at {sha[:10]}"


def _called(fn, sha: str, what: str):
    """fn() once, with one clear error when the older build's ``what`` takes other arguments than this one's."""
    try:
        return fn()
    except TypeError as exc:
        raise SparsedraftError(f"--against: commit {sha[:12]}'s {what} takes other arguments than this build's "
                               f"({str(exc).splitlines()[0]}); pick a commit with the same interface") from exc


SMOLLM2_LINEARS = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # [N, K]


def time_linear(rows: int, layers: int = 30, vocab: int = 49152, warmup: int = 2, repeats: int = 5,
                read_gb_s: float = 0.0, peak_gflop_s: float = 0.0, dtype: str = "fp32",
                against: Against | None = None) -> list[dict]:
    """Median ms of one step's linear layers (``layers`` x SmolLM2's seven projections, then the head) for
    ``rows`` rows of ``dtype``, per path, with the roofline time when bandwidth and peak are given."""
    require(1 <= rows <= MAX_LINEAR_ROWS, f"rows must be in 1..{MAX_LINEAR_ROWS}, got {rows}")
    gen = torch.Generator().manual_seed(rows)
    weights = [torch.randn(n, k, generator=gen) / k ** 0.5 for _ in range(layers) for n, k in SMOLLM2_LINEARS]
    weights.append(torch.randn(vocab, 576, generator=gen) / 24)
    weights = [w.to(DTYPES[dtype]) for w in weights]
    xs = {k: torch.randn(rows, k, generator=gen).to(DTYPES[dtype]) for k in (576, 1536)}

    def run(fn):
        def timed():
            start = time.perf_counter()
            for w in weights:
                fn(xs[w.shape[1]], w)
            return time.perf_counter() - start
        return timed

    def under(use, on):  # the kernel with a switch (use_tiles, use_pairs) set for the call, then put back
        def call(x, w):
            before = use(on)
            try:
                return linear(x, w)
            finally:
                use(before)
        return call

    paths = {"torch F.linear": run(F.linear), "kernel": run(lambda x, w: linear(x, w))}
    if path().startswith("AVX2") and rows > pair_from():
        paths["kernel, paired"] = run(under(use_pairs, True))
        paths["kernel, unpaired"] = run(under(use_pairs, False))
    if dtype == "bf16" and on_tiles():
        paths["kernel, no tiles"] = run(under(use_tiles, False))
    same = None
    if against is not None:
        old, sha = against
        no_bias = torch.empty(0, dtype=DTYPES[dtype])
        x, w = xs[weights[0].shape[1]], weights[0]
        with torch.inference_mode():
            same = torch.equal(linear(x, w), _called(lambda: old.linear(x, w, no_bias), sha, "linear"))
        paths[then_label(sha)] = run(lambda x, w: old.linear(x, w, no_bias))
    with torch.inference_mode():
        runs = interleaved_runs(paths, warmup, repeats)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flops = 2 * rows * sum(w.numel() for w in weights)
    roof = max(nbytes / read_gb_s / 1e6 if read_gb_s else 0.0, flops / peak_gflop_s / 1e6 if peak_gflop_s else 0.0)
    out = []
    for name, seconds in runs.items():
        ms = median_ms(seconds)
        out.append({"rows": rows, "dtype": dtype, "method": name, "ms": round(ms, 2),
                    "gflop_s": round(flops / ms / 1e6, 1),
                    "weight_gb_s": round(nbytes / ms / 1e6, 1), "roofline_ms": round(roof, 2) if roof else None,
                    "over_roofline": round(ms / roof, 2) if roof else None,
                    **({} if same is None else {"same_bits_as_against": same})})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[8000, 32000])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES),
                        help="attention dtypes, or with --linear the rows' and weights' dtypes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--linear", type=int, nargs="*", metavar="ROWS", default=None,
                        help="time the few-row linear kernel instead, at these step sizes (default 1 2 4 8 16)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--against", default="", metavar="REV",
                        help="also time the kernels as they were at this git commit, built beside this checkout's "
                             "and taking turns with them in this process (an A/B the machine's drift between "
                             "processes cannot blur)")
    parser.add_argument("--record", default="", metavar="PATH.json",
                        help="also write the rows as a results record (docs/results/), with this process's read "
                             "bandwidth, the ISA and the commit")
    args = parser.parse_args(argv)
    require(not args.record or args.record.endswith(".json"), f"--record takes a .json path, got {args.record!r}")
    require(all(1 <= m <= MAX_LINEAR_ROWS for m in args.linear or []),
            f"--linear takes step sizes in 1..{MAX_LINEAR_ROWS}, got {args.linear}")
    if args.against:
        revision(args.against)  # a commit that is not there is refused before the builds
    if args.threads:
        torch.set_num_threads(args.threads)
    if not available():
        raise SystemExit("the C++ kernel is unavailable here; nothing to time")
    against = kernels_at(args.against) if args.against else None
    if args.linear is not None:
        return _main_linear(args, argv, against)
    started = provenance()
    rows = [row for context in args.context for dtype in args.dtype for t in args.tokens
            for row in time_step(context=context, t=t, dtype=dtype, repeats=args.repeats, against=against)]
    print(f"kernels: {path()}")
    print(f"{'context':>8} {'T':>3} {'dtype':>5} {'method':>21} {'ms':>8} {'KV GB/s':>8} {'KV MB':>7}")
    for row in rows:
        print(f"{row['context']:>8} {row['T']:>3} {row['dtype']:>5} {row['method']:>21} {row['ms']:>8.2f} "
              f"{row['kv_gb_s']:>8.1f} {row['kv_mb']:>7.1f}")
    result = {"bench": "kernel_timing", "threads": torch.get_num_threads(), "kernels": path(),
              **_against_field(against), "rows": rows}
    finish_module(args.record, 'kernel_timing', argv, result, started)


def _against_field(against: Against | None) -> dict:
    return {} if against is None else {"against": against[1]}


def _main_linear(args, argv: list[str] | None, against: Against | None) -> None:
    steps = args.linear or [1, 2, 4, 8, 16]
    started = provenance()
    read = measure_read_bandwidth() / 1e9
    peaks = peak_gflops(list(args.dtype))
    rows = [row for dtype in args.dtype for m in steps
            for row in time_linear(m, repeats=args.repeats, read_gb_s=read, peak_gflop_s=peaks[dtype], dtype=dtype,
                                   against=against)]
    shown = ", ".join(f"{d} peak {peaks[d]:.1f} GFLOP/s" for d in args.dtype)
    print(f"kernels: {path()}; read {read:.1f} GB/s, {shown}, {torch.get_num_threads()} threads")
    print(f"{'rows':>4} {'dtype':>5} {'method':>17} {'ms':>8} {'GFLOP/s':>8} {'W GB/s':>7} {'roofline':>8} "
          f"{'x roof':>6}")
    for row in rows:
        print(f"{row['rows']:>4} {row['dtype']:>5} {row['method']:>17} {row['ms']:>8.2f} {row['gflop_s']:>8.1f} "
              f"{row['weight_gb_s']:>7.1f} {row['roofline_ms']:>8.2f} {row['over_roofline']:>6.2f}")
    result = {"bench": "kernel_timing", "kind": "linear", "isa": best_isa(cpu_flags()), "read_gb_s": read,
              "peak_gflops": {d: round(peaks[d], 1) for d in args.dtype}, "threads": torch.get_num_threads(),
              "kernels": path(), **_against_field(against), "rows": rows}
    finish_module(args.record, 'kernel_timing', argv, result, started, read)


if __name__ == "__main__":
    exit_with(main)
