"""Weight-only int8 linear layers: a lever that shifts bytes from weights to the KV cache.

At short context a small model's decode step reads mostly weights, so a sparse KV
cache alone saves little. Storing linear weights as int8 with one scale per
output row quarters the weight bytes in fp32 (halves them in bf16) and makes
the KV cache a larger share of each step -- the balance the papers' GPUs see
at long context. The baseline must get the same lever: quantise the model
once and use it for both AR and speculative decoding, so ratios stay fair and
greedy losslessness is judged against the quantised target itself.

On CPU a model's decode, verification and draft steps (``model.project``) go through our few-row
kernel over the int8 codes (``kernels.linear`` with a scale: each code read once for all rows, the
scale applied per output after the sum); prefill chunks and direct calls use torch's fused ``_weight_int8pack_mm``
(for TriForce's 4-row level-2 step at 16K it made an int8 step cost 4.3x an fp32 one: 7d16d31's
``docs/results/triforce-16k-wint8-kvsame.json``); other devices multiply
by the weights cast to the activation dtype and scale the output (the same
arithmetic, unfused). Whether the fused kernel beats fp32 depends on the CPU
and the row count (it is tuned for one row); ``bench spec --quant int8``
measures it against the fp32 baseline in one process.

A draft level that is the target itself (TriForce's level 2, retrieval
self-speculation, ``spec --draft self``) needs its tokens accepted, not exact,
so it may read fewer weight bytes than the verifier: :func:`draft_copy` gives
the target's weights as int8, int4 (group-wise scales and offsets, torch's
``_weight_int4pack_mm_for_cpu``) or bf16 while the verifier keeps its own, so
greedy output stays the target's token for token. The copy shares the
embedding, norms and rotary tables, is made once per model and kept on it,
and is chosen by one option, ``draft_weights`` (:data:`DRAFT_WEIGHTS`).

``w8a8`` goes one step further for such a draft: int8's codes and scales, and each row of x rounded
to int8 as well (its own scale, amax / 127), so a product is an exact int32 sum of int8 pairs: on
AVX2 two instructions per 32 weights, with VNNI one per 64 (``kernels/rounded_rows_linear.cpp``),
instead of widening every code to a float; what the rounding costs in acceptance is measured
against int8's (docs/engine.md, "Quantised draft levels").
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import require
from .config import ModelConfig

DRAFT_WEIGHTS = ("same", "bf16", "int8", "w8a8", "int4")  # a self-draft's weights; "same": the target's own
INT4_GROUP = 32  # input features sharing one int4 scale and offset (divides every hidden size we load)
CPU_ONLY = {"int4": "torch's int4 CPU matmul",  # draft weights whose arithmetic exists on CPU alone, and why
            "w8a8": "its kernel is a CPU one; elsewhere its exact sums would be float64 matmuls"}


class Int8Linear(nn.Module):
    """y = (x @ W_int8^T) * scale (+ bias); W_int8 [out, in], scale [out]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.register_buffer("weight_int8", (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if flat.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(flat.contiguous(), self.weight_int8, self.scale.to(x.dtype))
        else:
            y = F.linear(flat, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)


PACK_ROWS, PACK_INPUTS = 4, 32  # rounded_rows_linear.cpp's packing: 4 weight rows side by side per 32 inputs


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] as ``kernels/rounded_rows_linear.cpp`` reads them: [N4 / 4, K32 / 32, 4, 32], N and K
    padded with zero codes to multiples of 4 and 32, so four weight rows are one contiguous stream."""
    n, k = codes.shape
    padded = F.pad(codes, (0, -k % PACK_INPUTS, 0, -n % PACK_ROWS))
    rows, inputs = padded.shape
    blocks = padded.view(rows // PACK_ROWS, PACK_ROWS, inputs // PACK_INPUTS, PACK_INPUTS)
    return blocks.permute(0, 2, 1, 3).contiguous()


def unpack_codes(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """:func:`pack_codes`'s input back: [N, K]."""
    groups, blocks = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(groups * PACK_ROWS, blocks * PACK_INPUTS)[:n, :k]


def round_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [M, K] (float32) as int8 codes round(x * (127 / amax)), half to even, and its scale
    amax / 127 [M, 1]: the kernel's arithmetic, true divisions both (``127.0 / t`` would multiply by a
    reciprocal)."""
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (x * inv).round().clamp(-127, 127).to(torch.int8), amax / torch.full_like(amax, 127.0)


class RoundedInt8Linear(nn.Module):
    """y = (q(x) @ W_int8^T) * (sx * scale) (+ bias): :class:`Int8Linear`'s codes and scales, packed for the
    kernel (:func:`pack_codes`), times each row of x rounded to int8 alone (:func:`round_rows`), summed exactly.
    For draft levels only (``draft_weights="w8a8"``): rounding x changes what the level drafts. On CPU a step
    runs the kernel on the packed codes (``kernels.linear``, from model.project); this torch path gives the same
    bits for any rows."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        codes = Int8Linear(linear)
        self.register_buffer("packed", pack_codes(codes.weight_int8))
        self.register_buffer("scale", codes.scale.float())
        self.bias = codes.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        q, sx = round_rows(x.reshape(-1, shape[-1]).float())
        codes = unpack_codes(self.packed, self.out_features, self.in_features)
        dot = (torch._int_mm(q, codes.t()) if q.device.type == "cpu"
               else (q.double() @ codes.double().t()))  # exact either way: |sum| < 2^53
        y = dot.float() * (sx * self.scale)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` (attention, MLP, LM head) by :class:`Int8Linear`, in place.

    Embeddings stay in the model dtype (one row is read per token). For
    inference only: the int8 weights take no gradients.
    """
    require(not model.training, "quantize_int8 is for inference: call model.eval() first "
                                "(training needs the float weights)")
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(module))
    return model


class Int4Linear(nn.Module):
    """y = x @ W^T (+ bias) with W held as 4-bit codes, one scale and offset per ``group`` inputs of a row.

    Codes are ``round((w - min) / scale)`` in 0..15 with ``scale = (max - min) / 15`` per group (asymmetric:
    a group's range is used in full). CPU only: torch's ``_weight_int4pack_mm_for_cpu`` multiplies fp32 or
    bf16 rows by the packed codes, reading half a byte per weight.
    """

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP):
        super().__init__()
        w = linear.weight.detach().float()
        out_features, in_features = w.shape
        require(linear.weight.device.type == "cpu", "int4 draft weights run on CPU only (torch's int4 CPU matmul)")
        require(in_features % group == 0, f"int4 needs in_features ({in_features}) to be a multiple of the group "
                                          f"size ({group}); use draft_weights int8 for this model")
        groups = w.reshape(out_features, in_features // group, group)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-8)
        codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8))
        # The kernel computes (code - 8) * scale + offset, so the offset is the group's min plus 8 scales.
        offsets = torch.cat((scale, low + 8 * scale), -1).transpose(0, 1).contiguous()  # [in / group, out, 2]
        self.register_buffer("scales_and_zeros", offsets.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.group, self.in_features, self.out_features = group, in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_and_zeros.to(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)


class Bf16Linear(nn.Module):
    """y = x @ W^T (+ bias) with W stored in bf16 and x rounded to bf16 for the product (half of fp32's
    bytes), the result in x's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_bf16 = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        return F.linear(x.to(torch.bfloat16), self.weight_bf16, bias).to(x.dtype)


LAYERS = {"bf16": Bf16Linear, "int8": Int8Linear, "w8a8": RoundedInt8Linear, "int4": Int4Linear}


def check_draft_weights(weights: str, cfg: ModelConfig | None = None, device: torch.device | None = None) -> None:
    """``weights`` names a draft copy this model (its ``cfg``) can have on ``device``; before any heavy work."""
    require(weights in DRAFT_WEIGHTS, f"draft_weights must be one of {DRAFT_WEIGHTS}, got {weights!r}")
    if weights not in CPU_ONLY:
        return
    require(device is None or device.type == "cpu",
            f"draft_weights {weights} runs on CPU only ({CPU_ONLY[weights]}), not {device}; use int8 or bf16 there")
    if weights == "int4" and cfg is not None:
        inputs = {cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim}
        require(all(n % INT4_GROUP == 0 for n in inputs),
                f"draft_weights int4 groups {INT4_GROUP} input features per scale, but this model's linear layers "
                f"take {sorted(inputs)}; use int8")


def draft_copy(model: nn.Module, weights: str) -> nn.Module:
    """``model`` with every linear layer's weights as ``weights`` (:data:`DRAFT_WEIGHTS`; ``same`` returns the
    model itself) for drafting; the embedding, norms, rotary tables and the model's own weights are shared,
    not copied. Made once per model and kept on it, so every call (every decode, every run) reuses it."""
    check_draft_weights(weights, model.cfg, model.device)
    if weights == "same":
        return model
    kept = model.__dict__.setdefault("_sparsedraft_draft_copies", {})
    if weights not in kept:
        require(not model.training, "draft_copy is for inference: call model.eval() first")
        require(not any(not isinstance(m, nn.Linear) and hasattr(m, "in_features") for m in model.modules()),
                f"this model's linear layers are already quantised; draft_weights {weights!r} needs float weights")
        shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
        copy_ = copy.deepcopy(model, memo=shared)  # the module tree anew, every tensor shared
        copy_.__dict__.pop("_sparsedraft_draft_copies", None)
        for name, module in [(n, m) for n, m in copy_.named_modules() if isinstance(m, nn.Linear)]:
            parent_name, _, child = name.rpartition(".")
            setattr(copy_.get_submodule(parent_name) if parent_name else copy_, child, LAYERS[weights](module))
        kept[weights] = copy_
    return kept[weights]
