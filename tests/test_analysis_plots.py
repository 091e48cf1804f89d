"""Every plotting helper draws from the library's own data frames and returns a figure."""

import io

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from sparsedraft import report  # noqa: E402
from sparsedraft.analysis import plots  # noqa: E402
from sparsedraft.analysis.attention import LayerQK  # noqa: E402
from sparsedraft.analysis.costmodel import (HierarchySetup, speedup_vs_context,  # noqa: E402
                                            walkthrough_collapse_schedule, walkthrough_normal_schedule)
from sparsedraft.analysis.locality import LocalityConfig, layer_locality  # noqa: E402
from sparsedraft.analysis.sparsity import SparsityConfig, layer_recovery  # noqa: E402
from sparsedraft.errors import SparsedraftError  # noqa: E402
from sparsedraft.engine.roofline import HARDWARE, MODELS, bytes_per_token_table, crossover_context, latency_table


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _qk() -> LayerQK:
    gen = torch.Generator().manual_seed(0)
    return LayerQK(0, torch.randn(2, 48, 8, generator=gen), torch.randn(1, 48, 8, generator=gen), 0.5)


def test_cost_and_bottleneck_plots():
    tables = {"normal": walkthrough_normal_schedule().table(), "collapse": walkthrough_collapse_schedule(5.0).table()}
    assert isinstance(plots.plot_schedules(tables), Figure)
    cfg = MODELS["llama2-7b-128k"]
    speed = speedup_vs_context(cfg, MODELS["llama-68m"], HARDWARE["a100-80gb"], [4096, 32768, 131072],
                               HierarchySetup(0.8, 0.9, 0.5))
    assert isinstance(plots.plot_speedup_vs_context(speed), Figure)
    table = bytes_per_token_table(cfg, [0, 8192, 32768, 131072])
    assert isinstance(plots.plot_bytes_per_token(table, crossover_context(cfg), "Llama2-7B"), Figure)
    assert isinstance(plots.plot_latency(latency_table(cfg, list(HARDWARE.values()), [4096, 131072])), Figure)


def test_sparsity_and_locality_plots():
    recovery = layer_recovery(_qk(), [40, 47], SparsityConfig(budgets=(8, 16), chunk_size=4))
    recovery.insert(0, "layer", 0)
    assert isinstance(plots.plot_recovery(recovery), Figure)
    assert isinstance(plots.plot_recovery_heatmap(recovery, "chunk", 16), Figure)
    result = layer_locality(_qk(), [20, 30], LocalityConfig(budget=8, deltas=(0, 1, 4), chunk_size=4))
    assert isinstance(plots.plot_overlap(result.overlap), Figure)
    assert isinstance(plots.plot_decay(result.decay), Figure)


def _png(fig: Figure) -> bytes:
    out = io.BytesIO()
    fig.savefig(out, format="png", metadata={"Software": None})
    return out.getvalue()


def test_aggregated_lines_draw_the_same_png_every_time():
    """Many rows per x (heads, prompts): seaborn's bootstrap band must not change from one drawing to the next."""
    gen = torch.Generator().manual_seed(1)
    frame = pd.DataFrame({"delta": [d for d in (0, 1, 4, 16) for _ in range(24)], "selection": "chunk",
                          "intersection": torch.rand(96, generator=gen).tolist()})
    assert _png(plots.plot_overlap(frame)) == _png(plots.plot_overlap(frame))
    table = frame.rename(columns={"delta": "x", "intersection": "y"})
    assert _png(report.line_figure(table, "x", "y")) == _png(report.line_figure(table, "x", "y"))


def test_plots_name_the_missing_input():
    with pytest.raises(SparsedraftError, match="attention_recovery"):
        plots.plot_recovery(pd.DataFrame({"x": [1]}))
