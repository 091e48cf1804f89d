"""``python -m sparsedraft run [--profile cpu] [--only 01,04] [-p key=value] [--force]``: run the notebooks.

Parameters are layered notebook defaults -> ``notebooks/profiles/<profile>.yaml``
-> ``-p`` overrides, validated against each notebook's ``parameters`` cell
before anything executes (see :mod:`sparsedraft.runner.config`). Each notebook
runs with papermill into ``outputs/<notebook>/<profile>-<hash>/``; a finished
run with the same parameters is skipped unless ``--force`` (a summary notebook
that reads the others' results reruns whenever one of them ran). At the end
``outputs/README.md`` is rewritten to link every run with its headline
metrics. Exit status: 0 when every selected notebook finished (or was
skipped), 1 when one failed, 2 on a configuration error.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .config import RunConfig, plan
from .execute import execute
from .index import write_index

HELP = "run the notebooks with papermill into outputs/ (skips runs whose results exist)"


def add_run_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="cpu",
                        help="profile name in notebooks/profiles/ (cpu, quick, gpu-paper) or a .yaml path")
    parser.add_argument("--only", default="",
                        help="comma-separated notebook numbers or names, e.g. 01,04 (default: all)")
    parser.add_argument("-p", "--param", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a parameter (YAML value); NN.key=value targets one notebook")
    parser.add_argument("--force", action="store_true", help="rerun notebooks whose results already exist")
    parser.add_argument("--notebooks", type=Path, default=Path("notebooks"), help="folder of NN_*.ipynb")
    parser.add_argument("--outputs", type=Path, default=Path("outputs"), help="folder for run results")
    parser.add_argument("--kernel", default="python3", help="Jupyter kernel name")
    parser.add_argument("--timeout", type=int, default=None, help="per-cell time limit in seconds")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads per notebook kernel; 1 avoids thrashing on a machine shared with other jobs")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (run ids, parameters) and stop")


def run_notebooks(args: argparse.Namespace) -> int:
    """Plan (validating every parameter), then execute each notebook; the exit status of the command."""
    only = tuple(k.strip() for k in args.only.split(",") if k.strip())
    cfg = RunConfig(args.profile, only, args.force, tuple(args.overrides), args.notebooks, args.outputs,
                    args.kernel, args.timeout, args.threads)
    runs = plan(cfg)
    failed = ran = 0
    for run in runs:
        if args.dry_run:
            print(f"{run.name}: {run.output_dir}  {run.parameters}")
            continue
        print(f"{run.name}: {run.output_dir} ...", flush=True)
        outcome = execute(run, cfg.kernel, cfg.force or (run.reads_outputs and ran > 0), cfg.timeout_s,
                          cfg.threads)
        detail = f" ({outcome.error})" if outcome.error else ""
        print(f"{run.name}: {outcome.status} in {outcome.wall_s:.0f} s{detail}", flush=True)
        failed += outcome.status == "failed"
        ran += outcome.status != "skipped"
    if not args.dry_run:
        print(f"index: {write_index(cfg.outputs_dir)}")
    return 1 if failed else 0
