"""Configuration of a BudgetDraft training run: one frozen, validated dataclass.

Defaults are sized for a CPU (a few minutes of steps on 2 cores): the YaRN x4
SmolLM2-135M stand-in as verifier (so the drafter, which copies its RoPE,
drafts at 16K-32K too), a drafter made of its first 3 layers (embedding and
head copied and frozen), 16 windows of 2176 tokens from the essays' train
split, 100 steps. A run with the default shaping lives in
``outputs/budgetdraft/default`` (what ``budgetdraft``'s ``draft`` option
reads by default); any other in ``outputs/budgetdraft/<run name>``. The
training budgets are the paper's {256, ..., 2048}, the budgets evaluation uses (evaluation refuses budgets a drafter was not trained on), so
each window is a prefix of 2112 tokens -- longer than the largest budget, or
that budget would keep the whole prefix and train nothing sparse -- and a
continuation of 64 drafted tokens that L_C scores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..caches.budget import BUDGETS, SCORINGS, VIEW_VERSION, check_budget, check_scoring
from ..errors import require

DEFAULT_FOLDER = "default"  # outputs/budgetdraft/default: the default run, which `budgetdraft` drafts with
INITS = ("verifier", "scratch")  # anything else is a model spec for sparsedraft.engine.weights.load_model
DEVICES = ("cpu", "cuda")
_NOT_SHAPING = ("steps", "eval_every", "eval_sequences", "checkpoint_every", "final_context", "final_tokens",
                "teacher", "teacher_dir", "out_dir", "device")


@dataclass(frozen=True)
class TrainConfig:
    verifier: str = field(default="smollm2-135m-yarn32k",
                          metadata={"help": "frozen verifier: short name, .gguf, folder or HF id"})
    drafter_init: str = field(default="verifier", metadata={
        "help": "'verifier' (its first `layers` layers + embedding + head, copied), 'scratch' (random layers, "
                "the verifier's embedding/head), or any model spec sharing the verifier's tokenizer"})
    layers: int = field(default=3, metadata={"help": "drafter layers for the verifier/scratch inits"})
    train_embeddings: bool = field(default=False, metadata={"help": "also train the token embedding and head"})
    lam: float = field(default=1.0, metadata={"help": "weight of the sparse-view loss L_C (0 = L_A-only ablation)"})
    budgets: tuple[int, ...] = field(default=BUDGETS, metadata={
        "help": "KV budgets of the sparse view, one sampled per step; evaluate only these"})
    chunk_size: int = field(default=8, metadata={"help": "tokens per chunk of the sparse view"})
    obs_window: int = field(default=32, metadata={
        "help": "queries before the prefix's partial chunk that score chunks"})
    scoring: str = field(default="attention", metadata={
        "help": "chunk rule of the sparse view: attention (the observation window's, per layer) or keys (each "
                "chunk's mean key vs the last prefix key, per KV head: BudgetDraft's public code)",
        "choices": SCORINGS})
    seq_len: int = field(default=2176, metadata={"help": "tokens per training window (prefix + continuation)"})
    continuation: int = field(default=64, metadata={
        "help": "last tokens of each window drafted through the sparse view (L_C); the rest is the prefix "
                "whose chunks are selected, and must be longer than every budget"})
    sequences: int = field(default=16, metadata={"help": "training windows from the train split (teacher cost)"})
    eval_sequences: int = field(default=2, metadata={"help": "held-out windows for the agreement proxy"})
    loss_fraction: float = field(default=0.25, metadata={
        "help": "fraction of positions (sampled per step) that get logits and loss; the 49K-way head dominates"})
    batch: int = field(default=1, metadata={"help": "sequences per step"})
    steps: int = field(default=100, metadata={"help": "optimizer steps"})
    lr: float = field(default=1e-3, metadata={"help": "peak AdamW learning rate"})
    warmup: int = field(default=10, metadata={"help": "linear warm-up steps, then cosine decay to lr/10"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    grad_clip: float = field(default=1.0, metadata={"help": "max gradient norm (0 = off)"})
    seed: int = field(default=0, metadata={"help": "seeds init, data order, budgets and loss positions"})
    eval_every: int = field(default=25, metadata={"help": "steps between agreement evaluations (0 = end only)"})
    checkpoint_every: int = field(default=25, metadata={"help": "steps between checkpoints"})
    final_context: int = field(default=2560, metadata={
        "help": "context of the end-of-run acceptance check with BudgetCache (0 = skip)"})
    final_tokens: int = field(default=64, metadata={"help": "verifier tokens generated for that check"})
    teacher: bool = field(default=True, metadata={"help": "compute missing teacher targets (--no-teacher: "
                                                          "fail unless they are cached)"})
    teacher_dir: str = field(default="data/cache/teacher", metadata={"help": "teacher-target cache folder"})
    out_dir: str = field(default="", metadata={"help": "run folder (default: outputs/budgetdraft/<run name>)"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda", "choices": DEVICES})

    def __post_init__(self) -> None:
        require(self.lam >= 0, f"lam (weight of L_C) must be >= 0, got {self.lam}; use 0 for the L_A-only ablation")
        require(len(self.budgets) >= 1, "budgets must name at least one KV budget, e.g. 64 128 256 512")
        for budget in self.budgets:
            check_budget(budget, self.chunk_size)
        require(self.obs_window >= 1, f"obs_window must be >= 1, got {self.obs_window}")
        check_scoring(self.scoring)
        require(bool(self.drafter_init), f"drafter_init must be one of {INITS} or a model spec, got ''")
        require(self.layers >= 1, f"layers must be >= 1, got {self.layers}")
        require(self.continuation >= 1, f"continuation must be >= 1 token, got {self.continuation}")
        require(self.prefix_len > max(self.budgets),
                f"the prefix (seq_len {self.seq_len} - continuation {self.continuation} = {self.prefix_len} "
                f"tokens) must be longer than the largest budget ({max(self.budgets)}), or that budget keeps the "
                f"whole prefix and trains nothing sparse; use seq_len > {max(self.budgets) + self.continuation}")
        for name in ("sequences", "batch", "steps", "checkpoint_every"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_sequences", "eval_every", "warmup", "final_context", "final_tokens"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        require(0 < self.loss_fraction <= 1, f"loss_fraction must be in (0, 1], got {self.loss_fraction}")
        require(self.lr > 0, f"lr must be > 0, got {self.lr}")
        require(self.weight_decay >= 0 and self.grad_clip >= 0,
                f"weight_decay and grad_clip must be >= 0, got {self.weight_decay} and {self.grad_clip}")
        require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")

    @property
    def prefix_len(self) -> int:
        """Tokens of each window before the continuation: the prompt the sparse view selects chunks from."""
        return self.seq_len - self.continuation

    def shaping(self) -> dict[str, Any]:
        """Fields that decide the weights after a given step (``steps`` is left out so a run can be extended)."""
        shaping = {k: v for k, v in self.to_dict().items() if k not in _NOT_SHAPING}
        if shaping["scoring"] == "attention":  # the rule every run had before the option: their names stay
            del shaping["scoring"]
        return shaping

    @property
    def run_name(self) -> str:
        """Readable and unique: init, layers, lambda, seed, then a hash of :meth:`shaping`."""
        shaping = {**self.shaping(), "view_version": VIEW_VERSION}
        digest = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:8]
        init = self.drafter_init if self.drafter_init in INITS else "model"
        return f"{init}-k{self.layers}-lam{self.lam:g}-seed{self.seed}-{digest}"

    @property
    def folder_name(self) -> str:
        """``default`` for a run shaped like the defaults (whatever its steps or evaluation), else :attr:`run_name`."""
        return DEFAULT_FOLDER if self.shaping() == TrainConfig().shaping() else self.run_name

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("outputs/budgetdraft") / self.folder_name

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        require(not unknown, f"unknown training config fields {unknown}; known fields are {sorted(known)}")
        return cls(**{k: tuple(v) if k == "budgets" else v for k, v in data.items()})
