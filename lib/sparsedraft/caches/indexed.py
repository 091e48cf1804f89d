"""Attending to a retrieval selection on a GPU: gather it into a dense budget buffer, or index it in place.

TriForce's level 2 attends, per layer and KV head, to a few thousand tokens
chosen out of a long full cache. Two ways to run that step:

- **gather** (what :class:`~sparsedraft.caches.RetrievalCache` does at build
  time): copy the chosen tokens into a fixed ``[B, kv_heads, budget, D]``
  buffer once per build, then every step is dense attention over a small,
  contiguous, static-shape buffer (CUDA-graph friendly). The copy reads and
  writes the budget once per build; steps between builds amortise it.
- **indexed** (FlashInfer's paged decode with page size 1): leave the keys
  where they are and hand the kernel the token indices, so a build costs no
  copy, but every step reads scattered 256-byte rows of the full cache.

:func:`chunk_tokens` turns chosen chunk ids into token indices,
:func:`gather_tokens` is the gather, :func:`indexed_attention` the plain-torch
definition of attention over indices (a mask over the full cache, so it
shares no code with the gather and serves as the oracle for both), and
:class:`FlashInferIndexedDecode` the FlashInfer kernel when ``flashinfer`` is
importable (it never is on CPU).

Shapes: queries ``[B, heads, D]`` for one token; caches ``[B, kv_heads, L,
D]``; indices ``[B, kv_heads, S]`` (int64 token positions, per KV head).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from ..errors import require


def flashinfer_available() -> bool:
    """Whether the optional ``flashinfer`` package can be imported here (it needs CUDA)."""
    return importlib.util.find_spec("flashinfer") is not None and torch.cuda.is_available()


def chunk_tokens(chunks: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Chunk ids ``[B, kv_heads, n]`` -> token indices ``[B, kv_heads, n * chunk_size]``, chunk by chunk."""
    require(chunk_size >= 1, f"chunk_size must be >= 1, got {chunk_size}")
    offsets = torch.arange(chunk_size, device=chunks.device)
    return (chunks[..., None] * chunk_size + offsets).flatten(2)


def gather_tokens(keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor,
                  out_keys: torch.Tensor, out_values: torch.Tensor) -> None:
    """Copy the tokens ``index`` [B, kv_heads, S] of ``keys``/``values`` into slots ``[0, S)`` of the outputs."""
    s = index.shape[-1]
    require(out_keys.shape[2] >= s, f"the budget buffer holds {out_keys.shape[2]} slots, the selection {s} tokens")
    expanded = index[..., None].expand(-1, -1, -1, keys.shape[-1])
    out_keys[:, :, :s] = keys.gather(2, expanded)
    out_values[:, :, :s] = values.gather(2, expanded)


def indexed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Attention of one query ``[B, heads, D]`` over the tokens ``index`` of the full cache -> ``[B, heads, D]``.

    Defined as attention over the whole cache under a mask that keeps only
    the indexed tokens (no gather), the reference the fast paths must equal.
    """
    b, h, d = q.shape
    kv = keys.shape[1]
    keep = torch.zeros(keys.shape[:3], dtype=torch.bool, device=keys.device).scatter_(2, index, True)
    grouped = q.reshape(b, kv, h // kv, d)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=keep[:, :, None], scale=scale)
    return out.reshape(b, h, d)


class FlashInferIndexedDecode:
    """FlashInfer's paged decode with page size 1 over one layer's full cache and a fixed selection.

    Each (batch row, KV head) is one FlashInfer request with one KV head and
    its query group as query heads, because the selection differs per KV head
    while FlashInfer's page table is per request. The cache ``[B, kv_heads, L,
    D]`` (contiguous) is viewed as ``B * kv_heads * L`` pages of one token,
    so nothing is copied. ``plan`` runs once per selection (a build), the call
    once per step. CUDA only.
    """

    def __init__(self, index: torch.Tensor, cache_len: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                 scale: float, workspace: torch.Tensor | None = None):
        require(flashinfer_available(), "FlashInferIndexedDecode needs the flashinfer package and a CUDA device")
        import flashinfer
        b, kv, s = index.shape
        device = index.device
        self.shape = (b, num_heads, head_dim)
        requests = b * kv
        first_page = torch.arange(requests, device=device)[:, None] * cache_len
        indices = (first_page + index.reshape(requests, s)).flatten().to(torch.int32)
        indptr = torch.arange(requests + 1, device=device, dtype=torch.int32) * s
        last_page_len = torch.ones(requests, device=device, dtype=torch.int32)
        workspace = workspace if workspace is not None else torch.empty(128 << 20, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self.wrapper.plan(indptr, indices, last_page_len, num_heads // kv, 1, head_dim, 1,
                          q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
        self._indices = indices  # the plan refers to it

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [B, heads, D]; keys/values [B, kv_heads, L, D] contiguous -> [B, heads, D]."""
        b, kv, length, d = keys.shape
        pages = (keys.reshape(b * kv * length, 1, 1, d), values.reshape(b * kv * length, 1, 1, d))
        out = self.wrapper.run(q.reshape(b * kv, q.shape[1] // kv, d), pages)
        return out.reshape(self.shape)
