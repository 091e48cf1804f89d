"""One decoder-only transformer forward for Llama, Mistral, Qwen2 and Qwen3.

``forward(tokens, positions, cache)`` is the whole interface: positions are
explicit and the cache (see :mod:`sparsedraft.engine.cache`) decides which keys and
values each layer attends to and with what mask. Families differ only by
config switches (qkv bias, q/k norm, sliding window, tied head).

Grouped-query attention never copies KV heads: the queries of a group are
folded into the sequence axis, ``[B, H, T, D] -> [B, kv_heads, group*T, D]``,
so one attention call per layer reads each cached key once. A
:class:`Capture` records post-RoPE queries and/or attention weights of chosen
layers through the same attention function (weights force the explicit
softmax path, which the tests check against the fused one).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import require
from . import kernels, stack
from .cache import CAUSAL, Causal, Int8Slots, KVCache, RowCaches, SequenceView, StaticCache, causal_tail
from .config import ModelConfig
from .quant import Int8Linear, RoundedInt8Linear
from .rope import Rotary

try:  # optional CUDA kernel; SDPA is the path the tests cover
    from flash_attn import flash_attn_func as _flash_attn_func
except ImportError:  # pragma: no cover - depends on the machine
    _flash_attn_func = None


@dataclass
class Capture:
    """Ask the forward to record per-layer tensors (for the analysis notebooks).

    queries: post-RoPE queries [B, H, T, D]; weights: softmax attention
    [B, H, T, S] over the keys the cache exposed; key_positions are not
    needed because caches expose keys in slot order. ``hidden`` asks for the
    top layer's output before the final norm (what a feature drafter reads),
    kept in ``features`` [B, T, hidden] for every token of the step;
    ``hidden_layers`` (lower layer indices, ascending) puts those layers'
    outputs before it, ``features`` [B, T, (len(hidden_layers) + 1) * hidden]:
    the low, middle and top features an EAGLE-3 head fuses.
    """

    layers: set[int]
    weights: bool = False
    hidden: bool = False
    hidden_layers: tuple[int, ...] = ()
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    attention: dict[int, torch.Tensor] = field(default_factory=dict)
    features: torch.Tensor | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_step(x):  # x [B, T, ...]: a decode or verification step's rows, one C++ call
            return kernels.rms_norm(x.contiguous(), self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in torch's ops, Hugging Face's order (prefill chunks, training; the kernels' oracle)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | Causal | None,
              scale: float, need_weights: bool = False):
    """q [B, H, T, D], k/v [B, KV, S, D], mask None, :data:`~sparsedraft.engine.cache.CAUSAL` or bool [B, 1, T, S]
    (or [B, KV, T, S]: one mask per KV head, shared by its group's query heads).

    Returns (out [B, H, T, D], weights [B, H, T, S] or None). Paths, first that applies:
    explicit softmax when weights are asked for; flash-attn on CUDA (fp16/bf16);
    on CPU without autograd, a :data:`CAUSAL` step of at most
    :data:`KERNEL_MAX_TOKENS` new tokens (decode, verification) through
    the compiled kernel, which reads each key once for every query of its group
    and gives each query the same bits whatever the step's length (what keeps
    speculative greedy output equal to plain greedy output in bf16); a bf16
    causal prefill chunk through the same kernel in slices where bf16 attention
    runs on AVX512-BF16 dot products (:func:`attend_slices`); SDPA
    otherwise (causal prefill chunks without a mask tensor, see :func:`_sdpa`). Keys and values given as
    :class:`~sparsedraft.engine.cache.Int8Slots` (a quantised draft view) take the kernel's int8 form on
    such a step, and are made dense for every other path.
    """
    if isinstance(k, Int8Slots):
        t = q.shape[2]
        if mask is CAUSAL and not need_weights and _kernel_fits(q, t):
            b, h, _, d = q.shape
            kv = k.codes.shape[1]
            out = kernels.attend_int8(q.reshape(b, kv, (h // kv) * t, d), k.codes, k.scale, v.codes, v.scale,
                                      k.tail, v.tail, scale, t)
            return out.reshape(b, h, t, d), None
        k, v = k.dense(), v.dense()
    b, h, t, d = q.shape
    kv = k.shape[1]
    if need_weights:
        if mask is CAUSAL:
            mask = causal_tail(t, k.shape[2], q.device)
        g = h // kv
        qg = q.reshape(b, kv, g * t, d)
        scores = (qg @ k.transpose(-1, -2)).float() * scale
        if mask is not None:
            mg = mask[:, :, None].expand(b, -1, g, -1, -1).reshape(b, mask.shape[1], g * t, -1)
            scores = scores.masked_fill(~mg, float("-inf"))
        w = scores.softmax(-1)
        out = (w.to(v.dtype) @ v).reshape(b, h, t, -1)
        return out, w.reshape(b, h, t, -1)
    if mask is CAUSAL or mask is None:
        causal = mask is CAUSAL and t > 1
        if _flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            out = _flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                                   causal=causal)  # bottom-right aligned: the CAUSAL convention
            return out.transpose(1, 2), None
        if mask is CAUSAL and _kernel_fits(q, t):
            out = kernels.attend(q.reshape(b, kv, (h // kv) * t, d), k, v, scale, t)
            return out.reshape(b, h, t, d), None
        if causal and _slices_fit(q, k, v):
            return attend_slices(q, k, v, scale), None
        return _sdpa(q, k, v, (t, k.shape[2]) if causal else None, scale), None
    return _sdpa(q, k, v, mask, scale), None


KERNEL_MAX_TOKENS = 16  # longest step (gamma + 1 tokens) sent to the C++ kernel; longer ones are prefill chunks


def is_step(x: torch.Tensor) -> bool:
    """Whether ``x`` [B, T, ...] is a decode or verification step (at most :data:`KERNEL_MAX_TOKENS` tokens,
    CPU, no autograd) whose RMSNorms and rotary embeddings run as one C++ call each
    (``kernels/step_pointwise.cpp``): torch spends microseconds of dispatch per op whatever its size, and
    those are ~13 ops per layer (``python -m sparsedraft.bench.step_ops`` times both forms). The rule
    depends on T alone, as the matmuls' and attention's do (:func:`_kernel_fits`), so a row gets the same
    bits in a decode, a verification and a batch; prefill chunks and training keep torch."""
    return x.dim() >= 3 and _kernel_fits(x, x.shape[1])


def _kernel_fits(q: torch.Tensor, t: int) -> bool:
    """A step the C++ kernels take: at most KERNEL_MAX_TOKENS new tokens, and ``kernels.step_fits`` (CPU,
    fp32/bf16, no autograd, built)."""
    return t <= KERNEL_MAX_TOKENS and _step_fits(q)


# kernels.step_fits for the tensors of the forward under way, asked once by run_layers when autograd is off:
# every tensor of such a forward shares its input's device, dtype and (absent) autograd, and asking per call
# (~10 per layer, each reading the environment for SPARSEDRAFT_KERNELS) cost ~3% of a draft step. None: ask.
_STEP_FITS: contextvars.ContextVar[bool | None] = contextvars.ContextVar("sparsedraft_step_fits", default=None)


def _step_fits(x: torch.Tensor) -> bool:
    decided = _STEP_FITS.get()
    return kernels.step_fits(x) if decided is None else decided


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | tuple[int, int] | None,
          scale: float) -> torch.Tensor:
    """torch SDPA; ``mask`` None, bool [B, 1, T, S] or (T, S) for :data:`CAUSAL`.

    One query token folds its group into the sequence axis ([B, H, 1, D] ->
    [B, KV, g, D]) so each key is read once; longer steps keep their heads
    (``enable_gqa``) so the mask broadcasts over them instead of being copied
    g times. A causal step whose new tokens are all the keys (the first
    prefill chunk) passes ``is_causal`` and no mask; a later chunk on CPU runs
    :func:`_causal_split`, elsewhere one additive float mask per forward,
    shared by every layer (:func:`_additive`).
    """
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    if isinstance(mask, torch.Tensor) and 1 < mask.shape[1] < h:  # per KV head: each query head takes its group's
        mask = mask.repeat_interleave(h // mask.shape[1], dim=1)
    if t == 1 and mask is None:
        out = F.scaled_dot_product_attention(q.reshape(b, kv, h // kv, d), k, v, scale=scale)
        return out.reshape(b, h, t, d)
    if isinstance(mask, tuple) and t == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=kv != h)
    if isinstance(mask, tuple) and _split_fits(q):
        return _causal_split(q, k, v, scale)
    bias = None if mask is None else _additive(mask, q.dtype, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=kv != h)


_SLICES = True  # bf16 prefill chunks through the kernel on AVX512-BF16 dot products; prefill_slices() switches it


def prefill_slices(on: bool) -> bool:
    """Let a bf16 causal prefill chunk run through the attention kernel in slices where bf16 attention runs
    on AVX512-BF16 dot products (the default), or keep torch's CPU flash kernel, so a bench can time both in
    one process. Returns the previous choice."""
    global _SLICES
    before, _SLICES = _SLICES, bool(on)
    return before


def sliced_prefill(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether a prefill in ``dtype`` on ``device`` runs its chunks' attention through :func:`attend_slices`
    (:func:`_slices_fit` for its tensors). Its bits differ from flash's, so a prefill's identity names it."""
    return _SLICES and dtype == torch.bfloat16 and device.type == "cpu" and kernels.on_dots(head_dim)


