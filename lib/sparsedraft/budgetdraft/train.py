"""Train a BudgetDraft drafter against a frozen verifier: L = L_A + lambda * L_C.

:func:`train_drafter` runs the whole recipe from one :class:`TrainConfig`:
windows of the essays' train split, cached teacher targets, a drafter init,
AdamW with warm-up and cosine decay, periodic agreement checks on held-out
windows, checkpoints (resume is automatic when the run folder holds one),
and at the end an acceptance check with the real :class:`BudgetCache` on a
held-out prompt. Everything a step draws (which windows, which budget, which
loss positions) comes from a generator seeded by (seed, step), so a resumed
run repeats an uninterrupted one exactly. The λ = 0 ablation is the same call
with ``lam=0``; it skips the sparse branch and shares the teacher cache.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..engine.data import Tokenizer, model_tokenizer, prompt_tokens
from ..engine.model import Transformer
from ..engine.weights import from_state_dict, load_model
from ..errors import require
from ..progress import bar, bars_on
from ..speculative.loading import has_checkpoint, read_state
from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig
from .evaluate import acceptance_rows
from .init import init_drafter, set_trainable, trainable_parameters
from .loss import agreement, budgetdraft_loss
from .teacher import corpus_windows, teacher_targets


@dataclass
class TrainResult:
    run_dir: Path
    drafter: Transformer
    step: int
    history: list[dict[str, Any]]  # one entry per step; entries with "eval" hold agreement per budget
    tokens_per_s: float  # training tokens (batch * seq_len per step) per second of optimizer steps in this process
    final: dict[str, Any] = field(default_factory=dict)  # end-of-run agreement and BudgetCache acceptance


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr / 10`` at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def step_draws(cfg: TrainConfig, step: int, n_windows: int) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """(window indices [batch], budget, sorted loss positions or None) of one step, from (seed, step) alone."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    windows = torch.randint(n_windows, (cfg.batch,), generator=gen)
    budget = cfg.budgets[int(torch.randint(len(cfg.budgets), (1,), generator=gen))]
    count = max(1, round(cfg.loss_fraction * cfg.seq_len))
    positions = None if count == cfg.seq_len else torch.randperm(cfg.seq_len, generator=gen)[:count].sort().values
    return windows, budget, positions


def check_resumable(cfg: TrainConfig) -> None:
    """A run folder may only be resumed by the run that made it (before any heavy work)."""
    if has_checkpoint(cfg.run_dir):
        saved = read_state(cfg.run_dir)["config"]
        saved_shaping = TrainConfig.from_dict(saved).shaping()
        diff = sorted(k for k, v in cfg.shaping().items() if saved_shaping.get(k) != v)
        require(not diff, f"{cfg.run_dir} holds a checkpoint of a different run (fields {diff} differ); "
                          "choose another out_dir or delete the folder")


@dataclass
class Data:
    windows: torch.Tensor  # [N, seq_len] train-split token windows
    targets: torch.Tensor  # [N, seq_len] teacher tokens x*
    held_out: torch.Tensor  # [M, seq_len] held-out windows (M = eval_sequences, may be 0)
    held_targets: torch.Tensor  # [M, seq_len]


def load_data(cfg: TrainConfig, verifier: Transformer, tokenizer: Tokenizer, progress: bool) -> Data:
    windows = corpus_windows(tokenizer, cfg.seq_len, cfg.sequences, "train")
    targets = teacher_targets(verifier, cfg.verifier, windows, cfg.teacher_dir, cfg.teacher, progress)
    held_out = held_targets = torch.zeros(0, cfg.seq_len, dtype=torch.long)
    if cfg.eval_sequences:
        held_out = corpus_windows(tokenizer, cfg.seq_len, cfg.eval_sequences, "heldout")
        held_targets = teacher_targets(verifier, cfg.verifier, held_out, cfg.teacher_dir, cfg.teacher, progress)
    return Data(windows, targets, held_out, held_targets)


def held_out_agreement(cfg: TrainConfig, drafter: Transformer, data: Data) -> dict[str, float]:
    """Mean top-1 agreement with the teacher over the held-out windows, per view (see :func:`agreement`)."""
    was_training = drafter.training
    drafter.eval()
    device = drafter.device
    scores = [agreement(drafter, data.held_out[i:i + 1].to(device), data.held_targets[i:i + 1].to(device),
                        cfg.budgets, cfg.prefix_len, cfg.chunk_size, cfg.obs_window, cfg.scoring)
              for i in range(len(data.held_out))]
    drafter.train(was_training)
    return {k: sum(s[k] for s in scores) / len(scores) for k in scores[0]} if scores else {}


