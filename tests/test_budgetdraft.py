"""BudgetDraft's loss, drafter inits, config validation and teacher cache (tiny models, no downloads)."""

from pathlib import Path

import pytest
import torch

from sparsedraft.budgetdraft.config import TrainConfig
from sparsedraft.budgetdraft.init import copy_first_layers, init_drafter
from sparsedraft.budgetdraft.loss import budgetdraft_loss
from sparsedraft.caches import BUDGETS
from sparsedraft.budgetdraft.teacher import greedy_targets, teacher_targets
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.tiny import tiny_model


def batch(t=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (2, t), generator=gen), torch.randint(0, 256, (2, t), generator=gen)


PREFIX = 40  # of the 64-token windows: L_C covers positions 40..63


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sparse_loss_with_budget_covering_the_prefix_is_the_full_loss_on_the_continuation(family):
    model = tiny_model(family)
    tokens, targets = batch()
    continuation = torch.arange(PREFIX, 64)
    full = budgetdraft_loss(model, tokens, targets, 0.0, 8, PREFIX, 8, 16, continuation).full
    for budget in (40, 128):
        parts = budgetdraft_loss(model, tokens, targets, 0.5, budget, PREFIX, 8, 16, continuation)
        assert parts.sparse == pytest.approx(full, abs=1e-5)


def test_small_budget_changes_the_loss_and_lambda_zero_skips_it():
    model = tiny_model("llama")
    tokens, targets = batch()
    continuation = torch.arange(PREFIX, 64)
    sparse = budgetdraft_loss(model, tokens, targets, 1.0, 16, PREFIX, 8, 16, continuation)
    assert abs(sparse.sparse - sparse.full) > 1e-4
    assert torch.isclose(sparse.total, torch.tensor(sparse.full + sparse.sparse))
    ablation = budgetdraft_loss(model, tokens, targets, 0.0, 16, PREFIX, 8, 16, continuation)
    assert ablation.sparse is None and ablation.full == sparse.full


def test_bad_prefix_and_sliding_window_fail_before_any_forward():
    tokens, targets = batch()
    with pytest.raises(SparsedraftError, match="prefix_len"):
        budgetdraft_loss(tiny_model("llama"), tokens, targets, 1.0, 16, 64, 8, 16)
    with pytest.raises(SparsedraftError, match="sliding-window"):
        budgetdraft_loss(tiny_model("mistral"), tokens, targets, 1.0, 16, PREFIX, 8, 16)


def test_gradients_reach_only_trainable_parameters_and_never_the_verifier():
    verifier = tiny_model("llama")  # tied embedding/head, like SmolLM2
    before = {k: v.clone() for k, v in verifier.state_dict().items()}
    drafter = init_drafter(verifier, TrainConfig(verifier="tiny-llama", layers=1, seq_len=64, continuation=24,
                                                 budgets=(16,)))
    tokens, targets = batch()
    budgetdraft_loss(drafter, tokens, targets, 1.0, 16, PREFIX, 8, 16).total.backward()
    for name, p in drafter.named_parameters():
        if name in ("embed_tokens.weight", "lm_head.weight"):
            assert p.grad is None and not p.requires_grad
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    torch.optim.SGD([p for p in drafter.parameters() if p.requires_grad], lr=1.0).step()
    assert all(torch.equal(before[k], v) for k, v in verifier.state_dict().items())
    assert all(p.grad is None for p in verifier.parameters())


def test_trained_embeddings_get_gradients():
    verifier = tiny_model("qwen2")  # untied head
    drafter = init_drafter(verifier, TrainConfig(verifier="tiny-qwen2", layers=1, seq_len=64, continuation=24,
                                                 budgets=(16,), train_embeddings=True))
    tokens, targets = batch()
    budgetdraft_loss(drafter, tokens, targets, 1.0, 16, PREFIX, 8, 16).total.backward()
    assert drafter.embed_tokens.weight.grad is not None and drafter.lm_head.weight.grad is not None


def test_inits():
    verifier = tiny_model("llama", num_hidden_layers=3)
    copied = copy_first_layers(verifier, 2)
    assert copied.cfg.num_layers == 2
    assert torch.equal(copied.layers[1].mlp.up_proj.weight, verifier.layers[1].mlp.up_proj.weight)
    assert copied.layers[1].mlp.up_proj.weight.data_ptr() != verifier.layers[1].mlp.up_proj.weight.data_ptr()
    scratch = init_drafter(verifier, TrainConfig(verifier="tiny-llama", drafter_init="scratch", layers=2,
                                                 seq_len=64, continuation=24, budgets=(16,)))
    assert not torch.equal(scratch.layers[0].self_attn.q_proj.weight, verifier.layers[0].self_attn.q_proj.weight)
    assert torch.equal(scratch.embed_tokens.weight, verifier.embed_tokens.weight)
    other = init_drafter(verifier, TrainConfig(verifier="tiny-llama", drafter_init="tiny-qwen2", seq_len=64,
                                               continuation=24, budgets=(16,)))
    assert other.cfg.family == "qwen2" and other.training


