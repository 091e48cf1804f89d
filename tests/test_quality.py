"""The long-context quality check (analysis.quality): per-position NLL through the engine's prefill, bins, and the
three rules an extended model must pass."""

import pandas as pd
import pytest
import torch

from sparsedraft.analysis.quality import judge_extension, mean_bins, nll_by_bin, position_nll
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("chunk", [5, 1024])
def test_position_nll_equals_one_uncached_forward(family, chunk):
    model = tiny_model(family).eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logp = torch.log_softmax(model(tokens[None])[0].double(), dim=-1)
    expected = -logp[:-1].gather(1, tokens[1:, None])[:, 0]
    got = position_nll(model, tokens, chunk=chunk)
    assert got.shape == (22,) and got.dtype == torch.float64
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_position_nll_refuses_a_prompt_past_the_model_before_any_forward(monkeypatch):
    model = tiny_model("llama").eval()
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: pytest.fail("forward reached"))
    too_long = torch.zeros(model.cfg.max_position_embeddings + 1, dtype=torch.long)
    with pytest.raises(SparsedraftError, match="exceed the model's .* positions"):
        position_nll(model, too_long)


def test_past_limit_runs_a_model_beyond_its_positions_on_purpose():
    model = tiny_model("llama", max_position_embeddings=16).eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        logp = torch.log_softmax(model(tokens[None])[0].double(), dim=-1)
    expected = -logp[:-1].gather(1, tokens[1:, None])[:, 0]
    torch.testing.assert_close(position_nll(model, tokens, chunk=7, past_limit=True), expected, atol=1e-4, rtol=0)


def test_bins_average_the_positions_they_hold():
    nll = torch.arange(1, 10, dtype=torch.float64)  # positions 1..9
    bins = nll_by_bin(nll, bin_size=4)
    assert bins.bin_start.tolist() == [0, 4, 8]
    assert bins.tokens.tolist() == [3, 4, 2]
    assert bins.nll.tolist() == pytest.approx([2.0, 5.5, 8.5])
    assert bins.ppl.tolist() == pytest.approx([torch.tensor(v).exp().item() for v in (2.0, 5.5, 8.5)])


def _bins(values, size=2):
    return pd.DataFrame({"bin_start": [i * size for i in range(len(values))],
                         "bin_end": [(i + 1) * size for i in range(len(values))],
                         "tokens": [size] * len(values), "nll": values})


BASE = _bins([3.0, 3.0, 6.0, 6.0])  # unscaled: breaks past position 4


@pytest.mark.parametrize("values, holds, no_spike, cheap", [
    ([3.1, 3.0, 3.1, 3.08], True, True, True),    # holds: past mean 3.09 vs inside 3.05
    ([3.1, 3.0, 3.2, 3.1], False, True, True),    # past mean 0.1 above inside
    ([3.1, 3.1, 2.7, 3.5], True, False, True),    # one bin 0.4 above the worst inside
    ([3.3, 3.3, 3.3, 3.3], True, True, False),    # costs 0.3 nats at short context
])
def test_each_rule_can_fail_alone(values, holds, no_spike, cheap):
    verdict = judge_extension(_bins(values), BASE, trained=4)
    assert (verdict.holds, verdict.no_spike, verdict.cheap) == (holds, no_spike, cheap)
    assert verdict.passes == (holds and no_spike and cheap)
    assert verdict.as_row()["passes"] == verdict.passes


def test_the_unscaled_model_fails_and_a_straddling_bin_is_refused():
    assert not judge_extension(BASE, BASE, trained=4).passes
    with pytest.raises(SparsedraftError, match="straddles the trained context 3"):
        judge_extension(BASE, BASE, trained=3)
    with pytest.raises(SparsedraftError, match="longer than 8"):
        judge_extension(BASE, BASE, trained=8)


def test_mean_bins_weights_by_tokens():
    a = pd.DataFrame({"bin_start": [0], "bin_end": [4], "tokens": [3], "nll": [1.0]})
    b = pd.DataFrame({"bin_start": [0], "bin_end": [4], "tokens": [1], "nll": [5.0]})
    both = mean_bins([a, b])
    assert both.tokens.tolist() == [4] and both.nll.tolist() == pytest.approx([2.0])


@pytest.mark.parametrize("name, factor, limit", [("smollm2-135m-yarn16k", 2.0, 16384),
                                                 ("smollm2-135m-yarn32k", 4.0, 32768)])
def test_the_extended_stand_ins_declare_their_yarn_factor_and_limit(name, factor, limit):
    from sparsedraft.engine.weights import load_config, smollm2_path
    try:
        smollm2_path()
    except SparsedraftError as exc:
        pytest.skip(str(exc))
    base, cfg = load_config("smollm2-135m"), load_config(name)
    assert cfg.max_position_embeddings == limit and base.max_position_embeddings == 8192
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 8192}
    assert cfg.replace(max_position_embeddings=8192, rope_scaling=base.rope_scaling) == base


def test_a_context_past_smollm2_names_the_stand_in_that_reaches_it():
    from sparsedraft.engine.weights import longer_context_hint
    assert longer_context_hint("smollm2-135m", 9000) == (
        ", or use its YaRN-extended stand-in smollm2-135m-yarn16k (16384) / smollm2-135m-yarn32k (32768)")
    assert longer_context_hint("smollm2-135m", 20000) == ", or use its YaRN-extended stand-in smollm2-135m-yarn32k (32768)"
    assert longer_context_hint("smollm2-135m", 40000) == ""
    assert longer_context_hint("smollm2-135m-yarn32k", 40000) == ""
