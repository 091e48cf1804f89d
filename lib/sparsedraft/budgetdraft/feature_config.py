"""Configuration of a feature-drafter training run (``train-drafter --kind feature``): one validated dataclass.

Fields that the slice drafter's :class:`~.config.TrainConfig` also has keep
its meaning (``verifier``, ``steps``, ``sequences``, ``seq_len``, ``lam``,
``budgets``, ``seed``, ``out_dir``...), so the command's flags read the same
for both kinds. Defaults are the default recipe: SmolLM2-135M-YaRN-32K,
2K windows of the essays' train split plus Python's documentation text plus
the target's own sampled continuations, EAGLE's loss with a 3-step
training-time test, L_A + 0.5 * L_C over the paper's budgets, within an hour
of two CPU cores (data, features and training).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..caches.budget import BUDGETS, SCORINGS, check_budget, check_scoring
from ..errors import require
from .feature_data import TOP_K
from .feature_loss import check_window

TOKEN_TARGETS = ("greedy", "topk")
SET_SEED_STRIDE = 10_007  # seeds of sampled set k: no batch's seed (seed + row offset) in one set repeats another's

DEVICES = ("cpu", "cuda")
# The paper's budgets that a 2K window can train: 2048 would keep a 2K window's whole prefix (no sparsity), and
# longer windows cost teacher time the hour does not have.
TRAINABLE_BUDGETS = tuple(b for b in BUDGETS if b < 2048 - 64)
_NOT_SHAPING = ("steps", "final_context", "final_tokens", "final_prompts", "eval_every", "eval_sequences", "checkpoint_every", "teacher", "teacher_dir", "out_dir",
                "export", "device")


@dataclass(frozen=True)
class FeatureTrainConfig:
    verifier: str = field(default="smollm2-135m-yarn32k",
                          metadata={"help": "frozen target whose features the head reads"})
    seq_len: int = field(default=2048, metadata={"help": "tokens per essay / pydoc training window"})
    sequences: int = field(default=54, metadata={"help": "essay windows of the train split"})
    pydoc_sequences: int = field(default=24, metadata={"help": "windows of Python's documentation text"})
    sampled_sequences: int = field(default=48, metadata={
        "help": "the target's sampled continuations of train-split essay prompts (self-distillation)"})
    sampled_sets: int = field(default=1, metadata={
        "help": f"independent sampled continuations of each prompt (set k samples with seed + {SET_SEED_STRIDE} k, "
                "its own cache file): more of the target's own text for the price of its decode alone"})
    sampled_prompt: int = field(default=256, metadata={"help": "prompt tokens of each sampled window"})
    sampled_tokens: int = field(default=768, metadata={"help": "sampled tokens after each prompt"})
    sampled_offset: int = field(default=0, metadata={
        "help": "the sampled prompts start this many tokens into each of their evenly spaced strides of the train "
                "split: other prompts than a run with 0, so continuations a head trained on those never saw (to "
                "fit a gate, docs/feature-drafter.md)"})
    temperature: float = field(default=0.8, metadata={
        "help": "sampling temperature of the continuations; 0: the target's greedy continuations (the loops a "
                "greedy speculative decoder faces), one set only"})
    sample_batch: int = field(default=32, metadata={
        "help": "continuations decoded together in one batched cache (torch's GEMM; its prompt forward keeps "
                "sample_batch x sampled_prompt x vocab logits: 1.6 GB at 32 x 256 on SmolLM2)"})
    eval_sequences: int = field(default=2, metadata={"help": "held-out essay windows for the agreement curve"})
    draft_vocab: int = field(default=8192, metadata={
        "help": "tokens of the training CE's vocabulary (the train split's most frequent; 0 = all)"})
    embed_gain: float = field(default=1.0, metadata={
        "help": "fc's embedding half starts as embed_gain * (feature RMS / embedding RMS) * I, so the next token "
                "is heard as loud as the feature (0: EAGLE's pass-through; SmolLM2's features are ~300x louder "
                "than its embeddings, more than AdamW can learn up in a few hundred steps)"})
    head_init: str = field(default="", metadata={
        "help": "start from this trained feature-drafter folder (checked against the verifier; a fresh optimizer "
                "and schedule): more data or steps without retraining from scratch; empty: EAGLE's start from "
                "the target's top block"})
    fuse_layers: tuple[int, ...] = field(default=(), metadata={
        "help": "lower target layers whose outputs the head fuses with the top layer's (EAGLE-3's low and middle "
                "features, e.g. 2 15 on a 30-layer target); none: EAGLE's top-layer feature alone"})
    depth: int = field(default=1, metadata={
        "help": "decoder layers of the head (EAGLE: 1); a deeper head trained from a shallower one (--head-init) "
                "starts as it, its new layers adding nothing until they learn to"})
    head_window: tuple[int, ...] = field(default=(), metadata={
        "help": "SINK WINDOW: the head trains seeing its own entries as its StreamingLLM cache at true positions "
                "would show them (the first SINK and the WINDOW newest), as it drafts with draft_cache='streaming', "
                "draft_positions='true'; none: every entry (its full cache)"})
    behind: int = field(default=0, metadata={
        "help": "also read the first behind_sequences sampled continuations behind this many tokens of "
                "train-split text, the target's features behind a long context, kept to what the head window "
                "shows of it: the sink, then the WINDOW newest prefix tokens, then the continuation; 0: none. "
                "Needs head_window"})
    behind_sequences: int = field(default=0, metadata={
        "help": "sampled continuations (of the first set) that are also read behind a prefix, one target "
                "forward over each continuation behind a prefix computed once per prefix"})
    lookup_input: bool = field(default=False, metadata={
        "help": "the head also reads prompt lookup's proposal and its match length at every entry (a learnt "
                "lookup first; docs/feature-drafter.md); from a --head-init without it, it starts as that head"})
    lookup_gate: bool = field(default=False, metadata={
        "help": "with lookup_input: also a learnt logit bias on lookup's proposed token per match length, read "
                "from the match alone (docs/feature-drafter.md); from a --head-init without it, it starts as "
                "that head"})
    train_only: tuple[str, ...] = field(default=(), metadata={
        "help": "train only the head's parameters with these names or name prefixes (e.g. lookup_bias: fit a "
                "gate to a trained head, docs/feature-drafter.md); the rest keep their start; none: all"})
    unroll: int = field(default=3, metadata={"help": "draft steps of the training-time test after the first"})
    chains: int = field(default=256, metadata={"help": "chain starts per window that the unroll follows"})
    step_decay: float = field(default=0.8, metadata={"help": "weight of unroll step j is step_decay ** j"})
    noise: float = field(default=0.1, metadata={
        "help": "uniform noise on the input features, +- noise * their RMS (EAGLE)"})
    feature_weight: float = field(default=1.0, metadata={"help": "weight of the feature regression"})
    token_weight: float = field(default=1.0, metadata={"help": "weight of the token cross-entropy"})
    token_target: str = field(default="greedy", metadata={
        "help": f"what the token loss aims at: the verifier's greedy token, or its cached top-{TOP_K} "
                "distribution (topk: distillation)", "choices": TOKEN_TARGETS})
    loss_fraction: float = field(default=0.25, metadata={"help": "entries of each window that get the token loss"})
    lam: float = field(default=0.5, metadata={"help": "weight of the budgeted-view loss L_C (0 = L_A-only ablation)"})
    budgets: tuple[int, ...] = field(default=TRAINABLE_BUDGETS, metadata={
        "help": "KV budgets of L_C, one drawn per step; each must be below the window's prefix"})
    chunk_size: int = field(default=8, metadata={"help": "tokens per chunk of the budgeted view"})
    obs_window: int = field(default=32, metadata={"help": "queries before the prefix's partial chunk that score"})
    scoring: str = field(default="attention", metadata={"help": "chunk rule of the budgeted view",
                                                        "choices": SCORINGS})
    continuation: int = field(default=64, metadata={"help": "last entries of a window drafted under the budget"})
    final_context: int = field(default=4096, metadata={
        "help": "context of the end-of-run check on the target's greedy continuations (0 = skip)"})
    final_tokens: int = field(default=160, metadata={"help": "greedy tokens after each prompt of that check"})
    final_prompts: int = field(default=6, metadata={"help": "held-out prompts of that check"})
    steps: int = field(default=400, metadata={"help": "optimizer steps (one window each)"})
    lr: float = field(default=1e-3, metadata={"help": "peak AdamW learning rate"})
    warmup: int = field(default=20, metadata={"help": "linear warm-up steps, then cosine decay to lr/10"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    grad_clip: float = field(default=1.0, metadata={"help": "max gradient norm (0 = off)"})
    seed: int = field(default=0, metadata={"help": "seeds data order, noise, chains, budgets and sampling"})
    eval_every: int = field(default=50, metadata={"help": "steps between held-out agreement checks (0 = end only)"})
    checkpoint_every: int = field(default=50, metadata={"help": "steps between checkpoints"})
    teacher: bool = field(default=True, metadata={"help": "compute missing teacher data (--no-teacher: fail)"})
    teacher_dir: str = field(default="data/cache/feature", metadata={"help": "teacher data cache folder"})
    out_dir: str = field(default="", metadata={"help": "run folder (default: outputs/feature-drafter/<run name>)"})
    export: str = field(default="", metadata={"help": "also write the trained drafter folder here (e.g. "
                                                      "data/drafters/feature); empty: only <run folder>/drafter"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda", "choices": DEVICES})

    def __post_init__(self) -> None:
        for name in ("seq_len", "steps", "checkpoint_every", "sample_batch", "sampled_sets", "chunk_size", "obs_window",
                     "continuation", "sampled_prompt"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("sequences", "pydoc_sequences", "sampled_sequences", "sampled_tokens", "sampled_offset",
                     "eval_sequences", "draft_vocab", "unroll", "chains", "warmup", "eval_every"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("final_context", "final_tokens", "final_prompts"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        require(not self.final_context or (self.final_tokens >= 8 and self.final_prompts >= 1),
                "the end-of-run check needs final_tokens >= 8 and final_prompts >= 1 (or final_context 0 to skip)")
        require(self.sequences + self.pydoc_sequences + self.sampled_sequences >= 1,
                "no training data: give sequences, pydoc_sequences or sampled_sequences >= 1")
        require(self.sampled_sequences == 0 or self.sampled_tokens >= 1,
                "sampled_tokens must be >= 1 when sampled_sequences > 0")
        require(self.temperature >= 0, f"temperature must be >= 0 (0: greedy continuations), got {self.temperature}")
        require(self.temperature > 0 or self.sampled_sets == 1,
                f"greedy continuations (temperature 0) are the same text in every set: give sampled_sets 1, not "
                f"{self.sampled_sets}, or a temperature > 0")
        require(0 <= self.step_decay <= 1, f"step_decay must be in [0, 1], got {self.step_decay}")
        require(self.noise >= 0, f"noise must be >= 0, got {self.noise}")
        require(self.embed_gain >= 0, f"embed_gain must be >= 0, got {self.embed_gain}")
        require(self.token_target in TOKEN_TARGETS,
                f"token_target must be one of {TOKEN_TARGETS}, got {self.token_target!r}")
        require(self.feature_weight >= 0 and self.token_weight >= 0 and self.feature_weight + self.token_weight > 0,
                f"feature_weight and token_weight must be >= 0, not both 0; got {self.feature_weight}, "
                f"{self.token_weight}")
        require(0 < self.loss_fraction <= 1, f"loss_fraction must be in (0, 1], got {self.loss_fraction}")
        require(self.lam >= 0, f"lam (weight of L_C) must be >= 0, got {self.lam}; use 0 for the L_A-only ablation")
        require(all(i >= 0 for i in self.fuse_layers) and list(self.fuse_layers) == sorted(set(self.fuse_layers)),
                f"fuse_layers must be distinct layer indices >= 0, ascending; got {list(self.fuse_layers)}")
        require(isinstance(self.depth, int) and self.depth >= 1,
                f"depth must be >= 1 decoder layers, got {self.depth!r}")
        check_window(self.head_window, "head_window")
        require(self.behind >= 0 and self.behind_sequences >= 0,
                f"behind and behind_sequences must be >= 0, got {self.behind} and {self.behind_sequences}")
        require(bool(self.behind) == bool(self.behind_sequences),
                f"behind ({self.behind} tokens) and behind_sequences ({self.behind_sequences}) go together: give "
                "both or neither")
        require(not self.behind or (self.head_window and self.behind > sum(self.head_window)),
                f"reading continuations behind a prefix of {self.behind} tokens keeps what the head's window shows "
                f"of it: give head_window SINK WINDOW with SINK + WINDOW < behind (got {list(self.head_window)})")
        require(self.lookup_input or not self.lookup_gate,
                "lookup_gate biases prompt lookup's proposals, which the head reads only with lookup_input: pass "
                "--lookup-input too")
        require(self.behind_sequences <= self.sampled_sequences,
                f"behind_sequences ({self.behind_sequences}) reads sampled continuations behind a prefix: at most "
                f"sampled_sequences ({self.sampled_sequences})")
        require(len(self.budgets) >= 1, "budgets must name at least one KV budget, e.g. 256 512 1024 2048")
        for budget in self.budgets:
            check_budget(budget, self.chunk_size)
        check_scoring(self.scoring)
        require(self.lr > 0, f"lr must be > 0, got {self.lr}")
        require(self.weight_decay >= 0 and self.grad_clip >= 0,
                f"weight_decay and grad_clip must be >= 0, got {self.weight_decay} and {self.grad_clip}")
        require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        shortest = min(n for n, used in ((self.seq_len, self.sequences + self.pydoc_sequences),
                                         (self.sampled_prompt + self.sampled_tokens, self.sampled_sequences))
                       if used)
        require(self.unroll + 3 <= shortest, f"an unroll of {self.unroll} steps needs windows of >= "
                                             f"{self.unroll + 3} tokens; the shortest is {shortest}")
        longest = max(n for n, used in ((self.seq_len, self.sequences + self.pydoc_sequences),
                                        (self.sampled_prompt + self.sampled_tokens, self.sampled_sequences))
                      if used)
        require(not self.lam or longest - 1 - self.continuation > max(self.budgets),
                f"L_C needs a prefix (window - 1 - continuation = {longest - 1 - self.continuation} entries in the "
                f"longest window) longer than the largest budget ({max(self.budgets)}), or that budget keeps the "
                "whole prefix and trains nothing sparse; use longer windows, smaller budgets, or lam 0 (shorter "
                "windows draw only the budgets below their prefix, and skip L_C when none is)")

    def shaping(self) -> dict[str, Any]:
        """Fields that decide the weights after a given step (``steps`` is left out so a run can be extended)."""
        shaping = {k: v for k, v in self.to_dict().items() if k not in _NOT_SHAPING}
        for name, default in (("fuse_layers", ()), ("depth", 1), ("head_window", ()), ("behind", 0),
                              ("behind_sequences", 0), ("lookup_input", False),
                              ("lookup_gate", False), ("train_only", ()), ("sampled_offset", 0)):
            if getattr(self, name) == default:  # so runs from before the field keep their names and checkpoints
                del shaping[name]
        return shaping

    @property
    def run_name(self) -> str:
        digest = hashlib.sha256(json.dumps(self.shaping(), sort_keys=True).encode()).hexdigest()[:8]
        return f"feature-u{self.unroll}-lam{self.lam:g}-v{self.draft_vocab}-seed{self.seed}-{digest}"

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("outputs/feature-drafter") / self.run_name

    @property
    def window(self) -> tuple[int, int] | None:
        """(sink, window) of the head's view of its entries in training, or None (all of them)."""
        return check_window(self.head_window, "head_window")

    def replace(self, **changes: Any) -> "FeatureTrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FeatureTrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        require(not unknown, f"unknown feature training fields {unknown}; known fields are {sorted(known)}")
        return cls(**{k: tuple(v) if k in ("budgets", "fuse_layers", "head_window", "train_only") else v
                      for k, v in data.items()})