def _slices_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """A causal chunk :func:`attend_slices` takes: bf16, keys in rows of head_dim values, and a build whose
    bf16 attention of this head size runs on AVX512-BF16 dot products, where it was measured ahead.
    Elsewhere torch's flash kernel stays: in fp32 it runs a 1,024-query chunk at ~160 GFLOP/s on a Zen 4
    EPYC against the kernel's ~145 (scratch, in the message of the commit that added the slices), and on
    an AMX machine it ran a bf16 prefill's attention at ~520 GFLOP/s (``prefill-profile-8k-bf16.json``)
    where the tile path's 32-query calls have not been timed."""
    return (sliced_prefill(q.dtype, q.device, q.shape[-1]) and _step_fits(q)
            and all(x.stride(3) == 1 and x.stride(2) == x.shape[3] for x in (k, v)))


def attend_slices(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """:data:`CAUSAL` attention of T queries [B, H, T, D] over k, v [B, KV, S, D] (the T new keys last) as
    kernel calls of ``kernels.MAX_TOKENS`` queries, each over the keys its last query sees. The kernel gives
    a row the same bits whatever the call's length, so each prompt token's attention is what a one-token
    step over the same keys computes. On AVX512-BF16 dot products this runs a 1,024-query chunk at 8K about
    1.9x faster than torch's flash kernel, which is most of a bf16 prefill (docs/prefill.md)."""
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = h // kv
    out = torch.empty_like(q)
    with torch.profiler.record_function("sparsedraft::attend_slices"):  # its time in a profile (not an ATen op)
        for start in range(0, t, kernels.MAX_TOKENS):
            stop = min(start + kernels.MAX_TOKENS, t)
            n, seen = stop - start, s - t + stop
            rows = q[:, :, start:stop].reshape(b, kv, g * n, d)  # row i * n + j: head i of the group, token j
            out[:, :, start:stop] = kernels.attend(rows, k[:, :, :seen], v[:, :, :seen], scale, n).reshape(b, h, n, d)
    return out


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _split_fits(q: torch.Tensor) -> bool:
    """A later prefill chunk :func:`_causal_split` takes: CPU flash kernel present, fp32/bf16, no autograd."""
    return (_FLASH_CPU is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and not (torch.is_grad_enabled() and q.requires_grad))


def _causal_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """:data:`CAUSAL` attention of T new queries over S > T keys without a mask tensor: the S - T earlier
    keys unmasked plus the T new ones with ``is_causal`` (the flash kernel skips the blocks above the
    diagonal), the two results merged by their log-sum-exps in fp32. At 8K this is 17% (fp32) to 37%
    (bf16) faster than one call reading a [T, S] additive mask and scoring every masked key."""
    t, s = q.shape[2], k.shape[2]
    old, old_lse = _FLASH_CPU(q, k[:, :, :s - t], v[:, :, :s - t], scale=scale)[:2]
    new, new_lse = _FLASH_CPU(q, k[:, :, s - t:], v[:, :, s - t:], is_causal=True, scale=scale)[:2]
    top = torch.maximum(old_lse, new_lse)
    w_old, w_new = (old_lse - top).exp_()[..., None], (new_lse - top).exp_()[..., None]  # [B, H, T, 1]
    return ((old.float() * w_old + new.float() * w_new) / (w_old + w_new)).to(q.dtype)


_BIAS: dict = {}  # one forward's additive masks, converted once for all its layers; emptied when it ends


def _additive(mask: torch.Tensor | tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 0 / -inf float form of a bool mask, or of :data:`CAUSAL` given as (T, S); kept until the forward
    ends, so its layers convert it once instead of SDPA converting it in every call."""
    key = (mask if isinstance(mask, tuple) else id(mask), dtype)
    if key not in _BIAS:
        keep = causal_tail(*mask, device) if isinstance(mask, tuple) else mask
        _BIAS[key] = (mask, torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf")))
    return _BIAS[key][1]  # the entry holds the mask too, so its id cannot be reused while it lives


def _attend_rows(cache: RowCaches, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Attention of a :class:`~sparsedraft.engine.cache.RowCaches` batch: each row's real (last) queries over its
    own cache, by the call its batch-1 forward makes; padded queries get zeros."""
    out = torch.zeros_like(q)
    t = q.shape[2]
    for b in range(q.shape[0]):
        keys, values, mask, n = cache.attend_row(b, layer, k, v)
        out[b:b + 1, :, t - n:] = attention(q[b:b + 1, :, t - n:], keys, values, mask, scale)[0]
    return out


EXACT_ROWS = 256  # a batch of steps (<= KERNEL_MAX_TOKENS tokens a row) of up to this many rows: the kernel, 16 a call
_GEMM_BATCHES = contextvars.ContextVar("sparsedraft_gemm_batches", default=False)


@contextlib.contextmanager
def gemm_batches() -> Iterator[None]:
    """Within this block every linear layer multiplies through torch's own kernels instead of the few-row
    exact kernel. That kernel is built for bandwidth-bound steps; a batch of decodes is compute-bound, and
    there torch's GEMM is level with it at 32 rows and faster at 64 (``python -m sparsedraft.bench.sampler``
    times both).
    A row's bits then depend on its batch, so this is for making data (the feature drafter's sampled
    continuations), never for speculative decoding, whose batch rows must equal their batch-1 runs."""
    token = _GEMM_BATCHES.set(True)
    try:
        yield
    finally:
        _GEMM_BATCHES.reset(token)


def project(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``; a decode or verification step (CPU, no autograd, at most :data:`EXACT_ROWS` rows of at
    most :data:`KERNEL_MAX_TOKENS` tokens per sequence) goes through the C++ kernel, which reads the weight
    once per 16 rows and gives each row the bits it gets alone, so a batch of steps gives every row what its
    batch-1 step gives (unless :func:`gemm_batches` asks for speed instead)."""
    if _GEMM_BATCHES.get():
        return layer(x)
    if isinstance(layer, nn.Linear):  # parameters straight from the dict: a decode step makes ~200 calls
        weight, bias, scale = layer._parameters["weight"], layer._parameters["bias"], None
    elif isinstance(layer, Int8Linear):  # int8 codes and a scale per output row: the same kernel
        weight, bias, scale = layer.weight_int8, layer.bias, layer.scale
    elif isinstance(layer, RoundedInt8Linear):  # packed int8 codes, x rounded to int8 too: the kernel's other form
        weight, bias, scale = layer.packed, layer.bias, layer.scale
    else:  # int4 and bf16 draft layers (quant.py): torch's kernels
        return layer(x)
    rows = x.numel() // x.shape[-1]
    step = kernels.MAX_LINEAR_ROWS
    if rows <= step and kernels.weight_fits(x, weight) and _step_fits(x):
        return kernels.linear(x, weight, bias, scale)
    if (step < rows <= EXACT_ROWS and x.dim() == 3 and x.shape[1] <= KERNEL_MAX_TOKENS
            and kernels.linear_fits(x[:1, :1], weight)):  # a batch of steps; prefill chunks keep GEMMs
        flat = x.reshape(rows, x.shape[-1])
        parts = [kernels.linear(flat[i:i + step], weight, bias, scale) for i in range(0, rows, step)]
        return torch.cat(parts).view(*x.shape[:-1], -1)  # N: packed codes' first dim is not
    return layer(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = d ** -0.5

    def forward(self, x, angles, cache: KVCache, capture: Capture | None):
        return project(self.o_proj, self.heads(x, angles, cache, capture))

    def heads(self, x, angles, cache: KVCache, capture: Capture | None,
              qkv: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The attention's output before ``o_proj``: [B, T, heads * head_dim]. ``qkv``: a step's rotated q, k
        [B, T, heads, D] and v, as :func:`kernels.layer_head` makes them from the layer's input (``x`` is then
        not read)."""
        if qkv is None:
            q, k, v = self.qkv(x, angles, cache)
        else:
            q, k, v = (y.transpose(1, 2) for y in qkv)
        b, t = q.shape[0], q.shape[2]
        record = capture is not None and self.layer in capture.layers
        if isinstance(cache, RowCaches):
            require(not (record and capture.weights), "attention weights are not captured over a RowCaches batch")
            out, weights = _attend_rows(cache, self.layer, q, k, v, self.scale), None
        else:
            keys, values, mask = cache.attend(self.layer, k, v)
            out, weights = attention(q, keys, values, mask, self.scale, need_weights=record and capture.weights)
        if record:
            capture.queries[self.layer] = q.detach()
            if weights is not None:
                capture.attention[self.layer] = weights.detach()
        return out.transpose(1, 2).reshape(b, t, -1)

    def qkv(self, x, angles, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, T, D] and k rotated (k not where the cache keeps keys before RoPE), v [B, kv, T, D]."""
        b, t, _ = x.shape
        cfg = self.cfg
        q = project(self.q_proj, x).view(b, t, cfg.num_heads, cfg.head_dim)
        k = project(self.k_proj, x).view(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = project(self.v_proj, x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # per head, over head_dim: [B, T, H, D] as well as [B, H, T, D]
            q, k = self.q_norm(q), self.k_norm(k)
        if is_step(q):  # rotate [B, T, H, D] rows in C++, then transpose
            cos, sin = angles.rows()
            q = kernels.rope(q.contiguous(), cos, sin).transpose(1, 2)
            k = (k if cache.keys_prerope else kernels.rope(k.contiguous(), cos, sin)).transpose(1, 2)
        else:
            q, k = angles.apply(q.transpose(1, 2)), k.transpose(1, 2)
            if not cache.keys_prerope:
                k = angles.apply(k)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return project(self.down_proj, F.silu(project(self.gate_proj, x)) * project(self.up_proj, x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, angles, cache, capture):
        attn, norm, tail = self.self_attn, self.input_layernorm, self.post_attention_layernorm
        fused = _step_linears(self, x)
        if fused is None:
            x = x + attn(norm(x), angles, cache, capture)
            return x + self.mlp(tail(x))
        # A step's rows: the norm, q/k/v and RoPE in one C++ call, o_proj to the MLP's residual in another; the
        # same kernels and ATen ops in the same order as the lines above, so the same bits.
        cos, sin = angles.rows()
        qkv = kernels.layer_head(x, norm.weight, norm.eps, fused[0], attn.cfg.num_heads, cos, sin,
                                 not cache.keys_prerope)
        return kernels.layer_tail(x, attn.heads(None, angles, cache, capture, qkv), fused[1], tail.weight, tail.eps)


def _kernel_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """The weight the few-row kernel reads for ``layer`` in a ``dtype`` step (its int8 codes for an
    :class:`Int8Linear`), or None where the kernel does not take it."""
    if isinstance(layer, nn.Linear):
        weight = layer._parameters["weight"]
        return weight if weight.dtype == dtype and weight.is_contiguous() else None
    if isinstance(layer, Int8Linear):
        weight = layer._buffers["weight_int8"]
        return weight if weight.is_contiguous() else None
    if isinstance(layer, RoundedInt8Linear):  # packed codes: the block kernels tell them apart by their 4 dims
        return layer._buffers["packed"]
    return None


def _step_linears(block: "Block", x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """(weight, bias, scale) of ``block``'s q/k/v and of its o_proj, gate, up and down, as
    :func:`kernels.layer_head` and :func:`kernels.layer_tail` take them, when ``x`` is a step's rows (at most
    :data:`kernels.MAX_LINEAR_ROWS`, the kernels on), the layer has no q/k norm, and all seven are fp32/bf16 of
    x's dtype or int8; None sends the step down the Python path. Made once per block and dtype and kept while
    the layers hold the same weight tensors (an fp32 copy of each int8 scale per call was itself ~3% of an
    int8 step). Why two calls a layer: each of a step's ~200 calls paid microseconds of Python (what that
    saved: docs/engine.md, "A layer in two calls")."""
    # Submodules straight from their dicts, not through nn.Module's __getattr__ (which cProfile put among the top
    # costs of an int8 draft step's Python; what this saved: docs/engine.md, "Quantised draft levels").
    attention = block._modules["self_attn"]
    attn, mlp = attention._modules, block._modules["mlp"]._modules
    if (_GEMM_BATCHES.get() or attention.q_norm is not None or x.numel() > kernels.MAX_LINEAR_ROWS * x.shape[-1]
            or not is_step(x)):
        return None
    layers = (attn["q_proj"], attn["k_proj"], attn["v_proj"], attn["o_proj"], mlp["gate_proj"], mlp["up_proj"],
              mlp["down_proj"])
    weights = [_kernel_weight(layer, x.dtype) for layer in layers]
    kept = block.__dict__.get("_step_linears")
    if kept is not None and kept[0] == x.dtype and all(a is b for a, b in zip(kept[1], weights)):
        return kept[2]
    if any(w is None for w in weights):
        return None
    none = torch.empty(0, dtype=x.dtype)
    tensors = []
    for layer, weight in zip(layers, weights):
        scale = layer.scale.float().contiguous() if isinstance(layer, (Int8Linear, RoundedInt8Linear)) else none
        tensors += [weight, none if layer.bias is None else layer.bias, scale]
    fused = tensors[:9], tensors[9:]
    block.__dict__["_step_linears"] = (x.dtype, weights, fused)
    return fused  # the kept object itself: engine/stack.py tells weights apart by its identity


def _stacked_linears(block: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """:func:`_step_linears` for a block whose forward is :class:`Block`'s own (what ``engine/stack.py`` runs
    in C++), else None."""
    plain = type(block) is Block and type(block._modules["self_attn"]) is Attention
    return _step_linears(block, x) if plain else None


def run_layers(layers: nn.ModuleList, rotary: Rotary, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
               capture: Capture | None = None) -> torch.Tensor:
    """``x`` [B, T, hidden] through ``layers`` over ``cache`` at ``positions`` ([B, T] or [T]): the body of every
    forward (the target's, and a feature drafter's one layer). A step that allows it runs all of its layers in
    one C++ call (``engine/stack.py``), with the same bits."""
    if positions.dim() == 1:
        positions = positions[None].expand(x.shape[0], -1)
    angles = rotary.angles(cache.begin(positions), x.dtype)
    lower = capture.hidden_layers if capture is not None and capture.hidden else ()
    kept = []
    decided = _STEP_FITS.set(None if torch.is_grad_enabled() else kernels.step_fits(x))
    try:
        outputs = None if capture is not None and capture.layers else stack.run(layers, x, angles.rows, cache,
                                                                               lower, _stacked_linears)
        if outputs is not None:
            *kept, x = outputs
        else:
            for i, block in enumerate(layers):
                x = block(x, angles, cache, capture)
                if i in lower:
                    kept.append(x.detach())
    finally:
        _STEP_FITS.reset(decided)
    if capture is not None and capture.hidden:
        capture.features = torch.cat(kept + [x.detach()], -1) if kept else x.detach()
    _BIAS.clear()  # a converted mask (up to T x S floats) is not kept past its forward
    cache.end()
    return x


class Transformer(nn.Module):
    """Parameter names follow Hugging Face (``model.layers.N.self_attn.q_proj``...)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg)

    def new_cache(self, max_len: int, batch: int = 1) -> StaticCache:
        """A full static cache on this model's device and dtype (checks the model's context limit)."""
        require(max_len <= self.cfg.max_position_embeddings,
                f"context of {max_len} tokens exceeds the model's maximum of "
                f"{self.cfg.max_position_embeddings} (max_position_embeddings); use a shorter prompt "
                "or a checkpoint trained for longer context")
        return StaticCache(self.cfg, max_len, batch, self.dtype, self.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, *, last_only: bool = False,
                capture: Capture | None = None) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] (or [B, 1, V] with ``last_only``).

        ``positions`` [B, T] (or [T]) default to ``cache.length + arange(T)``;
        without a cache the tokens attend causally to each other only.
        """
        if cache is None:
            cache = SequenceView(self.cfg.sliding_window)
        if positions is None:
            start = getattr(cache, "length", 0)
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = run_layers(self.layers, self.rotary, self.embed_tokens(tokens), positions, cache, capture)
        if last_only:
            x = x[:, -1:]
        return project(self.lm_head, self.norm(x))
