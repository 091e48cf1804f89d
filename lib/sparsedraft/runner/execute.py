"""Execute one planned notebook with papermill and record how the run went.

A run folder holds ``parameters.json`` (written first), whatever the notebook
saves through :mod:`sparsedraft.report` (``metrics.json``, CSV tables, PNG
figures, ``answer.md``), the executed notebook, and ``run.json`` (written
last). ``run.json`` with status ``ok`` is what marks a run finished: a folder
left by a crash or a failed cell is rerun, a finished one is skipped unless
forced.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from .config import OUTPUT_DIR_PARAM, NotebookRun

RUN_FILE = "run.json"
PARAMETERS_FILE = "parameters.json"


@dataclass(frozen=True)
class RunOutcome:
    run: NotebookRun
    status: str  # "ok", "failed" or "skipped"
    wall_s: float
    error: str | None = None


def read_record(folder: Path) -> dict[str, Any] | None:
    """The ``run.json`` of a run folder, or None when missing or unreadable."""
    try:
        return json.loads((folder / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None


def notebook_digest(path: Path) -> str:
    """SHA-256 over the notebook's cell types and sources (outputs and metadata ignored)."""
    import nbformat
    nb = nbformat.read(path, as_version=4)
    text = json.dumps([[cell.cell_type, cell.source] for cell in nb.cells])
    return hashlib.sha256(text.encode()).hexdigest()


def is_finished(run: NotebookRun) -> bool:
    """A run folder with status ok, made by the notebook as it is now."""
    record = read_record(run.output_dir)
    return (record is not None and record.get("status") == "ok"
            and record.get("notebook_sha256") == notebook_digest(run.notebook))


def _versions() -> dict[str, str]:
    import importlib.metadata as md
    versions = {"python": platform.python_version()}
    for package in ("sparsedraft", "torch", "transformers", "papermill"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            continue
    return versions


def _describe(exc: Exception) -> str:
    """One line: papermill's cell error (ename: evalue) or the exception itself."""
    name = getattr(exc, "ename", type(exc).__name__)
    value = str(getattr(exc, "evalue", exc)).strip()
    return f"{name}: {value.splitlines()[0] if value else ''}".strip()


@contextmanager
def kernel_threads(threads: int | None) -> Iterator[None]:
    """Set ``OMP_NUM_THREADS`` for kernels started inside (they inherit the environment), then restore it."""
    old = os.environ.get("OMP_NUM_THREADS")
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


def execute(run: NotebookRun, kernel: str = "python3", force: bool = False,
            timeout_s: int | None = None, threads: int | None = None) -> RunOutcome:
    """Run ``run`` unless it already finished (or ``force``); never raises on a failing cell.

    ``threads`` caps the kernel's CPU threads: on a machine shared with other
    jobs, several OpenMP threads per process contend for the same cores and
    each waits at every parallel region.
    """
    import papermill

    if not force and is_finished(run):
        return RunOutcome(run, "skipped", 0.0)
    folder = run.output_dir
    if folder.exists():
        shutil.rmtree(folder)  # stale artifacts from an older attempt must not mix with this one
    folder.mkdir(parents=True)
    (folder / PARAMETERS_FILE).write_text(json.dumps(run.parameters, indent=2, sort_keys=True) + "\n")
    digest = notebook_digest(run.notebook)
    started = datetime.now(timezone.utc)
    start = time.perf_counter()
    error = None
    try:
        with kernel_threads(threads):
            papermill.execute_notebook(
                str(run.notebook), str(folder / run.notebook.name),
                parameters={**run.parameters, OUTPUT_DIR_PARAM: str(folder.resolve())},
                kernel_name=kernel, cwd=str(run.notebook.parent), progress_bar=False,
                execution_timeout=timeout_s)
    except Exception as exc:  # a failing cell, a dead kernel, a timeout: record it and go on
        error = _describe(exc)
    wall = time.perf_counter() - start
    status = "ok" if error is None else "failed"
    record = {"notebook": run.name, "run_id": run.run_id, "profile": run.profile, "status": status,
              "error": error, "notebook_sha256": digest, "started": started.isoformat(timespec="seconds"),
              "wall_s": round(wall, 1), "threads": threads, "versions": _versions()}
    (folder / RUN_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return RunOutcome(run, status, wall, error)
