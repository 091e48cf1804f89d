"""A recorded notebook run as a results record: the README's speedup-vs-context rows, figure and run times.

The benches write their own records (:mod:`sparsedraft.bench.record`). The
speedup-vs-context rows come from notebook 05 instead: its curve runs every
method from one shared prefill per context, tries several settings there and
computes the cost model's prediction beside the measured speedups.
:func:`record_curve` turns the newest finished run of notebook 05 of one
profile (``cpu``: ``make reproduce``, 4K-8K; ``cpu-long``: 8K-32K) into
``docs/results/speedup-vs-context-<profile>.json``, with the commit, date,
machine and wall time the runner recorded for that run; :func:`record_timing`
keeps the runner's timing of the whole profile and each notebook's metrics (what docs/
cites of a notebook's results), also for profiles that run no curve (:func:`ran_notebook`). The
results table's EAGLE and BudgetDraft rows come from notebook 06 the same way: :func:`record_speed`
turns its timed runs of the feature drafter into ``budgetdraft-speed-<profile>.json``. :func:`draw_curves` draws the
README's one figure from every curve record, each context from the newest
record that holds it, so ``python -m sparsedraft results --from-runs outputs``
refreshes the table, the run times and the figure, and nothing in them is
typed by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..bench.record import RESULTS_DIR
from ..errors import require
from ..report import METRICS_FILE, read_table
from .execute import PARAMETERS_FILE, read_record
from .index import latest_results

CURVE_RECORD = "speedup-vs-context-{profile}.json"
TIMING_RECORD = "reproduce-{profile}.json"
CURVE_FIGURE = "speedup-vs-context.png"
NOTEBOOK = "05"
# What the run holds: the best setting per context and every run of the grid (both required), the level-1 race.
BEST, RUNS, RACE = "speedup_vs_context.csv", "speedup_vs_context_runs.csv", "level1_race.csv"
RACE2 = "level2_race.csv"  # TriForce with quantised level-2 weights beside full precision (optional)
SPEED_RECORD = "budgetdraft-speed-{profile}.json"
SPEED_NOTEBOOK = "06"
SPEED = "feature_speed.csv"  # notebook 06's timed runs of the feature drafter
# Notebook 06's row labels, the decode() method each one ran and its drafter: the feature head, the head behind
# prompt lookup (draft_lookup), or prompt lookup alone
SPEED_METHODS = {"EAGLE (full cache)": ("spec", "feature"), "EAGLE behind prompt lookup": ("spec", "feature+lookup"),
                 "prompt lookup": ("spec", "ngram"), "BudgetDraft (budget cache)": ("budgetdraft", "feature"),
                 "TriForce, feature level 1": ("triforce", "feature"),
                 "TriForce, prompt lookup level 1": ("triforce", "ngram")}


def _row(method: str, options: dict[str, Any], context: int, run: dict[str, Any], tokens: int) -> dict[str, Any]:
    acceptance = {level: run[f"acceptance_{level}"] for level in ("level2", "target")
                  if run.get(f"acceptance_{level}") is not None}
    return {"method": method, "options": options, "context": context, "tokens": tokens,
            "ar_ms_per_token": run["ar_ms_per_token"], "ms_per_token": run["ms_per_token"],
            "speedup": run["speedup"], "acceptance": acceptance, "tokens_match": run["tokens_match"]}


def curve_rows(folder: Path) -> list[dict[str, Any]]:
    """Per context of notebook 05's run in ``folder``: TriForce's and retrieval's best greedy settings (TriForce
    with the cost model's prediction beside it), then TriForce with the feature drafter at level 1 and with
    quantised level-2 weights, also stopping on its own confidence where the run raced that (each against plain
    decoding in its own race)."""
    best = read_table(folder / BEST)
    runs = [r for r in read_table(folder / RUNS) if r["decoding"] == "greedy"]
    race = read_table(folder / RACE) if (folder / RACE).is_file() else []
    race2 = read_table(folder / RACE2) if (folder / RACE2).is_file() else []
    rows = []
    for b in best:
        context, tokens = int(b["context"]), int(b.get("new_tokens") or 0)
        for method in ("triforce", "retrieval"):
            want = {"budget": b[f"{method}_budget"], "gamma2": b[f"{method}_gamma2"]}
            if method == "triforce":
                want["gamma1"] = b["triforce_gamma1"]
            run = next(r for r in runs if r["context"] == context and r["method"] == method
                       and all(r[k] == v for k, v in want.items()))
            options = {"draft": "ngram", **want} if method == "triforce" else \
                {"budget": want["budget"], "gamma": want["gamma2"]}
            row = _row(method, options, context, run, tokens)
            if method == "triforce":
                row["predicted_speedup"] = b["predicted_speedup"]
            row["read_gb_s"] = b.get("read_gb_s")
            rows.append(row)
        for r in race:
            if r["context"] == context and r["level1"] == "feature drafter":
                options = {"draft": "feature", "budget": b["triforce_budget"], "gamma1": b["triforce_gamma1"],
                           "gamma2": b["triforce_gamma2"]}
                rows.append({**_row("triforce", options, context, r, tokens), "read_gb_s": r.get("read_gb_s")})
        for r in race2:  # the full-precision row of that race re-measures the best setting above: not repeated
            if r["context"] == context and r["draft_weights"] != "same":
                options = {"draft": "ngram", "budget": b["triforce_budget"], "gamma1": b["triforce_gamma1"],
                           "gamma2": b["triforce_gamma2"], "draft_weights": r["draft_weights"]}
                if r.get("draft_confidence"):  # the row whose level 2 stops on its own confidence (runs before
                    options["draft_confidence"] = r["draft_confidence"]  # it have no such column)
                rows.append({**_row("triforce", options, context, r, tokens), "read_gb_s": r.get("read_gb_s"),
                             "level2_step_over_decode": r.get("level2_step_over_decode")})
    return rows


def _finished_run(outputs: str | Path, profile: str, notebook: str, files: tuple[str, ...], what: str,
                  fix: str) -> tuple[Path, dict[str, Any]]:
    """The newest finished run of ``notebook`` of ``profile`` under ``outputs`` and the runner's record of it,
    after checking that it holds ``files`` and names its commit and machine; one error naming what is missing."""
    found = latest_results(outputs, notebook, profile)
    require(found is not None, f"no finished run of notebook {notebook} with profile {profile!r} under {outputs}: "
                               f"run `make reproduce` (or `python -m sparsedraft run --profile {profile} "
                               f"--only {notebook}`) first")
    run_dir = Path(found["run"])
    missing = [name for name in files if not (run_dir / name).is_file()]
    require(not missing, f"{run_dir} holds no {what} ({', '.join(missing)} missing): {fix}")
    run = read_record(run_dir) or {}
    require(run.get("commit") and run.get("machine"), f"{run_dir}/run.json names no commit or machine (written by "
                                                      f"an older runner); rerun notebook {notebook} to record them")
    return run_dir, run


def _write_run_record(path: Path, profile: str, notebook: str, run_dir: Path, run: dict[str, Any], bench: str,
                      model: str | None, rows: list[dict[str, Any]]) -> Path:
    """A record of ``rows`` measured in the notebook run ``run_dir``: the run's commit, date and machine, the
    median of the rows' own read bandwidths (each timed region measured its own) as the machine's."""
    speeds = sorted(r["read_gb_s"] for r in rows if r.get("read_gb_s") is not None)
    record = {"command": f"python -m sparsedraft run --profile {profile} --only {notebook}",
              "commit": run["commit"], "dirty": run.get("dirty"), "date": run["started"],
              "machine": {**run["machine"], "read_gb_s": speeds[len(speeds) // 2] if speeds else None,
                          "torch_threads": run.get("threads") or run["machine"].get("torch_threads")},
              "result": {"bench": bench, "run": str(run_dir), "wall_s": run.get("wall_s"), "model": model,
                         "rows": rows}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


def record_curve(outputs: str | Path = "outputs", profile: str = "cpu", folder: str | Path = RESULTS_DIR) -> Path:
    """Write ``folder/speedup-vs-context-<profile>.json`` from the newest finished notebook-05 run of
    ``profile`` under ``outputs``; one error naming what is missing when no such run holds the curve."""
    run_dir, run = _finished_run(outputs, profile, NOTEBOOK, (BEST, RUNS), "speedup-vs-context curve",
                                 "that run had curve_contexts empty; rerun notebook 05 with curve contexts")
    parameters = json.loads((run_dir / PARAMETERS_FILE).read_text())
    return _write_run_record(Path(folder) / CURVE_RECORD.format(profile=profile), profile, NOTEBOOK, run_dir, run,
                             "curve", parameters.get("curve_model"), curve_rows(run_dir))


def speed_rows(folder: Path) -> list[dict[str, Any]]:
    """Notebook 06's timed runs of the feature drafter in ``folder`` (one compare per speed context, every row
    checked against plain decoding): EAGLE over its full cache (alone, and behind prompt lookup where the run
    timed that, with prompt lookup alone beside it), BudgetDraft over its budget cache, TriForce with it and with
    prompt lookup at level 1, each with the cost model's prediction from the run's own parts. The context is the
    prompt's length, as in every other row of the results table."""
    p = json.loads((folder / PARAMETERS_FILE).read_text())
    tokens, gamma, vocab = p["speed_tokens"], p["gamma"], p["feature_draft_vocab"]
    gamma1, gamma2 = p["triforce_gammas"]
    stop = {"draft_confidence": p["feature_draft_confidence"]} if p.get("feature_draft_confidence") else {}
    rows = []
    for r in read_table(folder / SPEED):
        require(r["method"] in SPEED_METHODS, f"{folder / SPEED} names a method {r['method']!r} this reader does "
                                              f"not know ({sorted(SPEED_METHODS)}); add it to "
                                              "runner.results.SPEED_METHODS")
        method, draft = SPEED_METHODS[r["method"]]
        if method == "triforce":
            options = {"draft": "ngram" if draft == "ngram" else "feature", "budget": int(r["budget"]),
                       "gamma1": gamma1, "gamma2": gamma2}
        elif draft == "ngram":
            options = {"draft": "ngram", "gamma": gamma}
        elif method == "spec":
            options = {"draft": "feature", "draft_cache": "full", "gamma": gamma, "draft_vocab": vocab, **stop}
            if draft == "feature+lookup":
                options["draft_lookup"] = p["feature_draft_lookup"]
        else:
            options = {"draft": "feature", "budget": int(r["budget"]), "gamma": gamma, "draft_vocab": vocab, **stop}
        acceptance = {} if r.get("acceptance") is None else {"target": r["acceptance"]}
        rows.append({"method": method, "options": options, "context": int(r["context"]) - tokens, "tokens": tokens,
                     "ar_ms_per_token": r["ar_ms_per_token"], "ms_per_token": r["ms_per_token"],
                     "speedup": r["speedup"], "predicted_speedup": r.get("predicted_speedup"),
                     "acceptance": acceptance, "tokens_match": r["lossless"], "read_gb_s": r.get("read_gb_s")})
    return rows


