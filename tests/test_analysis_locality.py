"""Contextual locality: identities at Δ = 0, a hand-made stable context, the cache lifecycle."""

import pytest
import torch

from sparsedraft.analysis.attention import LayerQK
from sparsedraft.analysis.locality import LocalityConfig, contextual_locality, layer_locality
from sparsedraft.analysis.sparsity import SparsityConfig, layer_recovery
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.tiny import tiny_model


def _random_qk(seed=0, heads=4, kv=2, length=64) -> LayerQK:
    gen = torch.Generator().manual_seed(seed)
    return LayerQK(0, torch.randn(heads, length, 8, generator=gen), torch.randn(kv, length, 8, generator=gen), 0.5)


@pytest.mark.parametrize("share", [True, False])
def test_delta_zero_is_identity_and_matches_sparsity(share):
    qk = _random_qk()
    bases = [20, 30, 40]
    result = layer_locality(qk, bases, LocalityConfig(budget=16, deltas=(0, 3), chunk_size=4,
                                                      share_across_group=share))
    zero = result.overlap[result.overlap.delta == 0]
    assert (zero.jaccard == 1).all() and (zero.intersection == 1).all()
    decay0 = result.decay[result.decay.delta == 0].set_index(["selection", "head"])
    assert (decay0.recovery - decay0.fresh_recovery).abs().max() < 1e-9
    sparsity = layer_recovery(qk, bases, SparsityConfig(budgets=(16,), chunk_size=4, methods=("topk", "chunk"),
                                                        share_across_group=share))
    sparsity = sparsity.set_index(["method", "head"]).recovery
    for (selection, head), row in decay0.iterrows():
        assert row.recovery == pytest.approx(sparsity[selection, head], abs=1e-6)


def test_stable_context_overlaps_fully():
    """Identical queries and new keys that score low: the chosen old keys never change."""
    length = 48
    queries = torch.zeros(1, length, 4)
    queries[..., 0] = 1.0
    keys = torch.zeros(1, length, 4)
    keys[0, :24, 0] = torch.linspace(3.0, 0.0, 24)  # old keys, distinct scores
    keys[0, 24:, 0] = -5.0  # everything after position 23 is ignored by every query
    qk = LayerQK(0, queries, keys, scale=1.0)
    result = layer_locality(qk, [23, 24], LocalityConfig(budget=8, deltas=(0, 1, 8, 16), chunk_size=4))
    topk = result.overlap[result.overlap.selection == "topk"]
    assert (topk.jaccard == 1).all()
    chunk = result.overlap[result.overlap.selection == "chunk"]
    assert (chunk.intersection == 1).all()


def test_decay_follows_the_cache_lifecycle():
    qk = _random_qk(seed=1)
    result = layer_locality(qk, range(20, 30), LocalityConfig(budget=8, deltas=(0, 2, 8, 20), chunk_size=4))
    decay = result.decay
    beyond = decay[decay.delta >= 8].pivot_table(index=["head", "delta"], columns="selection", values="recovery")
    assert (beyond["topk"] - beyond["chunk"]).abs().max() < 1e-9  # only the newest 8 keys are left in both
    oracle = decay.groupby(["selection", "delta"])[["recovery", "fresh_recovery"]].mean()
    assert (oracle.fresh_recovery.loc["topk"] >= oracle.recovery.loc["topk"] - 1e-9).all()


def test_contextual_locality_on_a_tiny_model():
    model = tiny_model("qwen3")
    ids = torch.randint(0, model.cfg.vocab_size, (1, 80), generator=torch.Generator().manual_seed(4))
    result = contextual_locality(model, ids, range(30, 40), layers=[1],
                                 config=LocalityConfig(budget=0.25, deltas=(0, 4, 16)))
    assert list(result.overlap.columns) == ["layer", "head", "selection", "delta", "budget", "jaccard", "intersection"]
    assert list(result.decay.columns) == ["layer", "head", "selection", "delta", "budget", "recovery",
                                          "fresh_recovery"]
    assert len(result.overlap) == 4 * 2 * 3  # heads x selections x deltas
    values = result.overlap[["jaccard", "intersection"]]
    assert ((values >= 0) & (values <= 1 + 1e-9)).all().all()


def test_locality_rejects_out_of_range_steps():
    model = tiny_model("llama")
    ids = torch.zeros(1, 40, dtype=torch.long)
    with pytest.raises(SparsedraftError, match="largest delta"):
        contextual_locality(model, ids, [30], config=LocalityConfig(budget=8, deltas=(0, 16)))
    with pytest.raises(SparsedraftError, match="deltas"):
        LocalityConfig(deltas=(-1,))