def test_default_training_budgets_cover_the_evaluated_ones_with_a_longer_prefix():
    cfg = TrainConfig()
    assert set(BUDGETS) <= set(cfg.budgets) and cfg.prefix_len > max(BUDGETS)


def test_bad_configs_fail_clearly():
    with pytest.raises(SparsedraftError, match="longer than the largest budget"):
        TrainConfig(seq_len=512, continuation=64, budgets=(256, 512))
    with pytest.raises(SparsedraftError, match="multiple of chunk_size"):
        TrainConfig(budgets=(64, 100), chunk_size=8)
    with pytest.raises(SparsedraftError, match="lam"):
        TrainConfig(lam=-0.1)
    with pytest.raises(SparsedraftError, match="loss_fraction"):
        TrainConfig(loss_fraction=0)
    with pytest.raises(SparsedraftError, match="vocabulary"):
        init_drafter(tiny_model("llama", vocab_size=300), TrainConfig(drafter_init="tiny-qwen2", seq_len=64,
                                                                      continuation=24, budgets=(16,)))
    with pytest.raises(SparsedraftError, match="layers"):
        init_drafter(tiny_model("llama"), TrainConfig(layers=2, seq_len=64, continuation=24, budgets=(16,)))


def test_teacher_targets_are_cached_and_required_without_compute(tmp_path):
    verifier = tiny_model("llama")
    windows, _ = batch(t=32)
    with pytest.raises(SparsedraftError, match="not cached"):
        teacher_targets(verifier, "tiny-llama", windows, tmp_path, compute=False)
    targets = teacher_targets(verifier, "tiny-llama", windows, tmp_path)
    assert torch.equal(targets, greedy_targets(verifier, windows))
    assert len(list(tmp_path.iterdir())) == 1
    assert torch.equal(teacher_targets(verifier, "tiny-llama", windows, tmp_path, compute=False), targets)
    with pytest.raises(SparsedraftError, match="not cached"):  # other windows, other file
        teacher_targets(verifier, "tiny-llama", windows[:, :16], tmp_path, compute=False)


def test_the_chunk_rule_is_a_training_option_that_leaves_existing_run_names_alone():
    base = TrainConfig()
    assert "scoring" not in base.shaping()  # runs trained before the option keep their folders
    assert TrainConfig(scoring="keys").run_name != base.run_name
    with pytest.raises(SparsedraftError, match="chunk scoring must be one of"):
        TrainConfig(scoring="mean")


def test_a_default_shaped_run_lives_in_the_default_folder():
    default = TrainConfig()
    assert default.run_dir == Path("outputs/budgetdraft/default")
    # steps, evaluation and checkpointing do not shape the weights: still the default run (extended or resumed)
    assert TrainConfig(steps=300, eval_every=0, final_context=0).run_dir == default.run_dir
    other = TrainConfig(lam=0.0)
    assert other.run_dir == Path("outputs/budgetdraft") / other.run_name != default.run_dir
    assert TrainConfig(out_dir="elsewhere").run_dir == Path("elsewhere")
    assert default.verifier == "smollm2-135m-yarn32k"  # its RoPE lets the drafter draft past 8K


def test_budgetdraft_drafts_with_the_committed_feature_drafter_by_default(tmp_path, monkeypatch):
    """Its default is where make reproduce copies the committed feature drafter; missing, one error says how to
    get it, before any forward."""
    from sparsedraft import decode
    from sparsedraft.speculative.methods import COMMITTED_DRAFTER, DEFAULT_DRAFTER, BudgetDraftOptions
    from sparsedraft.speculative.loading import drafter_kind
    assert BudgetDraftOptions().draft == DEFAULT_DRAFTER == "outputs/drafters/feature"
    assert drafter_kind(str(Path(__file__).resolve().parents[1] / COMMITTED_DRAFTER)) == "feature"
    monkeypatch.chdir(tmp_path)  # no outputs/ here
    with pytest.raises(SparsedraftError, match="make reproduce"):
        decode(tiny_model("llama", 0), torch.randint(0, 256, (1, 64)), "budgetdraft", 4)
