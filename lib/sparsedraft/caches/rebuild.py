"""When to rebuild the retrieval cache: small policies with one question each.

The retrieval cache is chosen for one query and then only takes in new tokens
(TriForce's contextual locality). When the text moves on, its drafts get
rejected more often; a rebuild re-scores every chunk at the cost of reading
the whole cache. The paper rebuilds when a moving average of acceptance falls
below a threshold or at a fixed stride. The public TriForce code builds once,
after the prompt: its retrieval cache has a rebuild method (re-select, then
copy the recent tokens), but its decoding loop only ever syncs new tokens in
and never reaches that call, so :class:`Never` is what it runs.

Every policy answers ``should_rebuild(tokens_since_build, acceptance)`` where
``acceptance`` is the :class:`MovingAverage` of the retrieval-cache (level-2)
drafts' acceptance rate at level-3 verification, or None while the average has
too few rounds. A policy's ``acceptance_window`` tells the caller how many
rounds to average (policies that ignore acceptance keep 1). Build policies
from strings with :func:`rebuild_policy`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..errors import SparsedraftError, require

DEFAULT_ACCEPTANCE_WINDOW = 8  # rounds averaged by "accept<T" when no window is given


class RebuildPolicy:
    """Interface: decide after each verification round whether to rebuild."""

    acceptance_window: int = 1  # rounds the caller's MovingAverage spans

    def should_rebuild(self, tokens_since_build: int, acceptance: float | None) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class Never(RebuildPolicy):
    """Build once after the prompt (what the public TriForce code's decoding loop does)."""

    def should_rebuild(self, tokens_since_build: int, acceptance: float | None) -> bool:
        return False


@dataclass(frozen=True)
class EveryN(RebuildPolicy):
    """Rebuild once ``n`` tokens were committed since the last build (a fixed stride)."""

    n: int  # tokens between rebuilds, >= 1

    def __post_init__(self) -> None:
        require(self.n >= 1, f"EveryN.n (tokens between rebuilds) must be >= 1, got {self.n}")

    def should_rebuild(self, tokens_since_build: int, acceptance: float | None) -> bool:
        return tokens_since_build >= self.n


@dataclass(frozen=True)
class AcceptanceBelow(RebuildPolicy):
    """Rebuild when the moving average of level-2 acceptance drops below ``threshold`` (the paper)."""

    threshold: float  # acceptance rate in (0, 1]
    window: int = DEFAULT_ACCEPTANCE_WINDOW  # verification rounds averaged, >= 1

    def __post_init__(self) -> None:
        require(0 < self.threshold <= 1,
                f"AcceptanceBelow.threshold must be an acceptance rate in (0, 1], got {self.threshold}")
        require(self.window >= 1, f"AcceptanceBelow.window (rounds averaged) must be >= 1, got {self.window}")

    @property
    def acceptance_window(self) -> int:
        return self.window

    def should_rebuild(self, tokens_since_build: int, acceptance: float | None) -> bool:
        return acceptance is not None and acceptance < self.threshold


class MovingAverage:
    """Mean of the last ``window`` values; None until ``window`` values arrived.

    Waiting for a full window keeps one unlucky round right after a (re)build
    from triggering another; call :meth:`reset` after each build.
    """

    def __init__(self, window: int):
        require(window >= 1, f"moving-average window must be >= 1, got {window}")
        self._values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self._values.append(float(value))

    @property
    def value(self) -> float | None:
        if len(self._values) < self._values.maxlen:
            return None
        return sum(self._values) / len(self._values)

    def reset(self) -> None:
        self._values.clear()


FORMS = '"never", "every:N" (N tokens) or "accept<T" / "accept<T:W" (threshold T in (0, 1], W rounds)'


def rebuild_policy(spec: str) -> RebuildPolicy:
    """Parse "never", "every:N" or "accept<T" / "accept<T:W" (threshold T, W rounds averaged)."""
    text = spec.strip().lower()
    if text == "never":
        return Never()
    if text.startswith("every:"):
        return EveryN(_number(int, text.removeprefix("every:"), spec))
    if text.startswith("accept<"):
        threshold, _, window = text.removeprefix("accept<").partition(":")
        return AcceptanceBelow(_number(float, threshold, spec),
                               _number(int, window, spec) if window else DEFAULT_ACCEPTANCE_WINDOW)
    raise SparsedraftError(f"unknown rebuild policy {spec!r}; use {FORMS}")


def _number(kind: type, text: str, spec: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise SparsedraftError(f"cannot read {text!r} in rebuild policy {spec!r}; use {FORMS}") from None
