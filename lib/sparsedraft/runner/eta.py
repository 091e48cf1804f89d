"""One progress line across a whole ``run``: how many notebooks are done and when the rest should be.

A notebook's expected time is the wall time of its newest finished run under
the same profile in ``outputs/`` (any profile when that one never ran: a
rough guess beats none), so ``make reproduce`` on a machine that ran it once
shows an honest ETA from the first notebook on. A fresh clone has no
``outputs/``: there the committed timing record of the profile
(``docs/results/reproduce-<profile>.json``, written by
:func:`~sparsedraft.runner.results.record_timing` on the machine it names)
gives the estimate. A notebook that never ran anywhere has no estimate; the
plan line says how many are in that case instead of inventing a figure, and
the bar counts them at the mean of the others. The bar's unit is those expected seconds, so tqdm's own rate gives
the ETA: a machine running at half the recorded speed shows twice the time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bench.record import RESULTS_DIR
from ..progress import bar
from .config import NotebookRun
from .execute import read_record
from .results import TIMING_RECORD

COMMITTED = RESULTS_DIR / TIMING_RECORD  # a profile's committed timing, relative to the repository root


def recorded_seconds(run: NotebookRun, committed: Path = COMMITTED) -> float | None:
    """Wall seconds of the newest ``ok`` run of ``run``'s notebook in its outputs folder (same profile first),
    else of its row in the profile's committed timing record (``committed``, formatted with the profile)."""
    folder = run.outputs_dir / run.name
    records = [r for r in (read_record(f) for f in folder.iterdir() if f.is_dir())] if folder.is_dir() else []
    done = sorted((r for r in records if r and r.get("status") == "ok" and r.get("wall_s") is not None),
                  key=lambda r: r.get("started", ""), reverse=True)
    for same_profile in (True, False):
        for record in done:
            if not same_profile or record.get("profile") == run.profile:
                return float(record["wall_s"])
    path = Path(str(committed).format(profile=run.profile))
    try:
        rows = json.loads(path.read_text())["result"]["rows"] if path.is_file() else []
    except (ValueError, KeyError, TypeError):  # not a timing record: no estimate rather than a wrong one
        rows = []
    return next((float(r["wall_s"]) for r in rows if isinstance(r, dict) and r.get("notebook") == run.name
                 and r.get("status") == "ok" and r.get("wall_s") is not None), None)


@dataclass
class Plan:
    """Expected seconds per run name (None: never ran here)."""

    expected: dict[str, float | None]

    @classmethod
    def of(cls, runs: list[NotebookRun]) -> "Plan":
        return cls({run.name + ":" + run.run_id: recorded_seconds(run) for run in runs})

    def seconds(self, key: str) -> float:
        known = [s for s in self.expected.values() if s is not None]
        value = self.expected.get(key)
        return value if value is not None else (sum(known) / len(known) if known else 60.0)

    def summary(self) -> str:
        known = [s for s in self.expected.values() if s is not None]
        unknown = len(self.expected) - len(known)
        if not self.expected:
            return "nothing to run"
        text = f"{len(self.expected)} notebook run(s)"
        if known:
            text += f", about {sum(known) / 60:.0f} min for the {len(known)} with a recorded time"
        if unknown:
            text += f"; {unknown} never ran here or in a committed record, so no estimate for them"
        return text


class Overall:
    """The bar over a run's notebooks, in expected seconds; :meth:`done` after each outcome."""

    def __init__(self, runs: list[NotebookRun], show: bool):
        self.plan = Plan.of(runs)
        print(f"plan: {self.plan.summary()}", flush=True)
        total = sum(self.plan.seconds(k) for k in self.plan.expected)
        self.bar: Any = bar(total=round(total), desc="notebooks", unit="s", leave=True, show=show and total > 0,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {postfix} [{elapsed}<{remaining}]")
        self.count, self.runs = 0, len(runs)
        self.bar.set_postfix_str(f"0/{self.runs}")

    def done(self, run: NotebookRun) -> None:
        self.count += 1
        self.bar.update(round(self.plan.seconds(run.name + ":" + run.run_id)))
        self.bar.set_postfix_str(f"{self.count}/{self.runs} ({run.name})")

    def close(self) -> None:
        self.bar.close()

