"""Whole decode and verification steps of a real model on this checkout's C++ kernels against another revision's,
taking turns in one process, each beside its roofline.

Why: ``bench.kernel_timing --against`` times one kernel alone; what a kernel change is worth is what it does to a
whole step, where the linear layers, the attention, the row-wise kernels and Python's share of each step meet. On
the 2-core machines here the read bandwidth moves between processes by more than most changes are worth, so both
builds run here, step after step, over the same cache (``kernels.running`` points every kernel call at the
other build). The cache holds random keys and values (``bench.ar.random_cache``): a step's work does not depend
on them, so 32K needs no prefill. Each step's logits must be bitwise equal on the two builds (a kernel change
that moves bits changes the tokens) and the record says whether they were.

``--draft-weights int8`` times the steps of the model's quantised draft copy instead (``engine.quant.draft_copy``:
TriForce's level 2 and retrieval self-speculation draft with it), its roofline counting the int8 bytes;
``--draft-kv int8`` steps over a quantised retrieval view holding the whole context
(``caches.kv_quant.QuantizedRetrievalCache``, what those levels draft over), so with both a row is a level-2 step.

Not a test: ``python -m sparsedraft.bench.whole_steps --against REV``. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from types import SimpleNamespace

import torch

from ..engine import kernels, weights
from ..engine.machine import peak_gflops, provenance
from ..caches.kv_quant import DRAFT_KV, QuantizedRetrievalCache, check_draft_kv
from ..engine.quant import DRAFT_WEIGHTS, check_draft_weights, draft_copy
from ..engine.roofline import measure_read_bandwidth, step_cost
from ..engine.runtime import DTYPES, dtype_name
from ..errors import exit_with, require
from .ar import random_cache
from .kernel_timing import then_label
from .kernels_at import kernels_at, revision
from .record import finish_module
from .steps import StepRow, draft_cost, step_row, steps_table
from .timing import interleaved_runs, median_ms, seconds_of


def quantized_view(model, full, draft_kv: str, room: int) -> QuantizedRetrievalCache:
    """A ``draft_kv`` retrieval view holding all of ``full``'s tokens, with room for ``room`` new ones (chunks of
    one token, so any context fits: a view that keeps every token lays them out the same whatever the chunk)."""
    cfg = model.cfg
    view = QuantizedRetrievalCache(cfg, full.length, 1, room, draft_kv=draft_kv, dtype=model.dtype,
                                   device=model.device, allow_full=True)
    queries = torch.randn(cfg.num_layers, 1, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    view.build(full, {layer: q.to(model.dtype) for layer, q in enumerate(queries)})
    return view


def time_steps(model, context: int, tokens: list[int], against, read_bytes_per_s: float, peak: float,
               warmup: int = 1, repeats: int = 5, draft_weights: str = "same", draft_kv: str = "same") -> list[dict]:
    """For each step size in ``tokens``: one forward over ``context`` random cached tokens (rolled back after
    each) on this build and on ``against`` = (module, commit), interleaved; rows with ms, roofline and whether
    the two builds' logits were bitwise equal. ``draft_weights``: time the model's draft copy with those
    weights instead; ``draft_kv`` other than "same": over a view of the cache stored that way."""
    old, sha = against
    cache = random_cache(model, context, max(tokens))
    if draft_kv != "same":
        cache = quantized_view(model, cache, draft_kv, max(tokens))
    size = model.dtype.itemsize
    model = draft_copy(model, draft_weights)
    batch = torch.randint(0, model.cfg.vocab_size, (1, max(tokens)), generator=torch.Generator().manual_seed(0))
    dtype = dtype_name(model.dtype)
    rows = []
    for t in tokens:
        def step():
            logits = model(batch[:, :t], cache=cache)
            cache.rollback(t)
            return logits

        def step_then():
            with kernels.running(old):
                return step()

        same = torch.equal(step(), step_then())

        runs = interleaved_runs({"kernels": seconds_of(step), then_label(sha): seconds_of(step_then)}, warmup,
                                repeats)
        name = "decode" if t == 1 else f"verify-{t}"
        for method, seconds in runs.items():
            cost = draft_cost(step_cost(model.cfg, context, t, size), model.cfg,
                              SimpleNamespace(draft_weights=draft_weights, draft_kv=draft_kv), size)
            row = step_row(name, dtype, median_ms(seconds), cost, read_bytes_per_s, peak)
            rows.append({"method": method, **asdict(row), "draft_weights": draft_weights, "draft_kv": draft_kv,
                         "same_logits_as_against": same})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, metavar="REV",
                        help="the git commit whose kernels take turns with this checkout's")
    parser.add_argument("--model", default="smollm2-135m-yarn32k", help="short name, .gguf, folder or HF id")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--context", type=int, nargs="+", default=[8000])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 7])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--draft-weights", default="same", choices=DRAFT_WEIGHTS,
                        help="time the model's draft copy with these weights (TriForce's level 2: int8)")
    parser.add_argument("--draft-kv", default="same", choices=DRAFT_KV,
                        help="step over a retrieval view of the context stored this way (TriForce's level 2: int8)")
    parser.add_argument("--record", default="", metavar="PATH.json",
                        help="also write the rows as a results record (docs/results/)")
    args = parser.parse_args(argv)
    require(not args.record or args.record.endswith(".json"), f"--record takes a .json path, got {args.record!r}")
    require(all(t >= 1 for t in args.tokens) and args.repeats >= 1,
            f"--tokens must be >= 1 and --repeats >= 1, got {args.tokens} and {args.repeats}")
    cfg = weights.load_config(args.model)
    check_draft_weights(args.draft_weights, cfg)
    check_draft_kv(args.draft_kv, cfg)
    limit = cfg.max_position_embeddings
    require(max(args.context) + max(args.tokens) <= limit,
            f"context {max(args.context)} + {max(args.tokens)} tokens exceeds {args.model}'s {limit} positions"
            f"{weights.longer_context_hint(args.model, max(args.context) + max(args.tokens))}")
    revision(args.against)  # a commit that is not there is refused before the builds
    require(kernels.available(), "the C++ kernels are unavailable here; there is nothing to compare")
    against = kernels_at(args.against)
    started = provenance()
    model = weights.load_model(args.model, DTYPES[args.dtype]).eval()
    read = measure_read_bandwidth()
    peak = peak_gflops([args.dtype])[args.dtype]
    with torch.inference_mode():  # steps take the kernels only without autograd, as decoding runs them
        rows = [row for context in args.context
                for row in time_steps(model, context, args.tokens, against, read, peak, repeats=args.repeats,
                                      draft_weights=args.draft_weights, draft_kv=args.draft_kv)]
    print(f"kernels: {kernels.path()}; read {read / 1e9:.1f} GB/s, {args.dtype} peak {peak:.1f} GFLOP/s; "
          f"against {against[1][:10]}")
    for method in dict.fromkeys(r["method"] for r in rows):
        print(method)
        print(steps_table([_step(r) for r in rows if r["method"] == method]))
    print("logits bitwise equal on both builds:", all(r["same_logits_as_against"] for r in rows))
    result = {"bench": "whole_steps", "model": args.model, "draft_weights": args.draft_weights,
              "draft_kv": args.draft_kv,
              "kernels": kernels.path(), "against": against[1],
              "peak_gflops": peak, "rows": rows}
    finish_module(args.record, "whole_steps", argv, result, started, read / 1e9)


def _step(row: dict) -> StepRow:
    return StepRow(**{k: v for k, v in row.items() if k in StepRow.__dataclass_fields__})


if __name__ == "__main__":
    exit_with(main)
