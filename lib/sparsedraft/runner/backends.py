"""Where the planned runs execute: serially in this process, in parallel local processes, or as Ray tasks.

All three produce the same run folders (:mod:`sparsedraft.runner.execute`)
and report outcomes as runs finish. The runner decides which runs to start
(finished ones are skipped before any backend sees them), so a sweep killed
half-way resumes with the points that did not finish.

- ``serial`` (default): one run after another, papermill inside this process.
- ``local`` (``--jobs N``): N worker processes at a time
  (:mod:`sparsedraft.runner.worker`), each kernel with ``cores // N`` threads
  unless ``--threads`` says otherwise.
- ``ray`` (``--backend ray``): each run is one Ray task declaring its
  resources (``--threads`` CPUs, default 1, and one GPU when the run's
  ``device`` parameter is CUDA) that starts the same worker process. Without
  ``--address`` an embedded local Ray is started (``--ray-cpus``, default
  every core) and stopped at the end; with ``--address`` the runner joins an
  existing cluster, whose nodes must see this checkout and ``outputs/`` at the
  same paths (a shared filesystem) with sparsedraft installed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Iterable, Iterator
from urllib.parse import urlsplit

from ..errors import SparsedraftError, require
from .config import NotebookRun
from .execute import LOG_FILE, RunOutcome, execute, read_record, write_record
from .worker import run_spec

BACKENDS = ("serial", "local", "ray")
RAY_INSTALL = "pip install 'ray>=2.9' (in this project: .venv/bin/pip install -e '.[sweeps]')"
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Settings:
    """How each run executes, whatever the backend."""

    timeout_s: int | None = None  # per-cell limit
    threads: int | None = None  # CPU threads per kernel (and CPUs a Ray task declares)
    log_output: bool = False  # echo each run's log (always in run.log) to the console
    progress_bar: bool = False  # papermill's bar over cells


def launch(run: NotebookRun, settings: Settings, echo: IO[str] | None = None) -> RunOutcome:
    """Execute ``run`` in a worker process; its whole output becomes the run folder's ``run.log``.

    A worker that dies before recording the run (a killed process, an import
    error) still leaves a failed ``run.json`` naming its exit status.
    """
    run.output_dir.parent.mkdir(parents=True, exist_ok=True)
    pending = run.output_dir.parent / f".{run.run_id}.log"  # the worker clears the run folder first
    spec = run_spec(run, settings.timeout_s, settings.threads, settings.log_output, settings.progress_bar)
    started = datetime.now(timezone.utc)
    start = time.perf_counter()
    with open(pending, "w", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, "-m", "sparsedraft.runner.worker", json.dumps(spec)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=str(run.notebook.parent.resolve()))
        for line in proc.stdout:
            log.write(line)
            if echo is not None:
                echo.write(f"[{run.name}/{run.run_id}] {line}")
        code = proc.wait()
    wall = time.perf_counter() - start
    record = read_record(run.output_dir)
    if run.output_dir.is_dir():
        log_path = run.output_dir / LOG_FILE
        shutil.move(pending, log_path)
    else:
        log_path = pending
    fresh = record is not None and record.get("started", "") >= started.isoformat(timespec="seconds")
    if not fresh or record.get("status") not in ("ok", "failed"):
        error = f"the worker exited with status {code} before recording the run"
        if run.output_dir.is_dir():
            write_record(run, "failed", error, started, wall, settings.threads)
        return RunOutcome(run, "failed", wall, error, log_path)
    return RunOutcome(run, record["status"], wall, record.get("error"), log_path)


class SerialBackend:
    """One run after another, in this process."""

    name = "serial"

    def __init__(self, settings: Settings):
        self.settings = settings

    def run(self, runs: Iterable[NotebookRun]) -> Iterator[RunOutcome]:
        s = self.settings
        for run in runs:
            print(f"{run.name}: {run.output_dir} ...", flush=True)
            yield execute(run, force=True, timeout_s=s.timeout_s, threads=s.threads, log_output=s.log_output,
                          progress_bar=s.progress_bar)

    def close(self) -> None:
        pass


class LocalBackend:
    """``jobs`` worker processes at a time on this machine."""

    name = "local"

    def __init__(self, settings: Settings, jobs: int):
        require(jobs >= 1, f"--jobs must be >= 1, got {jobs}")
        threads = settings.threads or max(1, (os.cpu_count() or 1) // jobs)
        self.settings = Settings(settings.timeout_s, threads, settings.log_output, settings.progress_bar)
        self.jobs = jobs

    def run(self, runs: Iterable[NotebookRun]) -> Iterator[RunOutcome]:
        echo = sys.stdout if self.settings.log_output else None
        with ThreadPoolExecutor(self.jobs) as pool:
            futures = []
            for run in runs:
                print(f"{run.name}: {run.output_dir} queued", flush=True)
                futures.append(pool.submit(launch, run, self.settings, echo))
            for future in as_completed(futures):
                yield future.result()

    def close(self) -> None:
        pass


def ray_resources(run: NotebookRun, cpus: int) -> dict[str, int]:
    """What a run's Ray task declares: ``cpus`` CPUs, and one GPU when its ``device`` parameter is CUDA."""
    return {"num_cpus": cpus, "num_gpus": 1 if str(run.parameters.get("device", "cpu")).startswith("cuda") else 0}