def train_step(cfg: TrainConfig, drafter: Transformer, optimizer: torch.optim.Optimizer, data: Data,
               step: int) -> dict[str, Any]:
    """One optimizer step (index ``step``, 0-based); returns its history entry."""
    start = time.perf_counter()
    index, budget, positions = step_draws(cfg, step, len(data.windows))
    lr = learning_rate(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    device = drafter.device
    parts = budgetdraft_loss(drafter, data.windows[index].to(device), data.targets[index].to(device), cfg.lam,
                             budget, cfg.prefix_len, cfg.chunk_size, cfg.obs_window,
                             None if positions is None else positions.to(device), cfg.scoring)
    parts.total.backward()
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(trainable_parameters(drafter).values(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # The budget is drawn even when lam == 0, so the ablation sees the same windows and positions.
    return {"step": step + 1, "loss_a": parts.full, "loss_c": parts.sparse, "budget": budget if cfg.lam else None,
            "lr": lr, "seconds": time.perf_counter() - start}


def train_drafter(cfg: TrainConfig, verifier: Transformer | None = None, tokenizer: Tokenizer | None = None,
                  progress: bool = True, callback: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
    """Train (or resume) the run ``cfg`` describes; ``verifier``/``tokenizer`` default to ``cfg.verifier``'s.

    ``callback`` sees each step's history entry (after its checkpoint, if any). ``progress=False`` keeps
    this run's teacher and step bars off; otherwise they show when :func:`~sparsedraft.progress.bars_on`.
    """
    progress = progress and bars_on()
    check_resumable(cfg)
    torch.manual_seed(cfg.seed)
    verifier = verifier if verifier is not None else load_model(cfg.verifier, device=cfg.device)
    limit = verifier.cfg.max_position_embeddings
    require(cfg.final_context <= limit, f"final_context ({cfg.final_context}) exceeds the verifier's context "
                                        f"({limit}); use --final-context <= {limit}, or 0 to skip the check")
    require(not cfg.final_context or cfg.final_context > cfg.final_tokens + 1,
            f"final_context ({cfg.final_context}) must exceed final_tokens + 1 ({cfg.final_tokens + 1})")
    tokenizer = tokenizer if tokenizer is not None else model_tokenizer(cfg.verifier)
    data = load_data(cfg, verifier, tokenizer, progress)

    run_dir, step, history, moments = cfg.run_dir, 0, [], None
    if has_checkpoint(run_dir):
        ckpt = load_checkpoint(run_dir)
        drafter = from_state_dict(ckpt.model_config, ckpt.weights, device=verifier.device).train()
        set_trainable(drafter, cfg.train_embeddings)
        step, history, moments = ckpt.step, ckpt.history, ckpt.optimizer
    else:
        drafter = init_drafter(verifier, cfg)
    optimizer = torch.optim.AdamW(trainable_parameters(drafter).values(), lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    if moments is not None:
        optimizer.load_state_dict(moments)
    if step == 0 and cfg.eval_every:
        history.append({"step": 0, "eval": held_out_agreement(cfg, drafter, data)})  # the untrained init

    steps = bar(total=cfg.steps, initial=step, desc="train-drafter", unit="step", leave=True, show=progress)
    train_seconds, trained_steps = 0.0, 0
    while step < cfg.steps:
        entry = train_step(cfg, drafter, optimizer, data, step)
        step, trained_steps, train_seconds = step + 1, trained_steps + 1, train_seconds + entry["seconds"]
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            entry["eval"] = held_out_agreement(cfg, drafter, data)
        history.append(entry)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save_checkpoint(run_dir, cfg, drafter, optimizer, step, history)
        sparse, rate = entry["loss_c"], trained_steps * cfg.batch * cfg.seq_len / train_seconds
        steps.set_postfix(loss_a=f"{entry['loss_a']:.3f}", loss_c="-" if sparse is None else f"{sparse:.3f}",
                          B=entry["budget"] or "-", tok_s=f"{rate:.0f}")
        steps.update(1)
        if callback is not None:
            callback(entry)
    steps.close()
    drafter.eval()
    final = {"agreement": held_out_agreement(cfg, drafter, data),
             "acceptance": final_acceptance(cfg, verifier, drafter, tokenizer)}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").write_text(json.dumps(final, indent=1))
    rate = trained_steps * cfg.batch * cfg.seq_len / train_seconds if trained_steps else float("nan")
    return TrainResult(run_dir, drafter, step, history, rate, final)


def final_acceptance(cfg: TrainConfig, verifier: Transformer, drafter: Transformer,
                     tokenizer: Tokenizer) -> list[dict]:
    """Greedy speculative acceptance with a BudgetCache on one held-out prompt of ``final_context`` tokens."""
    if not cfg.final_context:
        return []
    prompt = prompt_tokens(tokenizer, cfg.final_context - cfg.final_tokens, split="heldout")
    budgets = [b for b in cfg.budgets if b < prompt.numel()] + [None]
    return acceptance_rows(verifier, {"drafter": drafter}, [prompt], budgets, cfg.final_tokens,
                           chunk_size=cfg.chunk_size, obs_window=cfg.obs_window, trained_budgets=cfg.budgets,
                           scorings=(cfg.scoring,))
