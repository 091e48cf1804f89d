"""Warm-up and repeated runs shared by every benchmark, interleaved so drift hits all runners alike.

Each runner is warmed up ``warmup`` times (untimed: first-call allocations,
kernel selection and caches settle), then the runners take turns for
``repeats`` rounds. Taking turns, rather than timing one runner's repeats
back to back, spreads a machine's slow phases (thermal throttling, a
neighbour's job) over every runner instead of charging them to one. The
runners time themselves (they synchronise the device around their regions).
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from ..progress import bar

R = TypeVar("R")


def interleaved_runs(runners: dict[str, Callable[[], R]], warmup: int, repeats: int,
                     progress: bool = False) -> dict[str, list[R]]:
    """Name -> its ``repeats`` timed results, after ``warmup`` discarded runs of each runner. Each round runs
    them in the other order from the round before (A B, B A, ...): in A/Bs of two kernel builds on a 2-core EPYC
    whichever ran first in a round was the slower by 5-10%, whichever build it was."""
    names = list(runners)
    steps = [(name, i >= warmup) for i in range(warmup + repeats) for name in (names if i % 2 == 0 else names[::-1])]
    kept: dict[str, list[R]] = {name: [] for name in runners}
    for name, timed in bar(steps, desc="bench", show=progress):
        result = runners[name]()
        if timed:
            kept[name].append(result)
    return kept


def seconds_of(fn: Callable[[], object], calls: int = 1) -> Callable[[], float]:
    """A runner for :func:`interleaved_runs`: the seconds ``calls`` calls of ``fn`` take (CPU work; a GPU runner
    synchronises inside ``fn``)."""
    def timed() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - start
    return timed


def median_run(runs: list[R], key: Callable[[R], float]) -> R:
    """The run whose ``key`` is the median (the upper middle one for an even count), so the stats a
    report shows beside a median time come from one real run."""
    return sorted(runs, key=key)[len(runs) // 2]


def median_ms(seconds: list[float]) -> float:
    """The median of timed runs in seconds (the upper middle one for an even count), in milliseconds."""
    return sorted(seconds)[len(seconds) // 2] * 1e3
