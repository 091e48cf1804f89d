"""Training the feature head on windows read behind a long prefix (``train-drafter --behind N
--behind-sequences K --head-window SINK WINDOW``): a window keeps the prefix's sink and newest entries at their
true positions, and the head computes on it what it computes on the whole sequence through its window; the
target's teacher is that of the whole reading; training draws its losses after the gap only."""

import pytest
import torch

from sparsedraft.budgetdraft import feature_train
from sparsedraft.budgetdraft.feature_context import behind_teacher
from sparsedraft.budgetdraft.feature_data import Window, teacher_of
from sparsedraft.budgetdraft.feature_eval import window_agreement
from sparsedraft.budgetdraft.feature_loss import trained_from, unroll
from sparsedraft.budgetdraft.feature_train import train_feature_drafter
from sparsedraft.engine.data import model_tokenizer
from sparsedraft.engine.tiny import tiny_model
from sparsedraft.errors import SparsedraftError

from test_feature_train import config, random_head

SINK, WINDOW = 2, 6


def gapped(n: int, m: int) -> torch.Tensor:
    """Positions of a window of ``m`` text tokens read behind ``n`` prefix tokens, as behind_teacher keeps it."""
    return torch.cat((torch.arange(SINK + 1), torch.arange(n - WINDOW, n), n + torch.arange(m)))


def test_a_gapped_window_is_what_the_head_computes_through_its_window_over_the_whole_reading():
    target = tiny_model("llama")
    head = random_head(target, seed=8)
    gen = torch.Generator().manual_seed(9)
    n, m, steps = 20, 14, 3
    features = torch.randn(1, n + m, target.cfg.hidden_size, generator=gen)
    tokens = torch.randint(target.cfg.vocab_size, (1, n + m), generator=gen)
    positions = gapped(n, m)
    first = trained_from(positions)
    assert first == SINK + 1 and trained_from(None) == 0 and trained_from(torch.arange(5)) == 0
    starts_whole = torch.tensor([n, n + 4, n + 9])  # chains that start in the text
    starts = starts_whole - n + first + WINDOW
    with torch.no_grad():
        whole, _, _ = unroll(head, features, tokens, starts_whole, steps, window=(SINK, WINDOW))
        kept, _, _ = unroll(head, features[:, positions], tokens[:, positions], starts, steps, window=(SINK, WINDOW),
                            positions=positions)
        torch.testing.assert_close(kept[0][0, first + WINDOW - 1:], whole[0][0, n - 1:], rtol=1e-5, atol=1e-5)
        for j in range(1, steps + 1):
            torch.testing.assert_close(kept[j], whole[j], rtol=1e-5, atol=1e-5)
        # without the window the head would see prefix entries the window drops: the gapped reading differs
        full, _, _ = unroll(head, features, tokens, starts_whole, 0)
        assert not torch.allclose(kept[0][0, -5:], full[0][0, -5:], atol=1e-3)
    with pytest.raises(SparsedraftError, match="before the window's last run of consecutive positions"):
        unroll(head, features[:, positions], tokens[:, positions], torch.tensor([1]), 1, window=(SINK, WINDOW),
               positions=positions)


def test_behind_teacher_is_the_teacher_of_the_whole_reading_and_is_cached(tmp_path, monkeypatch):
    target = tiny_model("llama")
    gen = torch.Generator().manual_seed(10)
    n, m = 24, 10
    texts = [Window(torch.randint(target.cfg.vocab_size, (m,), generator=gen), None, None, None, None, "sampled")
             for _ in range(3)]
    prefixes = torch.randint(target.cfg.vocab_size, (2, n), generator=gen)
    got = behind_teacher(target, "tiny-llama", texts, prefixes, SINK, WINDOW, tmp_path)
    for i, window in enumerate(got):
        whole = torch.cat((prefixes[i % 2], texts[i].tokens))
        want = teacher_of(target, whole)
        positions = gapped(n, m)
        assert window.source == "behind" and torch.equal(window.positions, positions)
        assert torch.equal(window.tokens, whole[positions]) and torch.equal(window.greedy, want["greedy"][positions])
        torch.testing.assert_close(window.features.float(), want["features"][positions].float(), rtol=0.02, atol=0.02)
    assert len(list(tmp_path.glob("behind-*"))) == 3  # one file per window
    monkeypatch.setattr(feature_train, "teacher_of", lambda *a, **k: pytest.fail("recomputed"), raising=False)
    again = behind_teacher(target, "tiny-llama", texts, prefixes, SINK, WINDOW, tmp_path, compute=False)
    assert all(torch.equal(a.features, b.features) for a, b in zip(got, again))
    fewer = behind_teacher(target, "tiny-llama", texts[:2], prefixes, SINK, WINDOW, tmp_path, compute=False)
    assert all(torch.equal(a.features, b.features) for a, b in zip(got, fewer))  # a shorter run reuses them
    with pytest.raises(SparsedraftError, match="not cached"):
        behind_teacher(target, "tiny-llama", texts, prefixes[:, 1:], SINK, WINDOW, tmp_path, compute=False)
    with pytest.raises(SparsedraftError, match="leaves no gap"):
        behind_teacher(target, "tiny-llama", texts, prefixes[:, :SINK + WINDOW], SINK, WINDOW, tmp_path)


