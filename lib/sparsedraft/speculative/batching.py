"""Batch decoding for :func:`sparsedraft.decode`: prompts as rows, memory checked first, rows in lockstep.

A batch is a list of prompts of any lengths. Nothing is padded: each row keeps
its own caches and length (:mod:`sparsedraft.speculative.lockstep`). A ``[B, T]`` tensor
holding prompts of different lengths must say which ids are padding with an
``attention_mask`` (1 real, 0 padding, on either side): without it the pads
would be read as text, so a tensor whose rows end in the tokenizer's pad id is
refused. Every method runs with a batch -- plain decoding, a draft model,
retrieval self-speculation, StreamingLLM self-speculation (``retrieval`` with
``group_reduce="recent"``), TriForce and BudgetDraft, with a feature drafter
too -- and row ``b`` gives
exactly its batch-1 run (greedy: token for token; sampled: with seed
``seed + b``).

Before any prefill, :func:`batch_bytes` adds up what the batch will hold (the
weights, every row's full cache, draft caches and shared prefills) and
:func:`check_memory` refuses a batch over ``max_memory`` (default: the memory
free where the caches live: the GPU's on CUDA, else the machine's), naming the ways to fit.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import torch

from ..caches import StreamingCache
from ..engine import roofline
from ..engine.config import ModelConfig
from ..engine.model import Transformer
from ..engine.sampling import SamplingConfig
from ..errors import require
from .feature import FeatureHead
from .lockstep import LockstepStats, run_rows

_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}


def prompt_rows(prompt: Any, tokenizer: Any, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """A batch of prompts as 1-D id tensors, one per row, each of its own length.

    Takes a list of texts, a list of id lists or 1-D tensors, or a ``[B, T]``
    tensor (with ``attention_mask`` when its rows are padded).
    """
    if isinstance(prompt, torch.Tensor):
        require(prompt.dim() == 2, f"a batch tensor is [batch, tokens], got {prompt.dim()}-D; pass a list of prompts")
        ids = prompt.long().cpu()
        if attention_mask is None:
            check_unpadded(ids, tokenizer)
            return list(ids)
        mask = torch.as_tensor(attention_mask).cpu()
        require(tuple(mask.shape) == tuple(ids.shape),
                f"attention_mask {tuple(mask.shape)} must have the prompt's shape {tuple(ids.shape)}")
        rows = []
        for b in range(ids.shape[0]):
            real = mask[b].nonzero().flatten()
            require(real.numel() > 0, f"row {b} of the batch has no real token (attention_mask all 0)")
            require(int(real[-1] - real[0]) + 1 == real.numel(),
                    f"row {b}'s real tokens are not contiguous in attention_mask; pad on the left or the right only")
            rows.append(ids[b, int(real[0]):int(real[-1]) + 1])
        return rows
    require(attention_mask is None, "attention_mask goes with a [batch, tokens] tensor; a list of prompts needs none")
    items = list(prompt)
    require(items, "the batch is empty; pass at least one prompt")
    rows = []
    for item in items:
        if isinstance(item, str):
            require(tokenizer is not None, "text prompts need a tokenizer: pass tokenizer=, or load the model by name")
            item = tokenizer.encode(item)
        row = torch.as_tensor(item, dtype=torch.long).cpu()
        require(row.dim() == 1 and row.numel() > 0, f"each prompt of a batch is a non-empty 1-D id list, got shape "
                                                    f"{tuple(row.shape)}")
        rows.append(row)
    return rows


def check_unpadded(ids: torch.Tensor, tokenizer: Any) -> None:
    """Refuse a ``[B > 1, T]`` tensor whose rows begin or end with the tokenizer's pad id: padding without an
    ``attention_mask`` would be read as text."""
    pad = getattr(tokenizer, "pad_token_id", None)
    require(pad is None or ids.dim() != 2 or ids.shape[0] == 1 or not bool((ids[:, [0, -1]] == pad).any()),
            f"the batch tensor has rows that begin or end with the pad token ({pad}) but no attention_mask: "
            "pass attention_mask= (1 real, 0 padding) or the prompts as a list, each of its own length")


def parse_bytes(value: int | float | str) -> int:
    """``8e9``, ``"8GB"``, ``"7.5 GiB"`` -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]?I?B?)\s*", value.upper())
    require(match is not None and match.group(2) in _UNITS,
            f"memory {value!r}: write a number of bytes or e.g. 8GB, 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def available_bytes(device: torch.device | str = "cpu") -> int | None:
    """Free memory where the caches will live: the GPU's free memory on CUDA, else MemAvailable from
    /proc/meminfo (None where neither is known)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def kv_bytes(cfg: ModelConfig, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values for ``tokens`` tokens of one sequence in ``dtype``."""
    return roofline.kv_bytes(cfg, tokens, torch.empty(0, dtype=dtype).element_size())


def batch_bytes(model: Transformer, draft: Any, lengths: Sequence[int], n: int, method: str, opts: Any,
                prefilled: bool) -> dict[str, int]:
    """What a batch holds, by part: weights, full caches, draft caches and, when ``prefilled`` (shared
    prefills held in memory, not left in a store's files), those prefills (bytes)."""
    cfg, dtype = model.cfg, model.dtype
    parts = {"weights": sum(p.numel() * p.element_size() for p in model.parameters()),
             "full caches": sum(kv_bytes(cfg, length + n, dtype) for length in lengths),
             "draft caches": 0, "shared prefills": sum(kv_bytes(cfg, length, dtype) for length in lengths)
             if prefilled else 0}
    if method in ("retrieval", "triforce"):  # the retrieval view: budget + level-2 speculative slots
        level2 = opts.gamma2 if method == "triforce" else opts.gamma
        parts["draft caches"] += len(lengths) * kv_bytes(cfg, opts.budget + level2, dtype)
    if isinstance(draft, (Transformer, FeatureHead)):  # a feature head: one layer of its own, the rest the target's
        if draft is not model and not any(p is q for p in draft.parameters() for q in model.parameters()):
            parts["weights"] += sum(p.numel() * p.element_size() for p in draft.parameters())
        if method == "triforce" or getattr(opts, "draft_cache", "full") == "streaming":  # as methods.py builds it
            spec_slots = opts.gamma1 + opts.gamma2 if method == "triforce" else opts.gamma
            held = [StreamingCache.slots_for(opts.sink, opts.window, spec_slots)] * len(lengths)
        else:  # a full (or budget) cache of the whole run
            held = [length + n for length in lengths]
        parts["draft caches"] += sum(kv_bytes(draft.cfg, tokens, draft.dtype) for tokens in held)
    return parts


def check_memory(parts: dict[str, int], max_memory: int | float | str | None,
                 device: torch.device | str = "cpu") -> None:
    """Refuse a batch whose parts exceed ``max_memory`` (default: the free memory of ``device``)."""
    limit = parse_bytes(max_memory) if max_memory is not None else available_bytes(device)
    total = sum(parts.values())
    if limit is None:
        return
    detail = ", ".join(f"{name} {size / 1e9:.2f} GB" for name, size in parts.items() if size)
    require(total <= limit,
            f"this batch needs about {total / 1e9:.2f} GB ({detail}) but {limit / 1e9:.2f} GB are allowed"
            f"{'' if max_memory is not None else ' (available memory)'}; use fewer rows, shorter prompts, a smaller "
            "budget, or load the model in bfloat16 (halves every cache)")


@dataclasses.dataclass
class BatchRun:
    """Per-row outcomes of :func:`run_batch` and what the batching did."""

    outcomes: list[Any]
    lockstep: LockstepStats


def run_batch(model: Transformer, rows: list[torch.Tensor], method: str, n: int, sampling: SamplingConfig,
              opts: Any, eos: int | None, prefilled: Sequence[Any] | None,
              draft: Transformer | FeatureHead | None) -> BatchRun:
    """Each row through ``METHODS[method]`` at batch 1, all rows in lockstep; ``draft`` is ``opts.draft``
    loaded (``methods.load_draft``), shared by the rows. Every check is the caller's (``decode``)."""
    from .methods import METHODS

    def job(row: int, wrap):
        restricted = {"draft_vocab": 0} if hasattr(opts, "draft_vocab") else {}  # load_draft applied it already
        # A feature head's one-layer steps run on the row's own thread (each row drafts from its own cache); the
        # target's verifications, which hand it the features, are batched like any other forward.
        row_draft = draft if isinstance(draft, FeatureHead) else wrap(draft)
        row_opts = dataclasses.replace(opts, draft=row_draft, **restricted) if draft is not None else opts
        row_sampling = sampling if sampling.greedy else dataclasses.replace(sampling, seed=sampling.seed + row)
        shared = prefilled[row] if prefilled is not None else None
        return METHODS[method].run(wrap(model), rows[row][None].to(model.device), n, row_sampling, row_opts, eos,
                                   shared)

    outcomes, stats = run_rows(job, len(rows))
    return BatchRun(outcomes, stats)
