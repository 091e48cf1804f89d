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


def status_of(main: Callable[[], int | None]) -> int:
    """The exit status of a command's ``main``: its own (0 for None), or 2 with a :class:`SparsedraftError`
    printed as one ``error:`` line on stderr instead of a traceback. ``python -m sparsedraft`` runs its commands
    through it."""
    try:
        return main() or 0
    except SparsedraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def exit_with(main: Callable[[], int | None]) -> NoReturn:
    """Exit with :func:`status_of` ``main``: how the ``python -m sparsedraft.bench.<module>`` commands end, so bad
    input there gets the same one line as in ``python -m sparsedraft``."""
    sys.exit(status_of(main))
