"""TriForce Fig. 1's three levels timed on one device with random weights, beside the roofline.

A decode step reads the same bytes whatever the weights hold, so the paper's
models are built from their configs (:data:`sparsedraft.engine.roofline.MODELS`)
with random weights, straight on the device in the check's dtype (built on
the meta device, then materialised: a 7B model never exists on the CPU).
The target's full cache is filled with random keys and values through the
cache protocol rather than by a 122K-token prefill, which would take longer
than the whole check and give values no more meaningful; the draft's
streaming cache is filled by a real prefill (it is small).

Each level is timed three ways, one token per step, each step rolled back so
every step sees the same context: the library's cache (``eager_ms``), its
static-shape counterpart (:mod:`sparsedraft.caches.static`, ``static_ms``) and
that cache under a CUDA graph (``graph_ms``, CUDA only). Steps are timed by a
:class:`Backend`, so the tests run all of this on CPU with tiny configs and
a fake clock. The retrieval level also times its two GPU strategies
(:mod:`sparsedraft.caches.indexed`): gathering the selection into the budget
buffer, dense attention over that buffer, and FlashInfer's indexed decode
over the full cache when ``flashinfer`` is importable.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from ..caches import RetrievalCache, StreamingCache
from ..caches.indexed import (FlashInferIndexedDecode, chunk_tokens, flashinfer_available, gather_tokens,
                              indexed_attention)
from ..caches.static import StaticFullCache, StaticRetrievalCache, StaticStreamingCache
from ..engine.cache import KVCache
from ..engine.config import ModelConfig
from ..engine.cudagraph import GraphedStep, next_positions
from ..engine.model import Transformer
from ..engine.prefill import prefill
from ..engine.roofline import FIG1_PAPER, GIB, bytes_per_token, kv_bytes, measure_read_bandwidth, parameter_count
from ..engine.rope import Rotary
from ..engine.runtime import synchronize
from ..errors import require

FULL, RETRIEVAL, DRAFT = (setting for setting, *_ in FIG1_PAPER)
PAPER_MS = {setting: ms for setting, _, _, _, ms in FIG1_PAPER}


class Backend(Protocol):
    """What the check asks of the machine (a fake one drives the tests)."""

    def free_bytes(self, device: torch.device) -> int: ...

    def bandwidth(self, device: torch.device) -> float: ...  # bytes per second, a pure read

    def median_ms(self, step: Callable[[], None], device: torch.device, warmup: int, repeats: int,
                  inner: int) -> float: ...


class DeviceBackend:
    """The machine at hand: free device memory, measured read bandwidth, synchronised step times."""

    def free_bytes(self, device: torch.device) -> int:
        require(device.type == "cuda", f"free memory is read from CUDA only, got device {device}")
        return torch.cuda.mem_get_info(device)[0]

    def bandwidth(self, device: torch.device) -> float:
        return measure_read_bandwidth(device)

    def median_ms(self, step: Callable[[], None], device: torch.device, warmup: int, repeats: int,
                  inner: int) -> float:
        """Median over ``repeats`` of the mean time of ``inner`` back-to-back steps, between device syncs."""
        for _ in range(warmup):
            step()
        times = []
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            for _ in range(inner):
                step()
            synchronize(device)
            times.append(1000 * (time.perf_counter() - start) / inner)
        return statistics.median(times)


@dataclass(frozen=True)
class StepTiming:
    warmup: int = 3  # untimed steps (the graph is captured in the first)
    repeats: int = 10  # timed groups; the median group is reported
    inner: int = 10  # steps per timed group (launch-bound steps need several to rise above timer noise)


@dataclass
class LevelRow:
    level: str  # Fig. 1's setting
    model: str
    context: int  # tokens a step attends to (full cache: the context; retrieval: the budget; draft: sink + window)
    eager_ms: float | None  # one step over the library's cache
    static_ms: float | None  # over the static-shape cache, eager
    graph_ms: float | None  # over the static-shape cache, replayed from a CUDA graph (None without CUDA)
    bytes_read: int  # weights + KV one step reads (roofline.bytes_per_token)
    roofline_ms: float  # bytes_read / the measured read bandwidth
    datasheet_ms: float | None  # bytes_read / the device's datasheet bandwidth, when the device is known
    paper_ms: float  # TriForce Fig. 1 (A100)
    notes: list[str] = field(default_factory=list)


def fit_context(cfg: ModelConfig, want: int, free_bytes: int, dtype_bytes: int, extra_bytes: int = 0,
                multiple: int = 1024) -> tuple[int, str | None]:
    """Longest full-cache context <= ``want`` that fits ``free_bytes`` beside the weights and ``extra_bytes``.

    Keeps a reserve of 4 GiB plus 5% of what is free for activations, the
    CUDA context and allocator slack. Returns (context, a note when the
    context was scaled down, else None); raises when not even ``multiple``
    tokens fit.
    """
    reserve = 4 * GIB + free_bytes // 20
    room = free_bytes - parameter_count(cfg) * dtype_bytes - extra_bytes - reserve
    per_token = kv_bytes(cfg, 1, dtype_bytes)
    most = max(room, 0) // per_token // multiple * multiple
    require(most >= multiple,
            f"{free_bytes / GIB:.1f} GiB free cannot hold the weights ({parameter_count(cfg) * dtype_bytes / GIB:.1f} "
            f"GiB) and {multiple} tokens of KV cache; free device memory or use a smaller model")
    if most >= want:
        return want, None
    return most, (f"full cache scaled from {want} to {most} tokens: {free_bytes / GIB:.1f} GiB free holds the "
                  f"weights ({parameter_count(cfg) * dtype_bytes / GIB:.1f} GiB), "
                  f"{per_token * most / GIB:.1f} GiB of KV and a {reserve / GIB:.1f} GiB reserve")


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Transformer:
    """A model of ``cfg`` with weights ~ N(0, 0.02) and unit norms, allocated only on ``device``."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(cfg).to(device)  # fp32 frequencies, computed (to_empty left garbage)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=generator)
    return model.eval()


