"""Benchmarks that return rows: the numbers every speedup claim is measured against.

:data:`BENCHES` is the one registry the CLI (``python -m sparsedraft bench
<name>``) reads. ``ar`` times plain decoding, our engine against transformers
(:mod:`.ar`). Every other decoding method in :data:`sparsedraft.speculative.methods.METHODS`
is a bench too: :func:`compare` runs it against the AR baseline in one
process (:mod:`.comparison`), its options and the shared ones (model, context,
sampling, ...) becoming flags. A method added to ``METHODS`` is therefore a
bench with no code here.

The GPU check (:mod:`.gpu`, command ``gpu-check``) is not a bench of this
registry: it is a fixed set of parts that writes its own record.

Every result renders a human table (``table()``) and a JSON-ready dict
(``to_dict()``); :class:`CompareResult` also gives a data frame
(``frame()``) for notebooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ..speculative.methods import METHODS
from .ar import ArBenchConfig, ArBenchResult, VerifyRow, run_ar_bench, time_verify_random
from .comparison import BASELINE, CompareConfig, CompareResult, MethodRow, compare


class BenchResult(Protocol):
    def table(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Bench:
    config: type  # frozen dataclass; its fields (with metadata "help"/"choices") become CLI options
    run: Callable[[Any, bool], BenchResult]  # (config, progress) -> result
    help: str
    method: str | None = None  # the decoding method compared with the baseline; its options become flags too


BENCHES: dict[str, Bench] = {
    "ar": Bench(ArBenchConfig, run_ar_bench,
                "autoregressive decoding: ours vs transformers, verify-k cost, achieved bandwidth"),
    **{name: Bench(CompareConfig, compare, f"{method.help}; vs {BASELINE} in one process: speedup, per-level "
                                           "acceptance and time", name)
       for name, method in METHODS.items() if name != BASELINE},
}

__all__ = ["BENCHES", "ArBenchConfig", "ArBenchResult", "Bench", "BenchResult", "CompareConfig", "CompareResult",
           "MethodRow", "VerifyRow", "compare", "run_ar_bench", "time_verify_random"]