def auth_hint(address: str | None) -> str:
    """What to try when joining a cluster failed and this process has no Ray token mode set.

    ``ray start`` enables token authentication by default (Ray 2.59 and later), and a driver only sends the
    token when ``RAY_AUTH_MODE=token`` is set in its own environment too.
    """
    if address is None or os.environ.get("RAY_AUTH_MODE"):
        return ""
    return ("; if the cluster uses token authentication (the default of `ray start` since Ray 2.59), set "
            "RAY_AUTH_MODE=token here as well (the token comes from RAY_AUTH_TOKEN or ~/.ray/auth_token)")


def check_reachable(address: str) -> None:
    """One clear error when ``host:port`` (or ``ray://host:port``) accepts no connection."""
    if address in ("auto", "local"):
        return
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    require(parts.hostname is not None and parts.port is not None,
            f"--address {address!r} must be host:port, ray://host:port or auto")
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise SparsedraftError(f"Ray cluster at --address {address} is unreachable ({exc}); start it with "
                               "`ray start --head` there, or drop --address to run an embedded local Ray") from exc


def _ray_task(run: NotebookRun, settings: Settings) -> RunOutcome:
    return launch(run, settings, sys.stdout if settings.log_output else None)  # Ray forwards it to the driver


class RayBackend:
    """Each run one Ray task; an embedded local Ray unless ``address`` names a cluster."""

    name = "ray"

    def __init__(self, settings: Settings, address: str | None = None, cpus: int | None = None):
        try:
            import ray
        except ImportError as exc:
            raise SparsedraftError(f"--backend ray needs Ray, which is not installed: {RAY_INSTALL}") from exc
        require(cpus is None or cpus >= 1, f"--ray-cpus must be >= 1, got {cpus}")
        require(cpus is None or address is None, "--ray-cpus sizes an embedded local Ray; a cluster given by "
                                                 "--address has its own resources")
        self.ray = ray
        self.settings = Settings(settings.timeout_s, settings.threads or 1, settings.log_output,
                                 settings.progress_bar)
        # Workers inherit this environment: relative entries of PYTHONPATH would point elsewhere from their folder.
        if os.environ.get("PYTHONPATH"):
            os.environ["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve())
                                                       for p in os.environ["PYTHONPATH"].split(os.pathsep) if p)
        if address is not None:
            check_reachable(address)
        try:
            if address is None:
                ray.init(num_cpus=cpus or os.cpu_count(), include_dashboard=False,
                         log_to_driver=self.settings.log_output, configure_logging=False)
            else:
                ray.init(address=address, log_to_driver=self.settings.log_output)
        except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ... depending on the address form
            raise SparsedraftError(f"could not start or join Ray (address {address or 'embedded local'}): "
                                   f"{exc}{auth_hint(address)}") from exc
        self.started_local = address is None
        self.task = ray.remote(_ray_task)

    def run(self, runs: Iterable[NotebookRun]) -> Iterator[RunOutcome]:
        pending = {}
        for run in runs:
            options = ray_resources(run, self.settings.threads)
            print(f"{run.name}: {run.output_dir} submitted to Ray ({options})", flush=True)
            pending[self.task.options(**options).remote(run, self.settings)] = run
        while pending:
            done, _ = self.ray.wait(list(pending), num_returns=1)
            for ref in done:
                run = pending.pop(ref)
                try:
                    yield self.ray.get(ref)
                except Exception as exc:  # the task itself died (node lost, worker killed)
                    yield RunOutcome(run, "failed", 0.0, f"Ray task failed: {type(exc).__name__}: {exc}",
                                     None)

    def close(self) -> None:
        if self.started_local:
            self.ray.shutdown()


def make_backend(name: str | None, settings: Settings, jobs: int = 1, address: str | None = None,
                 ray_cpus: int | None = None) -> SerialBackend | LocalBackend | RayBackend:
    """The backend the options ask for, checked (Ray started or joined) before any run starts."""
    name = name or ("local" if jobs > 1 else "serial")
    require(name in BACKENDS, f"--backend must be one of {BACKENDS}, got {name!r}")
    require(jobs == 1 or name == "local", f"--jobs applies to the local backend, not {name}"
                                          + ("; Ray runs as many tasks as its CPUs allow (--threads CPUs each)"
                                             if name == "ray" else ""))
    require(name == "ray" or (address is None and ray_cpus is None), "--address and --ray-cpus need --backend ray")
    if name == "serial":
        return SerialBackend(settings)
    if name == "local":
        return LocalBackend(settings, jobs)
    return RayBackend(settings, address, ray_cpus)


def log_tail(path: Path | None, lines: int = 15) -> str:
    """The last lines of a run's log, for a failure report."""
    if path is None or not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

