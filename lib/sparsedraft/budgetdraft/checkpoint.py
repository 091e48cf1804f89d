"""Run folders: drafter weights and optimizer state as safetensors, everything else as JSON.

Layout of ``run_dir``:

- ``drafter.safetensors``: the whole drafter (a tied head is stored once, as
  the embedding), loadable for inference by :func:`load_drafter`;
- ``optimizer.safetensors``: AdamW moments and step counts, keyed
  ``<param index>.<name>``;
- ``state.json``: view version, step, training config, drafter model config,
  optimizer hyper-parameters and the metric history. Written last, through a rename, so
  a folder with a ``state.json`` always holds a complete checkpoint.

A folder written under another :data:`~.config.VIEW_VERSION` (a drafter
trained on a different sparse view) is refused, not loaded silently, and so is
one whose drafter was trained for another verifier (``state.json`` records the
verifier's vocabulary size and a digest of its tokenizer, checked by
:func:`check_drafter_for` before any prefill) or whose files cannot be read.
Nothing is pickled: weights are safetensors, the rest JSON. Data order, budgets and loss positions are drawn from a
generator seeded by (seed, step), so weights + optimizer + step are the whole
training state and a resumed run continues bit for bit.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..config import ModelConfig
from ..data import model_tokenizer
from ..errors import SparsedraftError, require
from ..model import Transformer
from ..weights import from_state_dict
from .config import VIEW_VERSION, TrainConfig

STATE = "state.json"


@dataclass
class Checkpoint:
    step: int
    config: TrainConfig
    model_config: ModelConfig
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # a torch optimizer state_dict
    history: list[dict[str, Any]]


def atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path)


def save_checkpoint(run_dir: Path, cfg: TrainConfig, drafter: Transformer, optimizer: torch.optim.Optimizer,
                    step: int, history: list[dict[str, Any]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    weights = drafter.state_dict()
    if drafter.cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    atomic_save(weights, run_dir / "drafter.safetensors")
    opt = optimizer.state_dict()
    atomic_save(optimizer_tensors(optimizer), run_dir / "optimizer.safetensors")
    state = {"view_version": VIEW_VERSION, "step": step, "config": cfg.to_dict(), "model_config": asdict(drafter.cfg),
             "verifier": {"source": cfg.verifier, "vocab_size": drafter.cfg.vocab_size,
                          "tokenizer": tokenizer_digest(cfg.verifier)},
             "param_groups": opt["param_groups"], "history": history}
    tmp = run_dir / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1, default=list))
    tmp.replace(run_dir / STATE)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter tensors (moments, step counts), keyed ``<param index>.<name>``."""
    return {f"{index}.{name}": value for index, state in optimizer.state_dict()["state"].items()
            for name, value in state.items() if torch.is_tensor(value)}


def optimizer_state(path: Path, param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """A torch optimizer state_dict from :func:`optimizer_tensors` saved at ``path`` and its param groups."""
    moments: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(path)).items():
        index, name = key.split(".", 1)
        moments.setdefault(int(index), {})[name] = value
    return {"state": moments, "param_groups": param_groups}


def has_checkpoint(run_dir: Path) -> bool:
    return (run_dir / STATE).is_file()


def read_state(run_dir: Path) -> dict[str, Any]:
    """The run's ``state.json``, after checking it exists and was written for this view version."""
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


@functools.lru_cache(maxsize=8)
def tokenizer_digest(source: str) -> str:
    """A short sha256 of the token -> id map of model ``source``'s tokenizer (tiny random models share the
    UTF-8 byte one): what makes a drafter's ids mean the same words to a verifier."""
    tokenizer = model_tokenizer(source)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {"utf-8 bytes": 256}
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]


def check_drafter_for(run_dir: Path, vocab_size: int, source: str | None = None) -> None:
    """Refuse, before any prefill, a run folder that cannot draft for a verifier of ``vocab_size`` tokens
    (named ``source``, when known, whose tokenizer must be the one the drafter was trained with) or whose
    files cannot be read."""
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
        with safe_open(str(run_dir / "drafter.safetensors"), framework="pt") as weights:
            weights.keys()
    except (SafetensorError, OSError) as exc:
        raise SparsedraftError(f"{run_dir / 'drafter.safetensors'} is not readable safetensors ({exc}); the "
                               "checkpoint is damaged: retrain into a new folder or delete this one") from None


def load_checkpoint(run_dir: Path) -> Checkpoint:
    state = read_state(run_dir)
    return Checkpoint(step=state["step"], config=TrainConfig.from_dict(state["config"]),
                      model_config=ModelConfig(**state["model_config"]),
                      weights=load_file(str(run_dir / "drafter.safetensors")),
                      optimizer=optimizer_state(run_dir / "optimizer.safetensors", state["param_groups"]),
                      history=state["history"])


def load_drafter(run_dir: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> Transformer:
    """A trained drafter for inference (eval mode), from a run folder (weights only: the optimizer
    moments, twice the drafter's size, are not read)."""
    model_config = ModelConfig(**read_state(Path(run_dir))["model_config"])
    return from_state_dict(model_config, load_file(str(Path(run_dir) / "drafter.safetensors")), dtype=dtype,
                           device=device)
