"""One exception type for every mistake a user can make.

Callers catch :class:`SparsedraftError` (a ``ValueError``) and read a message
that names the problem and the fix; we raise it before any heavy work.
"""

import sys
from collections.abc import Callable
from typing import NoReturn


class SparsedraftError(ValueError):
    """Bad input: the message says what was wrong and how to fix it."""


def require(condition: bool, message: str | Callable[[], str]) -> None:
    """Raise :class:`SparsedraftError` with ``message`` unless ``condition``. A check on a hot path (a
    kernel called ~200 times per decode step) passes ``lambda: f"..."``, so the message is only built when
    it is raised."""
    if not condition:
        raise SparsedraftError(message() if callable(message) else message)


def exit_with(main: Callable[[], int | None]) -> NoReturn:
    """Run a command's ``main`` as ``python -m sparsedraft`` runs its own: exit with its status (0 for None), or
    print a :class:`SparsedraftError` as one ``error:`` line and exit with status 2, not a traceback. For the
    ``python -m sparsedraft.bench.<module>`` commands."""
    try:
        status = main()
    except SparsedraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(status or 0)
