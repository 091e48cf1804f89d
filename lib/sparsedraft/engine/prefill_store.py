"""An opt-in disk cache of prefilled prompts, so a prompt is prefilled once across processes and notebooks.

Each entry is one safetensors file (tensors and string metadata only: loading
never unpickles) holding a :class:`~sparsedraft.engine.prefilled.PrefilledPrompt`:
the prompt, the full cache's committed keys, values and positions, the last
logits and the last token's queries. It is named by a hash of its key -- the
model's identity (:func:`~sparsedraft.engine.prefilled.model_identity`: source,
config with RoPE theta, scaling and maximum context, dtype, device type, a
hash of every weight) and a hash of the prompt's ids -- and stores that key
with a checksum of its tensors. A read verifies both, so a file from another
key, a damaged or a truncated one is never used: it is deleted with a
one-line warning and the prefill is computed again. The device type is part
of the key because kernels differ: a prefill from the GPU would not give the
CPU's tokens.

The folder is capped (``max_bytes``, 4 GiB by default): after each write the
least recently used entries go first, a hit counting as a use (it touches the
file's modification time). Writes go through a temporary file and a rename,
so a crash never leaves a half-written entry under an entry's name. Keep the
folder under ``data/cache/`` (git-ignored), e.g. ``data/cache/prefill``.

:func:`prefill_prompt` is the one way to a prefill: read from a store when
one is given and holds it, computed (:func:`~sparsedraft.engine.prefilled.compute_prefill`)
and written to the store otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import SparsedraftError, require
from .cache import StaticCache
from .model import Transformer
from .prefill import check_prompt
from .prefilled import PrefilledPrompt, as_prompt, compute_prefill, first_difference, model_identity, tensor_digest
from .runtime import synchronize

FORMAT = 2  # 2: prompt features (feature drafters) beside the cache; bump when the layout of an entry changes: older entries then miss
SUFFIX = ".safetensors"
GiB = 2 ** 30
DEFAULT_MAX_BYTES = 4 * GiB
CACHE_PREFIX = "cache."  # tensor names of the full cache's state, beside tokens, logits and q{layer}


def entry_key(identity: dict[str, Any], tokens: torch.Tensor,
              feature_layers: tuple[int, ...] = ()) -> dict[str, Any]:
    """What an entry must match: the layout version, the model's identity, the prompt's ids and the lower
    layers whose features it keeps (named only when there are some, so older entries keep their keys)."""
    return {"format": FORMAT, **identity, "prompt": tensor_digest([("tokens", tokens.cpu())]),
            "prompt_shape": list(tokens.shape),
            **({"feature_layers": list(feature_layers)} if feature_layers else {})}


class PrefillStore:
    """A folder of prefilled prompts, at most ``max_bytes`` of them (least recently used evicted first)."""

    def __init__(self, root: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES):
        require(max_bytes > 0, f"the prefill cache's size cap must be > 0 bytes, got {max_bytes}")
        require(not Path(root).is_file(), f"the prefill cache {root} is a file; give a folder (e.g. data/cache/prefill)")
        self.root, self.max_bytes = Path(root), int(max_bytes)

    def path(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return self.root / f"{digest[:32]}{SUFFIX}"

    def load(self, model: Transformer, prompt: torch.Tensor | Sequence[int], on_disk: bool = False,
             feature_layers: tuple[int, ...] = ()) -> PrefilledPrompt | None:
        """``model``'s prefill of ``prompt`` if stored and intact; None otherwise (a damaged entry is
        deleted with a warning, so the caller computes it again). ``on_disk`` keeps its cache in the file
        (:class:`StoredCache`): a decoder reads it when it starts, so a batch holds no second copy of its
        caches in memory."""
        tokens = as_prompt(prompt)
        key = entry_key(model_identity(model), tokens, feature_layers)
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            found = self._read(path, key, model, on_disk)
        except SparsedraftError as exc:
            warnings.warn(f"prefill cache: {exc}; deleted it, prefilling again", stacklevel=2)
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # a hit is a use: least recently used entries are evicted first
        if isinstance(found.cache, StoredCache):
            found.cache.stamp()  # as the file is now, touched
        return found

    def _read(self, path: Path, key: dict[str, Any], model: Transformer, on_disk: bool = False) -> PrefilledPrompt:
        start = time.perf_counter()
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError) as exc:
            raise SparsedraftError(f"{path} is not a readable safetensors file (damaged or truncated: {exc})") from exc
        try:
            stored = json.loads(meta.get("key", ""))
        except json.JSONDecodeError:
            raise SparsedraftError(f"{path} has no readable key in its metadata") from None
        differs = first_difference(key, stored)
        require(differs is None, f"{path} was stored for another key ({differs}, wanted vs stored)")
        require(meta.get("checksum") == tensor_digest(sorted(tensors.items())),
                f"{path} does not match its checksum (damaged)")
        device = model.device
        # clones: a read may hand out views of one buffer holding the whole file, which a kept slice would pin
        tokens = tensors.pop("tokens").clone()
        if on_disk:
            cache = StoredCache(path, tokens.shape[1])
        else:
            cache = model.new_cache(tokens.shape[1], tokens.shape[0])
            cache.load_state({name.removeprefix(CACHE_PREFIX): t for name, t in tensors.items()
                              if name.startswith(CACHE_PREFIX)})
        tensors = {name: t for name, t in tensors.items() if not name.startswith(CACHE_PREFIX)}
        queries = {int(name[1:]): t.to(device, copy=True) for name, t in tensors.items() if name.startswith("q")}
        logits = tensors["logits"].to(device, copy=True)
        features = tensors["features"].to(device, copy=True) if "features" in tensors else None
        synchronize(device)
        return PrefilledPrompt(tokens, cache, logits, queries, model_identity(model), float(meta["seconds"]),
                               str(path), time.perf_counter() - start, features,
                               tuple(key.get("feature_layers", ())))

    def save(self, prefilled: PrefilledPrompt) -> Path | None:
        """Write ``prefilled`` (replacing an entry of the same key), then evict down to the cap; the path,
        or None when the entry alone is over the cap and so was not kept."""
        key = entry_key(prefilled.model, prefilled.tokens, prefilled.feature_layers)
        tensors = {"tokens": prefilled.tokens, "logits": prefilled.logits,
                   **{f"q{layer}": q for layer, q in prefilled.queries.items()},
                   **({"features": prefilled.features} if prefilled.features is not None else {}),
                   **{CACHE_PREFIX + name: t for name, t in prefilled.cache.state().items()}}
        tensors = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
        meta = {"key": json.dumps(key, sort_keys=True), "checksum": tensor_digest(sorted(tensors.items())),
                "seconds": repr(prefilled.seconds)}
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file(tensors, str(partial), metadata=meta)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        self.evict()
        if path.exists():
            return path
        warnings.warn(f"prefill cache: an entry of {tensor_bytes(tensors) / GiB:.2f} GiB is over the cap of "
                      f"{self.max_bytes / GiB:.2f} GiB; not kept", stacklevel=2)
        return None

    def entries(self) -> list[tuple[Path, int]]:
        """(file, bytes) of every entry, least recently used first."""
        found = []
        for path in self.root.glob(f"*{SUFFIX}"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another process evicted it meanwhile
                continue
            found.append((stat.st_mtime_ns, path, stat.st_size))
        return [(path, size) for _, path, size in sorted(found)]

    def evict(self) -> list[Path]:
        """Delete least recently used entries until the rest fit the cap; the deleted files."""
        entries = self.entries()
        total = sum(size for _, size in entries)
        removed = []
        for path, size in entries:
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
            removed.append(path)
        return removed


_READING = threading.Lock()


class StoredCache:
    """A prefill's full cache left in its verified store file: ``state()`` reads it from there (what a decoder
    copies into its own cache), so nothing but the file holds it between runs. The file must stay as it was
    when it was verified (same size and modification time); otherwise ``state()`` refuses it."""

    def __init__(self, path: Path, length: int):
        self.path, self.length = path, length
        self.stamp()

    def stamp(self) -> None:
        """Remember the file as it is now (after verifying it)."""
        stat = self.path.stat()
        self._stamp = (stat.st_size, stat.st_mtime_ns)

    def copy_into(self, cache: StaticCache) -> None:
        """As :meth:`StaticCache.copy_into`, read from the file, one stored prefill at a time across threads (a
        batch's rows start together; each read is the size of a full cache)."""
        with _READING:
            cache.load_state(self.state())

    def state(self) -> dict[str, torch.Tensor]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            stat = None
        require(stat is not None and (stat.st_size, stat.st_mtime_ns) == self._stamp,
                f"the stored prefill {self.path} changed or went away since it was verified (evicted by another "
                "run?); load it again, or raise the prefill cache's size cap")
        with safe_open(str(self.path), framework="pt", device="cpu") as f:
            return {name.removeprefix(CACHE_PREFIX): f.get_tensor(name) for name in f.keys()
                    if name.startswith(CACHE_PREFIX)}


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors an entry holds (its file is this plus a small header)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def prefill_prompt(model: Transformer, prompt: torch.Tensor | Sequence[int], *, store: PrefillStore | None = None,
                   warmup: bool = False, on_disk: bool = False,
                   feature_layers: tuple[int, ...] = ()) -> PrefilledPrompt:
    """The prefill of ``prompt`` (ids, ``[T]`` or ``[B, T]``) that ``decode(..., prefilled=)`` and every
    decoder start from. With ``store`` it is read from that disk cache when there (a damaged entry is
    recomputed with a one-line warning) and written to it otherwise; ``on_disk`` then leaves its cache in
    the file, read by each decoder when it starts (a batch's prefills then cost no memory between runs;
    kept in memory when the store could not keep the entry). ``feature_layers``: the prompt features also
    hold those lower layers' outputs, for a feature drafter that fuses them (its ``feature_layers``)."""
    ids = as_prompt(prompt)
    check_prompt(model, ids, 0)
    if store is not None:
        found = store.load(model, ids, on_disk=on_disk, feature_layers=feature_layers)
        if found is not None:
            return found
    result = compute_prefill(model, ids, warmup, feature_layers)
    if store is not None and store.save(result) is not None and on_disk:
        return store.load(model, ids, on_disk=True, feature_layers=feature_layers) or result
    return result