@torch.inference_mode()
def fill_random(cache: KVCache, cfg: ModelConfig, tokens: int, chunk: int, dtype: torch.dtype,
                device: torch.device, seed: int = 0) -> None:
    """Append ``tokens`` random keys and values through the cache protocol, ``chunk`` tokens per step."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        cache.begin(next_positions(cache, n, 1, device))
        for layer in range(cfg.num_layers):
            shape = (1, cfg.num_kv_heads, n, cfg.head_dim)
            cache.attend(layer, torch.randn(shape, generator=generator, device=device, dtype=dtype),
                         torch.randn(shape, generator=generator, device=device, dtype=dtype))
        cache.end()


def decode_step(model: Transformer, cache: KVCache, ids: torch.Tensor,
                graph: GraphedStep | None = None) -> Callable[[], None]:
    """One forward of ``ids`` over ``cache`` (through ``graph`` when given), rolled back."""

    forward = graph if graph is not None else (lambda x: model(x, cache=cache))

    @torch.inference_mode()
    def step() -> None:
        forward(ids)
        cache.rollback(ids.shape[1])
    return step


class LevelTimer:
    """Times steps of one device for the check: eager, static and graphed, with shared settings."""

    def __init__(self, backend: Backend, device: torch.device, timing: StepTiming, bandwidth: float,
                 datasheet_gb_s: float | None):
        self.backend, self.device, self.timing = backend, device, timing
        self.bandwidth, self.datasheet_gb_s = bandwidth, datasheet_gb_s

    def ms(self, step: Callable[[], None]) -> float:
        t = self.timing
        return self.backend.median_ms(step, self.device, t.warmup, t.repeats, t.inner)

    def graph_ms(self, model: Transformer, cache: KVCache, ids: torch.Tensor) -> float | None:
        if self.device.type != "cuda":
            return None
        return self.ms(decode_step(model, cache, ids, GraphedStep(model, cache, ids.shape[1])))

    def row(self, level: str, name: str, cfg: ModelConfig, context: int, dtype_bytes: int, eager: float | None,
            static: float | None, graph: float | None, notes: list[str]) -> LevelRow:
        n = bytes_per_token(cfg, context, dtype_bytes)
        sheet = None if self.datasheet_gb_s is None else n / (self.datasheet_gb_s * 1e6)
        return LevelRow(level, name, context, eager, static, graph, n, 1000 * n / self.bandwidth, sheet,
                        PAPER_MS[level], notes)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def draft_level(timer: LevelTimer, name: str, cfg: ModelConfig, dtype: torch.dtype, sink: int, window: int,
                spec_slots: int, prompt_tokens: int, seed: int = 0) -> LevelRow:
    """The draft over a StreamingLLM cache (sink + window), filled by a real prefill of random tokens."""
    device = timer.device
    model = random_model(cfg, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_tokens), generator=gen).to(device)
    ids = prompt[:, -1:]
    cache = StreamingCache(cfg, sink, window, spec_slots, dtype=dtype, device=device, rotary=model.rotary,
                           positions="cache")
    prefill(model, cache, prompt)
    eager = timer.ms(decode_step(model, cache, ids))
    del cache
    static = StaticStreamingCache(cfg, sink, window, spec_slots, dtype=dtype, device=device, rotary=model.rotary,
                                  positions="cache")
    prefill(model, static, prompt, chunk=static.max_step)
    static_ms = timer.ms(decode_step(model, static, ids))
    graph_ms = timer.graph_ms(model, static, ids)
    notes = [f"{prompt_tokens}-token random prompt prefilled; keys re-rotated at cache positions (TriForce's draft)"]
    row = timer.row(DRAFT, name, cfg, sink + window, dtype.itemsize, eager, static_ms, graph_ms, notes)
    del model, static
    _free(device)
    return row


def retrieval_kernels(timer: LevelTimer, cfg: ModelConfig, full, view: RetrievalCache) -> dict:
    """Per decode step over all layers: gather the selection into a budget buffer, dense attention over it,
    and FlashInfer's indexed decode over the full cache (when importable). Milliseconds, plus the worst
    difference between each path's attention output and :func:`indexed_attention` on layer 0."""
    layers, device = range(cfg.num_layers), timer.device
    index = [chunk_tokens(view.chosen[layer], view.chunk_size) for layer in layers]
    selected = index[0].shape[-1]
    out_k, out_v = torch.empty_like(view.k[0]), torch.empty_like(view.v[0])
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(1, cfg.num_heads, cfg.head_dim, generator=gen, device=device, dtype=view.dtype)
    scale = cfg.head_dim ** -0.5
    grouped = q.reshape(1, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)

    def gather() -> None:
        for layer in layers:
            gather_tokens(full.k[layer], full.v[layer], index[layer], out_k, out_v)

    def dense() -> torch.Tensor:
        out = None
        for _ in layers:
            out = F.scaled_dot_product_attention(grouped, out_k[:, :, :selected], out_v[:, :, :selected], scale=scale)
        return out.reshape(q.shape)

    result = {"selected_tokens": selected, "gather_ms": timer.ms(gather), "dense_attention_ms": timer.ms(dense),
              "flashinfer_ms": None, "note": None}
    gather_tokens(full.k[0], full.v[0], index[0], out_k, out_v)
    reference = indexed_attention(q, full.k[0], full.v[0], index[0], scale)
    result["dense_max_abs_diff"] = float((dense() - reference).abs().max())
    if not flashinfer_available():
        result["note"] = "flashinfer is not importable here: indexed decode not timed"
        return result
    try:  # untested API surface (no FlashInfer where this was written): a failure is a note, not a lost part
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        decoders = [FlashInferIndexedDecode(index[layer], full.max_len, cfg.num_heads, cfg.head_dim, view.dtype,
                                            scale, workspace) for layer in layers]
        result["flashinfer_ms"] = timer.ms(
            lambda: [decoders[layer](q, full.k[layer], full.v[layer]) for layer in layers])
        result["flashinfer_max_abs_diff"] = float((decoders[0](q, full.k[0], full.v[0]) - reference).abs().max())
    except Exception as exc:  # noqa: BLE001
        result["note"] = f"FlashInfer indexed decode failed: {type(exc).__name__}: {exc}"
    return result


