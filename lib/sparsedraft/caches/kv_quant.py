"""Quantised KV for a draft level's retrieval cache: fewer bytes per retrieved token (QuantSpec's second lever).

A level-2 step (the target over its retrieval cache) reads the weights plus
budget x layers x 2 x kv_heads x head_dim cached values. The draft only has to
be accepted, not exact, so those values may be stored as int8 (one scale per
token and KV head: a quarter of fp32's bytes) or int4 (one scale per 32
values, two values per byte: an eighth, plus the scales). Each token is
quantised once, from the target's own full-precision KV, when it enters the
view (build, sync); the verifier keeps its full-precision cache, so greedy
output is still the target's token for token.

:class:`QuantizedRetrievalCache` is a :class:`~.retrieval.RetrievalCache`
whose budget region is read from the quantised store; the speculative region
(level-2 tokens since the last sync) stays in the view's own precision. An
int8 view hands the attention its codes and scales
(:class:`~sparsedraft.engine.cache.Int8Slots`), and a decode or verification
step on CPU reads them in the C++ kernel (``kernels.attend_int8``: each chunk
dequantised in cache), so what streams from memory is the codes. int4 views,
and the paths without that kernel, dequantise the budget region into one
workspace shared by every layer (a layer's attention consumes it before the
next layer asks) and attend to that.
"""

from __future__ import annotations

from functools import partial

import torch

from ..engine.cache import CAUSAL, Causal, Int8Slots
from ..engine.config import ModelConfig
from ..errors import require
from .retrieval import RetrievalCache

DRAFT_KV = ("same", "int8", "int4")  # a draft level's retrieval cache values; "same": the target's dtype
INT4_GROUP = 32  # values sharing one int4 scale


def check_draft_kv(draft_kv: str, cfg: ModelConfig | None = None) -> None:
    """One error naming the choices (and, given ``cfg``, a head size int4's groups cannot split)."""
    require(draft_kv in DRAFT_KV, f"draft_kv must be one of {DRAFT_KV}, got {draft_kv!r}")
    if cfg is not None and draft_kv == "int4":
        require(cfg.head_dim % INT4_GROUP == 0,
                f"draft_kv int4 groups {INT4_GROUP} values per scale, which does not divide this model's head_dim "
                f"{cfg.head_dim}; use draft_kv int8")


