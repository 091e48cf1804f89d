"""Train a feature drafter (EAGLE-style head) against a frozen target: ``train-drafter --kind feature``.

:func:`train_feature_drafter` runs the whole recipe from one
:class:`~.feature_config.FeatureTrainConfig`: teacher data cached on disk
(:mod:`.feature_data`), a head started as EAGLE starts it (the target's top
block, ``fc`` passing the feature through), AdamW with warm-up and cosine
decay over the loss of :mod:`.feature_loss`, a held-out agreement curve
against training tokens seen (``curve.csv``), checkpoints (resume is
automatic when the run folder holds one), and at the end the drafter folder
that :func:`~sparsedraft.speculative.feature.load_feature_head` reads, with
the run's record (recipe, command, commit, date, ISA, wall time, peak RSS,
data sizes, agreements). Every draw of a step (window, noise, loss
positions, chains, budget) comes from a generator seeded by (seed, step), so
a resumed run repeats an uninterrupted one bit for bit.
"""

from __future__ import annotations

import csv
import json
import math
import resource
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file

from ..engine import machine
from ..engine.data import Tokenizer, model_tokenizer
from ..engine.model import Transformer
from ..engine.weights import load_model
from ..errors import require
from ..progress import bar, bars_on
from ..report import read_table
from ..speculative.feature import (FeatureHead, check_depth, check_feature_drafter, check_fuse_layers,
                                   load_feature_head, save_feature_head)
from ..speculative.vocab import frequent_tokens
from .checkpoint import atomic_save, optimizer_state, optimizer_tensors
from .feature_config import SET_SEED_STRIDE, FeatureTrainConfig
from .feature_data import Window, feature_scales, sampled_teacher, teacher_windows, text_windows
from .feature_context import behind_teacher, training_prefixes
from .feature_eval import budgeted_agreement, training_fit, window_agreement
from .feature_loss import Draws, TokenHead, feature_loss, trained_from
from .teacher import corpus_windows

STATE = "state.json"
CURVE = "curve.csv"
DRAFTER = "drafter"  # the run folder's trained drafter (what --export copies)


@dataclass
class FeatureData:
    train: list[Window]
    held_out: list[Window]
    scales: list[float]  # each feature block's RMS (lower layers', then the top's): units of the noise
    ids: torch.Tensor | None  # the training CE's draft vocabulary (None: all tokens)

    @property
    def scale(self) -> float:
        """The top layer's feature RMS: the unit of the regression."""
        return self.scales[-1]

    def sizes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for w in self.train:
            out[f"{w.source}_tokens"] = out.get(f"{w.source}_tokens", 0) + w.tokens.numel()
        return {**out, "train_windows": len(self.train), "train_tokens": sum(w.tokens.numel() for w in self.train),
                "held_out_tokens": sum(w.tokens.numel() for w in self.held_out)}


def load_feature_data(cfg: FeatureTrainConfig, target: Transformer, tokenizer: Tokenizer,
                      progress: bool) -> FeatureData:
    """Every window the run trains and evaluates on, with its teacher (computed once, then read from disk)."""
    cache, layers = cfg.teacher_dir, cfg.fuse_layers
    train: list[Window] = []
    for source, count in (("essays", cfg.sequences), ("pydoc", cfg.pydoc_sequences)):
        windows = text_windows(tokenizer, source, cfg.seq_len, count)
        train += teacher_windows(target, cfg.verifier, windows, source, cache, cfg.teacher, progress, layers)
    for k in range(cfg.sampled_sets):
        sampled = sampled_teacher(target, cfg.verifier, tokenizer, cfg.sampled_sequences, cfg.sampled_prompt,
                                  cfg.sampled_tokens, cfg.temperature, cfg.seed + SET_SEED_STRIDE * k, cache,
                                  cfg.teacher, cfg.sample_batch, progress, layers, cfg.sampled_offset)
        if k == 0 and cfg.behind:
            sink, window = cfg.head_window
            train += behind_teacher(target, cfg.verifier, sampled[:cfg.behind_sequences],
                                    training_prefixes(tokenizer, cfg.behind), sink, window, cache, cfg.teacher,
                                    progress, layers, cfg.lookup_input)
        train += sampled
    held = corpus_windows(tokenizer, cfg.seq_len, cfg.eval_sequences, "heldout") if cfg.eval_sequences else \
        torch.zeros(0, cfg.seq_len, dtype=torch.long)
    held_out = teacher_windows(target, cfg.verifier, held, "heldout", cache, cfg.teacher, progress, layers)
    ids = frequent_tokens(tokenizer, cfg.draft_vocab, target.cfg.vocab_size) if cfg.draft_vocab else None
    return FeatureData(train, held_out, feature_scales(train, target.cfg.hidden_size), ids)


