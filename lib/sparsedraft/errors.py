"""One exception type for every mistake a user can make.

Callers catch :class:`SparsedraftError` (a ``ValueError``) and read a message
that names the problem and the fix; we raise it before any heavy work.
"""

from collections.abc import Callable


class SparsedraftError(ValueError):
    """Bad input: the message says what was wrong and how to fix it."""


def require(condition: bool, message: str | Callable[[], str]) -> None:
    """Raise :class:`SparsedraftError` with ``message`` unless ``condition``. A check on a hot path (a
    kernel called ~200 times per decode step) passes ``lambda: f"..."``, so the message is only built when
    it is raised."""
    if not condition:
        raise SparsedraftError(message() if callable(message) else message)
