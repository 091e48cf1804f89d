"""A feature head that reads prompt lookup's proposal (``FeatureHead(lookup=True)``, a learnt lookup first).

The table is prompt lookup's own rule at every position, kept incrementally by
the drafter and computed whole for training, and both give the same rows. The
head reads the same row at the same entry whether it drafts, fills its cache
or trains. Greedy output stays the target's over every cache; the sampling
law is held by the chi-square test in test_feature_drafter.py. Training
starts from a head without lookup as that head, and a window read behind a
long prefix carries lookup's rows over its whole reading. The raced head is
gated (``lookup_gate``): its draft logits carry the bias for the row its
entry read, in drafting, cache filling and training alike.
"""

from __future__ import annotations

import random

import pytest
import torch
from feature_heads import greedy_run, perturbed_head, raced, small_run

from sparsedraft import SparsedraftError, decode
from sparsedraft.budgetdraft.feature_context import behind_teacher
from sparsedraft.budgetdraft.feature_data import Window
from sparsedraft.budgetdraft.feature_loss import TokenHead, unroll
from sparsedraft.budgetdraft.feature_train import train_feature_drafter
from sparsedraft.engine.cache import StaticCache
from sparsedraft.engine.prefill import prefill
from sparsedraft.engine.tiny import tiny_model
from sparsedraft.speculative import speculative
from sparsedraft.speculative.drafters import ngram_lookup
from sparsedraft.speculative.feature import GATE_GAIN, Entries, FeatureHead, load_feature_head, save_feature_head
from sparsedraft.speculative.feature_drafter import FeatureDrafter
from sparsedraft.speculative.lookup_input import LookupTable, lookup_table

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 24


def test_the_table_is_prompt_lookups_proposal_at_every_position_and_follows_rewinds():
    rng = random.Random(0)
    for _ in range(100):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 50))]
        table = LookupTable()
        table.extend(tokens)
        for p in range(len(tokens)):
            proposal, n = ngram_lookup(torch.tensor(tokens[:p + 1]), 1)
            assert table.rows[p][1] == n and (n == 0 or table.rows[p][0] == int(proposal[0]))
        cut, more = rng.randrange(len(tokens) + 1), [rng.randrange(5) for _ in range(rng.randrange(20))]
        table.truncate(cut)
        table.extend(more)
        fresh = LookupTable()
        fresh.extend(tokens[:cut] + more)
        assert table.rows == fresh.rows and table.ends == fresh.ends
    assert torch.equal(lookup_table(torch.tensor([fresh.tokens]))[0], fresh.table(0, len(fresh)))


def lookup_pair():
    """A gated lookup head (EAGLE's start, which the raced target's text partly agrees with, its lookup_fc
    moved off zero, its gate a few nats per match length) racing a tiny target; its random 48-token prompt
    repeats tokens, so lookup finds matches."""
    def make(target):
        head = FeatureHead(target.cfg, lookup=True, lookup_gate=True).init_from(target).attach(target)
        with torch.no_grad():
            head.lookup_fc.weight.normal_(0.0, 0.003, generator=torch.Generator().manual_seed(1))  # heard, not ruling
            head.lookup_bias.copy_(torch.tensor([0.5, 0.02, 0.05, 0.1]))  # slot 0 (no match) must stay unread
        return head.requires_grad_(False)
    return raced(make, NEW)


@pytest.fixture(scope="module")
def pair():
    return lookup_pair()


@pytest.mark.parametrize("cache", ["full", "streaming", "budget"])
def test_greedy_speculation_with_a_lookup_head_equals_autoregressive(pair, cache):
    out = greedy_run(pair, cache)
    level = out.stats.levels[-1]
    assert 0 < level.accepted and level.drafted > 0


def test_the_head_reads_the_same_row_drafting_filling_its_cache_and_training(pair):
    """Entry t reads the table's row t + 1 everywhere: the cache-filling forward (Entries), the training
    forward (unroll) and the drafter's own table after a run all agree."""
    target, head, prompt, _ = pair
    from sparsedraft.engine.model import Capture
    capture = Capture(layers=set(), hidden=True)
    target(prompt, capture=capture)
    features, tokens = capture.features, prompt
    trained, _, rows = unroll(head, features, tokens, torch.zeros(0, dtype=torch.long), 0)
    cache = StaticCache(head.cfg, tokens.shape[1], 1, head.dtype, head.device)
    filled = prefill(Entries(head, features, head.lookups_for(tokens)), cache, tokens[:, 1:])  # last entry's logits
    gated = head.logits(trained[0][:, -1:], rows[0][:, -1:])
    ungated = TokenHead(head, None).target_logits(trained[0][:, -1:])
    assert rows[0][0, -1, 1] > 0 and not torch.allclose(gated, ungated)  # the gate is read
    torch.testing.assert_close(filled, gated[:, -1], rtol=1e-4, atol=1e-4)
    drafter = FeatureDrafter.create(head, "full", prompt.shape[1] + NEW, gamma=3)
    speculative(target, drafter, prompt, NEW, 3)
    assert torch.equal(drafter.lookup.table(0, len(drafter.tokens)), lookup_table(torch.tensor([drafter.tokens]))[0])
    silent = head.lookup_input(torch.zeros(1, 1, 2, dtype=torch.long))
    found = head.lookup_input(torch.tensor([[[5, 2]]]))
    assert not torch.equal(silent, found)  # the proposal reaches the head


