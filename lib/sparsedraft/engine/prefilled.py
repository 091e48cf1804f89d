"""One prefill per prompt, shared by plain decoding and every speculative method.

At 8K tokens the prompt forward costs as much as hundreds of decode steps, and
a bench of AR and three methods used to pay it once per run. A
:class:`PrefilledPrompt` holds everything a decoder takes from the prefill: the
target's full cache holding exactly the prompt, the logits after its last
token, and that token's post-RoPE queries (which select a retrieval cache).
Decoders copy the cache into one of their own (:meth:`StaticCache.load_state`)
and never write to the prefilled one, so one prefill seeds any number of runs,
each token for token equal to a run that prefilled itself: the copy holds the
same numbers the run's own chunked prefill would have written. A draft model
with its own cache (a separate model, ``truncated:K``, a BudgetDraft drafter)
still prefills that cache itself.

A prefill remembers the model that made it (:func:`model_identity`: source,
config with its RoPE settings, dtype, device type and a hash of every weight),
and :meth:`PrefilledPrompt.check` refuses another model or prompt before a
decoder does any work. :func:`compute_prefill` makes one; the entry point
:func:`~sparsedraft.engine.prefill_store.prefill_prompt` lives with the disk cache
(:mod:`sparsedraft.engine.prefill_store`), which the same identity keys, so this
module never imports the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from ..errors import require
from .cache import StaticCache
from .model import Capture, Transformer, sliced_prefill
from .prefill import PREFILL_CHUNK, prefill
from .runtime import synchronize


def tensor_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over each tensor's name, dtype, shape and bytes, in the order given."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().data)
    return h.hexdigest()


def weights_digest(model: Transformer) -> str:
    """:func:`tensor_digest` of every parameter and buffer; remembered on the model until one of its tensors is
    replaced or written in place (a storage address or version counter changes), so checks stay cheap."""
    tensors = sorted(model.state_dict(keep_vars=True).items())
    tracked = not any(t.is_inference() for _, t in tensors)  # inference tensors keep no version counter
    stamp = tuple((name, t.data_ptr(), t._version) for name, t in tensors) if tracked else None
    memo = getattr(model, "_sparsedraft_weights_digest", None)
    if memo is None or memo[0] is None or memo[0] != stamp:
        memo = (stamp, tensor_digest(tensors))
        model._sparsedraft_weights_digest = memo
    return memo[1]


def model_identity(model: Transformer) -> dict[str, Any]:
    """What makes two models give the same prefill: source, config (RoPE theta, scaling and maximum
    context included), dtype, device type and weights, and the prefill's attention where it is not torch's
    (a bf16 prefill through the kernel's slices, :func:`~sparsedraft.engine.model.sliced_prefill`, whose bits
    differ from flash's). JSON-ready."""
    config = {k: dict(v) if k == "rope_scaling" else v for k, v in dataclasses.asdict(model.cfg).items()}
    sliced = sliced_prefill(model.dtype, model.device, model.cfg.head_dim)
    return {"source": getattr(model, "source", None), "config": config,
            "dtype": str(model.dtype).removeprefix("torch."), "device": model.device.type,
            "weights": weights_digest(model), **({"prefill_attention": "kernel slices"} if sliced else {})}


def first_difference(mine: Any, theirs: Any, path: str = "") -> str | None:
    """The first field where two JSON-like values differ, as ``"config.rope_theta: 10000.0 vs 500000.0"``."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in sorted(set(mine) | set(theirs)):
            found = first_difference(mine.get(key), theirs.get(key), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    return None if mine == theirs else f"{path}: {mine!r} vs {theirs!r}"


def as_prompt(prompt: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Token ids as ``[batch, tokens]`` long (a ``[tokens]`` tensor or a list of ids is one sequence)."""
    ids = torch.as_tensor(prompt).long()
    require(ids.dim() in (1, 2), f"a prompt is [tokens] or [batch, tokens] ids, got {ids.dim()}-D")
    return ids if ids.dim() == 2 else ids[None]


@dataclass(frozen=True)
class PrefilledPrompt:
    tokens: torch.Tensor  # [B, T] the prompt's ids, on the CPU
    cache: StaticCache  # the target's full cache holding exactly the T prompt tokens; decoders copy it, never write it
    # (a prefill_store.StoredCache when loaded on_disk: the same state() and copy_into(), read from its file)
    logits: torch.Tensor  # [B, V] the target's logits after the last prompt token, on the model's device
    queries: dict[int, torch.Tensor]  # layer -> [B, heads, head_dim] post-RoPE queries of the last prompt token
    model: dict[str, Any]  # model_identity() of the model that computed it
    seconds: float  # wall time of the prompt forward where it was computed (a disk copy keeps that time)
    loaded_from: str | None = None  # the file it was read from; None when computed in this process
    load_s: float = 0.0  # seconds reading and verifying that file
    features: torch.Tensor | None = None  # [B, T, hidden] top-layer features of every prompt token (feature drafters)
    feature_layers: tuple[int, ...] = ()  # lower layers whose outputs precede the top's in features: [B, T, (k+1) hidden]

    @property
    def prompt_len(self) -> int:
        return self.tokens.shape[1]

    def features_of(self, layers: tuple[int, ...] = ()) -> torch.Tensor:
        """The prompt features a drafter that fuses lower ``layers`` reads: their outputs, then the top's
        ([B, T, (len(layers) + 1) hidden]), cut from the layers this prefill kept."""
        require(self.features is not None, "this prefill holds no prompt features; prefill again with "
                                           "prefill_prompt (it keeps them)")
        missing = sorted(set(layers) - set(self.feature_layers))
        require(not missing, f"this prefill keeps the features of target layers {list(self.feature_layers)} below "
                             f"the top, not {missing}; prefill with prefill_prompt(model, prompt, "
                             f"feature_layers={tuple(sorted(set(layers) | set(self.feature_layers)))})")
        if tuple(layers) == self.feature_layers:
            return self.features
        hidden = self.features.shape[-1] // (len(self.feature_layers) + 1)
        blocks = [self.feature_layers.index(i) for i in layers] + [len(self.feature_layers)]
        return torch.cat([self.features[..., b * hidden:(b + 1) * hidden] for b in blocks], -1)

    def seed(self, cache: StaticCache) -> None:
        """Copy this prefill's cache into a run's ``cache`` (a stored one is read from its file then, one row
        of a batch at a time, so a batch never holds more than one extra copy)."""
        self.cache.copy_into(cache)

    def check(self, model: Transformer, prompt: torch.Tensor) -> None:
        """Fail with the problem and its fix unless this prefill is ``model``'s for ``prompt`` [B, T]."""
        fix = "prefill this prompt with this model (prefill_prompt(model, prompt)) or pass no prefill"
        require(tuple(prompt.shape) == tuple(self.tokens.shape) and torch.equal(prompt.cpu(), self.tokens),
                f"the prefill holds a prompt of shape {tuple(self.tokens.shape)} that is not the prompt given "
                f"(shape {tuple(prompt.shape)}); {fix}")
        require(self.cache.length == self.prompt_len,
                f"the prefill's cache holds {self.cache.length} tokens, not its {self.prompt_len}-token prompt "
                f"(something rolled it back or wrote to it); {fix}")
        require(self.logits.device == model.device,
                f"the prefill lives on {self.logits.device}, the model on {model.device}; {fix}")
        differs = first_difference(model_identity(model), self.model)
        require(differs is None, f"the prefill was made by another model ({differs}, this model vs the prefill's); "
                                 f"{fix}")


@torch.inference_mode()
def compute_prefill(model: Transformer, prompt: torch.Tensor, warmup: bool = False,
                    feature_layers: tuple[int, ...] = ()) -> PrefilledPrompt:
    """One timed prefill of ``prompt`` [B, T] into a cache of exactly T slots. ``warmup`` first runs the
    first chunk untimed, so the timed forward pays no first-call costs (a benchmark's habit). The features
    kept hold ``feature_layers``' outputs before the top layer's (what a fusing feature drafter reads)."""
    device = model.device
    tokens = prompt.to(device)
    if warmup:
        first = tokens[:, :PREFILL_CHUNK]
        prefill(model, model.new_cache(first.shape[1], first.shape[0]), first)
    cache = model.new_cache(tokens.shape[1], tokens.shape[0])
    capture = Capture(layers=set(range(model.cfg.num_layers)), hidden=True, hidden_layers=tuple(feature_layers))
    synchronize(device)
    t0 = time.perf_counter()
    logits = prefill(model, cache, tokens, capture=capture)
    synchronize(device)
    seconds = time.perf_counter() - t0
    queries = {layer: q[:, :, -1].clone() for layer, q in capture.queries.items()}
    return PrefilledPrompt(prompt.cpu(), cache, logits, queries, model_identity(model), seconds,
                           features=capture.features, feature_layers=tuple(feature_layers))
