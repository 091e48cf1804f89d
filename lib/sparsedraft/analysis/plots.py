"""Figures for the analysis notebooks: each takes the library's data frames and returns a Figure.

Notebooks stay thin by calling these; the functions never show or save (the
caller decides), and they pick their axes scales from the data they get, so
the same call works for a 2K CPU run and a 128K sweep.
"""

from __future__ import annotations

from typing import Mapping

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from ..errors import require
from ..report import BAND_SEED
from .costmodel import LEVEL_NAMES

_LEVEL_COLORS = {1: "tab:green", 2: "tab:blue", 3: "tab:red", 0: "tab:gray"}


def _need(frame: pd.DataFrame, columns: list[str], producer: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    require(not missing, f"data frame lacks columns {missing}; pass the output of {producer}")


def plot_schedules(tables: Mapping[str, pd.DataFrame]) -> Figure:
    """Timeline of each iteration (``Schedule.table()`` by name): one bar segment per step, coloured by level."""
    require(len(tables) > 0,
            "pass at least one schedule table, e.g. {'normal': walkthrough_normal_schedule().table()}")
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(tables)))
    for row, (name, table) in enumerate(tables.items()):
        _need(table, ["level", "ms", "clock_ms", "emitted"], "Schedule.table()")
        for step in table.itertuples():
            ax.barh(row, step.ms, left=step.clock_ms - step.ms, color=_LEVEL_COLORS[step.level], edgecolor="white")
        tokens = int(table.loc[table.level == 3, "emitted"].sum())
        total = table.clock_ms.iloc[-1]
        ax.text(total, row, f"  {total:.1f} ms / {tokens} tok = {total / tokens:.1f} ms/tok", va="center")
    ax.set_yticks(range(len(tables)), list(tables))
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=_LEVEL_COLORS[level]) for level in (1, 2, 3, 0)]
    ax.legend(handles, [LEVEL_NAMES[level] for level in (1, 2, 3, 0)], loc="lower right", fontsize="small")
    ax.margins(x=0.35)
    fig.tight_layout()
    return fig


def plot_acceptance_sweep(frame: pd.DataFrame, size: tuple[float, float] = (7, 4)) -> Figure:
    """Predicted speedup against the acceptance rate, one line per (γ1, γ2) pair (``acceptance_sweep``)."""
    from ..report import line_figure
    _need(frame, ["alpha", "speedup", "gammas"], "acceptance_sweep")
    return line_figure(frame, "alpha", "speedup", hue="gammas", hline=1.0, size=size,
                       xlabel="acceptance rate α at both levels", ylabel="predicted speedup over vanilla")


def plot_speedup_vs_context(frame: pd.DataFrame) -> Figure:
    """Speedup over vanilla by method as the context grows (``speedup_vs_context``)."""
    _need(frame, ["context", "method", "speedup"], "speedup_vs_context")
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(data=frame, x="context", y="speedup", hue="method", marker="o", ax=ax, seed=BAND_SEED)
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="black", lw=0.8, ls=":")
    ax.set_ylabel("theoretical speedup (x)")
    fig.tight_layout()
    return fig


