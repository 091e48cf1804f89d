"""``python -m sparsedraft run [--profile cpu] [--only 01,04] [-p key value] [-f params.yaml] [--jobs N | --backend ray]``.

Parameters are layered notebook defaults -> ``notebooks/profiles/<profile>.yaml``
-> ``-f`` files -> ``-p`` overrides, validated against each notebook's
``parameters`` cell before anything executes (see :mod:`sparsedraft.runner.config`);
a profile's ``sweep`` expands into one run per grid point. Each run executes
with papermill into ``outputs/<notebook>/<profile>-<hash>/`` on the chosen
backend (:mod:`sparsedraft.runner.backends`: serial, ``--jobs N`` local
processes, or Ray); a finished run with the same parameters is skipped unless
``--force``, so a killed sweep resumes where it stopped. Summary notebooks that
read the others' results run after them, and rerun whenever one of them ran.
At the end ``outputs/README.md`` is rewritten to link every run with its
headline metrics, and ``outputs/run-<profile>.json`` records the command's wall time, each notebook's
and the peak memory. Exit status: 0 when every selected run finished (or was
skipped), 1 when one failed (each failure is printed with the tail of its
log), 2 on a configuration error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import time
from pathlib import Path
from typing import Any

from ..engine.machine import machine_record, peak_gflops, provenance
from ..errors import require
from ..progress import bars_on
from .backends import BACKENDS, Settings, log_tail, make_backend
from .config import NotebookRun, RunConfig, override_item, plan
from .eta import Overall
from .execute import RunOutcome, is_finished
from .index import write_index

HELP = "run the notebooks with papermill into outputs/ (skips runs whose results exist)"


def add_run_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="cpu",
                        help="profile name in notebooks/profiles/ (cpu, quick, gpu-paper, cpu-sweep, cost-sweep, "
                             "long-quality, batch-16k) or a .yaml path")
    parser.add_argument("--only", default="",
                        help="comma-separated notebook numbers or names, e.g. 01,04 (default: all, or the "
                             "profile's select)")
    parser.add_argument("-p", "--param", dest="overrides", action="append", default=[], nargs="+",
                        metavar="KEY[=VALUE]",
                        help="override a parameter: -p key value or -p key=value (YAML value); NN.key targets "
                             "one notebook")
    parser.add_argument("-f", "--parameters-file", dest="parameter_files", action="append", default=[], type=Path,
                        metavar="PARAMS.yaml", help="YAML file of parameters (name: value, or \"05\": {name: value})")
    parser.add_argument("--force", action="store_true", help="rerun notebooks whose results already exist")
    parser.add_argument("--notebooks", type=Path, default=Path("notebooks"), help="folder of NN_*.ipynb")
    parser.add_argument("--outputs", type=Path, default=Path("outputs"), help="folder for run results")
    parser.add_argument("--kernel", default=None,
                        help="Jupyter kernel for every notebook (default: each notebook's kernelspec, sparsedraft)")
    parser.add_argument("--timeout", type=int, default=None, help="per-cell time limit in seconds")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads per notebook kernel (and CPUs per Ray task); 1 avoids thrashing on a "
                             "machine shared with other jobs")
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="serial (default), local (implied by --jobs N > 1) or ray")
    parser.add_argument("--jobs", type=int, default=1, help="local backend: notebook runs at a time")
    parser.add_argument("--address", default=None,
                        help="ray backend: an existing cluster (host:port, ray://host:port or auto); default "
                             "starts an embedded local Ray")
    parser.add_argument("--measure-machine", action="store_true",
                        help="measure read bandwidth and fp32 matmul peak (a few seconds) before running, into "
                             "outputs/run-<profile>.json, so the job's time can be set against the machine's speed")
    parser.add_argument("--ray-cpus", type=int, default=None, help="CPUs of the embedded local Ray (default: all)")
    parser.add_argument("--log-output", action="store_true",
                        help="echo each run's log, cell output included, to the console (it is always in run.log)")
    parser.add_argument("--progress-bar", action="store_true", help="papermill's progress bar over cells")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (run ids, parameters) and stop")


def report(outcome: RunOutcome) -> None:
    run = outcome.run
    detail = f" ({outcome.error})" if outcome.error else ""
    print(f"{run.name}: {outcome.status} in {outcome.wall_s:.0f} s{detail}", flush=True)
    if outcome.status == "failed":
        tail = log_tail(outcome.log)
        where = f"log: {outcome.log}" if outcome.log else "no log was written"
        print(f"{run.name}: failed run {run.output_dir}; {where}" + (f"\n{tail}" if tail else ""), flush=True)


def run_notebooks(args: argparse.Namespace) -> int:
    """Plan (validating every parameter), start the backend, then execute; the exit status of the command."""
    only = tuple(k.strip() for k in args.only.split(",") if k.strip())
    overrides = tuple(override_item(values) for values in args.overrides)
    require(args.timeout is None or args.timeout > 0, f"--timeout must be > 0, got {args.timeout}")
    cfg = RunConfig(profile=args.profile, only=only, force=args.force, overrides=overrides,
                    parameter_files=tuple(args.parameter_files), notebooks_dir=args.notebooks,
                    outputs_dir=args.outputs, kernel=args.kernel, timeout_s=args.timeout, threads=args.threads)
    runs = plan(cfg)
    if args.dry_run:
        for run in runs:
            print(f"{run.name}: {run.output_dir}  {run.parameters}")
        return 0
    check_environment(runs)
    settings = Settings(cfg.timeout_s, cfg.threads, args.log_output, args.progress_bar)
    backend = make_backend(args.backend, settings, args.jobs, args.address, args.ray_cpus)
    failed = ran = 0
    began, where, outcomes = time.perf_counter(), provenance(), []
    # what will run, as far as it is known now (a summary notebook reruns only when another ran)
    unfinished = {r for r in runs if cfg.force or not is_finished(r)}
    where["machine"] = machine_record(measure=False)
    if args.measure_machine and unfinished:  # the speed this machine had when the job started: its time's yardstick
        where["machine"] = {**machine_record(), "peak_gflops_fp32": round(peak_gflops(["fp32"])["fp32"], 1)}
        print(f"machine: {where['machine']}", flush=True)
    likely = [r for r in runs if r in unfinished or (r.reads_outputs and any(not o.reads_outputs for o in unfinished))]
    overall = Overall(likely, show=bars_on())
    try:
        for stage in ([r for r in runs if not r.reads_outputs], [r for r in runs if r.reads_outputs]):
            todo: list[NotebookRun] = []
            for run in stage:
                if cfg.force or (run.reads_outputs and ran > 0) or not is_finished(run):
                    todo.append(run)
                else:
                    print(f"{run.name}: skipped (finished: {run.output_dir})", flush=True)
            for outcome in backend.run(todo):
                report(outcome)
                outcomes.append(outcome)
                overall.done(outcome.run)
                failed += outcome.status == "failed"
                ran += 1
    finally:
        overall.close()
        backend.close()
        print(f"index: {write_index(cfg.outputs_dir)}")
        if ran:
            print(f"timing: {write_timing(cfg, outcomes, time.perf_counter() - began, where)}")
    return 1 if failed else 0


def write_timing(cfg: RunConfig, outcomes: list[RunOutcome], wall_s: float, where: dict[str, Any]) -> Path:
    """``<outputs>/run-<profile>.json``: this command's wall time, each notebook's, and the peak resident memory
    of its largest process (a notebook kernel, or this one), with the commit it started from and the machine;
    ``python -m sparsedraft results --from-runs`` makes it the record of the README's "the hour" figure."""
    peak_kb = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    record = {"profile": cfg.profile, **where, "wall_s": round(wall_s, 1), "peak_rss_mb": round(peak_kb / 1024),
              "threads": cfg.threads,
              "notebooks": [{"notebook": o.run.name, "status": o.status, "wall_s": round(o.wall_s, 1),
                             "run": str(o.run.output_dir)} for o in outcomes]}
    path = Path(cfg.outputs_dir) / f"run-{cfg.profile}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


RUN_PACKAGES = ("papermill", "nbconvert", "jupyter_client")


def check_environment(runs: list[NotebookRun]) -> None:
    """The packages that execute and render notebooks, and every kernel the runs need, before any run starts."""
    missing = [name for name in RUN_PACKAGES if importlib.util.find_spec(name) is None]
    require(not missing, f"running notebooks needs {', '.join(missing)}, not installed: pip install -e "
                         "'.[notebooks]' (`make install` does it)")
    from jupyter_client.kernelspec import KernelSpecManager
    installed = set(KernelSpecManager().find_kernel_specs())
    missing = sorted({run.kernel for run in runs} - installed)
    require(not missing, f"Jupyter kernel(s) {missing} not installed (installed: {sorted(installed)}); `make install` "
                         "registers the sparsedraft kernel, or run `python -m ipykernel install --sys-prefix --name "
                         "sparsedraft --display-name 'Python (sparsedraft)'`, or pass --kernel NAME")
