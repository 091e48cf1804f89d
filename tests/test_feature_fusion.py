"""A feature head that fuses lower target layers with the top one (EAGLE-3's low, middle and top features).

The target captures the chosen layers' outputs before the top's, in one
forward or a chunked prefill alike; the untrained fused head is EAGLE's head
exactly (the lower layers start silent); every driver hands it the right
features, so greedy output stays plain greedy output; a prefill that lacks
the layers is refused naming the fix, and a prefill of more layers serves a
head that reads fewer; training writes a folder that loads as the same head.
"""

from __future__ import annotations

import pytest
import torch
from feature_heads import greedy_run, perturbed_head, raced, small_run

from sparsedraft import SparsedraftError, decode
from sparsedraft.budgetdraft.feature_config import FeatureTrainConfig
from sparsedraft.budgetdraft.feature_train import train_feature_drafter
from sparsedraft.engine.generate import generate
from sparsedraft.engine.model import Capture, run_layers
from sparsedraft.engine.prefill import prefill
from sparsedraft.engine.prefill_store import PrefillStore, prefill_prompt
from sparsedraft.engine.tiny import tiny_model
from sparsedraft.speculative import speculative
from sparsedraft.speculative.feature import FeatureHead, feature_layers_of, load_feature_head, save_feature_head
from sparsedraft.speculative.feature_drafter import FeatureDrafter

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 20
LAYERS = (0,)  # the tiny targets have 2 layers: layer 0's output and the top's


def fused_head(target, seed: int = 1, noise: float = 0.2, layers=LAYERS) -> FeatureHead:
    """A fused head whose lower block is heard (random fuse weights) and whose other weights are perturbed."""
    head, gen = perturbed_head(target, layers, seed=seed, noise=noise)
    with torch.no_grad():
        head.fuse.weight[:, :-target.cfg.hidden_size].normal_(0, 0.05, generator=gen)
    return head


@pytest.fixture(scope="module")
def pair():
    return raced(fused_head, NEW)


