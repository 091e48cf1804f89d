"""The attention analyses from a stored prefill: a copy of its cache and a re-run of the queried tail give the
tables of a full capture, the stored cache is never written, a prefill of another prompt or model is refused,
and H2O (every query row) keeps the full prefill."""

import pandas as pd
import pytest
import torch

from sparsedraft.analysis.attention import LayerQK, layer_qk
from sparsedraft.analysis.locality import LocalityConfig, contextual_locality, layer_locality
from sparsedraft.analysis.sparsity import SparsityConfig, attention_recovery, last_positions, layer_recovery
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.prefill_store import PrefillStore
from sparsedraft.engine.prefill_store import prefill_prompt
from sparsedraft.engine.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTH = 160
CHUNK = 32  # the full capture's prefill chunk; the stored prefill runs the prompt in one chunk
SPARSITY = SparsityConfig(budgets=(16, 0.25), methods=("topk", "chunk", "streaming"), chunk_size=4, sink=4,
                          prefill_chunk=CHUNK)
LOCALITY = LocalityConfig(budget=16, deltas=(0, 1, 5, 12), chunk_size=4, prefill_chunk=CHUNK)
BASES = range(LENGTH - 12 - 6, LENGTH - 12)  # the last bases that leave room for the largest delta


def _prompt(seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 256, (1, LENGTH), generator=torch.Generator().manual_seed(seed))


def _every_query(model, prompt) -> list[LayerQK]:
    """The reference: one prefill of the whole prompt keeping every query row."""
    return list(layer_qk(model, prompt, prefill_chunk=CHUNK))


def _close(tail: pd.DataFrame, full: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(tail, full, check_exact=False, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_recovery_from_a_prefill_equals_the_full_capture(family):
    model, prompt = tiny_model(family), _prompt()
    positions = last_positions(LENGTH, 12)
    tail = attention_recovery(model, prompt, positions, config=SPARSITY, prefilled=prefill_prompt(model, prompt))
    frames = []
    for qk in _every_query(model, prompt):
        frame = layer_recovery(qk, positions, SPARSITY)
        frame.insert(0, "layer", qk.layer)
        frames.append(frame)
    _close(tail, pd.concat(frames, ignore_index=True))


def test_locality_from_a_store_equals_the_full_capture(tmp_path):
    model, prompt = tiny_model("llama"), _prompt()
    store = PrefillStore(tmp_path)
    first = contextual_locality(model, prompt, BASES, config=LOCALITY, store=store)
    assert len(store.entries()) == 1  # an empty store computes the prefill and keeps it for the next notebook
    again = contextual_locality(model, prompt, BASES, config=LOCALITY, store=store)  # read from disk this time
    for qk in _every_query(model, prompt):
        full = layer_locality(qk, BASES, LOCALITY)
        for result in (first, again):
            for tail, reference in ((result.overlap, full.overlap), (result.decay, full.decay)):
                mine = tail[tail.layer == qk.layer].drop(columns="layer").reset_index(drop=True)
                _close(mine, reference)


def test_tail_queries_and_keys_are_those_of_the_full_capture():
    model, prompt = tiny_model("qwen2"), _prompt()
    start = LENGTH - 20
    prefilled = prefill_prompt(model, prompt)
    for tail, full in zip(layer_qk(model, prompt, first=start, prefilled=prefilled), _every_query(model, prompt)):
        assert tail.start == start and tail.queries.shape[1] == 20
        torch.testing.assert_close(tail.queries, full.queries[:, start:], rtol=0, atol=1e-5)
        torch.testing.assert_close(tail.keys, full.keys, rtol=0, atol=1e-5)


def test_the_stored_prefill_is_left_as_it_was():
    model, prompt = tiny_model("llama"), _prompt()
    prefilled = prefill_prompt(model, prompt)
    before = {name: t.clone() for name, t in prefilled.cache.state().items()}
    attention_recovery(model, prompt, last_positions(LENGTH, 12), config=SPARSITY, prefilled=prefilled)
    contextual_locality(model, prompt, BASES, config=LOCALITY, prefilled=prefilled)
    assert prefilled.cache.length == LENGTH
    after = prefilled.cache.state()
    assert all(torch.equal(after[name], t) for name, t in before.items())


def test_a_prefill_of_another_prompt_or_model_is_refused():
    model, prompt = tiny_model("llama"), _prompt()
    other_prompt = prefill_prompt(model, _prompt(seed=6))
    with pytest.raises(SparsedraftError, match="not the prompt given"):
        attention_recovery(model, prompt, [LENGTH - 1], config=SPARSITY, prefilled=other_prompt)
    other_model = prefill_prompt(tiny_model("llama", seed=1), prompt)
    with pytest.raises(SparsedraftError, match="another model"):
        contextual_locality(model, prompt, BASES, config=LOCALITY, prefilled=other_model)


def test_h2o_keeps_the_full_prefill(tmp_path):
    """H2O needs every query row: a prefill given is refused, a store is left unused."""
    model, prompt = tiny_model("llama"), _prompt()
    config = SparsityConfig(budgets=(16,), chunk_size=4, sink=4, prefill_chunk=CHUNK)
    with pytest.raises(SparsedraftError, match="every query"):
        attention_recovery(model, prompt, [LENGTH - 1], config=config, prefilled=prefill_prompt(model, prompt))
    store = PrefillStore(tmp_path)
    with_store = attention_recovery(model, prompt, [LENGTH - 2, LENGTH - 1], config=config, store=store)
    assert store.entries() == []
    _close(with_store, attention_recovery(model, prompt, [LENGTH - 2, LENGTH - 1], config=config))


def _offset_pair(start: int = 10):
    gen = torch.Generator().manual_seed(7)
    queries, keys = torch.randn(4, 40, 8, generator=gen), torch.randn(2, 40, 8, generator=gen)
    return LayerQK(0, queries, keys, 0.5), LayerQK(0, queries[:, start:], keys, 0.5, start)


def test_queries_after_an_offset_are_read_by_absolute_position():
    every, tail = _offset_pair()
    positions = torch.tensor([10, 23, 39])
    assert torch.equal(tail.rows(positions), every.rows(positions))
    config = SparsityConfig(budgets=(8,), methods=("topk", "chunk", "streaming"), chunk_size=4, sink=3)
    _close(layer_recovery(tail, positions, config), layer_recovery(every, positions, config))


def test_an_offset_refuses_what_it_does_not_hold():
    every, tail = _offset_pair()
    with pytest.raises(SparsedraftError, match="before position 10 were not kept"):
        tail.rows(torch.tensor([9, 20]))
    with pytest.raises(SparsedraftError, match="cumulative score"):
        tail.cumulative(torch.tensor([20]), block=8)
    with pytest.raises(SparsedraftError, match="end at the same position"):
        LayerQK(0, every.queries[:, 10:], every.keys, 0.5, 9)
    model, prompt = tiny_model("llama"), _prompt()
    with pytest.raises(SparsedraftError, match="full prefill"):
        next(layer_qk(model, prompt, first=0, prefilled=prefill_prompt(model, prompt)))
