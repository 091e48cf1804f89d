"""Progress bars for runs by hand, silent in batch runs and tests.

Bars show when someone is watching: stderr is a terminal, or the code runs in
an interactive IPython kernel (Jupyter, where ``tqdm.auto`` draws a widget).
``SPARSEDRAFT_PROGRESS`` overrides that guess: ``1`` forces bars on (a log
file that should show them), ``0`` forces them off. The notebook runner sets
``0`` for the kernels it starts (see
:func:`sparsedraft.runner.execute.kernel_environment`), so executed notebooks
hold no bars; pytest captures stderr, so tests and CI logs stay clean.

A bar that does not show costs nothing: :func:`bar` hands back the iterable
itself, or a :class:`NullBar` whose methods do nothing when the caller counts
by hand. Bars only ever write to stderr; stdout stays for results.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, TypeVar

from tqdm.auto import tqdm

from .errors import require

ENV = "SPARSEDRAFT_PROGRESS"
CHOICES = {"1": True, "0": False}

T = TypeVar("T")


def bars_on() -> bool:
    """Whether progress bars show: ``SPARSEDRAFT_PROGRESS`` when set, else whether someone is watching."""
    value = os.environ.get(ENV)
    if value is None:
        return _watched()
    require(value in CHOICES, f"{ENV}={value!r} is not allowed; set {ENV}=1 (bars on), {ENV}=0 (bars off), "
                              "or unset it (bars when stderr is a terminal or in Jupyter)")
    return CHOICES[value]


def _watched() -> bool:
    """stderr is a terminal, or this is an interactive IPython kernel (no import unless ipykernel is loaded)."""
    isatty = getattr(sys.stderr, "isatty", None)
    if isatty is not None and isatty():
        return True
    if sys.modules.get("ipykernel") is None:
        return False
    from IPython import get_ipython
    return get_ipython() is not None


class NullBar:
    """What :func:`bar` returns for a hidden bar counted by hand: every method does nothing."""

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def bar(iterable: Iterable[T] | None = None, *, total: float | None = None, desc: str | None = None,
        unit: str = "it", leave: bool = False, show: bool = True, **options: Any) -> Iterable[T] | NullBar | tqdm:
    """A tqdm bar on stderr over ``iterable`` (or counted by hand with ``total=`` and ``update``) when bars are
    on (:func:`bars_on`); otherwise ``iterable`` itself, or a :class:`NullBar` without one.

    ``show=False`` keeps this bar off whatever the environment says: a caller's own switch, or a loop too
    short to be worth a bar. The environment is read either way, so a bad ``SPARSEDRAFT_PROGRESS`` always
    fails. ``options`` go to tqdm (``initial``, ``unit_scale``, ...).
    """
    if not (bars_on() and show):
        return NullBar() if iterable is None else iterable
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, file=sys.stderr, **options)
