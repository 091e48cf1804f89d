"""Run folders: drafter weights and optimizer state as safetensors, everything else as JSON.

Layout of ``run_dir``:

- ``drafter.safetensors``: the whole drafter (a tied head is stored once, as
  the embedding), loadable for inference by
  :func:`sparsedraft.speculative.loading.load_drafter`;
- ``optimizer.safetensors``: AdamW moments and step counts, keyed
  ``<param index>.<name>``;
- ``state.json``: view version, step, training config, drafter model config,
  the verifier (source, vocabulary size, a digest of its tokenizer),
  optimizer hyper-parameters and the metric history. Written last, through a
  rename, so a folder with a ``state.json`` always holds a complete checkpoint.

This module writes the folder and reads back what only training needs (the
optimizer, to resume); what inference reads -- ``state.json``'s checks, the
drafter's weights -- is :mod:`sparsedraft.speculative.loading`'s, so decoding
never imports training. Nothing is pickled: weights are safetensors, the rest
JSON. Data order, budgets and loss positions are drawn from a generator
seeded by (seed, step), so weights + optimizer + step are the whole training
state and a resumed run continues bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..engine.config import ModelConfig
from ..engine.model import Transformer
from ..speculative.loading import DRAFTER_WEIGHTS, STATE, read_state, tokenizer_digest
from .config import VIEW_VERSION, TrainConfig


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
    atomic_save(weights, run_dir / DRAFTER_WEIGHTS)
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


def load_checkpoint(run_dir: Path) -> Checkpoint:
    state = read_state(run_dir)
    return Checkpoint(step=state["step"], config=TrainConfig.from_dict(state["config"]),
                      model_config=ModelConfig(**state["model_config"]),
                      weights=load_file(str(run_dir / DRAFTER_WEIGHTS)),
                      optimizer=optimizer_state(run_dir / "optimizer.safetensors", state["param_groups"]),
                      history=state["history"])
