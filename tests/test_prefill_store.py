"""The disk cache of prefilled prompts: a round trip gives the same tensors and tokens, a damaged, truncated
or misplaced entry is never used, another dtype, RoPE setting or prompt misses, and the least recently used
entries go when the folder is over its cap."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

import sparsedraft.bench.comparison
from sparsedraft import decode, load_model
from sparsedraft.bench import CompareConfig, compare
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.prefill_store import PrefillStore, entry_key
from sparsedraft.engine.prefilled import model_identity
from sparsedraft.engine.prefill_store import prefill_prompt
from sparsedraft.engine.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTH = 160


def prompt(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (1, LENGTH), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-llama")


def tensors(prefilled) -> dict[str, torch.Tensor]:
    named = {f"cache.{k}": v for k, v in prefilled.cache.state().items()}
    named.update({f"q{k}": v for k, v in prefilled.queries.items()})
    return {**named, "logits": prefilled.logits, "tokens": prefilled.tokens}


def test_a_round_trip_gives_the_same_tensors_and_tokens(model, tmp_path):
    store = PrefillStore(tmp_path)
    computed = prefill_prompt(model, prompt(), store=store)
    loaded = prefill_prompt(model, prompt(), store=store)
    assert computed.loaded_from is None and loaded.loaded_from == str(store.entries()[0][0])
    assert len(store.entries()) == 1 and loaded.seconds == computed.seconds and loaded.load_s > 0
    mine, theirs = tensors(computed), tensors(loaded)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[name], theirs[name]) and mine[name].dtype == theirs[name].dtype for name in mine)
    for method, options in (("ar", {}), ("retrieval", {"budget": 64, "gamma": 3})):
        expected = decode(model, prompt(), method, 12, prefilled=computed, **options).tokens
        assert torch.equal(decode(model, prompt(), method, 12, prefilled=loaded, **options).tokens, expected)


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x55  # inside the last tensor's bytes
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.mark.parametrize("damage, words", [(_flip_a_byte, "does not match its checksum"),
                                           (_truncate, "not a readable safetensors file")])
def test_a_damaged_entry_is_never_used(model, tmp_path, damage, words):
    store = PrefillStore(tmp_path)
    good = prefill_prompt(model, prompt(), store=store)
    [(path, _)] = store.entries()
    damage(path)
    with pytest.warns(UserWarning, match=words):
        again = prefill_prompt(model, prompt(), store=store)
    assert again.loaded_from is None  # computed again, and stored again
    assert torch.equal(again.cache.state()["k0"], good.cache.state()["k0"])
    assert prefill_prompt(model, prompt(), store=store).loaded_from == str(path)


def test_an_entry_under_another_keys_name_is_refused(model, tmp_path):
    store = PrefillStore(tmp_path)
    prefill_prompt(model, prompt(0), store=store)
    [(path, _)] = store.entries()
    other = store.path(entry_key(model_identity(model), prompt(1)))
    path.rename(other)
    with pytest.warns(UserWarning, match="stored for another key \\(prompt: "):
        assert store.load(model, prompt(1)) is None
    assert not other.exists()


def _other_rope(model):
    other = tiny_model("llama", rope_theta=500_000.0)  # the same seed and shapes: only the RoPE setting differs
    other.source = model.source
    return other


@pytest.mark.parametrize("change", ["dtype", "rope", "prompt"])
def test_another_dtype_rope_or_prompt_misses(model, tmp_path, change, recwarn):
    store = PrefillStore(tmp_path)
    prefill_prompt(model, prompt(), store=store)
    other = {"dtype": lambda: copy.deepcopy(model).to(torch.bfloat16), "rope": lambda: _other_rope(model),
             "prompt": lambda: model}[change]()
    ids = prompt(1) if change == "prompt" else prompt()
    assert store.load(other, ids) is None
    assert prefill_prompt(other, ids, store=store).loaded_from is None
    assert len(store.entries()) == 2 and not recwarn.list  # a miss, not a damaged entry


def test_the_least_recently_used_entries_go_when_over_the_cap(model, tmp_path):
    store = PrefillStore(tmp_path)
    first = store.save(prefill_prompt(model, prompt(0)))
    size = first.stat().st_size
    store = PrefillStore(tmp_path, max_bytes=int(2.5 * size))
    second = store.save(prefill_prompt(model, prompt(1)))
    now = time.time()
    os.utime(first, (now - 300, now - 300))
    os.utime(second, (now - 200, now - 200))
    assert store.load(model, prompt(0)) is not None  # a hit: the first is now the most recently used
    third = store.save(prefill_prompt(model, prompt(2)))
    assert {path for path, _ in store.entries()} == {first, third}
    assert not second.exists()


def test_an_entry_over_the_cap_is_not_kept(model, tmp_path):
    store = PrefillStore(tmp_path, max_bytes=1000)
    with pytest.warns(UserWarning, match="over the cap"):
        assert store.save(prefill_prompt(model, prompt())) is None
    assert store.entries() == []


def test_a_file_as_the_cache_folder_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(sparsedraft.bench.comparison.weights, "load_model", lambda *a: pytest.fail("loaded"))
    (tmp_path / "file").write_text("")
    with pytest.raises(SparsedraftError, match="is a file; give a folder"):
        compare(CompareConfig(model="tiny-llama", device="cpu", context=200, new_tokens=4,
                              prefill_cache=str(tmp_path / "file")))


def test_a_prefill_left_on_disk_seeds_runs_like_one_in_memory(tmp_path):
    """on_disk: the cache stays in the verified file and is read when a run starts; a changed file is refused."""
    from sparsedraft import decode
    from sparsedraft.engine.prefill_store import StoredCache
    model = tiny_model("llama")
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    store = PrefillStore(tmp_path)
    kept = prefill_prompt(model, prompt, store=store)
    lazy = prefill_prompt(model, prompt, store=store, on_disk=True)
    assert isinstance(lazy.cache, StoredCache) and lazy.cache.length == 40
    for method, options in (("ar", {}), ("retrieval", {"budget": 16, "chunk_size": 4, "gamma": 2})):
        want = decode(model, prompt, method, 8, prefilled=kept, **options).tokens
        assert torch.equal(decode(model, prompt, method, 8, prefilled=lazy, **options).tokens, want)
    lazy.cache.path.write_bytes(lazy.cache.path.read_bytes() + b"\0")
    with pytest.raises(SparsedraftError, match="changed or went away"):
        decode(model, prompt, "ar", 8, prefilled=lazy)