def init_head(head: FeatureHead, target: Transformer, scales: list[float], gain: float) -> None:
    """EAGLE's start (:meth:`FeatureHead.init_from`), with fc's embedding half at ``gain`` times the ratio of the
    top features' RMS (``scales[-1]``) to the embeddings', so both inputs of the layer start equally loud; a
    fusing head's ``fuse_gain`` scales each lower block up to the top's RMS for the same reason."""
    head.init_from(target)
    hidden, scale = head.cfg.hidden_size, scales[-1]
    ratio = scale / float(target.embed_tokens.weight.float().pow(2).mean().sqrt())
    with torch.no_grad():
        head.fc.weight[:, hidden:] = gain * ratio * torch.eye(hidden, dtype=head.dtype, device=head.device)
    head.init_fuse(scales)
    head.init_lookup(target, scale)


def learning_rate(cfg: FeatureTrainConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr / 10`` at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def step_draws(cfg: FeatureTrainConfig, step: int, windows: list[Window], scales: list[float],
               hidden: int) -> tuple[int, Draws]:
    """(window index, draws) of step ``step``, from (seed, step) alone; the input noise of each feature block
    is in units of that block's RMS (``scales``)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    index = int(torch.randint(len(windows), (1,), generator=gen))
    t = windows[index].tokens.numel()
    first = trained_from(windows[index].positions)  # a window read behind a prefix learns after its gap only
    noise = None
    if cfg.noise:
        unit = torch.tensor([cfg.noise * s for s in scales]).repeat_interleave(hidden)
        noise = (torch.rand(1, t - 1, len(scales) * hidden, generator=gen) * 2 - 1) * unit
    count = max(1, round(cfg.loss_fraction * (t - 1 - first)))
    ce_positions = first + torch.randperm(t - 1 - first, generator=gen)[:count].sort().values
    room = t - 1 - cfg.unroll - first  # chain starts first .. t - 2 - unroll
    starts = first + torch.randperm(room, generator=gen)[:min(cfg.chains, room)].sort().values
    fitting = [b for b in cfg.budgets if b < t - 1 - cfg.continuation]  # a budget must leave the prefix sparse
    if first:  # the budgeted view would select among a gapped prefix no budget cache ever holds
        fitting = []
    budget = fitting[int(torch.randint(len(fitting), (1,), generator=gen))] if cfg.lam and fitting else None
    return index, Draws(noise, ce_positions, starts, budget)


def trainable(head: FeatureHead, names: tuple[str, ...]) -> list[torch.nn.Parameter]:
    """The head's parameters named by ``names`` (a name or its prefix: ``lookup_bias``, ``layers.0``), all of them
    for none; the others stop taking gradients, so they keep their start."""
    params = dict(head.named_parameters())
    if not names:
        return list(params.values())
    hits = {n: {k for k in params if k == n or k.startswith(n + ".")} for n in names}
    unknown = [n for n, keys in hits.items() if not keys]
    require(not unknown, f"train_only names {unknown}, which name none of this head's parameters: "
                         f"{sorted(params)}")
    chosen = set().union(*hits.values())
    for key, p in params.items():
        p.requires_grad_(key in chosen)
    return [params[k] for k in params if k in chosen]


def train_step(cfg: FeatureTrainConfig, head: FeatureHead, tokens: TokenHead, optimizer: torch.optim.Optimizer,
               data: FeatureData, step: int) -> dict[str, Any]:
    """One optimizer step (index ``step``, 0-based) on one window; returns its history entry."""
    start = time.perf_counter()
    index, draws = step_draws(cfg, step, data.train, data.scales, head.cfg.hidden_size)
    lr = learning_rate(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    window, device = data.train[index], head.device
    move = {"noise": None if draws.noise is None else draws.noise.to(device)}
    draws = Draws(move["noise"], draws.ce_positions.to(device), draws.starts.to(device), draws.budget)
    soft = None
    if cfg.token_target == "topk":
        soft = (window.top_ids[None].to(device), window.top_probs[None].to(device))
    out = feature_loss(head, tokens, window.tokens[None].to(device), window.features[None].to(device).float(),
                       window.greedy[None].to(device), draws, scale=data.scale, feature_weight=cfg.feature_weight,
                       token_weight=cfg.token_weight, step_decay=cfg.step_decay, unroll_steps=cfg.unroll,
                       lam=cfg.lam, continuation=cfg.continuation, chunk_size=cfg.chunk_size,
                       obs_window=cfg.obs_window, scoring=cfg.scoring, soft=soft, window=cfg.window,
                       positions=None if window.positions is None else window.positions.to(device),
                       lookups=None if window.lookups is None else window.lookups[None].to(device))
    out.total.backward()
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"step": step + 1, "tokens": window.tokens.numel(), "lr": lr, "budget": draws.budget,
            "seconds": time.perf_counter() - start, **out.parts}


def held_out_agreement(cfg: FeatureTrainConfig, head: FeatureHead, data: FeatureData) -> dict[str, float]:
    """Teacher-forced first-draft agreement (full head and draft vocabulary) and unrolled step-j agreement,
    averaged over the held-out windows, the head seeing its entries as it trained to (``cfg.head_window``)."""
    if not data.held_out:
        return {}
    was = head.training
    head.eval()
    rows = [{**window_agreement(head, w, data.ids, cfg.unroll, head_window=cfg.window),
             **{f"budget_{k}": v for k, v in budgeted_agreement(head, w, cfg.budgets, eval_continuation(cfg, w),
                                                                cfg.chunk_size, cfg.obs_window, cfg.scoring).items()}}
            for w in data.held_out]
    head.train(was)
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def eval_continuation(cfg: FeatureTrainConfig, window: Window) -> int:
    """Entries the budgeted agreement drafts at the end of a held-out window: 4x L_C's, as the prefix allows."""
    return max(1, min(4 * cfg.continuation, window.tokens.numel() - 2 - max(cfg.budgets)))


def save_state(cfg: FeatureTrainConfig, head: FeatureHead, optimizer: torch.optim.Optimizer, step: int,
               history: list[dict[str, Any]], scale: float) -> None:
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_save(head.state_dict(), run_dir / "head.safetensors")
    atomic_save(optimizer_tensors(optimizer), run_dir / "optimizer.safetensors")
    state = {"kind": "feature", "step": step, "config": cfg.to_dict(), "scale": scale,
             "param_groups": optimizer.state_dict()["param_groups"], "history": history}
    tmp = run_dir / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1, default=list))
    tmp.replace(run_dir / STATE)


