"""What a speculative run reports: acceptance per level, forwards, and where the time went.

Counters live in :class:`LevelStats` (one per verification level) and are
filled by the drivers and by :class:`~.hierarchy.SpeculativeDrafter`. Level
and region names are the constants below, so that benchmarks and plots read
the same strings the decoders write. Time is
measured only by a :class:`Stopwatch` the driver owns and lends to nested
drafters, so verification and drafting functions stay free of clocks; every
timed region synchronises the device, otherwise asynchronous CUDA work would
be billed to whichever region happens to wait for it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..engine.runtime import synchronize

TARGET = "target"  # the full-cache verifier: the last level of every run
RETRIEVAL_LEVEL = "level2"  # TriForce's middle level: the target over a retrieval cache
DRAFT, VERIFY, SYNC, REBUILD = "draft", "verify", "sync", "rebuild"  # the driver's timed regions


def region(level: str, phase: str) -> str:
    """Timed region of a nested level's phase: ``region(RETRIEVAL_LEVEL, DRAFT) == "level2_draft"``."""
    return f"{level}_{phase}"


@dataclass
class LevelStats:
    """One verifier level: how many draft tokens it saw and kept.

    ``rounds[g][n]`` counts verifications of g drafts that kept exactly n of
    them. Keeping the draft length matters: a round capped below γ (the last
    round before level 3, or the end of generation) cannot accept more than it
    drafted, and a fit of the acceptance rate that ignores this is biased (see
    :func:`sparsedraft.analysis.fit_alpha`).
    """

    name: str
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0  # forwards of this level's verifier
    rounds: dict[int, list[int]] = field(default_factory=dict)

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verifications += 1
        self.rounds.setdefault(drafted, [0] * (drafted + 1))[accepted] += 1

    @property
    def histogram(self) -> list[int]:
        """``histogram[n]``: verifications that kept exactly n drafts, whatever they drafted
        (length: the largest draft length + 1)."""
        counts = [0] * (max(self.rounds, default=-1) + 1)
        for row in self.rounds.values():
            for n, c in enumerate(row):
                counts[n] += c
        return counts

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens kept (nan before any draft)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def mean_accepted(self) -> float:
        """Draft tokens kept per verification (each verification also emits one token of its own)."""
        return self.accepted / self.verifications if self.verifications else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "drafted": self.drafted, "accepted": self.accepted,
                "verifications": self.verifications, "acceptance_rate": self.acceptance_rate,
                "mean_accepted": self.mean_accepted, "histogram": self.histogram,
                "rounds": {g: list(row) for g, row in sorted(self.rounds.items())}}


class Stopwatch:
    """Accumulates seconds per named region; regions may nest (times are inclusive)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, region: str) -> Iterator[None]:
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.seconds[region] += time.perf_counter() - start


@dataclass
class SpecStats:
    """Everything a speculative run measured. ``levels`` are ordered draft-most first:
    the last entry is the full-cache target verifying the outermost drafter."""

    levels: list[LevelStats]
    generated: int  # tokens emitted
    target_forwards: int  # full-cache target forwards after prefill (one per outer verification)
    rebuilds: int  # drafter cache rebuilds triggered by the rebuild policy
    prefill_s: float  # prompt forward (a shared prefill's seconds) + cache copies, builds and draft prefills
    decode_s: float
    seconds: dict[str, float]  # inclusive time per region: DRAFT, VERIFY, SYNC, REBUILD, region(level, phase)

    @property
    def tokens_per_iteration(self) -> float:
        """Tokens emitted per full-cache target forward."""
        return self.generated / self.target_forwards if self.target_forwards else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {"generated": self.generated, "target_forwards": self.target_forwards,
                "tokens_per_iteration": self.tokens_per_iteration, "rebuilds": self.rebuilds,
                "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "seconds": dict(self.seconds),
                "levels": [lvl.to_dict() for lvl in self.levels]}
