"""A feature head of more than one decoder layer (``depth``): capacity beyond EAGLE's one layer.

The untrained deeper head is the one-layer head exactly (its new layers add
nothing: their output projections start at zero), so a trained one-layer
drafter can start a deeper run as itself; every driver and cache serves it,
so greedy output stays plain greedy output; its folder records the depth and
loads as the same head; a cache of the wrong depth, a depth the target cannot
hold and a run shallower than its start are each one clear error.
"""

from __future__ import annotations

import pytest
import torch
from feature_heads import greedy_run, perturbed_head, raced, small_run

from sparsedraft import SparsedraftError, decode
from sparsedraft.budgetdraft.feature_train import train_feature_drafter
from sparsedraft.engine.cache import StaticCache
from sparsedraft.engine.generate import generate
from sparsedraft.engine.tiny import tiny_model
from sparsedraft.speculative.feature import FeatureHead, load_feature_head, read_record, save_feature_head
from sparsedraft.speculative.feature_drafter import FeatureDrafter

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 20


def deep_head(target, depth: int = 2, seed: int = 1, noise: float = 0.2) -> FeatureHead:
    """A deeper head whose every layer is heard (all weights perturbed, the zeroed projections included)."""
    return perturbed_head(target, depth=depth, seed=seed, noise=noise, floor=0.02)[0]


@pytest.fixture(scope="module")
def pair():
    return raced(deep_head, NEW)


def test_the_untrained_deeper_head_is_the_one_layer_head():
    target = tiny_model("llama", num_hidden_layers=3)
    one = FeatureHead(target.cfg).init_from(target).attach(target)
    three = FeatureHead(target.cfg, depth=3).init_from(target).attach(target)
    assert three.depth == 3 and len(three.layers) == 3 and three.cfg.num_layers == 3
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(1, 9, target.cfg.hidden_size, generator=gen)
    tokens = torch.randint(0, target.cfg.vocab_size, (1, 9), generator=gen)
    with torch.no_grad():
        assert torch.equal(three(features, tokens), one(features, tokens))
    for bad in (0, 4, 1.5):
        with pytest.raises(SparsedraftError, match="depth is 1..3"):
            FeatureHead(target.cfg, depth=bad)


@pytest.mark.parametrize("cache", ["full", "streaming", "budget"])
def test_greedy_speculation_with_a_deeper_head_equals_autoregressive(pair, cache):
    level = greedy_run(pair, cache).stats.levels[-1]
    assert 0 < level.accepted < level.drafted  # both outcomes happened


def test_a_cache_of_another_depth_is_refused(pair):
    target, head, prompt, _ = pair
    with pytest.raises(SparsedraftError, match="cache of 1 layers cannot serve a feature head of 2"):
        FeatureDrafter(head, StaticCache(FeatureHead.layer_config(target.cfg), 64))


def test_a_saved_deeper_head_loads_as_itself_and_decodes_everywhere(pair, tmp_path):
    target, head, prompt, ar = pair
    folder = save_feature_head(head, tmp_path / "deep", target)
    assert read_record(folder)["depth"] == 2
    assert "depth" not in read_record(save_feature_head(FeatureHead(target.cfg).attach(target), tmp_path / "one",
                                                        target))  # one-layer records are as before the option
    loaded = load_feature_head(folder, target)
    saved = {k: v.to(torch.bfloat16).float() for k, v in head.state_dict().items()}  # the file keeps bf16
    assert loaded.depth == 2 and set(saved) == set(loaded.state_dict())
    assert all(torch.equal(v, saved[k]) for k, v in loaded.state_dict().items())
    for method, options in [("spec", {}), ("budgetdraft", {"budget": 16, "chunk_size": 4}),
                            ("triforce", {"budget": 16, "chunk_size": 4, "sink": 4, "window": 8})]:
        assert torch.equal(decode(target, prompt, method, NEW, draft=str(folder), **options).tokens, ar), method


def test_a_one_layer_drafter_deepens_into_one_that_starts_as_itself(tmp_path, monkeypatch):
    target = tiny_model("llama")
    one = train_feature_drafter(small_run(tmp_path, "one"), target, progress=False, provenance=False)
    started, saved = {}, load_feature_head(one.run_dir / "drafter", target)  # what the folder holds (bf16)
    real = FeatureHead.init_layers

    def spy(head, target_, first):
        real(head, target_, first)
        features = torch.randn(1, 7, target.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        tokens = torch.randint(0, target.cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            started["same"] = torch.allclose(head(features, tokens), saved(features, tokens))
        started["first"] = first
        return head
    monkeypatch.setattr(FeatureHead, "init_layers", spy)
    deep = train_feature_drafter(small_run(tmp_path, "deep", depth=2, head_init=str(one.run_dir / "drafter")),
                                 target, progress=False, provenance=False)
    assert started == {"same": True, "first": 1}  # the deeper head began as the one-layer head it was loaded from
    assert deep.head.depth == 2 and deep.record["recipe"]["depth"] == 2
    assert float(deep.head.layers[1].mlp.down_proj.weight.detach().abs().max()) > 0  # its new layer learnt (L_C too)
    prompt = torch.randint(0, target.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    assert torch.equal(decode(target, prompt, "spec", 12, draft=str(deep.run_dir / "drafter")).tokens,
                       generate(target, prompt, 12).tokens)
    with pytest.raises(SparsedraftError, match="--depth 2 or more"):
        train_feature_drafter(small_run(tmp_path, "shallow", head_init=str(deep.run_dir / "drafter")), target,
                              progress=False, provenance=False)
    with pytest.raises(SparsedraftError, match="depth must be >= 1"):
        small_run(tmp_path, "none", depth=0)
