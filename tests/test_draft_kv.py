"""Quantised retrieval caches for self-draft levels (``draft_kv``): values stored as int8 or int4, quantised from
the target's own KV; the verifier's cache keeps its precision, so greedy output equals plain greedy token for
token. Tiny random models in process; bad values fail before any forward."""

import pytest
import torch

from sparsedraft import decode
from sparsedraft.caches import RetrievalCache
from sparsedraft.caches.kv_quant import QuantizedKV, QuantizedRetrievalCache
from sparsedraft.engine.cache import StaticCache
from sparsedraft.engine.model import Capture
from sparsedraft.engine.tiny import tiny_model
from sparsedraft.errors import SparsedraftError
from sparsedraft.speculative.methods import method_options

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 24
RUNS = {"retrieval": dict(budget=16, chunk_size=4, gamma=4),
        "triforce": dict(budget=16, chunk_size=4, gamma1=2, gamma2=4)}


def prompt(length: int = 48) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("bits, group, worst", [(8, 64, 1 / 254), (4, 32, 1 / 14)])
def test_stored_values_come_back_within_half_a_step_of_their_group(bits, group, worst):
    x = torch.randn(2, 3, 10, 64, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 2, 10)[:, None]
    store = QuantizedKV(bits, (2, 3, 12, 64))
    store.write(slice(0, 4), x[:, :, :4])
    store.write(torch.tensor([11, 4, 5, 6, 7, 8]), x[:, :, 4:])  # out of order, as recent tokens land
    back = store.read_into(torch.empty(2, 3, 12, 64))
    order = torch.tensor([0, 1, 2, 3, 11, 4, 5, 6, 7, 8])
    err = (back[:, :, order] - x).abs().unflatten(-1, (-1, group))
    bound = x.abs().unflatten(-1, (-1, group)).amax(-1, keepdim=True) * worst * 1.0001
    assert (err <= bound).all() and err.max() > 0  # within half a quantisation step, and really quantised
    assert back[:, :, 9:11].abs().max() == 0  # slots never written stay empty
    assert store.nbytes < x.numel() * 4 * 12 / 10 / (2 if bits == 8 else 4)  # well under the fp32 bytes


@pytest.mark.parametrize("draft_kv", ["int8", "int4"])
def test_the_view_reads_its_budget_from_the_store_and_its_new_tokens_exactly(draft_kv):
    target = tiny_model("llama", 0)
    full = StaticCache(target.cfg, 64)
    capture = Capture(layers=set(range(target.cfg.num_layers)))
    target(prompt(40), cache=full, capture=capture)
    queries = {layer: q[:, :, -1] for layer, q in capture.queries.items()}
    plain = RetrievalCache(target.cfg, 16, 4, spec_slots=4)
    quant = QuantizedRetrievalCache(target.cfg, 16, 4, spec_slots=4, draft_kv=draft_kv)
    for view in (plain, quant):
        view.build(full, queries)
    positions = torch.tensor([[40]])
    new_k, new_v = torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32)
    for view in (plain, quant):
        view.begin(positions)
    (pk, pv, _), (qk, qv, _) = plain.attend(0, new_k, new_v), quant.attend(0, new_k, new_v)
    if draft_kv == "int8":  # codes for the attention kernel; their dense form is what any other path reads
        qk, qv = qk.dense(), qv.dense()
    assert torch.equal(qk[:, :, 16:], pk[:, :, 16:]) and torch.equal(qv[:, :, 16:], pv[:, :, 16:])
    step = 1 / 127 if draft_kv == "int8" else 1 / 7
    assert 0 < (qk[:, :, :16] - pk[:, :, :16]).abs().max() <= pk[:, :, :16].abs().max() * step
    assert 0 < (qv[:, :, :16] - pv[:, :, :16]).abs().max() <= pv[:, :, :16].abs().max() * step


@pytest.mark.parametrize("family, draft_kv", [("llama", "int8"), ("llama", "int4"), ("mistral", "int8")])
@pytest.mark.parametrize("method", sorted(RUNS))
def test_greedy_tokens_equal_ar_with_a_quantised_retrieval_cache(family, method, draft_kv):
    target = tiny_model(family, 0)
    expected = decode(target, prompt(), "ar", NEW).tokens
    weights = "int8" if method == "triforce" else "same"  # QuantSpec's pairing on one, the cache alone on the other
    result = decode(target, prompt(), method, NEW, draft_kv=draft_kv, draft_weights=weights, **RUNS[method])
    assert torch.equal(result.tokens, expected)
    assert result.levels[-1].drafted > 0


@pytest.mark.parametrize("options, match", [(dict(draft_kv="int2"), "draft_kv must be one of"),
                                            (dict(draft_kv="fp8"), "draft_kv must be one of")])
def test_bad_draft_kv_fails_when_the_options_are_built(options, match):
    with pytest.raises(SparsedraftError, match=match):
        method_options("retrieval", **options)
