"""Execute one planned notebook with papermill and record how the run went.

A run folder holds ``parameters.json`` (written first), whatever the notebook
saves through :mod:`sparsedraft.report` (``metrics.json``, CSV tables, PNG
figures, ``answer.md``), the executed notebook and its HTML render, ``run.log`` (papermill's log:
the cells it ran and what they printed), and ``run.json``
(written last). ``run.json`` with status ``ok`` is what marks a run finished: a
folder left by a crash, a kill or a failed cell is rerun, a finished one is
skipped unless forced.

Kernels started here get ``OMP_NUM_THREADS`` (when ``threads`` is given) and
``SPARSEDRAFT_PROGRESS=0``: a batch run keeps progress bars out of the
executed notebooks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from ..engine.machine import machine_record, provenance
from .config import OUTPUT_DIR_PARAM, NotebookRun
from .html import render_html

RUN_FILE = "run.json"
PARAMETERS_FILE = "parameters.json"
LOG_FILE = "run.log"
PAPERMILL_LOGGER = "papermill"


@dataclass(frozen=True)
class RunOutcome:
    run: NotebookRun
    status: str  # "ok", "failed" or "skipped"
    wall_s: float
    error: str | None = None
    log: Path | None = None  # the run's log, when one was written


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
def kernel_environment(threads: int | None) -> Iterator[None]:
    """Environment for kernels started inside (they inherit it), restored afterwards."""
    changes = {"SPARSEDRAFT_PROGRESS": "0"}
    if threads is not None:
        changes["OMP_NUM_THREADS"] = str(threads)
    old = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def papermill_log(path: Path | None, echo: bool) -> Iterator[None]:
    """Send papermill's log to ``path`` (and to stderr when ``echo``) for the duration of one run."""
    logger = logging.getLogger(PAPERMILL_LOGGER)
    handlers: list[logging.Handler] = []
    if path is not None:
        handlers.append(logging.FileHandler(path, encoding="utf-8"))
    if echo:
        handlers.append(logging.StreamHandler())
    level = logger.level
    logger.setLevel(logging.INFO)
    for handler in handlers:
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    try:
        yield
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
            handler.close()
        logger.setLevel(level)


def prepare(run: NotebookRun) -> Path:
    """An empty run folder holding ``parameters.json``; an older attempt's files are removed."""
    folder = run.output_dir
    if folder.exists():
        shutil.rmtree(folder)  # stale artifacts from an older attempt must not mix with this one
    folder.mkdir(parents=True)
    (folder / PARAMETERS_FILE).write_text(json.dumps(run.parameters, indent=2, sort_keys=True) + "\n")
    return folder


def write_record(run: NotebookRun, status: str, error: str | None, started: datetime, wall: float,
                 threads: int | None, digest: str | None = None, where: dict[str, Any] | None = None) -> None:
    """``run.json``; ``where`` is :func:`provenance` taken when the run started (the commit that ran), and the
    machine is recorded without a bandwidth figure (a notebook's timed tables carry the one measured there)."""
    record = {"notebook": run.name, "run_id": run.run_id, "profile": run.profile, "status": status,
              "error": error, "notebook_sha256": digest or notebook_digest(run.notebook),
              "started": started.isoformat(timespec="seconds"), "wall_s": round(wall, 1), "threads": threads,
              "kernel": run.kernel, "versions": _versions(), **{k: v for k, v in (where or {}).items() if k != "date"},
              "machine": machine_record(measure=False)}
    (run.output_dir / RUN_FILE).write_text(json.dumps(record, indent=2) + "\n")


def execute(run: NotebookRun, force: bool = False, timeout_s: int | None = None, threads: int | None = None,
            log_output: bool = False, progress_bar: bool = False, log_file: bool = True) -> RunOutcome:
    """Run ``run`` in this process unless it already finished (or ``force``); never raises on a failing cell.

    ``threads`` caps the kernel's CPU threads: on a machine shared with other
    jobs, several OpenMP threads per process contend for the same cores and
    each waits at every parallel region. Papermill's log, the cells' output
    included, goes to ``run.log``; ``log_output`` echoes it to stderr too; ``progress_bar``
    shows papermill's bar over cells. ``log_file=False`` sends the log to
    stderr instead of ``run.log``: a worker process whose whole output the
    caller captures into ``run.log`` (:func:`sparsedraft.runner.backends.launch`).
    """
    import papermill

    if not force and is_finished(run):
        return RunOutcome(run, "skipped", 0.0)
    folder = prepare(run)
    digest = notebook_digest(run.notebook)
    started = datetime.now(timezone.utc)
    where = provenance()
    start = time.perf_counter()
    error = None
    try:
        with kernel_environment(threads), papermill_log(folder / LOG_FILE if log_file else None,
                                                        echo=log_output or not log_file):
            papermill.execute_notebook(
                str(run.notebook), str(folder / run.notebook.name),
                parameters={**run.parameters, OUTPUT_DIR_PARAM: str(folder.resolve())},
                kernel_name=run.kernel, cwd=str(run.notebook.parent), progress_bar=progress_bar,
                log_output=True, execution_timeout=timeout_s)
    except Exception as exc:  # a failing cell, a dead kernel, a timeout: record it and go on
        error = _describe(exc)
    wall = time.perf_counter() - start
    executed = folder / run.notebook.name
    if executed.is_file():  # papermill saves a failed notebook too: its page shows where it stopped
        try:
            render_html(executed)
        except Exception as exc:
            error = error or f"HTML rendering failed: {_describe(exc)}"
    status = "ok" if error is None else "failed"
    write_record(run, status, error, started, wall, threads, digest, where)
    return RunOutcome(run, status, wall, error, folder / LOG_FILE if log_file else None)
