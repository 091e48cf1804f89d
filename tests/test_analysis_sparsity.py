"""Attention recovery: exact rows, a loop reference, hand-made attention with known answers."""

import math

import pytest
import torch

from sparsedraft.analysis.attention import LayerQK, layer_qk
from sparsedraft.analysis.sparsity import (SparsityConfig, attention_recovery, last_positions, layer_recovery,
                                           summarize_recovery)
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.model import Capture
from sparsedraft.engine.tiny import TINY_CONFIGS, tiny_model


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_rows_equal_the_models_own_attention(family):
    model = tiny_model(family)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 50), generator=torch.Generator().manual_seed(1))
    capture = Capture(layers={0, 1}, weights=True)
    with torch.no_grad():
        model(ids, capture=capture)
    positions = torch.tensor([0, 7, 31, 49])
    for qk in layer_qk(model, ids, prefill_chunk=16):  # chunked prefill must not change the queries
        expected = capture.attention[qk.layer][0][:, positions]
        assert (qk.rows(positions) - expected).abs().max() < 1e-5


def _hand_made() -> LayerQK:
    """One head, 32 keys: every query scores 10 on keys 3 and 17 and 0 on all others."""
    queries = torch.zeros(1, 32, 4)
    queries[..., 0] = 10.0
    keys = torch.zeros(1, 32, 4)
    keys[0, [3, 17], 0] = 1.0
    return LayerQK(0, queries, keys, scale=1.0)


def test_hand_made_attention_gives_known_recoveries():
    config = SparsityConfig(budgets=(8, 16), chunk_size=8, sink=4)
    frame = layer_recovery(_hand_made(), [31], config).set_index(["method", "budget"]).recovery
    hot, total = math.exp(10), 2 * math.exp(10) + 30
    assert frame["topk", 8] == pytest.approx((2 * hot + 6) / total)  # both hot keys + 6 cold ones
    assert frame["chunk", 16] == pytest.approx((2 * hot + 14) / total)  # sink chunk 0 (key 3) + chunk 2 (key 17)
    assert frame["chunk", 8] == pytest.approx((hot + 7) / total)  # only the sink chunk fits
    assert frame["streaming", 8] == pytest.approx((hot + 7) / total)  # sinks 0-3 hold key 3; window 28-31
    assert frame["h2o", 8] == pytest.approx(frame["topk", 8])  # heavy hitters are the hot keys


def _softmax(scores):
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    return [e / sum(exps) for e in exps]