def test_the_gate_adds_its_bias_at_the_proposed_token_where_lookup_matched(pair):
    """GATE_GAIN * lookup_bias[n] lands on the proposed token's logit where lookup matched n > 0 tokens, nowhere
    else; a restricted head puts it on that token's column, or nowhere when the token is outside its vocabulary.
    A gate needs the lookup input."""
    target, head, _, _ = pair
    features = torch.randn(1, 4, head.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    rows = torch.tensor([[[5, 0], [5, 1], [7, 3], [2, 2]]])
    plain, gated = TokenHead(head, None).target_logits(features), head.logits(features, rows)
    bias = torch.zeros_like(plain)
    for i, (token, n) in enumerate(rows[0].tolist()):
        if n:
            bias[0, i, token] = GATE_GAIN * float(head.lookup_bias[n])
    torch.testing.assert_close(gated - plain, bias)
    ids = torch.tensor([2, 5, 9])  # 7 is outside: its row gets nothing
    restricted = TokenHead(head, ids)
    diff = restricted.logits(features, rows) - restricted.target_logits(features)
    want = torch.zeros_like(diff)
    want[0, 1, 1], want[0, 3, 0] = GATE_GAIN * float(head.lookup_bias[1]), GATE_GAIN * float(head.lookup_bias[2])
    torch.testing.assert_close(diff, want)
    with pytest.raises(SparsedraftError, match="needs lookup=True"):
        FeatureHead(target.cfg, lookup_gate=True)
    with pytest.raises(SparsedraftError, match="read the lookup rows"):
        head.logits(features)


def test_lookup_rows_are_required_by_a_lookup_head_and_refused_by_any_other(pair):
    target, head, prompt, _ = pair
    feats, tokens = torch.randn(1, 4, head.cfg.hidden_size), prompt[:, :4]
    with pytest.raises(SparsedraftError, match="pass lookups"):
        head(feats, tokens)
    plain = perturbed_head(target)[0]
    with pytest.raises(SparsedraftError, match="pass no lookups"):
        plain(feats, tokens, lookups=torch.zeros(1, 4, 2, dtype=torch.long))


def test_a_saved_lookup_head_loads_as_one_and_decodes_through_decode(pair, tmp_path):
    target, head, prompt, ar = pair
    folder = save_feature_head(head, tmp_path / "lookup", target)
    loaded = load_feature_head(folder, target)
    assert loaded.lookup and torch.equal(loaded.lookup_gain, head.lookup_gain.to(torch.bfloat16).float())  # as saved
    for method, options in (("spec", {}), ("budgetdraft", {"budget": 16, "chunk_size": 4}),
                            ("triforce", {"budget": 16, "chunk_size": 4, "sink": 4, "window": 8})):
        assert torch.equal(decode(target, prompt, method, NEW, draft=str(folder), **options).tokens, ar)


def test_training_learns_a_lookup_input_from_a_head_without_one(tmp_path, monkeypatch):
    """A run with lookup_input from a plain head starts as that head (its lookup silent) and moves the lookup
    input; a lookup head cannot be trained into a plain one."""
    target = tiny_model("llama")
    plain = train_feature_drafter(small_run(tmp_path, "plain"), target, progress=False, provenance=False)
    saved, started = load_feature_head(plain.run_dir / "drafter", target), {}
    real = FeatureHead.init_lookup

    def spy(head, target_, rms=None):
        real(head, target_, rms)
        features = torch.randn(1, 7, target.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        tokens = torch.tensor([[1, 2, 3, 1, 2, 3, 1]])
        with torch.no_grad():
            started["same"] = torch.allclose(head(features, tokens, lookups=head.lookups_for(tokens)),
                                             saved(features, tokens))
        return head
    monkeypatch.setattr(FeatureHead, "init_lookup", spy)
    child = train_feature_drafter(small_run(tmp_path, "child", head_init=str(plain.run_dir / "drafter"),
                                            lookup_input=True), target, progress=False, provenance=False)
    assert started == {"same": True}
    assert child.head.lookup and float(child.head.lookup_fc.weight.detach().abs().max()) > 0
    assert child.record["recipe"]["lookup_input"] is True
    with pytest.raises(SparsedraftError, match="pass --lookup-input"):
        train_feature_drafter(small_run(tmp_path, "back", head_init=str(child.run_dir / "drafter")), target,
                              progress=False, provenance=False)
    gated = train_feature_drafter(small_run(tmp_path, "gated", head_init=str(child.run_dir / "drafter"),
                                            lookup_input=True, lookup_gate=True), target, progress=False,
                                  provenance=False)
    assert float(gated.head.lookup_bias.detach()[1:].abs().max()) > 0 and gated.record["recipe"]["lookup_gate"]
    assert load_feature_head(gated.run_dir / "drafter", target).lookup_gate
    with pytest.raises(SparsedraftError, match="pass --lookup-gate"):
        train_feature_drafter(small_run(tmp_path, "ungated", head_init=str(gated.run_dir / "drafter"),
                                        lookup_input=True), target, progress=False, provenance=False)
    with pytest.raises(SparsedraftError, match="pass --lookup-input too"):
        small_run(tmp_path, "half", lookup_gate=True)


def test_train_only_fits_the_gate_and_leaves_every_other_weight_as_it_started(tmp_path, monkeypatch):
    target = tiny_model("llama")
    parent = train_feature_drafter(small_run(tmp_path, "parent", lookup_input=True, lookup_gate=True), target,
                                   progress=False, provenance=False)
    fitted = train_feature_drafter(small_run(tmp_path, "fitted", head_init=str(parent.run_dir / "drafter"),
                                             lookup_input=True, lookup_gate=True, train_only=("lookup_bias",)),
                                   target, progress=False, provenance=False)
    before = load_feature_head(parent.run_dir / "drafter", target).state_dict()
    after = load_feature_head(fitted.run_dir / "drafter", target).state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == ["lookup_bias"]
    import sparsedraft.budgetdraft.feature_train as feature_train

    def no_data(*args, **kwargs):
        raise AssertionError("teacher data made before the bad name was refused")
    monkeypatch.setattr(feature_train, "load_feature_data", no_data)
    with pytest.raises(SparsedraftError, match="train_only names \\['lookup_gate'\\]"):
        train_feature_drafter(small_run(tmp_path, "typo", lookup_input=True, lookup_gate=True,
                                        train_only=("lookup_gate",)), target, progress=False, provenance=False)


def test_a_window_read_behind_a_prefix_carries_lookups_over_the_whole_reading(tmp_path):
    """behind_teacher keeps some of the prefix's entries; lookup reads all its tokens, so a lookup head's window
    carries the rows of the whole reading at the kept positions, and through the head's window it computes on
    the kept entries what it computes on the whole reading. Without them a gapped window is refused."""
    target = tiny_model("llama")
    head = perturbed_head(target, noise=0.2, floor=0.2, lookup=True)[0]
    sink, window, n, m, steps = 2, 6, 24, 12, 2
    gen = torch.Generator().manual_seed(10)
    texts = [Window(torch.randint(8, (m,), generator=gen), None, None, None, None, "sampled") for _ in range(2)]
    prefixes = torch.randint(8, (2, n), generator=gen)  # a small alphabet: lookup finds matches across the gap
    got = behind_teacher(target, "tiny-llama", texts, prefixes, sink, window, tmp_path, lookups=True)
    for i, w in enumerate(got):
        whole = torch.cat((prefixes[i], texts[i].tokens))
        assert torch.equal(w.lookups, lookup_table(whole[None])[0][w.positions])
    w, whole = got[0], torch.cat((prefixes[0], texts[0].tokens))[None]
    features = torch.randn(1, n + m, target.cfg.hidden_size, generator=gen)
    first = sink + 1 + window
    starts_whole = torch.tensor([n, n + 5])
    with torch.no_grad():
        full, _, _ = unroll(head, features, whole, starts_whole, steps, window=(sink, window))
        kept, _, _ = unroll(head, features[:, w.positions], w.tokens[None], starts_whole - n + first, steps,
                            window=(sink, window), positions=w.positions, lookups=w.lookups[None])
    torch.testing.assert_close(kept[0][0, first - 1:], full[0][0, n - 1:], rtol=1e-5, atol=1e-5)
    for j in range(1, steps + 1):
        torch.testing.assert_close(kept[j], full[j], rtol=1e-5, atol=1e-5)
    with pytest.raises(SparsedraftError, match="pass its lookups"):
        unroll(head, features[:, w.positions], w.tokens[None], starts_whole - n + first, steps,
               window=(sink, window), positions=w.positions)