def check_resumable(cfg: FeatureTrainConfig) -> dict[str, Any] | None:
    """The saved state of ``cfg``'s run folder, if any, after checking it is this run's (before heavy work)."""
    path = cfg.run_dir / STATE
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    require(state.get("kind") == "feature", f"{cfg.run_dir} holds a checkpoint of another drafter kind; choose "
                                            "another out_dir or delete the folder")
    saved = FeatureTrainConfig.from_dict(state["config"]).shaping()
    diff = sorted(k for k, v in cfg.shaping().items() if saved.get(k) != v)
    require(not diff, f"{cfg.run_dir} holds a checkpoint of a different run (fields {diff} differ); choose another "
                      "out_dir or delete the folder")
    return state


def write_curve(run_dir: Path, history: list[dict[str, Any]]) -> None:
    """``curve.csv``: held-out agreement against training tokens seen (one row per evaluation)."""
    rows, seen = [], 0
    for entry in history:
        seen += entry.get("tokens", 0)
        if "eval" in entry:
            rows.append({"step": entry["step"], "train_tokens_seen": seen, **entry["eval"]})
    write_rows(run_dir / CURVE, rows)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    if rows:
        with open(path, "w", newline="") as f:
            names = list(dict.fromkeys(k for row in rows for k in row))  # a parent's curve may measure other budgets
            writer = csv.DictWriter(f, fieldnames=names)
            writer.writeheader()
            writer.writerows(rows)