def test_a_run_behind_a_prefix_trains_after_the_gap_and_records_its_windows(tmp_path):
    target = tiny_model("llama")
    shape = dict(sequences=1, pydoc_sequences=0, sampled_sequences=2, sampled_prompt=16, sampled_tokens=24,
                 temperature=0.0, eval_sequences=1, head_window=(SINK, WINDOW), behind=40, behind_sequences=2,
                 steps=6, lam=0.5, unroll=2)
    cfg = config(tmp_path, "behind", **shape)
    data = feature_train.load_feature_data(cfg, target, model_tokenizer("tiny-llama"), False)
    behind = [w for w in data.train if w.source == "behind"]
    assert len(behind) == 2 and data.sizes()["behind_tokens"] == 2 * (SINK + 1 + WINDOW + 40)
    sampled = [w for w in data.train if w.source == "sampled"]
    for b, s in zip(behind, sampled):  # the same text, read behind a prefix
        assert torch.equal(b.tokens[SINK + 1 + WINDOW:], s.tokens) and b.positions[-1] == 40 + 39
    for step in range(40):
        index, draws = feature_train.step_draws(cfg, step, data.train, data.scales, target.cfg.hidden_size)
        first = trained_from(data.train[index].positions)
        assert int(draws.ce_positions.min()) >= first and int(draws.starts.min()) >= first
        assert draws.budget is None or first == 0
    result = train_feature_drafter(cfg, target, progress=False, provenance=False)
    assert set(result.record["training_fit"]) == {"essays", "sampled", "behind"}
    seen, every = (window_agreement(result.head, data.held_out[0], data.ids, cfg.unroll, head_window=w)
                   for w in (cfg.window, None))
    assert {k: result.record["held_out_agreement"][k] for k in seen} == seen != every  # as it trained to see


@pytest.mark.parametrize("changes, message", [
    (dict(behind=40), "go together"),
    (dict(behind=40, behind_sequences=1), "give head_window SINK WINDOW"),
    (dict(behind=8, behind_sequences=1, head_window=(2, 6)), "SINK \\+ WINDOW < behind"),
    (dict(behind=40, behind_sequences=3, head_window=(2, 6)), "at most sampled_sequences"),
    (dict(head_window=(2,)), "head_window takes SINK >= 0 and WINDOW >= 1"),
])
def test_bad_behind_flags_fail_before_any_work(tmp_path, changes, message):
    with pytest.raises(SparsedraftError, match=message):
        config(tmp_path, "bad", sampled_sequences=2, sampled_prompt=16, sampled_tokens=24, **changes)


def test_the_prefixes_training_reads_behind_are_not_the_ones_the_agreement_check_reads():
    from sparsedraft.bench.agreement import behind_prefixes
    from sparsedraft.budgetdraft.feature_context import CHECK_PREFIXES, prefix_windows, training_prefixes
    tokenizer = model_tokenizer("tiny-llama")
    trained, checked = training_prefixes(tokenizer, 12), prefix_windows(tokenizer, 12, CHECK_PREFIXES)
    assert not any(torch.equal(a, b) for a in trained for b in checked)
    assert torch.equal(trained[0], prefix_windows(tokenizer, 12, 1, first=CHECK_PREFIXES)[0])
    with pytest.raises(SparsedraftError, match="give --prompts <= 16"):  # before the drafter folder is read
        behind_prefixes("no-such-folder", 12, CHECK_PREFIXES + 1)

