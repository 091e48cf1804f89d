"""What a notebook hands back to the runner: metrics, tables, figures, and prose built from numbers.

A notebook calls :func:`init` with the ``output_dir`` parameter the runner
(``python -m sparsedraft run``) injects, then saves what it computed:

- :func:`save_metrics` merges values into ``metrics.json``; keys saved with
  ``headline=True`` are listed in the results index ``outputs/README.md``;
- :func:`save_table` writes ``<name>.csv``; :func:`save_figure` ``<name>.png``;
  :func:`format_table` renders rows as plain text (the benchmarks' tables);
- :func:`line_figure` and :func:`bar_figure` are generic seaborn figures for
  the measured frames that have no dedicated helper in
  :mod:`sparsedraft.analysis.plots`;
- :func:`show_text` renders Markdown from a template and computed values, so
  no result in a notebook's prose is typed by hand; :func:`answer` does the
  same for the closing answer and stores it as ``answer.md`` for the index;
- :func:`paper_results` and :func:`paper_row` read the papers' reported
  numbers (``data/paper_results.csv``), so prose quotes them from the table.

With ``output_dir`` empty (a notebook opened by hand) nothing is written and
everything is only displayed, so a notebook runs the same way in Jupyter.
"""

from __future__ import annotations

import csv
import json
import math
import numbers
import string
from pathlib import Path
from typing import Any, Mapping

from .errors import SparsedraftError, require

# seaborn draws a bootstrap confidence band where several rows share an x; a fixed seed makes the same data give
# the same PNG, run after run
BAND_SEED = 0

METRICS_FILE = "metrics.json"
ANSWER_FILE = "answer.md"
HEADLINE_KEY = "headline"  # metrics.json: list of the keys the index shows
HEADLINE_FIGURE_KEY = "headline_figure"  # metrics.json: the figure (stem) the index shows

_state: dict[str, Any] = {"dir": None, "metrics": {}, "headline": []}


def init(output_dir: str | Path | None) -> Path | None:
    """Start a report in ``output_dir`` (created); empty or None: display only, write nothing."""
    _state.update(dir=None, metrics={}, headline=[])
    if output_dir:
        path = Path(output_dir)
        path.mkdir(parents=True, exist_ok=True)
        _state["dir"] = path
    return _state["dir"]


def output_dir() -> Path | None:
    """Folder the current report writes to (None when displaying only)."""
    return _state["dir"]