def plot_bytes_per_token(frame: pd.DataFrame, crossover: int | None = None, title: str = "") -> Figure:
    """Weight vs KV bytes read per token as the context grows (``bytes_per_token_table``)."""
    _need(frame, ["context", "weights_bytes", "kv_bytes"], "bytes_per_token_table")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.stackplot(frame.context, frame.weights_bytes / 1e9, frame.kv_bytes / 1e9, labels=["weights", "KV cache"],
                 alpha=0.8)
    if crossover is not None:
        ax.axvline(crossover, color="black", ls="--", lw=1)
        ax.annotate(f"KV = weights at {crossover:,} tokens", (crossover, ax.get_ylim()[1] * 0.9),
                    xytext=(5, 0), textcoords="offset points")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("GB read per generated token")
    ax.set_title(title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    return fig


def plot_latency(frame: pd.DataFrame) -> Figure:
    """Ideal per-token latency by hardware as the context grows (``latency_table``)."""
    _need(frame, ["context", "hardware", "ideal_ms"], "latency_table")
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(data=frame, x="context", y="ideal_ms", hue="hardware", marker="o", ax=ax, seed=BAND_SEED)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylabel("ideal ms per token (bytes / bandwidth)")
    fig.tight_layout()
    return fig


def plot_recovery(frame: pd.DataFrame) -> Figure:
    """Attention recovery by method at each budget, spread over layers and heads (``attention_recovery``)."""
    _need(frame, ["method", "budget", "recovery"], "attention_recovery")
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.boxplot(data=frame, x="budget", y="recovery", hue="method", ax=ax, fliersize=2)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("attention mass recovered")
    fig.tight_layout()
    return fig


def plot_recovery_heatmap(frame: pd.DataFrame, method: str = "topk", budget: float | None = None) -> Figure:
    """Recovery per layer and head for one method and budget (the first budget by default)."""
    _need(frame, ["layer", "head", "method", "budget", "recovery"], "attention_recovery")
    budget = frame.budget.iloc[0] if budget is None else budget
    chosen = frame[(frame.method == method) & (frame.budget == budget)]
    require(not chosen.empty, f"no rows for method={method!r}, budget={budget}; pick from "
                              f"{sorted(frame.method.unique())} and {sorted(frame.budget.unique())}")
    grid = chosen.pivot_table(index="layer", columns="head", values="recovery")
    fig, ax = plt.subplots(figsize=(1 + 0.5 * grid.shape[1], 1 + 0.25 * grid.shape[0]))
    sns.heatmap(grid, vmin=0, vmax=1, cmap="viridis", ax=ax, cbar_kws={"label": "recovery"})
    ax.set_title(f"{method}, budget {budget}")
    fig.tight_layout()
    return fig


def plot_overlap(frame: pd.DataFrame, metric: str = "intersection") -> Figure:
    """Overlap of the selection at t with the one at t + Δ (``LocalityResult.overlap``)."""
    _need(frame, ["delta", "selection", metric], "contextual_locality(...).overlap")
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(data=frame, x="delta", y=metric, hue="selection", marker="o", ax=ax, seed=BAND_SEED)
    ax.set_xscale("symlog", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("Δ (steps after the selection was built)")
    fig.tight_layout()
    return fig


def plot_decay(frame: pd.DataFrame) -> Figure:
    """Recovery of a cache built at t, used at t + Δ, beside a cache rebuilt at t + Δ (``.decay``)."""
    _need(frame, ["delta", "selection", "recovery", "fresh_recovery"], "contextual_locality(...).decay")
    long = frame.melt(id_vars=["delta", "selection"], value_vars=["recovery", "fresh_recovery"],
                      var_name="cache", value_name="mass")
    long["cache"] = long.cache.map({"recovery": "built at t", "fresh_recovery": "rebuilt at t+Δ"})
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(data=long, x="delta", y="mass", hue="selection", style="cache", marker="o", ax=ax, seed=BAND_SEED)
    ax.set_xscale("symlog", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("Δ (steps after the selection was built)")
    ax.set_ylabel("attention mass recovered")
    fig.tight_layout()
    return fig


def plot_nll_bins(frame: pd.DataFrame, trained: int | None = None) -> Figure:
    """Mean NLL per position bin, one line per model (``nll_by_bin`` frames with a ``model`` column), with the
    base model's training context marked."""
    _need(frame, ["model", "bin_start", "bin_end", "nll"], "analysis.quality.nll_by_bin(...) with a model column")
    frame = frame.assign(position=(frame.bin_start + frame.bin_end) / 2)
    fig, ax = plt.subplots(figsize=(8, 4))
    sns.lineplot(data=frame, x="position", y="nll", hue="model", marker="o", ax=ax, seed=BAND_SEED)
    if trained is not None:
        ax.axvline(trained, color="gray", linestyle="--", label="trained context")
        ax.legend()
    ax.set_xlabel("position of the predicted token")
    ax.set_ylabel("mean NLL per bin (nats)")
    fig.tight_layout()
    return fig
