"""Weight-only int8: close to the float model, exact against its own cache path."""

import pytest
import torch

from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.quant import Int8Linear, quantize_int8
from sparsedraft.engine.tiny import tiny_model


def test_int8_model_tracks_float_model():
    ref = tiny_model("qwen2")
    q = quantize_int8(tiny_model("qwen2"))
    assert isinstance(q.lm_head, Int8Linear) and isinstance(q.layers[0].mlp.up_proj, Int8Linear)
    ids = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        a, b = ref(ids), q(ids)
    assert (a - b).abs().max() < 0.02 * a.abs().max()
    assert (a - b).abs().max() > 0  # it really is quantised


def test_int8_cached_decoding_equals_one_forward():
    q = quantize_int8(tiny_model("llama"))
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        full = q(ids)
        cache = q.new_cache(20)
        steps = torch.cat([q(ids[:, i:i + 1], cache=cache) for i in range(20)], 1)
    assert (steps - full).abs().max() <= 1e-4


def test_quantizing_a_training_model_is_refused():
    with pytest.raises(SparsedraftError, match="model.eval"):
        quantize_int8(tiny_model("llama").train())
