"""Command line: ``python -m sparsedraft <command> ...`` (also installed as ``sparsedraft``).

Commands live in :data:`COMMANDS` (name -> how to add its parser, how to run
it). ``bench <method>`` takes its options from the method's config dataclass
(see :data:`sparsedraft.bench.BENCHES`): each field becomes ``--field-name``,
booleans get ``--name/--no-name``, and the dataclass validates the values.
A benchmark prints its human table, then one JSON object as the last line of
stdout; progress bars go to stderr. A :class:`SparsedraftError` prints as one
``error:`` line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from .bench import BENCHES as AR_BENCHES
from .bench import Bench
from .bench_spec import DECODERS, SpecBenchConfig, run_spec_bench
from .budgetdraft.cli import HELP as TRAIN_HELP
from .budgetdraft.cli import add_train_parser, run_train_drafter
from .cliopts import add_config_options, config_from_args
from .errors import SparsedraftError

# `bench spec|retrieval|triforce` share one config; the method name sets its decoder.
BENCHES: dict[str, Bench] = {**AR_BENCHES, **{
    name: Bench(SpecBenchConfig, run_spec_bench, f"{name} decoding vs AR in one process: speedup, "
                                                 "per-level acceptance and time")
    for name in DECODERS}}


def add_bench_parser(parser: argparse.ArgumentParser) -> None:
    methods = parser.add_subparsers(dest="method", required=True, metavar="method")
    for name, bench in BENCHES.items():
        sub = methods.add_parser(name, help=bench.help, description=bench.help)
        add_config_options(sub, bench.config)
        if name in DECODERS:
            sub.set_defaults(decoder=name)


def run_bench(args: argparse.Namespace) -> None:
    bench = BENCHES[args.method]
    result = bench.run(config_from_args(bench.config, args), True)
    print(result.table())
    print(json.dumps(result.to_dict()))


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], None]]] = {
    "bench": ("time decoding methods; prints a table, then one JSON line", add_bench_parser, run_bench),
    "train-drafter": (TRAIN_HELP, add_train_parser, run_train_drafter),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparsedraft", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (help_text, add_parser, _) in COMMANDS.items():
        add_parser(commands.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    try:
        COMMANDS[args.command][2](args)
    except SparsedraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
