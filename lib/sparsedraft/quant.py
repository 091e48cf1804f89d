"""Weight-only int8 linear layers: a lever that shifts bytes from weights to the KV cache.

At short context a small model's decode step reads mostly weights, so a sparse KV
cache alone saves little. Storing linear weights as int8 with one scale per
output row quarters the weight bytes in fp32 (halves them in bf16) and makes
the KV cache a larger share of each step -- the balance the papers' GPUs see
at long context. The baseline must get the same lever: quantise the model
once and use it for both AR and speculative decoding, so ratios stay fair and
greedy losslessness is judged against the quantised target itself.

CPU uses torch's fused ``_weight_int8pack_mm`` kernel; other devices multiply
by the weights cast to the activation dtype and scale the output (the same
arithmetic, unfused). Whether the fused kernel beats fp32 depends on the CPU
and the row count (it is tuned for one row); ``bench spec --quant int8``
measures it against the fp32 baseline in one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .errors import require


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