def record_speed(outputs: str | Path = "outputs", profile: str = "cpu", folder: str | Path = RESULTS_DIR) -> Path:
    """Write ``folder/budgetdraft-speed-<profile>.json`` from the newest finished notebook-06 run of ``profile``
    under ``outputs``: the README's BudgetDraft and EAGLE rows."""
    run_dir, run = _finished_run(outputs, profile, SPEED_NOTEBOOK, (SPEED, PARAMETERS_FILE),
                                 "timed runs of the feature drafter", "rerun notebook 06 with speed_contexts")
    parameters = json.loads((run_dir / PARAMETERS_FILE).read_text())
    return _write_run_record(Path(folder) / SPEED_RECORD.format(profile=profile), profile, SPEED_NOTEBOOK, run_dir,
                             run, "speed", parameters.get("verifier"), speed_rows(run_dir))


def ran_notebook(outputs: str | Path = "outputs", profile: str = "cpu", notebook: str = NOTEBOOK) -> bool:
    """Whether the runner's last run of ``profile`` (``outputs/run-<profile>.json``) ran ``notebook``: 05 gives
    :func:`record_curve` its curve, 06 :func:`record_speed` its timed runs; profiles without them
    (``batch-16k``, ``long-quality``...) get a timing only."""
    source = Path(outputs) / f"run-{profile}.json"
    require(source.is_file(), f"no timing in {source}: run `python -m sparsedraft run --profile {profile} "
                              "--measure-machine` first")
    rows = json.loads(source.read_text()).get("notebooks", [])
    return any(row["notebook"][:2] == notebook for row in rows)


