"""One exception type for every mistake a user can make.

Callers catch :class:`SparsedraftError` (a ``ValueError``) and read a message
that names the problem and the fix; we raise it before any heavy work.
"""


class SparsedraftError(ValueError):
    """Bad input: the message says what was wrong and how to fix it."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`SparsedraftError` with ``message`` unless ``condition``."""
    if not condition:
        raise SparsedraftError(message)
