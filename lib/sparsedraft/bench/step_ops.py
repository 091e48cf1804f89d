"""What the C++ row-wise step operations buy: each operation (RMSNorm, rotary embedding) on
SmolLM2-135M's shapes in torch's form and as the kernel, then a whole SmolLM2 decode and verification step
three ways, interleaved in one process: with the step kernels and each layer's two fused calls
(``kernels.layer_head`` / ``layer_tail``), with the step kernels called one by one from Python (the fused
calls off), and with torch's ops (``model.is_step`` forced false). ``--dtype`` and ``--draft-weights`` time a
quantised draft copy, such as TriForce's int8 level 2.

Why a bench: on a 2-core CPU a torch op costs microseconds of dispatch whatever its size, and a decode step
runs ~13 of them per layer around its matmuls; this is the figure that says how much of a step that was.
Not a test (a test never asserts a wall-clock time): ``python -m sparsedraft.bench.step_ops``. Prints a
table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch

from ..caches.kv_quant import DRAFT_KV, check_draft_kv
from ..engine import kernels, stack
from ..engine import model as engine
from ..engine.cpuinfo import cpu_flags
from ..engine.machine import best_isa, provenance
from ..engine.quant import check_draft_weights, draft_copy
from ..engine.runtime import DTYPES
from ..engine.rope import Angles
from ..engine.weights import load_config, load_model
from ..errors import exit_with, require
from .ar import random_cache
from .record import finish_module
from .timing import interleaved_runs, median_ms, seconds_of
from .whole_steps import quantized_view



def time_ops(repeats: int = 5, calls: int = 2000) -> list[dict]:
    """Median µs per call of each row-wise op on one decode row of SmolLM2-135M, torch form vs kernel."""
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(1, 1, 576, generator=gen), torch.ones(576)
    q = torch.randn(1, 1, 9, 64, generator=gen)  # [B, T, H, D], as the step has it before the transpose
    angles = Angles(torch.randn(1, 1, 1, 64, generator=gen), torch.randn(1, 1, 1, 64, generator=gen))
    pairs = {"rms_norm": (lambda: engine.rms_norm(x, weight, 1e-5), lambda: kernels.rms_norm(x, weight, 1e-5)),
             "rope": (lambda: angles.apply(q.transpose(1, 2)), lambda: kernels.rope(q, *angles.rows()))}
    runners = {f"{op} {form}": seconds_of(fn, calls) for op, (torch_fn, kernel_fn) in pairs.items()
               for form, fn in (("torch", torch_fn), ("kernel", kernel_fn))}
    with torch.inference_mode():
        runs = interleaved_runs(runners, 1, repeats)
    return [{"op": name.split()[0], "form": name.split()[1], "us": round(median_ms(s) * 1000 / calls, 2)}
            for name, s in runs.items()]


def time_steps(model: str = "smollm2-135m", context: int = 512, tokens: tuple[int, ...] = (1, 7),
               repeats: int = 9, dtype: str = "fp32", draft_weights: str = "same",
               draft_kv: str = "same") -> list[dict]:
    """Median ms of a step of each length over a cache of ``context`` random keys and values (the work
    does not depend on the values, so no prefill; ``draft_kv`` other than "same": a retrieval view of them
    stored that way, as TriForce's level 2 reads): with the whole layer stack in one call, with the fused
    layer calls, with the step kernels one call at a time, and with torch's ops."""
    full = load_model(model, DTYPES[dtype]).eval()
    cache = random_cache(full, context, max(tokens))
    if draft_kv != "same":
        cache = quantized_view(full, cache, draft_kv, max(tokens))
    target = draft_copy(full, draft_weights)
    gen = torch.Generator().manual_seed(1)
    no_fusion = lambda *a: None  # noqa: E731 - engine._step_linears saying no layer takes the fused calls
    forms = {"stack": (engine.is_step, engine._step_linears, True),
             "on": (engine.is_step, engine._step_linears, False), "layers": (engine.is_step, no_fusion, False),
             "off": (lambda x: False, engine._step_linears, False)}
    rows = []
    with torch.inference_mode():
        for t in tokens:
            new = torch.randint(0, target.cfg.vocab_size, (1, t), generator=gen)

            def step(form: str):
                is_step, step_linears, stacked = forms[form]

                def timed():
                    cache.rollback(cache.length - context if draft_kv == "same" else cache.spec)
                    before = stack.stack_steps(stacked)
                    try:
                        with mock.patch.object(engine, "is_step", is_step), \
                                mock.patch.object(engine, "_step_linears", step_linears):
                            start = time.perf_counter()
                            target(new, cache=cache, last_only=True)
                            return time.perf_counter() - start
                    finally:
                        stack.stack_steps(before)
                return timed

            runs = interleaved_runs({form: step(form) for form in forms}, 2, repeats)
            whole, on, layers, off = (median_ms(runs[form]) for form in forms)
            rows.append({"model": model, "dtype": dtype, "draft_weights": draft_weights, "draft_kv": draft_kv,
                         "context": context, "tokens": t, "stack_ms": round(whole, 2), "kernels_ms": round(on, 2),
                         "python_layers_ms": round(layers, 2), "torch_ops_ms": round(off, 2),
                         "saved": round(1 - on / off, 3), "layer_calls_saved": round(1 - on / layers, 3),
                         "stack_saved": round(1 - whole / on, 3)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=512, help="cached tokens under the timed steps")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 7], help="step lengths (1: a decode)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    parser.add_argument("--draft-weights", default="same",
                        help="time a draft copy of the model with these weights (same, bf16, int8, w8a8, int4)")
    parser.add_argument("--draft-kv", default="same", choices=DRAFT_KV,
                        help="step over a retrieval view of the context stored this way (TriForce's level 2)")
    parser.add_argument("--record", default="", metavar="PATH.json",
                        help="also write the rows as a results record (docs/results/) with the read bandwidth, ISA "
                             "and commit")
    args = parser.parse_args(argv)
    require(not args.record or args.record.endswith(".json"), f"--record takes a .json path, got {args.record!r}")
    require(all(1 <= t <= engine.KERNEL_MAX_TOKENS for t in args.tokens),
            f"--tokens takes step lengths in 1..{engine.KERNEL_MAX_TOKENS}, got {args.tokens}")
    require(args.context >= 8, f"--context must be at least 8 tokens, got {args.context}")
    check_draft_weights(args.draft_weights)
    check_draft_kv(args.draft_kv, load_config(args.model))
    if not kernels.available():
        raise SystemExit("the C++ kernels are unavailable here; nothing to time")
    started = provenance()
    ops = time_ops()
    steps = time_steps(args.model, args.context, tuple(args.tokens), args.repeats, args.dtype, args.draft_weights,
                       args.draft_kv)
    print(f"kernels: {kernels.path()}, {torch.get_num_threads()} threads")
    for row in ops:
        print(f"{row['op']:>9} {row['form']:>7} {row['us']:>8.1f} us")
    for row in steps:
        print(f"{row['model']} {row['dtype']} ({row['draft_weights']} weights, {row['draft_kv']} KV) step of "
              f"{row['tokens']} at {row['context']}: {row['stack_ms']:.1f} ms with the layer stack in one call "
              f"({100 * row['stack_saved']:.0f}% under the fused layer calls), "
              f"{row['kernels_ms']:.1f} ms with the kernels and fused layer calls, "
              f"{row['python_layers_ms']:.1f} ms calling the kernels one by one "
              f"({100 * row['layer_calls_saved']:.0f}% saved), {row['torch_ops_ms']:.1f} ms with torch's ops "
              f"({100 * row['saved']:.0f}% saved)")
    result = {"bench": "step_ops", "isa": best_isa(cpu_flags()), "kernels": kernels.path(),
              "threads": torch.get_num_threads(), "ops": ops, "rows": steps}
    finish_module(args.record, 'step_ops', argv, result, started)


if __name__ == "__main__":
    exit_with(main)