def record_timing(outputs: str | Path = "outputs", profile: str = "cpu", folder: str | Path = RESULTS_DIR,
                  read_gb_s: float | None = None) -> Path:
    """``folder/reproduce-<profile>.json`` from ``outputs/run-<profile>.json`` (the runner's timing of its last
    command that ran notebooks): wall time, each notebook's, peak RSS. ``read_gb_s``: the bandwidth measured
    in that run's own timed steps (the curve record's), where the runner measured none (no ``--measure-machine``)."""
    source = Path(outputs) / f"run-{profile}.json"
    require(source.is_file(), f"no timing in {source}: run `python -m sparsedraft run --profile {profile}` "
                              "(make reproduce) first")
    run = json.loads(source.read_text())
    require(run.get("commit") and run.get("machine"), f"{source} names no commit or machine; rerun the notebooks")
    require(run["machine"].get("read_gb_s") or read_gb_s, f"{source} measured no read bandwidth and no curve gave "
                                                           "one: rerun the profile with --measure-machine")
    record = {"command": f"python -m sparsedraft run --profile {profile}", "commit": run["commit"],
              "dirty": run.get("dirty"), "date": run["date"],
              "machine": {**run["machine"], "read_gb_s": run["machine"].get("read_gb_s") or read_gb_s},
              "result": {"bench": "reproduce", "profile": profile, "wall_s": run["wall_s"],
                         "peak_rss_mb": run["peak_rss_mb"], "threads": run.get("threads"),
                         "rows": [{**row, **_metrics(Path(outputs), row)} for row in run["notebooks"]]}}
    path = Path(folder) / TIMING_RECORD.format(profile=profile)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def _metrics(outputs: Path, row: dict[str, Any]) -> dict[str, Any]:
    """``{"metrics": {...}}``: every metric of the notebook run ``row`` names (its ``metrics.json``, a few KB,
    with its ``headline`` list), so docs can cite any figure a notebook measured from this record; ``{}`` when
    the run folder is gone. The runner names folders as ``outputs/<notebook>/<run>``; ``outputs`` may have moved."""
    parts = Path(str(row.get("run", ""))).parts
    folder = outputs.joinpath(*parts[1:]) if len(parts) > 1 else None
    if folder is None or not (folder / METRICS_FILE).is_file():
        return {}
    return {"metrics": json.loads((folder / METRICS_FILE).read_text())}