def target_levels(timer: LevelTimer, name: str, cfg: ModelConfig, dtype: torch.dtype, context: int, budget: int,
                  chunk_size: int, spec_slots: int, fill_chunk: int, static_full: bool,
                  seed: int = 0) -> tuple[list[LevelRow], dict]:
    """The target over its full cache of ``context`` tokens and over a retrieval cache of ``budget`` tokens.

    ``static_full`` also times the static-shape full cache (a second
    allocation of the whole cache, after the first is freed).
    """
    device = timer.device
    model = random_model(cfg, dtype, device, seed)
    ids = torch.randint(0, cfg.vocab_size, (1, 1), generator=torch.Generator().manual_seed(seed)).to(device)
    full = model.new_cache(context + spec_slots)
    fill_random(full, cfg, context, fill_chunk, dtype, device, seed)
    full_eager = timer.ms(decode_step(model, full, ids))
    gen = torch.Generator(device=device).manual_seed(seed)
    queries = {layer: torch.randn(1, cfg.num_heads, cfg.head_dim, generator=gen, device=device, dtype=dtype)
               for layer in range(cfg.num_layers)}
    view = RetrievalCache(cfg, budget, chunk_size, spec_slots, dtype=dtype, device=device)
    view.build(full, queries)
    view_eager = timer.ms(decode_step(model, view, ids))
    kernels = retrieval_kernels(timer, cfg, full, view)
    del view
    static_view = StaticRetrievalCache(cfg, budget, chunk_size, spec_slots, dtype=dtype, device=device)
    static_view.build(full, queries)
    view_static = timer.ms(decode_step(model, static_view, ids))
    view_graph = timer.graph_ms(model, static_view, ids)
    del static_view, full
    _free(device)
    full_static = full_graph = None
    full_notes = ["random keys and values (no prefill)"]
    if static_full:
        cache = StaticFullCache(cfg, context + spec_slots, dtype=dtype, device=device)
        fill_random(cache, cfg, context, fill_chunk, dtype, device, seed)
        full_static = timer.ms(decode_step(model, cache, ids))
        full_graph = timer.graph_ms(model, cache, ids)
        full_notes.append("the static-shape full cache attends to every slot under a positional mask")
        del cache
    else:
        full_notes.append("static-shape full cache skipped (time budget)")
    rows = [timer.row(FULL, name, cfg, context, dtype.itemsize, full_eager, full_static, full_graph, full_notes),
            timer.row(RETRIEVAL, name, cfg, budget, dtype.itemsize, view_eager, view_static, view_graph,
                      [f"chunk {chunk_size}, selection by random queries"])]
    del model
    _free(device)
    return rows, kernels

