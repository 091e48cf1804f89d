"""Teacher targets: the frozen verifier's greedy token at every position of every training window.

x*_t = argmax of the verifier's full-cache logits after tokens[:t+1] -- the
token greedy verification accepts. One forward per window gives all T of
them, but on a CPU a 135M verifier manages ~100-300 tokens/s, so the targets
are computed once and cached on disk. The file name hashes everything they
depend on (format version, verifier id and config, dtype, the exact window
tokens), so a changed tokenizer, split or window length never reuses stale
targets; the BudgetDraft run and its lambda = 0 ablation share one file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..engine.data import Tokenizer, corpus_tokens, prompt_tokens
from ..engine.model import Transformer
from ..errors import require
from ..progress import bar

TEACHER_VERSION = 1  # bump when the meaning of a cached file changes


def corpus_windows(tokenizer: Tokenizer, seq_len: int, count: int, split: str) -> torch.Tensor:
    """[count, seq_len] non-overlapping consecutive windows of the essays of ``split``."""
    available = corpus_tokens(tokenizer, split).numel() // seq_len
    require(count <= available,
            f"the {split!r} split holds only {available} windows of {seq_len} tokens, {count} were asked for; "
            f"use sequences <= {available} or a shorter seq_len")
    return torch.stack([prompt_tokens(tokenizer, seq_len, split=split, variant=i) for i in range(count)])


def teacher_key(verifier_id: str, verifier: Transformer, windows: torch.Tensor) -> dict[str, Any]:
    """Everything the targets depend on, JSON-ready."""
    data = hashlib.sha256(windows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
    return {"version": TEACHER_VERSION, "verifier": verifier_id, "config": asdict(verifier.cfg),
            "dtype": str(verifier.dtype), "windows": list(windows.shape), "data_sha256": data}


def teacher_file(cache_dir: str | Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return Path(cache_dir) / f"v{TEACHER_VERSION}-{digest}.safetensors"


@torch.inference_mode()
def greedy_targets(verifier: Transformer, windows: torch.Tensor, progress: bool = False) -> torch.Tensor:
    """[N, T] windows -> [N, T] int64 verifier argmax per position (one full causal forward per window)."""
    out = []
    for row in bar(windows, desc="teacher", unit="seq", show=progress):
        logits = verifier(row[None].to(verifier.device))
        out.append(logits[0].argmax(-1).cpu())
    return torch.stack(out)


def teacher_targets(verifier: Transformer, verifier_id: str, windows: torch.Tensor, cache_dir: str | Path,
                    compute: bool = True, progress: bool = False) -> torch.Tensor:
    """Cached :func:`greedy_targets`; with ``compute=False`` a missing cache is an error, not a silent recompute."""
    key = teacher_key(verifier_id, verifier, windows)
    path = teacher_file(cache_dir, key)
    if path.is_file():
        stored = load_file(str(path))
        require(torch.equal(stored["windows"], windows.to(torch.int64)),
                f"teacher cache {path} holds other windows than its name claims; delete the file")
        return stored["targets"]
    require(compute, f"teacher targets for verifier {verifier_id!r} over {tuple(windows.shape)} windows are not "
                     f"cached (expected {path}); run once without --no-teacher to compute them")
    targets = greedy_targets(verifier, windows, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"windows": windows.to(torch.int64).contiguous(), "targets": targets.contiguous()}, str(tmp),
              metadata={"key": json.dumps(key, sort_keys=True, default=str)})
    tmp.replace(path)
    return targets
