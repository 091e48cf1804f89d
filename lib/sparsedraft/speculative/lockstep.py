"""Batches of independent sequences, each decoded by the library's own batch-1 code, in one forward per step.

Speculative decoding with a batch is awkward because every row accepts a
different number of tokens, so rows drift apart in length, in what their
caches hold and, in a hierarchy, in which level runs next. Instead of
rewriting every decoder and cache for ragged batches, :func:`run_rows` runs
one *job* per row (any batch-1 decoder: :func:`~sparsedraft.engine.generate.generate`,
:func:`~sparsedraft.speculative.speculative`, TriForce...), each in its own
thread, and hands each job :class:`RowModel` stand-ins for the models. A
row's forward does not run in its thread: it waits until every unfinished
row waits too, then the main thread runs the waiting forwards of one model as
*one* forward over a :class:`~sparsedraft.engine.cache.RowCaches` batch (steps of
different lengths left-padded), so the weights are read once for all rows.

Each row's caches are its own batch-1 caches (full, retrieval, streaming,
budget: any class), with their own lengths, masks and rollbacks, and every
row's attention is the call its batch-1 run makes; the projections go
through the row-exact kernel (:func:`~sparsedraft.engine.model.project`). So a row of
a batch gets bit for bit the logits of its batch-1 run: batched greedy output
is each row's batch-1 output, batched speculative output is each row's plain
greedy output, and a sampled row has the law of a batch-1 run (with its own
seed). Prompts need no padding: each row keeps its own length. Forwards of
more than :data:`~sparsedraft.engine.model.KERNEL_MAX_TOKENS` tokens (prefill chunks)
run one row at a time, exactly as at batch 1.

Threads only wait and do the rows' small bookkeeping (verification,
rollbacks, retrieval selection) under the GIL; all model forwards run on the
calling thread, inside ``torch.inference_mode``.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..engine.cache import KVCache, RowCaches
from ..engine.model import KERNEL_MAX_TOKENS, Capture, Transformer
from ..errors import require


@dataclass
class _Call:
    row: int
    model: Transformer
    tokens: torch.Tensor  # [1, T]
    positions: torch.Tensor | None
    cache: KVCache | None
    last_only: bool
    capture: Capture | None
    result: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class LockstepStats:
    """What the batching did: forwards run, rows per batched forward, padded tokens."""

    forwards: int = 0  # model forwards run (batched or solo)
    batched_rows: int = 0  # rows over all batched forwards
    solo: int = 0  # forwards run one row at a time (prefill chunks, a lone row)
    padded_tokens: int = 0  # padding positions the batched forwards carried
    forward_s: float = 0.0  # seconds the main thread spent running forwards (the rest: rows' own work, waits)
    per_model: dict[str, int] = field(default_factory=dict)

    @property
    def mean_rows(self) -> float:
        batched = self.forwards - self.solo
        return self.batched_rows / batched if batched else 0.0


class Lockstep:
    """The meeting point of the rows' forwards (see the module docstring)."""

    def __init__(self, rows: int):
        require(rows >= 1, f"a batch needs >= 1 row, got {rows}")
        self.rows = rows
        self.live = rows
        self.waiting: list[_Call] = []
        self.cv = threading.Condition()
        self.stats = LockstepStats()

    def submit(self, call: _Call) -> torch.Tensor:
        """From a row's thread: wait until the main thread has run ``call``; its logits."""
        with self.cv:
            self.waiting.append(call)
            self.cv.notify_all()
            self.cv.wait_for(lambda: call.done)
        if call.error is not None:
            raise call.error
        return call.result

    def finish(self) -> None:
        """From a row's thread when its job ends (returned or raised)."""
        with self.cv:
            self.live -= 1
            self.cv.notify_all()

    def serve(self) -> None:
        """On the main thread: run the rows' forwards until every row has finished."""
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.live == 0 or (self.waiting and len(self.waiting) == self.live))
                if self.live == 0:
                    return
                calls, self.waiting = self.waiting, []
            t0 = time.perf_counter()
            with torch.inference_mode():
                self._run(calls)
            self.stats.forward_s += time.perf_counter() - t0
            with self.cv:
                for call in calls:
                    call.done = True
                self.cv.notify_all()

    def _run(self, calls: list[_Call]) -> None:
        groups: dict[tuple, list[_Call]] = {}
        for call in sorted(calls, key=lambda c: c.row):
            solo = call.tokens.shape[1] > KERNEL_MAX_TOKENS or not isinstance(call.cache, KVCache)
            key = ("solo", call.row) if solo else (id(call.model), call.cache.keys_prerope)
            groups.setdefault(key, []).append(call)
        for group in groups.values():
            try:
                if len(group) == 1:
                    self._solo(group[0])
                else:
                    self._batched(group)
            except BaseException as exc:  # noqa: BLE001 - handed to the rows, which raise it in their threads
                for call in group:
                    call.error = exc

    def _solo(self, call: _Call) -> None:
        self.stats.forwards += 1
        self.stats.solo += 1
        call.result = call.model(call.tokens, call.positions, call.cache, last_only=call.last_only,
                                 capture=call.capture)

    def _batched(self, group: list[_Call]) -> None:
        model = group[0].model
        t = max(call.tokens.shape[1] for call in group)
        counts = [call.tokens.shape[1] for call in group]
        tokens = torch.zeros(len(group), t, dtype=torch.long, device=model.device)
        positions = torch.zeros(len(group), t, dtype=torch.long, device=model.device)
        for b, call in enumerate(group):
            n = counts[b]
            pos = call.positions
            if pos is None:
                start = call.cache.length
                pos = torch.arange(start, start + n, device=model.device)
            tokens[b, t - n:] = call.tokens[0]
            positions[b] = pos.reshape(-1)[0]  # padding takes the first real position (any valid one would do)
            positions[b, t - n:] = pos.reshape(-1)
        layers = set().union(*(call.capture.layers for call in group if call.capture is not None))
        hidden = any(call.capture is not None and call.capture.hidden for call in group)  # a feature drafter's rows
        kinds = {call.capture.hidden_layers for call in group if call.capture is not None and call.capture.hidden}
        require(len(kinds) <= 1, f"rows of one batched forward ask for features of different layers {sorted(kinds)}; "
                                 "give every row the same kind of feature drafter")
        capture = Capture(layers=layers, hidden=hidden, hidden_layers=next(iter(kinds), ())) \
            if layers or hidden else None
        last_only = all(call.last_only for call in group)
        logits = model(tokens, positions, RowCaches([call.cache for call in group], counts), last_only=last_only,
                       capture=capture)
        for b, call in enumerate(group):
            n = counts[b]
            row = logits[b:b + 1]
            call.result = row[:, -1:] if call.last_only else row[:, t - n:]
            if call.capture is not None:
                call.capture.queries.update({layer: capture.queries[layer][b:b + 1, :, t - n:]
                                             for layer in call.capture.layers})
                if call.capture.hidden:
                    call.capture.features = capture.features[b:b + 1, t - n:]
        self.stats.forwards += 1
        self.stats.batched_rows += len(group)
        self.stats.padded_tokens += sum(t - n for n in counts)
        name = getattr(model, "source", None) or type(model).__name__
        self.stats.per_model[str(name)] = self.stats.per_model.get(str(name), 0) + 1


