"""The GPU check on CPU: paper shapes, memory fitting, random models, the retrieval gather, the JSON record
(tiny models, a fake machine), the time budget and the refusal without CUDA; ``gpu``-marked runs on CUDA."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from sparsedraft.__main__ import main as cli
from sparsedraft.bench.gpu import (NO_CUDA, GpuCheckConfig, aligned_slots, datasheet, device_slug, run_gpu_check,
                                   run_gpu_check_command)
from sparsedraft.bench.gpu_levels import DeviceBackend, fill_random, fit_context, random_model
from sparsedraft.engine.cache import StaticCache
from sparsedraft.caches import RetrievalCache
from sparsedraft.caches.indexed import (FlashInferIndexedDecode, chunk_tokens, flashinfer_available, gather_tokens,
                                        indexed_attention)
from sparsedraft.caches.static import StaticFullCache
from sparsedraft.engine.config import ModelConfig
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.prefill import prefill
from sparsedraft.engine.model import Capture
from sparsedraft.engine.roofline import GIB, MODELS, kv_bytes, parameter_count
from sparsedraft.engine.rope import Rotary
from sparsedraft.engine.tiny import tiny_hf_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
NEEDS_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
TINY = {"target": ModelConfig.from_hf(tiny_hf_config("llama", num_key_value_heads=4)),
        "draft": ModelConfig.from_hf(tiny_hf_config("qwen2"))}


class FakeBackend:
    """A machine with fixed memory and bandwidth whose steps all take 2 ms (each step still runs twice)."""

    def __init__(self):
        self.steps = 0

    def free_bytes(self, device):
        return 8 * GIB

    def bandwidth(self, device):
        return 5e9

    def median_ms(self, step, device, warmup, repeats, inner):
        for _ in range(2):
            step()
            self.steps += 1
        return 2.0


def tiny_config(tmp_path, **changes) -> GpuCheckConfig:
    values = dict(device="cpu", target="target", draft="draft", context=640, budget=64, chunk_size=8, gamma1=2,
                  gamma2=3, sink=4, window=12, draft_prompt=40, fill_chunk=128, smollm2_model="tiny-llama",
                  smollm2_context=300, smollm2_new_tokens=8, smollm2_repeats=1, smollm2_budget=64,
                  out_dir=str(tmp_path))
    return GpuCheckConfig(**{**values, **changes})


def test_paper_shapes_and_defaults():
    target, draft = MODELS["llama2-7b-128k"], MODELS["llama-68m"]
    assert (target.hidden_size, target.num_layers, target.num_heads, target.num_kv_heads, target.intermediate_size,
            target.vocab_size) == (4096, 32, 32, 32, 11008, 32000)
    assert target.rope_scaling["rope_type"] == "yarn" and target.max_position_embeddings == 131072
    assert (draft.hidden_size, draft.num_layers, draft.num_heads, draft.intermediate_size, draft.vocab_size) == \
        (768, 2, 12, 3072, 32000)
    config = GpuCheckConfig()
    assert config.context == 122 * 1024 and config.budget == 4096 and config.sink + config.window == 256
    assert config.dtype == "fp16" and config.target == "llama2-7b-128k" and config.draft == "llama-68m"
    assert 13.4e9 < parameter_count(target) * 2 < 13.6e9  # 7B in fp16
    assert 65e9 < kv_bytes(target, config.context, 2) < 66e9  # 32 layers * K,V * 32 heads * 128 * 2 B * 122K
    assert aligned_slots(4096, 7) == 8 and aligned_slots(256, 2) == 8 and aligned_slots(16, 8) == 8
    with pytest.raises(SparsedraftError, match="multiple of chunk_size"):
        GpuCheckConfig(budget=4000, chunk_size=64)
    with pytest.raises(SparsedraftError, match="warmup >= 1"):
        GpuCheckConfig(warmup=0)


def test_fit_context_keeps_the_paper_context_on_an_h200_and_scales_it_on_an_a100():
    cfg = MODELS["llama2-7b-128k"]
    extra = 2 * kv_bytes(cfg, 4096 + 7, 2) + kv_bytes(cfg, 122 * 1024, 4) // cfg.num_layers
    assert fit_context(cfg, 122 * 1024, 140 * GIB, 2, extra) == (122 * 1024, None)
    context, note = fit_context(cfg, 122 * 1024, int(79.2 * GIB), 2, extra)
    assert 100_000 < context < 122 * 1024 and context % 1024 == 0
    assert f"scaled from {122 * 1024} to {context} tokens" in note
    used = parameter_count(cfg) * 2 + kv_bytes(cfg, context, 2) + extra
    assert used + 4 * GIB <= 79.2 * GIB  # the reserve stays free
    with pytest.raises(SparsedraftError, match="cannot hold the weights"):
        fit_context(cfg, 4096, 14 * GIB, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_model_is_built_on_the_device_in_its_dtype(dtype):
    cfg = ModelConfig.from_hf(tiny_hf_config("llama"))  # tied head, llama3 RoPE scaling
    model = random_model(cfg, dtype, torch.device("cpu"), seed=1)
    params = dict(model.named_parameters())
    assert all(p.device.type == "cpu" and p.dtype == dtype for p in params.values())
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.rotary.inv_freq, Rotary(cfg).inv_freq)
    assert torch.all(params["norm.weight"] == 1)
    assert 0.015 < float(params["layers.0.mlp.up_proj.weight"].detach().float().std()) < 0.025
    again = random_model(cfg, dtype, torch.device("cpu"), seed=1)
    assert torch.equal(again.layers[1].self_attn.q_proj.weight, model.layers[1].self_attn.q_proj.weight)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()


@pytest.mark.parametrize("kind", [StaticCache, StaticFullCache])
@torch.no_grad()
def test_fill_random_appends_through_the_cache_protocol(kind):
    model = tiny_model("llama")
    cache = kind(model.cfg, 100)
    fill_random(cache, model.cfg, 70, chunk=32, dtype=torch.float32, device=torch.device("cpu"))
    assert cache.length == 70 and cache.keys(0).shape == (1, model.cfg.num_kv_heads, 70, model.cfg.head_dim)
    assert float(cache.keys(1)[:, :, 69].abs().sum()) > 0
    out = model(torch.tensor([[5]]), cache=cache)
    assert cache.length == 71 and torch.isfinite(out).all()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@torch.no_grad()
def test_gather_equals_the_retrieval_cache_and_indexed_attention(family):
    model = tiny_model(family)
    cfg = model.cfg
    full = model.new_cache(130)
    capture = Capture(layers=set(range(cfg.num_layers)))
    prefill(model, full, torch.randint(0, 256, (1, 123), generator=torch.Generator().manual_seed(2)), capture=capture)
    view = RetrievalCache(cfg, budget=48, chunk_size=8, spec_slots=4)
    view.build(full, {layer: q[:, :, -1] for layer, q in capture.queries.items()})
    out_k, out_v = torch.zeros_like(view.k[0]), torch.zeros_like(view.v[0])
    q = torch.randn(1, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(3))
    scale = cfg.head_dim ** -0.5
    assert view.chunk_slots == view.budget and view.written == 3  # tokens 120-122 took the last three slots
    for layer in range(cfg.num_layers):
        index = chunk_tokens(view.chosen[layer], view.chunk_size)
        assert index.shape == (1, cfg.num_kv_heads, view.budget)
        index[..., view.budget - 3:] = torch.tensor([122, 121, 120])  # recent token i sits in slot budget - 1 - i
        gather_tokens(full.k[layer], full.v[layer], index, out_k, out_v)
        assert torch.equal(out_k[:, :, :view.budget], view.k[layer][:, :, :view.budget])
        assert torch.equal(out_v[:, :, :view.budget], view.v[layer][:, :, :view.budget])
        grouped = q.reshape(1, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
        dense = F.scaled_dot_product_attention(grouped, out_k[:, :, :view.budget], out_v[:, :, :view.budget],
                                               scale=scale).reshape(q.shape)
        torch.testing.assert_close(dense, indexed_attention(q, full.k[layer], full.v[layer], index, scale))


def test_the_check_writes_its_record_on_cpu_with_a_fake_machine(tmp_path):
    backend = FakeBackend()
    result = run_gpu_check(tiny_config(tmp_path), backend=backend, models=TINY)
    assert result.ok, result.errors
    record = json.loads((tmp_path / f"{result.date}-cpu.json").read_text())
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"]) and record["device"] == "cpu"
    assert record["read_bandwidth_gb_s"] == 5.0 and record["versions"]["torch"] == torch.__version__
    assert record["bench"] == "gpu-check" and record["config"]["context"] == 640 and record["path"] == result.path
    levels = {row["level"]: row for row in record["levels"]}
    assert list(levels) == ["target, full cache", "target, 4K retrieval cache", "draft, StreamingLLM cache"]
    assert [levels[k]["paper_ms"] for k in levels] == [56.0, 14.0, 0.45]
    for row, cfg, context in zip(levels.values(), (TINY["target"], TINY["target"], TINY["draft"]), (640, 64, 16)):
        assert row["context"] == context and row["eager_ms"] == row["static_ms"] == 2.0
        assert row["graph_ms"] is None and row["datasheet_ms"] is None  # no CUDA, no known datasheet
        weights = parameter_count(cfg) - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
        assert row["bytes_read"] == (weights + 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context) * 2
        assert row["roofline_ms"] == pytest.approx(1000 * row["bytes_read"] / 5e9)
    kernels = record["retrieval_kernels"]
    assert kernels["selected_tokens"] == 64 and kernels["gather_ms"] == 2.0 and kernels["flashinfer_ms"] is None
    assert kernels["dense_max_abs_diff"] < 1e-2 and "flashinfer" in kernels["note"]
    smol = record["smollm2"]
    assert smol["tokens_match"] is True and smol["speedup"] > 0 and smol["compare"]["prompt_len"] == 300
    assert any("no CUDA device" in note for note in record["notes"]) and record["skipped"] == []
    assert backend.steps == 2 * 8  # every timing ran its step: 3 levels x 2 caches, gather and dense attention
    assert "wrote" in result.table() and "draft, StreamingLLM cache" in result.table()


def test_the_check_skips_parts_past_its_time_budget(tmp_path):
    ticks = iter(range(0, 10_000, 200))  # every clock read moves 200 s: the draft part fits, nothing after it
    result = run_gpu_check(tiny_config(tmp_path, time_limit_s=300), backend=FakeBackend(), models=TINY,
                           clock=lambda: next(ticks))
    assert [row["level"] for row in result.to_dict()["levels"]] == ["draft, StreamingLLM cache"]
    assert [s.split(":")[0] for s in result.skipped] == ["target", "smollm2"]
    assert "left of the 300 s budget" in result.skipped[0]
    assert (tmp_path / f"{result.date}-cpu.json").is_file()


def test_a_failing_part_is_recorded_and_the_rest_still_run(tmp_path):
    result = run_gpu_check(tiny_config(tmp_path, smollm2=False, budget=1024, context=2048), backend=FakeBackend(),
                           models={**TINY, "target": TINY["target"].replace(max_position_embeddings=1024)})
    assert not result.ok and result.errors[0].startswith("target: SparsedraftError")
    assert [row.level for row in result.levels] == ["draft, StreamingLLM cache"]
    assert result.skipped == ["smollm2: turned off (--no-smollm2)"]


def test_device_names():
    assert device_slug("NVIDIA H200") == "nvidia-h200"
    assert device_slug("NVIDIA A100-SXM4-80GB") == "nvidia-a100-sxm4-80gb"
    assert datasheet("NVIDIA H200").bandwidth_gb_s == 4800.0
    assert datasheet("NVIDIA A100-SXM4-80GB").name == "A100-80GB" and datasheet("NVIDIA A100-SXM4-40GB") is None
    assert datasheet("cpu") is None


@NEEDS_NO_CUDA
def test_the_check_refuses_without_cuda(capsys, tmp_path):
    assert cli(["gpu-check", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: gpu-check needs a CUDA GPU") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SparsedraftError, match="needs a CUDA GPU"):
        run_gpu_check(GpuCheckConfig(out_dir=str(tmp_path)))
    assert NO_CUDA.startswith("gpu-check needs a CUDA GPU") and callable(run_gpu_check_command)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_check_on_cuda_with_tiny_models(tmp_path):
    result = run_gpu_check(tiny_config(tmp_path, device="cuda", repeats=2, inner=2), backend=DeviceBackend(),
                           models=TINY)
    assert result.ok, result.errors
    assert all(row.graph_ms is not None and row.graph_ms > 0 for row in result.levels)
    assert result.smollm2["tokens_match"] is True


@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_available(), reason="needs flashinfer and CUDA")
def test_flashinfer_indexed_decode_equals_indexed_attention():
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, kv, length, d, heads = 1, 4, 300, 128, 8
    keys, values = (torch.randn(b, kv, length, d, generator=gen, device="cuda", dtype=torch.float16) for _ in "kv")
    index = torch.stack([torch.randperm(length, device="cuda")[:64] for _ in range(kv)])[None]
    q = torch.randn(b, heads, d, generator=gen, device="cuda", dtype=torch.float16)
    decode = FlashInferIndexedDecode(index, length, heads, d, torch.float16, d ** -0.5)
    torch.testing.assert_close(decode(q, keys, values), indexed_attention(q, keys, values, index, d ** -0.5),
                               atol=2e-3, rtol=2e-3)