def test_the_capture_puts_the_lower_layers_outputs_before_the_tops():
    target = tiny_model("llama", num_hidden_layers=3)
    tokens = torch.randint(0, target.cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    capture = Capture(layers=set(), hidden=True, hidden_layers=(0, 1))
    with torch.no_grad():
        target(tokens, capture=capture)
        hidden = target.cfg.hidden_size
        for i in (0, 1):  # the output of the first i + 1 layers alone
            alone = run_layers(target.layers[:i + 1], target.rotary, target.embed_tokens(tokens),
                               torch.arange(30), target.new_cache(30, 2))
            torch.testing.assert_close(capture.features[..., i * hidden:(i + 1) * hidden], alone)
        top = Capture(layers=set(), hidden=True)
        target(tokens, capture=top)
    assert capture.features.shape[-1] == 3 * hidden
    assert torch.equal(capture.features[..., -hidden:], top.features)
    chunked = Capture(layers=set(), hidden=True, hidden_layers=(0, 1))
    prefill(target, target.new_cache(30, 2), tokens, chunk=7, capture=chunked)
    torch.testing.assert_close(chunked.features, capture.features, rtol=1e-5, atol=1e-5)


def test_the_untrained_fused_head_is_eagles_head():
    target = tiny_model("llama", num_hidden_layers=3)
    top_only = FeatureHead(target.cfg).init_from(target).attach(target)
    fused = FeatureHead(target.cfg, (0, 1)).init_from(target).attach(target)
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(1, 9, 3 * target.cfg.hidden_size, generator=gen)
    tokens = torch.randint(0, target.cfg.vocab_size, (1, 9), generator=gen)
    with torch.no_grad():
        assert torch.equal(fused(features, tokens), top_only(fused.top(features), tokens))
    with pytest.raises(SparsedraftError, match="hidden_layers"):
        fused(features[..., :2 * target.cfg.hidden_size], tokens)
    for bad in [(2,), (1, 0), (0, 0), (-1,)]:
        with pytest.raises(SparsedraftError, match="fuse_layers must be"):
            FeatureHead(target.cfg, bad)


@pytest.mark.parametrize("cache", ["full", "streaming", "budget"])
def test_greedy_speculation_with_a_fused_head_equals_autoregressive(pair, cache):
    assert greedy_run(pair, cache).stats.levels[-1].drafted > 0


def test_a_saved_fused_head_loads_as_itself_and_decodes_everywhere(pair, tmp_path):
    target, head, prompt, ar = pair
    folder = save_feature_head(head, tmp_path / "fused", target)
    loaded = load_feature_head(folder, target)
    assert loaded.fuse_layers == LAYERS and feature_layers_of(str(folder), "self", None) == LAYERS
    saved = {k: v.to(torch.bfloat16).float() for k, v in head.state_dict().items()}  # the file keeps bf16
    assert all(torch.equal(v, saved[k]) for k, v in loaded.state_dict().items()) and set(saved) == set(
        loaded.state_dict())
    for method, options in [("spec", {}), ("budgetdraft", {"budget": 16, "chunk_size": 4}),
                            ("triforce", {"budget": 16, "chunk_size": 4, "sink": 4, "window": 8})]:
        assert torch.equal(decode(target, prompt, method, NEW, draft=str(folder), **options).tokens, ar), method
    rows = [prompt[0, :40].tolist(), prompt[0].tolist()]
    batch = decode(target, rows, "spec", NEW, draft=str(folder), gamma=3)
    for b, row in enumerate(rows):
        assert torch.equal(batch.tokens[b], generate(target, torch.tensor([row]), NEW).tokens[0]), b


def test_a_prefill_must_hold_the_layers_the_head_fuses(pair, tmp_path):
    target, head, prompt, ar = pair
    drafter = FeatureDrafter.create(head, "full", prompt.shape[1] + NEW, gamma=3)
    plain = prefill_prompt(target, prompt)
    with pytest.raises(SparsedraftError, match=r"feature_layers=\(0,\)"):
        speculative(target, drafter, prompt, NEW, 3, prefilled=plain)
    store = PrefillStore(tmp_path / "store")
    shared = prefill_prompt(target, prompt, store=store, feature_layers=LAYERS)
    assert torch.equal(speculative(target, drafter, prompt, NEW, 3, prefilled=shared).tokens, ar)
    again = prefill_prompt(target, prompt, store=store, feature_layers=LAYERS)
    assert again.loaded_from is not None and again.feature_layers == LAYERS
    assert prefill_prompt(target, prompt, store=store).loaded_from is None  # another entry: top-only features
    top_only = FeatureHead(target.cfg).init_from(target).attach(target).requires_grad_(False)
    served = FeatureDrafter.create(top_only, "full", prompt.shape[1] + NEW, gamma=3)
    assert torch.equal(speculative(target, served, prompt, NEW, 3, prefilled=again).tokens, ar)  # a subset


def test_a_fused_run_trains_and_its_folder_decodes(tmp_path):
    target = tiny_model("llama")
    cfg = FeatureTrainConfig(verifier="tiny-llama", seq_len=64, sequences=2, pydoc_sequences=0, sampled_sequences=0,
                             eval_sequences=1, draft_vocab=64, chains=16, continuation=16, budgets=(16, 32),
                             obs_window=8, steps=6, warmup=1, lr=3e-3, checkpoint_every=3, eval_every=3,
                             final_context=0, fuse_layers=LAYERS, teacher_dir=str(tmp_path / "teacher"),
                             out_dir=str(tmp_path / "run"))
    result = train_feature_drafter(cfg, target, progress=False, provenance=False)
    assert result.head.fuse_layers == LAYERS
    assert len(result.record["feature_scales"]) == 2
    assert float(result.head.fuse.weight.detach()[:, :target.cfg.hidden_size].abs().max()) > 0  # the lower block learnt
    folder = result.run_dir / "drafter"
    prompt = torch.randint(0, target.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    assert torch.equal(decode(target, prompt, "spec", 12, draft=str(folder)).tokens,
                       generate(target, prompt, 12).tokens)
    with pytest.raises(SparsedraftError, match="--fuse-layers 0"):
        train_feature_drafter(cfg.replace(fuse_layers=(), head_init=str(folder), out_dir=str(tmp_path / "warm")),
                              target, progress=False, provenance=False)
    with pytest.raises(SparsedraftError, match="fuse_layers must be"):
        train_feature_drafter(cfg.replace(fuse_layers=(1,), out_dir=str(tmp_path / "top")), target,
                              progress=False, provenance=False)


def test_fused_sampled_windows_reuse_the_sampled_text_and_add_its_lower_layers(tmp_path):
    from sparsedraft.budgetdraft.feature_data import sampled_teacher
    from sparsedraft.engine.data import model_tokenizer
    target = tiny_model("llama")
    args = (target, "tiny-llama", model_tokenizer("tiny-llama"), 3, 16, 24, 0.8, 5, tmp_path)
    top = sampled_teacher(*args, batch=2)
    fused = sampled_teacher(*args, batch=2, fuse_layers=LAYERS)
    assert len(list(tmp_path.glob("sampled-*"))) == 2  # the text sampled once; the fused features beside it
    hidden = target.cfg.hidden_size
    for a, b in zip(top, fused):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.greedy, b.greedy)
        assert b.features.shape == (a.tokens.numel(), 2 * hidden)
        torch.testing.assert_close(b.features[:, hidden:].float(), a.features.float(), rtol=0.02, atol=0.02)
        capture = Capture(layers=set(), hidden=True, hidden_layers=LAYERS)
        with torch.no_grad():
            target(a.tokens[None], capture=capture)
        assert torch.equal(b.features, capture.features[0].to(torch.bfloat16))


def test_a_top_only_drafter_widens_into_a_fused_one_that_starts_as_itself(tmp_path, monkeypatch):
    target = tiny_model("llama")
    top = train_feature_drafter(small_run(tmp_path, "top"), target, progress=False, provenance=False)
    started, saved = {}, load_feature_head(top.run_dir / "drafter", target)  # what the folder holds (bf16)
    real = FeatureHead.init_fuse

    def spy(head, scales=None):
        real(head, scales)
        features = torch.randn(1, 7, 2 * target.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        tokens = torch.randint(0, target.cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            started["same"] = torch.allclose(head(features, tokens), saved(head.top(features), tokens))
        return head
    monkeypatch.setattr(FeatureHead, "init_fuse", spy)
    wide = train_feature_drafter(small_run(tmp_path, "wide", fuse_layers=LAYERS,
                                           head_init=str(top.run_dir / "drafter")), target, progress=False,
                                 provenance=False)
    assert started["same"]  # the widened head began as the top-only head it was loaded from
    assert wide.head.fuse_layers == LAYERS and wide.record["started_from"]["steps"] == 3