def draw_curves(folder: str | Path = RESULTS_DIR) -> Path | None:
    """``folder/speedup-vs-context.png`` from every curve record in ``folder``: at each context the newest record
    holding it gives TriForce's and retrieval's measured speedups and the cost model's prediction, and the title
    names each record's date, commit and machine. None (and no file) when no curve record exists."""
    import matplotlib.pyplot as plt
    import pandas as pd

    from .. import report
    from ..bench.record import load_records
    curves = sorted(((r["date"], name, r) for name, r in load_records(folder) if r["result"].get("bench") == "curve"),
                    reverse=True)
    if not curves:
        return None
    points, sources, seen, models = [], [], set(), set()
    for date, name, record in curves:
        rows = [r for r in record["result"]["rows"] if r["context"] not in seen and r["options"].get("draft") != "feature"
                and r["options"].get("draft_weights", "same") == "same"]  # the figure: full precision, prompt lookup
        contexts = sorted({r["context"] for r in rows})
        if not contexts:
            continue
        seen.update(contexts)
        models.add(record["result"]["model"])
        sources.append(f"{contexts[0] // 1000}K-{contexts[-1] // 1000}K: {date[:10]}, {record['commit'][:7]}, "
                       f"{record['machine']['isa']}, {record['machine']['read_gb_s']:.0f} GB/s")
        for r in rows:
            label = "TriForce" if r["method"] == "triforce" else "retrieval self-speculation"
            points.append({"context": r["context"], "speedup": r["speedup"], "method": label, "source": "measured"})
            if r.get("predicted_speedup"):
                points.append({"context": r["context"], "speedup": r["predicted_speedup"], "method": label,
                               "source": "cost model"})
    fig = report.line_figure(pd.DataFrame(points), "context", "speedup", hue="method", style="source", logx=True,
                             xlabel="context (tokens)", ylabel="speedup over plain decoding", hline=1.0,
                             title="\n".join([f"greedy decoding, {', '.join(sorted(models))}", *sources]))
    ax = fig.axes[0]
    ticks = sorted(seen)
    ax.set_xticks(ticks, [f"{c / 1000:g}K" for c in ticks])
    ax.minorticks_off()
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    path = Path(folder) / CURVE_FIGURE
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