def _plain(value: Any) -> Any:
    """JSON-ready copy of ``value``: numpy/torch scalars to Python numbers, NaN/inf to None."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and tuple(getattr(value, "shape", (1,))) == ():  # numpy / torch scalars
        value = value.item()
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else None
    raise SparsedraftError(f"metric value {value!r} of type {type(value).__name__} is not JSON-ready; "
                           "save numbers, strings, booleans, or lists and dicts of them")


def save_metrics(values: Mapping[str, Any], headline: bool = False) -> dict[str, Any]:
    """Merge ``values`` into ``metrics.json``; ``headline=True`` lists their keys in the results index."""
    plain = _plain(values)
    _state["metrics"].update(plain)
    if headline:
        _state["headline"].extend(k for k in plain if k not in _state["headline"])
    if _state["dir"] is not None:
        record = {**_state["metrics"], HEADLINE_KEY: list(_state["headline"])}
        (_state["dir"] / METRICS_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return dict(_state["metrics"])


def metrics() -> dict[str, Any]:
    """Everything saved so far in this report."""
    return dict(_state["metrics"])


def _check_name(name: str) -> None:
    require(bool(name) and all(c.isalnum() or c in "_-." for c in name) and not name.startswith("."),
            f"artifact name {name!r} must be a plain file stem (letters, digits, _ - .)")


def save_table(df, name: str, show: bool = True):
    """Write ``df`` to ``<name>.csv`` (no index column) and display it; returns ``df``."""
    _check_name(name)
    if _state["dir"] is not None:
        df.to_csv(_state["dir"] / f"{name}.csv", index=False)
    if show:
        _display(df)
    return df


def read_table(path: str | Path) -> list[dict[str, Any]]:
    """A CSV that :func:`save_table` (or any writer) left, as one dict per row, its cells back to Python values:
    empty / ``None`` -> None, ``True`` / ``False`` -> bool, then int, float, or the text itself."""
    def value(text: str) -> Any:
        if text in ("", "None"):
            return None
        if text in ("True", "False"):
            return text == "True"
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text
    with open(path, newline="") as f:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Right-aligned plain-text table, for a terminal or a log where a data frame cannot render."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(line, widths)) for line in [header, *rows])


def save_figure(fig, name: str, dpi: int = 110, headline: bool = False):
    """Write ``fig`` to ``<name>.png``, display it once, and close it; returns ``fig``.

    The results index shows one figure per run: the one saved with ``headline=True``, else the first saved."""
    import matplotlib.pyplot as plt
    _check_name(name)
    fig = getattr(fig, "figure", fig)  # seaborn FacetGrid / JointGrid carry the matplotlib figure
    if _state["dir"] is not None:
        fig.savefig(_state["dir"] / f"{name}.png", dpi=dpi, bbox_inches="tight")
    if headline or HEADLINE_FIGURE_KEY not in _state["metrics"]:
        save_metrics({HEADLINE_FIGURE_KEY: name})
    _display(fig)
    plt.close(fig)
    return fig


def _axes(title: str, size: tuple[float, float]):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=size)
    ax.set_title(title)
    return fig, ax


def _finish(fig, ax, xlabel: str | None, ylabel: str | None, hline: float | None):
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if hline is not None:
        ax.axhline(hline, color="black", lw=0.8, ls=":")
    fig.tight_layout()
    return fig


def line_figure(frame, x: str, y: str, hue: str | None = None, style: str | None = None, col: str | None = None,
                logx: bool = False, logy: bool = False, xlabel: str | None = None, ylabel: str | None = None,
                title: str = "", hline: float | None = None, size: tuple[float, float] = (7, 4)):
    """Seaborn line plot of ``frame`` (long format) with markers; log2 x / log10 y on request.

    ``col`` draws one panel per value of that column, each with its own y axis
    (for quantities in different units, e.g. speedup beside acceptance).
    """
    import seaborn as sns
    if col is None:
        fig, ax = _axes(title, size)
        sns.lineplot(data=frame, x=x, y=y, hue=hue, style=style, marker="o", ax=ax, seed=BAND_SEED)
        axes = [ax]
    else:
        panels = frame[col].nunique()
        grid = sns.relplot(data=frame, x=x, y=y, hue=hue, style=style, col=col, kind="line", marker="o",
                           seed=BAND_SEED, height=size[1], aspect=size[0] / size[1] / max(panels, 1) * 1.6,
                           facet_kws={"sharey": False})
        grid.set_titles("{col_name}")
        fig, axes = grid.figure, list(grid.axes.flat)
        if title:
            fig.suptitle(title, y=1.02)
    for ax in axes:
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        _finish(fig, ax, xlabel, ylabel, hline)
    return fig


def bar_figure(frame, x: str, y: str, hue: str | None = None, xlabel: str | None = None,
               ylabel: str | None = None, title: str = "", hline: float | None = None,
               size: tuple[float, float] = (7, 4)):
    """Seaborn bar plot of ``frame`` (long format); bars show means when rows repeat (no error bars)."""
    import seaborn as sns
    fig, ax = _axes(title, size)
    sns.barplot(data=frame, x=x, y=y, hue=hue, errorbar=None, ax=ax)
    return _finish(fig, ax, xlabel, ylabel, hline)


def render(template: str, **values: Any) -> str:
    """``template`` formatted with ``values``; every ``{field}`` must be supplied."""
    fields = {f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(template) if f}
    missing = sorted(fields - set(values))
    require(not missing, f"text template needs values for {missing}; pass them as keyword arguments")
    return template.format(**values)


def show_text(template: str, **values: Any) -> str:
    """Display Markdown rendered from ``template`` and computed ``values``; returns the text."""
    text = render(template, **values)
    from IPython.display import Markdown
    _display(Markdown(text))
    return text


def answer(template: str, **values: Any) -> str:
    """:func:`show_text` for a notebook's closing answer, also saved as ``answer.md`` for the index."""
    text = show_text(template, **values)
    if _state["dir"] is not None:
        (_state["dir"] / ANSWER_FILE).write_text(text.strip() + "\n")
    return text


PAPER_COLUMNS = ("key", "paper", "source", "metric", "value", "unit", "context", "budget", "context_source",
                 "budget_source", "hardware", "setting", "note")
VALUE_SOURCES = ("paper", "triforce-code")  # where a row's context or budget is stated


def paper_results(path: str | Path):
    """The papers' reported numbers (``data/paper_results.csv``, see ``data/README.md``) as a data frame."""
    import pandas as pd
    path = Path(path)
    require(path.is_file(), f"paper results table {path} not found; it ships as data/paper_results.csv in the "
                            "repository (notebooks run from notebooks/, so the default path is ../data/...)")
    frame = pd.read_csv(path, dtype={"context": "Int64", "budget": "Int64"})
    missing = [c for c in PAPER_COLUMNS if c not in frame.columns]
    require(not missing, f"{path} lacks columns {missing}; expected {PAPER_COLUMNS}")
    require(frame.key.is_unique, f"{path}: the key column must be unique")
    for column in ("context", "budget"):
        source = frame[f"{column}_source"]
        unsourced = frame.key[frame[column].notna() & ~source.isin(VALUE_SOURCES)].tolist()
        require(not unsourced, f"{path}: rows {unsourced} give a {column} without {column}_source in "
                               f"{VALUE_SOURCES}; state where the number is written or leave it blank")
        orphan = frame.key[frame[column].isna() & source.notna()].tolist()
        require(not orphan, f"{path}: rows {orphan} name a {column}_source for an empty {column}; clear it")
    return frame


def paper_row(frame, key: str) -> dict[str, Any]:
    """One reported result by its ``key`` (e.g. ``triforce.table2.speedup``) as a dict."""
    rows = frame[frame.key == key]
    require(len(rows) == 1, f"no paper result with key {key!r}; keys are {sorted(frame.key)}")
    return rows.iloc[0].to_dict()


def _display(obj: Any) -> None:
    from IPython.display import display
    display(obj)
