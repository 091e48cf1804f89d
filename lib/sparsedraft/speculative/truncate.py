"""A free draft model: the target's first k layers, its final norm and its head.

Early layers already carry much of the next-token signal (early exit /
self-speculation), so a truncated target drafts without training and without
a second tokenizer. The draft *shares* the target's parameter tensors --
building it costs no memory and no copy -- and only its config (``num_layers
= k``) differs, so its own caches get k layers.
"""

from __future__ import annotations

import torch
from torch import nn

from ..engine.model import Transformer
from ..errors import require


def truncated_draft(target: Transformer, k: int) -> Transformer:
    """A Transformer running ``target.layers[:k]`` then ``target.norm`` and ``target.lm_head`` (shared)."""
    layers = target.cfg.num_layers
    require(1 <= k < layers, f"a truncated draft keeps 1 <= k < {layers} layers of the target, got k={k}")
    with torch.device("meta"):  # placeholders only: every module is replaced by the target's below
        draft = Transformer(target.cfg.replace(num_layers=k))
    draft.embed_tokens = target.embed_tokens
    draft.layers = nn.ModuleList(target.layers[:k])
    draft.norm = target.norm
    draft.lm_head = target.lm_head
    draft.rotary = target.rotary
    return draft.eval()
