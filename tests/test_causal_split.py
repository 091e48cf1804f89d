"""A later prefill chunk's :data:`CAUSAL` attention on CPU runs as two flash calls merged by log-sum-exp
(:func:`sparsedraft.engine.model._causal_split`); it must equal attention with the causal mask written out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparsedraft.engine.cache import causal_tail
from sparsedraft.engine.model import _causal_split, _split_fits


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("t,s", [(1, 9), (5, 40), (64, 200)])
def test_split_equals_masked_attention(dtype, tol, t, s):
    g = torch.Generator().manual_seed(t * s)
    q, k, v = (torch.randn(2, heads, n, 16, generator=g).to(dtype) for heads, n in ((6, t), (2, s), (2, s)))
    if not _split_fits(q):
        pytest.skip("this torch has no CPU flash attention op")
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=causal_tail(t, s),
                                          enable_gqa=True, scale=0.25)
    torch.testing.assert_close(_causal_split(q, k, v, 0.25).float(), want, rtol=tol, atol=tol)