class RowModel:
    """A model as one row's job sees it: every attribute is the model's, but a forward goes through the
    :class:`Lockstep` (so it is batched with the other rows'). ``isinstance(row_model, Transformer)`` holds,
    as for any stand-in, so the decoders take it where they take a model."""

    def __init__(self, model: Transformer, lockstep: Lockstep, row: int):
        self._model, self._lockstep, self._row = model, lockstep, row

    @property
    def __class__(self):  # noqa: D105 - isinstance() sees the model's class, as with unittest.mock's spec
        return type(self._model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None,
                 *, last_only: bool = False, capture: Capture | None = None) -> torch.Tensor:
        require(tokens.shape[0] == 1, f"a row's forward holds one sequence, got batch {tokens.shape[0]}")
        call = _Call(self._row, self._model, tokens, positions, cache, last_only, capture)
        return self._lockstep.submit(call)

    forward = __call__


def run_rows(job: Callable[[int, Callable[[Transformer], Transformer]], Any], rows: int) -> tuple[list[Any],
                                                                                               LockstepStats]:
    """Run ``job(row, wrap)`` for each row in lockstep; their results in row order, and the batching stats.

    ``wrap(model)`` gives the row's stand-in for a model, which the job must use
    for every forward it wants batched. The first row that raised re-raises here
    once every row has ended.
    """
    lockstep = Lockstep(rows)
    results: list[Any] = [None] * rows
    errors: list[BaseException | None] = [None] * rows

    def body(row: int) -> None:
        try:
            results[row] = job(row, lambda model: RowModel(model, lockstep, row))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors[row] = exc
        finally:
            lockstep.finish()

    threads = [threading.Thread(target=body, args=(row,), name=f"sparsedraft-row-{row}", daemon=True)
               for row in range(rows)]
    for thread in threads:
        thread.start()
    lockstep.serve()
    for thread in threads:
        thread.join()
    release_freed_memory()
    for exc in errors:
        if exc is not None:
            raise exc
    return results, lockstep.stats


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``; nothing elsewhere).

    Each row's thread allocates its caches from a glibc arena of its own, and
    glibc keeps what a thread freed in that arena: without a trim, every
    batch leaves its caches' size in resident memory for the next one to add to.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.malloc_trim(0)