class QuantizedKV:
    """Symmetric int8 or int4 storage of ``[B, H, N, D]`` values, written by slot, read back in full."""

    def __init__(self, bits: int, shape: tuple[int, int, int, int], device: torch.device | str = "cpu"):
        require(bits in (4, 8), f"bits must be 4 or 8, got {bits}")
        b, h, n, d = shape
        self.bits, self.group = bits, d if bits == 8 else INT4_GROUP
        require(d % self.group == 0 and (bits == 8 or d % 2 == 0),
                f"head_dim {d} must split into groups of {self.group} values")
        self.q = torch.zeros(b, h, n, d if bits == 8 else d // 2, dtype=torch.int8 if bits == 8 else torch.uint8,
                             device=device)
        self.scale = torch.zeros(b, h, n, d // self.group, 1, dtype=torch.float32, device=device)
        self.levels = 127 if bits == 8 else 7

    def token_scale(self) -> torch.Tensor:
        """int8's one scale per stored token, [B, H, N] (a view): what ``kernels.attend_int8`` reads."""
        return self.scale[..., 0, 0]

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [B, H, T, D] -> (codes, scales) as stored."""
        groups = x.float().unflatten(-1, (-1, self.group))
        scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / self.levels
        codes = (groups / scale).round().clamp(-self.levels, self.levels).flatten(-2)
        if self.bits == 8:
            return codes.to(torch.int8), scale
        unsigned = (codes + 8).to(torch.uint8)  # 1..15
        return unsigned[..., 0::2] | (unsigned[..., 1::2] << 4), scale

    def write(self, slots: torch.Tensor | slice, x: torch.Tensor) -> None:
        """Store ``x`` [B, H, T, D] at ``slots`` (T slot indices, or a slice of T) of dim 2."""
        codes, scale = self.quantize(x.detach())
        if isinstance(slots, slice):
            self.q[:, :, slots], self.scale[:, :, slots] = codes, scale
        else:
            self.q.index_copy_(2, slots, codes)
            self.scale.index_copy_(2, slots, scale)

    def read_into(self, out: torch.Tensor) -> torch.Tensor:
        """Dequantise every slot into ``out`` [B, H, N, D] (any float dtype); returns ``out``."""
        if self.bits == 8:
            values = self.q.unflatten(-1, (-1, self.group))
        else:
            low, high = (self.q & 15).to(torch.int8) - 8, (self.q >> 4).to(torch.int8) - 8
            values = torch.stack((low, high), dim=-1).flatten(-2).unflatten(-1, (-1, self.group))
        torch.mul(values, self.scale, out=out.unflatten(-1, (-1, self.group)))
        return out

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


class QuantizedRetrievalCache(RetrievalCache):
    """A retrieval view whose budget region is stored as ``draft_kv`` ("int8" or "int4") and read from there."""

    def __init__(self, cfg: ModelConfig, budget: int, chunk_size: int, spec_slots: int, draft_kv: str = "int8",
                 **kwargs):
        check_draft_kv(draft_kv, cfg)
        require(draft_kv != "same", "a QuantizedRetrievalCache stores int8 or int4; use RetrievalCache for 'same'")
        super().__init__(cfg, budget, chunk_size, spec_slots, **kwargs)
        self.draft_kv, bits = draft_kv, int(draft_kv.removeprefix("int"))
        shape = (self.batch, cfg.num_kv_heads, budget, cfg.head_dim)
        self.qk = [QuantizedKV(bits, shape, self.device) for _ in range(cfg.num_layers)]
        self.qv = [QuantizedKV(bits, shape, self.device) for _ in range(cfg.num_layers)]
        self.work_k, self.work_v = torch.zeros_like(self.k[0]), torch.zeros_like(self.v[0])  # shared by layers

    def _stored(self, layer: int, slots: torch.Tensor | slice) -> None:
        self.qk[layer].write(slots, self.k[layer][:, :, slots])
        self.qv[layer].write(slots, self.v[layer][:, :, slots])

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[Int8Slots | torch.Tensor,
                                                                             Int8Slots | torch.Tensor,
                                                                             torch.Tensor | Causal | None]:
        stop = self._write_new(layer, k, v)
        mask = self._mask
        pairs = ((self.qk[layer], self.k[layer], self.work_k), (self.qv[layer], self.v[layer], self.work_v))
        if self.draft_kv == "int8":  # the attention reads the codes where its kernel can (model.attention)
            keys, values = (Int8Slots(store.q, store.token_scale(), own[:, :, self.budget:stop],
                                      partial(self._dense, store, own, work, stop)) for store, own, work in pairs)
            return keys, values, mask
        keys, values = (self._dense(store, own, work, stop) for store, own, work in pairs)
        return keys, values, mask

    def step_slots(self) -> tuple[int, int] | None:
        plain = (self._mask is CAUSAL and self.draft_kv == "int8"
                 and type(self).attend is QuantizedRetrievalCache.attend)
        return self._new_slots() if plain else None

    def step_codes(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                                  int] | None:
        if self.draft_kv != "int8":
            return None
        if "_codes" not in self.__dict__:  # views made once (the stores are written in place): one stack per cache
            self._codes = ([s.q for s in self.qk], [s.token_scale() for s in self.qk], [s.q for s in self.qv],
                           [s.token_scale() for s in self.qv], self.budget)
        return self._codes

    def _dense(self, store: QuantizedKV, own: torch.Tensor, work: torch.Tensor, stop: int) -> torch.Tensor:
        """The budget region dequantised and the speculative region as it is, in the workspace every layer shares."""
        store.read_into(work[:, :, :self.budget])
        work[:, :, self.budget:stop] = own[:, :, self.budget:stop]
        return work[:, :, :stop]
