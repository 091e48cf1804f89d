"""Time a whole command (``make test``, ``make reproduce``) as a results record, the way ``/usr/bin/time -v`` would.

The README states how long its two commands take on a fresh clone. Typed by
hand, such a figure cannot be traced or refreshed; this module runs the
command, takes its wall time and the peak resident memory of its largest
process (the child's ``wait4`` rusage, what ``/usr/bin/time`` reports), and
writes a record with the commit of the checkout it ran in, the machine's ISA
and read bandwidth (measured after the command, so it does not compete with
it) and the exit status. ``python -m sparsedraft results`` renders the record
into the README's run-times table beside the runner's per-notebook timing.

    python -m sparsedraft timed --record docs/results/command-make-test.json --label "fresh clone" -- make test
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ..engine import machine
from ..errors import require
from .record import write_record

HELP = "run a command (make test, make reproduce) and record its wall time and peak RSS"


def add_timed_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--record", required=True, metavar="FILE.json",
                        help="record to write (e.g. docs/results/command-make-test.json)")
    parser.add_argument("--label", default="", help="how the command was run, e.g. 'fresh clone, with install'")
    parser.add_argument("--cwd", default=".", help="folder to run it in (its git checkout is the record's commit)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- make test")


def timed_run(argv: list[str], cwd: str | Path = ".") -> dict:
    """Run ``argv`` in ``cwd``; its exit status, wall seconds and the peak RSS of its largest process (MB)."""
    began = time.monotonic()
    child = subprocess.Popen(argv, cwd=cwd)
    _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage, not every child this process ever had
    wall = time.monotonic() - began
    child.returncode = os.waitstatus_to_exitcode(status)
    return {"argv": list(argv), "rc": child.returncode, "wall_s": round(wall, 1),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}  # ru_maxrss: KiB on Linux


def run_timed(args: argparse.Namespace) -> int:
    argv = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    require(argv, "give the command to time after --, e.g. python -m sparsedraft timed --record R.json -- make test")
    require(str(args.record).endswith(".json"), f"a record is a .json file, got {args.record!r}")
    cwd = Path(args.cwd)
    require(cwd.is_dir(), f"--cwd {cwd} is not a folder")
    started = machine.provenance(cwd.resolve())  # the commit of the checkout the command runs in
    require(started["commit"] is not None, f"{cwd.resolve()} is not a git checkout: the record could name no commit")
    run = timed_run(argv, cwd)
    path = write_record(args.record, {"bench": "command", "label": args.label, "rows": [run]},
                        command=shlex.join(argv), started=started)
    print(f"{shlex.join(argv)}: rc {run['rc']}, {run['wall_s'] / 60:.1f} min, peak RSS "
          f"{run['peak_rss_mb'] / 1024:.1f} GB; recorded in {path}", file=sys.stderr)
    return run["rc"]
