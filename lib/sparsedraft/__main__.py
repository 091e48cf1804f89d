"""Command line: ``python -m sparsedraft <command> ...`` (also installed as ``sparsedraft``).

Commands live in :data:`COMMANDS` (name -> help, how to add its parser, how to
run it). ``bench <name>`` covers every bench in
:data:`sparsedraft.bench.BENCHES`: ``ar`` and each decoding method, whose
flags come from its options dataclass plus the shared
:class:`~sparsedraft.bench.CompareConfig` fields (each field becomes
``--field-name``, booleans get ``--name/--no-name``; the dataclasses validate
the values before any model loads). A benchmark prints its human table, then
one JSON object as the last line of stdout; progress bars go to stderr.
``train-drafter`` trains a BudgetDraft drafter; ``run`` executes the
notebooks; ``gpu-check`` times the GPU path (:mod:`sparsedraft.bench.gpu`). ``bench ... --record
FILE.json`` also writes the result with its command, commit, date and machine
(:mod:`sparsedraft.bench.record`); ``results`` rebuilds the README's results
table from those records. A :class:`SparsedraftError` prints as one ``error:`` line on
stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Callable

from .bench import BENCHES
from .bench.gpu import HELP as GPU_CHECK_HELP
from .bench.gpu import add_gpu_check_parser, run_gpu_check_command
from .bench.record import RESULTS_DIR, refresh_readme, resolved_options, write_record
from .bench.timed_command import HELP as TIMED_HELP
from .bench.timed_command import add_timed_parser, run_timed
from .bench.tuned import SOURCE, TUNED, tuned_context, tuned_options
from .budgetdraft.cli import HELP as TRAIN_HELP
from .budgetdraft.cli import add_train_parser, run_train_drafter
from .cliopts import add_config_options, config_from_args, options_from_pairs, values_from_args
from .engine import kernels
from .engine.machine import provenance
from .errors import status_of
from .runner.cli import HELP as RUN_HELP
from .runner.cli import add_run_parser, run_notebooks
from .speculative.methods import METHODS


TUNED_HELP = ("an option not given takes the best setting notebook 05 measured at the largest tuned context at or "
              "below --context (sparsedraft.bench.tuned), else the default shown")


def add_bench_parser(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="bench", required=True, metavar="bench")
    for name, bench in BENCHES.items():
        sub = benches.add_parser(name, help=bench.help, description=bench.help)
        add_config_options(sub, bench.config)
        sub.add_argument("--record", metavar="FILE.json", default="",
                         help="also write the result with its command, commit, date, CPU ISA path and read "
                              f"bandwidth to this file (e.g. {RESULTS_DIR}/NAME.json); empty: none")
        if bench.method is not None:
            group = sub.add_argument_group(f"{name} options", TUNED_HELP if name in TUNED else None)
            add_config_options(group, METHODS[bench.method].options, given_only=True)
            sub.add_argument("--also", action="append", default=[], metavar="OPTION=VALUE[,...]",
                             help=f"also time {name} with these options changed from the ones above, in the same "
                                  "process from the same prefill, a row each (e.g. --also draft=ngram,"
                                  "draft_vocab=0); repeatable")


def bench_config(args: argparse.Namespace):
    """The bench's config from parsed flags. A method's options not given on the command line come from its
    tuned per-context defaults (:mod:`sparsedraft.bench.tuned`) when there are some, else its dataclass; each
    ``--also`` adds the method again with some of them changed."""
    bench = BENCHES[args.bench]
    if bench.method is None:
        return config_from_args(bench.config, args)
    kind = METHODS[bench.method].options
    options = {**tuned_options(bench.method, args.context), **values_from_args(kind, args)}
    variants = [{**options, **options_from_pairs(kind, text)} for text in args.also]
    return config_from_args(bench.config, args, methods=tuple((bench.method, o) for o in [options, *variants]))


def tuned_note(args: argparse.Namespace, config) -> str:
    """The line naming the options the tuned table filled in because the command line left them off ('' when
    it filled none)."""
    method = BENCHES[args.bench].method
    if method is None:
        return ""
    given = values_from_args(METHODS[method].options, args)
    taken = {k: v for k, v in tuned_options(method, config.context).items() if k not in given}
    return (f"{method} options not given on the command line took the best settings measured at context "
            f"{tuned_context(method, config.context)} ({SOURCE}): {taken}") if taken else ""


def run_bench(args: argparse.Namespace) -> None:
    config = bench_config(args)
    started = provenance() if args.record else None
    bench = BENCHES[args.bench]
    result = bench.run(config, True)
    print(result.table())
    note = tuned_note(args, config)
    if note:
        print(note)
    print(json.dumps(result.to_dict()))
    if args.record:
        found = result.to_dict()
        read = found.get("read_gb_s", found.get("read_bandwidth_gbps"))
        if bench.method is not None:
            found["resolved_options"] = resolved_options(config)
        command = "python -m sparsedraft " + shlex.join(getattr(args, "argv", sys.argv[1:]))
        print(f"record written to {write_record(args.record, found, read, command, started)}", file=sys.stderr)


def add_results_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--readme", default="README.md", help="file whose marked results table is rebuilt")
    parser.add_argument("--records", default=str(RESULTS_DIR), help="folder of records written by bench --record")
    parser.add_argument("--from-runs", default="", metavar="OUTPUTS",
                        help="first record the newest finished runs of --profile under this folder (e.g. outputs): "
                             "notebook 05's curve as speedup-vs-context-<profile>.json and notebook 06's timed "
                             "runs as budgetdraft-speed-<profile>.json (when the profile ran them), and the "
                             "runner's timing of that profile (run-<profile>.json) as reproduce-<profile>.json")
    parser.add_argument("--profile", default="cpu",
                        help="profile of that run (default: cpu, make reproduce's; cpu-long: the 8K-32K curve)")


def run_results(args: argparse.Namespace) -> None:
    from .runner.results import SPEED_NOTEBOOK, draw_curves, ran_notebook, record_curve, record_speed, record_timing
    if args.from_runs:
        made = []
        if ran_notebook(args.from_runs, args.profile):
            made.append(record_curve(args.from_runs, args.profile, args.records))
        if ran_notebook(args.from_runs, args.profile, SPEED_NOTEBOOK):
            made.append(record_speed(args.from_runs, args.profile, args.records))
        reads = [json.loads(path.read_text())["machine"]["read_gb_s"] for path in made]
        read = next((r for r in reads if r), None)  # the bandwidth those runs measured, where the runner took none
        made.append(record_timing(args.from_runs, args.profile, args.records, read))
        print(f"recorded {' and '.join(map(str, made))}", file=sys.stderr)
    print(refresh_readme(args.readme, args.records))
    figure = draw_curves(args.records)
    if figure is not None:
        print(f"figure drawn: {figure}", file=sys.stderr)


Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int | None]]
COMMANDS: dict[str, Command] = {
    "bench": ("time decoding methods; prints a table, then one JSON line", add_bench_parser, run_bench),
    "train-drafter": (TRAIN_HELP, add_train_parser, run_train_drafter),
    "run": (RUN_HELP, add_run_parser, run_notebooks),
    "gpu-check": (GPU_CHECK_HELP, add_gpu_check_parser, run_gpu_check_command),
    "results": ("rebuild README.md's results table from the records in docs/results/", add_results_parser,
                run_results),
    "timed": (TIMED_HELP, add_timed_parser, run_timed),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsedraft", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (help_text, add_parser, _) in COMMANDS.items():
        add_parser(commands.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a record names as its command

    def run() -> int | None:
        if kernels.enabled():  # a forced vector path this CPU lacks: one error now, not after a prefill
            kernels.check_isa(kernels.requested_isa())
        return COMMANDS[args.command][2](args)
    return status_of(run)


if __name__ == "__main__":
    sys.exit(main())
