"""Loading: GGUF round trip, HF folders (safetensors and .bin), and clear errors."""

import json

import pytest
import torch

from gguf_files import write_gguf
from oracle import hf_pair
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.generate import generate
from sparsedraft.engine.tiny import tiny_hf_config, tiny_model
from sparsedraft.engine.weights import load_model


def _same_logits(a, b, ids):
    with torch.no_grad():
        return (a(ids) - b(ids)).abs().max().item()


def test_gguf_round_trip_undoes_the_llama_permutation(tmp_path):
    model = tiny_model("llama", rope_scaling=None)  # GGUF header carries no llama3 scaling here
    path = write_gguf(model, tmp_path / "tiny.gguf")
    loaded = load_model(path)
    assert loaded.cfg.tie_word_embeddings and loaded.cfg.num_kv_heads == 2
    assert _same_logits(model, loaded, torch.randint(0, 256, (1, 32))) <= 1e-5


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_hf_folder_loads(tmp_path, fmt):
    hf, ours = hf_pair("qwen3")
    if fmt == "safetensors":
        hf.save_pretrained(tmp_path)
    else:  # transformers 5 no longer writes .bin; older checkpoints still ship them
        hf.config.save_pretrained(tmp_path)
        torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    loaded = load_model(tmp_path)
    assert _same_logits(ours, loaded, torch.randint(0, 256, (1, 20))) <= 1e-5


def test_missing_file_names_the_path():
    with pytest.raises(SparsedraftError, match="not found.*nope.gguf"):
        load_model("/tmp/does/not/exist/nope.gguf")


def test_unknown_short_name_lists_what_exists():
    with pytest.raises(SparsedraftError, match="smollm2-135m"):
        load_model("smollm3-9000")


def test_unknown_architecture_in_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**tiny_hf_config("llama"), "model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SparsedraftError, match="unknown architecture 'gpt2'"):
        load_model(tmp_path)


def test_unknown_architecture_in_gguf(tmp_path):
    path = write_gguf(tiny_model("llama", rope_scaling=None), tmp_path / "x.gguf", arch="gpt2")
    with pytest.raises(SparsedraftError, match="unknown architecture 'gpt2'"):
        load_model(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_gguf(tmp_path, damage):
    good = write_gguf(tiny_model("llama", rope_scaling=None), tmp_path / "good.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10 if damage == "garbage" else good[: len(good) // 2])
    with pytest.raises(SparsedraftError, match="corrupt or truncated GGUF"):
        load_model(bad)


def test_context_longer_than_the_model_allows():
    model = tiny_model("mistral")
    with pytest.raises(SparsedraftError, match="exceeds the model's maximum"):
        model.new_cache(model.cfg.max_position_embeddings + 1)
    with pytest.raises(SparsedraftError, match="exceeds the model's maximum"):
        generate(model, torch.zeros(1, 2000, dtype=torch.long), max_new_tokens=100)


def test_prompt_longer_than_the_cache():
    model = tiny_model("qwen2")
    cache = model.new_cache(16)
    with pytest.raises(SparsedraftError, match="does not fit.*max_len >= 20"):
        model(torch.zeros(1, 20, dtype=torch.long), cache=cache)
    assert cache.length == 0


def test_token_ids_outside_the_vocabulary():
    model = tiny_model("qwen2")
    with pytest.raises(SparsedraftError, match="outside the vocabulary"):
        generate(model, torch.full((1, 4), 999), max_new_tokens=2)