def read_curve(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``curve.csv``; none if the file is missing."""
    return read_table(path) if path.is_file() else []


def continue_curve(parent: list[dict[str, Any]], own: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A warm start's curve as the continuation of the curve of the drafter it began from: the parent's rows,
    then this run's with its steps and training tokens counted on from the parent's last row (this run's step-0
    row, which measures the parent's final weights again, is left out), so the drafter's curve covers every
    step that made it."""
    if not parent:
        return own
    last = parent[-1]
    later = [r for r in own if r["step"] > 0]
    return parent + [{**r, "step": r["step"] + last["step"],
                      "train_tokens_seen": r["train_tokens_seen"] + last["train_tokens_seen"]} for r in later]


@dataclass
class FeatureTrainResult:
    run_dir: Path
    head: FeatureHead
    step: int
    history: list[dict[str, Any]]
    record: dict[str, Any]  # what the drafter folder's record holds besides the target


def train_feature_drafter(cfg: FeatureTrainConfig, target: Transformer | None = None,
                          tokenizer: Tokenizer | None = None, progress: bool = True,
                          callback: Callable[[dict[str, Any]], None] | None = None,
                          evaluate: Callable[[FeatureHead], dict[str, Any]] | None = None,
                          provenance: bool = True) -> FeatureTrainResult:
    """Train (or resume) the run ``cfg`` describes and write its drafter folder (and ``cfg.export``).

    ``evaluate(head)`` (e.g. :func:`~.feature_eval.final_report`) adds end-of-run measurements to the
    record; ``callback`` sees each step's history entry after its checkpoint; ``provenance=False`` leaves
    the commit and the machine (git and a bandwidth measurement: seconds) out of the record."""
    began = time.time()
    started = machine.provenance() if provenance else {}  # the commit that runs is the one checked out now
    progress = progress and bars_on()
    saved = check_resumable(cfg)
    torch.manual_seed(cfg.seed)
    target = target if target is not None else load_model(cfg.verifier, device=cfg.device)
    target.requires_grad_(False)
    tokenizer = tokenizer if tokenizer is not None else model_tokenizer(cfg.verifier)
    check_fuse_layers(cfg.fuse_layers, target.cfg.num_layers)
    check_depth(cfg.depth, target.cfg.num_layers)
    lineage, parent_curve = None, []
    if cfg.head_init and saved is None:  # a wrong folder is refused before the teacher data is made
        parent = check_feature_drafter(cfg.head_init, target)
        theirs = tuple(parent.get("fuse_layers", ()))
        require(theirs in ((), cfg.fuse_layers), f"the drafter in {cfg.head_init} fuses target layers "
                                                 f"{list(theirs)}, this run {list(cfg.fuse_layers)}; pass "
                                                 f"--fuse-layers {' '.join(map(str, theirs))}, or start from "
                                                 "scratch or from a head that reads the top layer alone")
        require(int(parent.get("depth", 1)) <= cfg.depth,
                f"the drafter in {cfg.head_init} has {parent.get('depth', 1)} layers, this run {cfg.depth}; pass "
                f"--depth {parent.get('depth', 1)} or more (a head can grow deeper, not shallower)")
        require(cfg.lookup_input or not parent.get("lookup_input"),
                f"the drafter in {cfg.head_init} reads prompt lookup's proposals; pass --lookup-input (a head "
                "can learn to read them, not to forget them)")
        require(cfg.lookup_gate or not parent.get("lookup_gate"),
                f"the drafter in {cfg.head_init} has a lookup gate; pass --lookup-gate (a head can learn a gate, "
                "not forget one)")
        lineage = started_from(parent)
        parent_curve = read_curve(Path(cfg.head_init) / CURVE)  # read now: the export may overwrite the folder
    trainable(FeatureHead(target.cfg, cfg.fuse_layers, cfg.depth, cfg.lookup_input, cfg.lookup_gate),
              cfg.train_only)  # a name no parameter has is refused before the teacher data is made
    data = load_feature_data(cfg, target, tokenizer, progress)
    data_seconds = time.time() - began

    head = FeatureHead(target.cfg, cfg.fuse_layers, cfg.depth, cfg.lookup_input, cfg.lookup_gate).to(
        device=target.device, dtype=torch.float32)
    head.attach(target)
    step, history = 0, []
    optimizer = torch.optim.AdamW(trainable(head, cfg.train_only), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if saved is not None:
        head.load_state_dict(load_file(str(cfg.run_dir / "head.safetensors")))
        optimizer.load_state_dict(optimizer_state(cfg.run_dir / "optimizer.safetensors", saved["param_groups"]))
        step, history = saved["step"], saved["history"]
    else:
        if cfg.head_init:
            parent_head = load_feature_head(cfg.head_init, target)
            widen = bool(cfg.fuse_layers) and not parent_head.fuse_layers  # a top-only head learns to fuse
            deepen = cfg.depth > parent_head.depth  # new layers on top of the trained ones
            learn_lookup = cfg.lookup_input and not parent_head.lookup  # a silent lookup input to learn
            learn_gate = cfg.lookup_gate and not parent_head.lookup_gate  # a gate at zero to learn
            head.load_state_dict(parent_head.state_dict(), strict=not (widen or deepen or learn_lookup or learn_gate))
            if learn_lookup:
                head.init_lookup(target, data.scales[-1])
            if widen:
                head.init_fuse(data.scales)  # the lower layers silent: it starts as the head it was
            if deepen:
                head.init_layers(target, parent_head.depth)  # new layers add nothing: the same start
            if evaluate is not None:  # the same end-of-run check on the head it starts from: before and after
                lineage["measured"] = evaluate(head.eval())
        else:
            init_head(head, target, data.scales, cfg.embed_gain)
        if cfg.eval_every:
            history.append({"step": 0, "tokens": 0, "eval": held_out_agreement(cfg, head, data)})
    tokens = TokenHead(head, data.ids)
    head.train()

    steps = bar(total=cfg.steps, initial=step, desc="train-drafter (feature)", unit="step", leave=True,
                show=progress)
    while step < cfg.steps:
        entry = train_step(cfg, head, tokens, optimizer, data, step)
        step += 1
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            entry["eval"] = held_out_agreement(cfg, head, data)
        history.append(entry)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save_state(cfg, head, optimizer, step, history, data.scale)
            write_curve(cfg.run_dir, history)
        steps.set_postfix(loss=f"{entry['loss_a']:.3f}", tok0=f"{entry['token_0']:.2f}",
                          feat0=f"{entry['feat_0']:.3f}")
        steps.update(1)
        if callback is not None:
            callback(entry)
    steps.close()
    head.eval()
    final = held_out_agreement(cfg, head, data)
    history.append({"step": step, "tokens": 0, "eval": final})
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    write_curve(cfg.run_dir, history)
    record = run_record(cfg, data, history, began, data_seconds, final, started if provenance else None)
    if saved is not None:  # wall time and peak RSS below are this process's only; the steps before were another's
        record["resumed_from_step"] = saved["step"]
    if lineage is not None:  # the export may overwrite the folder it started from: keep what it was
        record["started_from"] = lineage
    record["training_fit"] = training_fit(head, data.train, cfg.sampled_prompt, window=cfg.window)
    if evaluate is not None:
        record["measured"] = evaluate(head)
    record["wall_seconds"] = round(time.time() - began, 1)
    record["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    drafter = save_feature_head(head, cfg.run_dir / DRAFTER, target, record)
    if (cfg.run_dir / CURVE).is_file():  # the agreement curve travels with the drafter it describes
        write_rows(drafter / CURVE, continue_curve(parent_curve, read_curve(cfg.run_dir / CURVE)))
    if cfg.export:
        Path(cfg.export).mkdir(parents=True, exist_ok=True)
        for item in drafter.iterdir():
            shutil.copy2(item, Path(cfg.export) / item.name)
    return FeatureTrainResult(cfg.run_dir, head, step, history, record)


def started_from(record: dict[str, Any]) -> dict[str, Any]:
    """What a warm start's record keeps of the drafter it began from (its run, data and agreement), nested so
    a chain of warm starts stays readable."""
    keep = ("command", "commit", "started", "steps", "data", "held_out_agreement", "started_from")
    return {k: record[k] for k in keep if k in record}


def run_record(cfg: FeatureTrainConfig, data: FeatureData, history: list[dict[str, Any]], began: float,
               data_seconds: float, final: dict[str, float], started: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """What the drafter folder says about how it was made (the target's fingerprint is added on save)."""
    trained = [e for e in history if "seconds" in e]
    seconds = sum(e["seconds"] for e in trained)
    where = {**started, "machine": machine.machine_record()} if started is not None else {}
    return {"recipe": cfg.to_dict(), "command": "python -m sparsedraft " + shlex.join(sys.argv[1:]),
            **where, "data": data.sizes(), "feature_scale": data.scale,
            **({"feature_scales": data.scales} if len(data.scales) > 1 else {}),
            "data_seconds": round(data_seconds, 1), "train_seconds": round(seconds, 1), "steps": cfg.steps,
            "train_tokens_per_s": round(sum(e["tokens"] for e in trained) / seconds, 1) if seconds else None,
            "loss": "L_A + lam * L_C" if cfg.lam else "L_A only (lam = 0 ablation)",
            "held_out_agreement": final, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began))}
