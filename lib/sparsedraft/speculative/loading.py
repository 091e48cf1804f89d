"""One self-describing drafter loader: a trained drafter's folder says what it holds, speculation reads it.

Two kinds of trained drafter exist, each written by its training loop in
:mod:`sparsedraft.budgetdraft`:

- a *slice* drafter (BudgetDraft: a small Transformer, often the verifier's
  first layers), a run folder holding ``drafter.safetensors`` (the whole
  drafter; a tied head stored once, as the embedding) and ``state.json``
  (view version, training config, drafter config, the verifier it drafts
  for: vocabulary size and a digest of its tokenizer);
- a *feature* drafter (an EAGLE head over the target's top-layer features),
  a folder holding ``feature_drafter.json`` and its weights, read by
  :mod:`sparsedraft.speculative.feature`.

Training writes, this module reads, so decoding never imports the training
package. :func:`drafter_kind` tells a folder's kind from its files;
:func:`check_trained_for` refuses, before any prefill, a folder trained for
another verifier or one that cannot be read; :func:`load_trained` returns a
slice drafter as a Transformer and a feature drafter as a
:class:`~sparsedraft.speculative.feature.FeatureHead` attached to its target.
A slice folder written under another
:data:`~sparsedraft.caches.budget.VIEW_VERSION` (a drafter trained on a
different sparse view) is refused, not loaded silently. Nothing is pickled:
weights are safetensors, the rest JSON.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..caches.budget import VIEW_VERSION
from ..engine.config import ModelConfig
from ..engine.data import model_tokenizer
from ..engine.model import Transformer
from ..engine.weights import from_state_dict
from ..errors import SparsedraftError, require
from .feature import FeatureHead, is_feature_drafter, load_feature_head, read_record

STATE = "state.json"  # a slice drafter's run folder: written last, so its presence means a complete checkpoint
DRAFTER_WEIGHTS = "drafter.safetensors"
SLICE, FEATURE = "slice", "feature"


def has_checkpoint(run_dir: str | Path) -> bool:
    return (Path(run_dir) / STATE).is_file()


def drafter_kind(folder: str | Path) -> str | None:
    """:data:`SLICE` or :data:`FEATURE` for a folder holding a trained drafter, None for anything else."""
    if has_checkpoint(folder):
        return SLICE
    return FEATURE if is_feature_drafter(folder) else None


def _kind(folder: str | Path) -> str:
    kind = drafter_kind(folder)
    require(kind is not None, f"{folder} holds no trained drafter (neither {STATE} nor a feature drafter's record); "
                              "train one (sparsedraft train-drafter) or pass the folder it wrote")
    return kind


def read_state(run_dir: str | Path) -> dict[str, Any]:
    """A slice drafter's ``state.json``, after checking it exists and was written for this view version."""
    run_dir = Path(run_dir)
    require(has_checkpoint(run_dir), f"{run_dir} holds no checkpoint ({STATE} missing); train a drafter first")
    try:
        state = json.loads((run_dir / STATE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SparsedraftError(f"{run_dir / STATE} is not readable JSON ({exc}); the checkpoint is damaged: "
                               "retrain into a new folder or delete this one") from None
    require(isinstance(state, dict) and "model_config" in state,
            f"{run_dir / STATE} is not a drafter checkpoint's state; retrain into a new folder or delete this one")
    version = state.get("view_version", 1)
    require(version == VIEW_VERSION,
            f"{run_dir} holds a drafter trained on BudgetDraft view version {version}, but this code drafts with "
            f"version {VIEW_VERSION} (a fixed chunk selection from the prefix plus the growing tail); "
            "retrain it into a new folder or delete the folder")
    return state


def trained_scoring(folder: str | Path) -> str:
    """The budget cache's chunk rule the drafter in ``folder`` was trained with (``attention`` by default)."""
    recipe = read_state(folder)["config"] if _kind(folder) == SLICE else read_record(folder)
    return recipe.get("scoring", "attention")


def trained_verifier(folder: str | Path) -> str:
    """The verifier the drafter in ``folder`` was trained for, as its training named it (a feature drafter's
    record, a slice run's config): what a bench loads when no model is given."""
    recipe = read_state(folder)["config"] if _kind(folder) == SLICE else read_record(folder).get("recipe", {})
    verifier = recipe.get("verifier") if isinstance(recipe, dict) else None
    require(verifier, f"{folder} does not name the verifier it was trained for; pass the model explicitly")
    return verifier


@functools.lru_cache(maxsize=8)
def tokenizer_digest(source: str) -> str:
    """A short sha256 of the token -> id map of model ``source``'s tokenizer (tiny random models share the
    UTF-8 byte one): what makes a drafter's ids mean the same words to a verifier."""
    tokenizer = model_tokenizer(source)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {"utf-8 bytes": 256}
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]


def check_drafter_for(run_dir: str | Path, vocab_size: int, source: str | None = None) -> None:
    """Refuse, before any prefill, a slice drafter's run folder that cannot draft for a verifier of
    ``vocab_size`` tokens (named ``source``, when known, whose tokenizer must be the one the drafter was trained
    with) or whose files cannot be read."""
    run_dir = Path(run_dir)
    state = read_state(run_dir)
    trained = state["model_config"].get("vocab_size")
    verifier = state.get("verifier", {})
    fix = "train a drafter for this model (train-drafter --verifier <this model>) or pass its own run folder"
    require(trained == vocab_size, f"the drafter in {run_dir} has a vocabulary of {trained} tokens, this verifier "
                                   f"{vocab_size}: it was trained for {verifier.get('source', 'another model')}; {fix}")
    if source is not None and verifier.get("tokenizer") is not None:
        require(verifier["tokenizer"] == tokenizer_digest(source),
                f"the drafter in {run_dir} was trained for {verifier.get('source')!r}, whose tokenizer differs from "
                f"{source!r}'s (same vocabulary size, other token ids); {fix}")
    try:
        with safe_open(str(run_dir / DRAFTER_WEIGHTS), framework="pt") as weights:
            weights.keys()
    except (SafetensorError, OSError) as exc:
        raise SparsedraftError(f"{run_dir / DRAFTER_WEIGHTS} is not readable safetensors ({exc}); the "
                               "checkpoint is damaged: retrain into a new folder or delete this one") from None


def check_trained_for(folder: str | Path, cfg: ModelConfig, source: str | None = None) -> None:
    """Refuse, before anything loads, a trained drafter's folder that cannot draft for a target of config
    ``cfg`` (named ``source``, when known): a slice drafter by vocabulary and tokenizer, a feature drafter by
    the vocabulary and hidden size its record names (its weights are checked on load)."""
    kind = _kind(folder)
    if kind == SLICE:
        check_drafter_for(folder, cfg.vocab_size, source)
        return
    theirs = read_record(folder)["target"]
    require((theirs.get("vocab_size"), theirs.get("hidden_size")) == (cfg.vocab_size, cfg.hidden_size),
            f"the feature drafter in {folder} reads a target of vocabulary {theirs.get('vocab_size')} and hidden "
            f"size {theirs.get('hidden_size')} ({theirs.get('source')!r}), not this one ({cfg.vocab_size}, "
            f"{cfg.hidden_size}); use the target it was trained for")


def load_drafter(run_dir: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> Transformer:
    """A trained slice drafter for inference (eval mode), from a run folder (weights only: a training run's
    optimizer moments, twice the drafter's size, are not read)."""
    model_config = ModelConfig(**read_state(run_dir)["model_config"])
    return from_state_dict(model_config, load_file(str(Path(run_dir) / DRAFTER_WEIGHTS)), dtype=dtype,
                           device=device)


def load_trained(folder: str | Path, target: Transformer) -> Transformer | FeatureHead:
    """The drafter in ``folder``, checked against ``target`` first, on the target's device and dtype: a slice
    drafter as its own Transformer, a feature drafter as a head attached to ``target``."""
    if _kind(folder) == SLICE:
        check_drafter_for(folder, target.cfg.vocab_size, getattr(target, "source", None))
        return load_drafter(folder, target.dtype, target.device)
    return load_feature_head(folder, target)