def _loop_reference(qk: LayerQK, positions, budget, chunk, sink, recent_share, share):
    """Mean recovery per (method, head) computed key by key."""
    q, k = qk.queries.double().tolist(), qk.keys.double().tolist()
    heads, group = qk.heads, qk.group
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    weights = {p: [_softmax([qk.scale * dot(q[h][p], k[h // group][j]) for j in range(p + 1)]) for h in range(heads)]
               for p in range(max(positions) + 1)}
    units = [list(range(u * group, (u + 1) * group)) for u in range(heads // group)] if share else \
        [[h] for h in range(heads)]
    out = {m: [0.0] * heads for m in ("topk", "chunk", "streaming", "h2o")}
    for p in positions:
        n = p + 1
        for members in units:
            def total(j, members=members):
                return sum(weights[p][h][j] for h in members)
            chosen = {"topk": sorted(range(n), key=lambda j: (-total(j), j))[:budget]}
            chunk_score = {}
            for c in range(p // chunk + 1):
                ids = range(c * chunk, min((c + 1) * chunk, n))
                mean = [sum(k[members[0] // group][j][d] for j in ids) / len(ids) for d in range(len(k[0][0]))]
                chunk_score[c] = sum(dot(q[h][p], mean) for h in members)
            order = sorted(chunk_score, key=lambda c: (c != 0, -chunk_score[c], c))
            chosen["chunk"] = [j for c in order for j in range(c * chunk, min((c + 1) * chunk, n))][:budget]
            chosen["streaming"] = sorted(range(n), key=lambda j: j if j < sink else sink + p - j)[:budget]
            recent = max(1, round(recent_share * budget))
            cumulative = {j: sum(weights[t][h][j] for t in range(j, p) for h in members) for j in range(n)}
            window = [j for j in range(n) if p - j < recent]
            heavy = sorted((j for j in range(n) if p - j >= recent), key=lambda j: (-cumulative[j], j))
            chosen["h2o"] = (window + heavy)[:budget]
            for method, keys in chosen.items():
                for h in members:
                    out[method][h] += sum(weights[p][h][j] for j in keys) / len(positions)
    return out


@pytest.mark.parametrize("share", [True, False])
def test_vectorised_recovery_matches_a_loop_reference(share):
    gen = torch.Generator().manual_seed(3)
    qk = LayerQK(0, torch.randn(4, 40, 8, generator=gen), torch.randn(2, 40, 8, generator=gen), scale=0.5)
    positions = [5, 22, 39]
    config = SparsityConfig(budgets=(8,), chunk_size=4, sink=3, h2o_recent_share=0.25,
                            share_across_group=share, query_block=2)
    frame = layer_recovery(qk, positions, config).set_index(["method", "head"]).recovery
    reference = _loop_reference(qk, positions, 8, 4, 3, 0.25, share)
    for method, per_head in reference.items():
        for head, value in enumerate(per_head):
            assert frame[method, head] == pytest.approx(value, abs=1e-5), (method, head)


def test_full_budget_recovers_everything_and_topk_is_the_oracle():
    model = tiny_model("mistral")  # 4 query heads on 1 KV head
    ids = torch.randint(0, model.cfg.vocab_size, (1, 96), generator=torch.Generator().manual_seed(2))
    config = SparsityConfig(budgets=(8, 0.25, 96), share_across_group=False)
    frame = attention_recovery(model, ids, last_positions(96, 12), config=config)
    assert list(frame.columns) == ["layer", "head", "method", "budget", "budget_tokens", "recovery"]
    assert frame[frame.budget == 96].recovery.sub(1).abs().max() < 1e-5
    assert frame.recovery.between(0, 1 + 1e-6).all()
    wide = frame.pivot_table(index=["layer", "head", "budget"], columns="method", values="recovery")
    for method in ("chunk", "streaming", "h2o"):
        assert (wide["topk"] >= wide[method] - 1e-6).all()
    topk = frame[frame.method == "topk"].groupby("budget").recovery.mean()
    assert topk[8] < topk[0.25] < topk[96]
    summary = summarize_recovery(frame)
    assert set(summary.columns) == {"method", "budget", "mean", "min", "max"}


def test_fraction_budget_rounds_to_whole_chunks():
    frame = layer_recovery(_hand_made(), [31], SparsityConfig(budgets=(0.5,), chunk_size=8, methods=("topk",)))
    assert frame.budget_tokens.iloc[0] == 16  # half of 32 keys


@pytest.mark.parametrize("kwargs, fragment", [
    ({"budgets": (12,)}, "multiple of chunk_size"),
    ({"budgets": (1.5,)}, "fractional budget"),
    ({"methods": ("topk", "snapkv")}, "unknown entries"),
    ({"h2o_recent_share": 2.0}, "h2o_recent_share"),
])
def test_config_rejects_bad_values(kwargs, fragment):
    with pytest.raises(SparsedraftError, match=fragment):
        SparsityConfig(**kwargs)


def test_bad_inputs_fail_before_work():
    model = tiny_model("llama")
    with pytest.raises(SparsedraftError, match="query positions"):
        attention_recovery(model, torch.zeros(20, dtype=torch.long), [25])
    with pytest.raises(SparsedraftError, match="one sequence"):
        attention_recovery(model, torch.zeros(2, 20, dtype=torch.long), [5])
    with pytest.raises(SparsedraftError, match="layers"):
        attention_recovery(model, torch.zeros(20, dtype=torch.long), [5], layers=[7])


@pytest.mark.slow
def test_smollm2_attention_is_sparse(smollm2):
    from sparsedraft.engine.data import prompt_tokens
    model, tokenizer = smollm2
    prompt = prompt_tokens(tokenizer, 1024)
    config = SparsityConfig(budgets=(0.05, 0.25), methods=("topk", "chunk", "streaming"))
    frame = attention_recovery(model, prompt, last_positions(1024, 16), layers=[4, 14, 24], config=config)
    mean = frame.groupby(["method", "budget"]).recovery.mean()  # measured: topk 0.84 / 0.96 at 5% / 25%
    assert mean["topk", 0.25] > mean["topk", 0.05] > 0.75
    assert mean["topk", 0.05] > mean["chunk", 0.05] > mean["streaming", 0.05] * 0.9
