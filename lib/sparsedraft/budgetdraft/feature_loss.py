"""The feature drafter's objective: EAGLE's loss, an unrolled training-time test, and BudgetDraft's L_C.

Entry ``t`` of a window is ``(f_t, x_{t+1})``; the head predicts ``f_{t+1}``
and, through the target's norm and head, the verifier's greedy token after
``x_{t+1}``. Per predicted entry the loss is EAGLE's pair: a smooth-L1
regression on the next feature, in units of the features' RMS (so it means
the same on any target), plus cross-entropy against the verifier's greedy
token (the token greedy verification accepts), optionally over a restricted
draft vocabulary (tokens outside it are left out of the CE).

**Training-time test, faithful to inference.** At draft step ``j`` of a round
that starts at entry ``s`` (the newest entry with a true feature), the head's
cache holds true-feature entries ``0..s`` and its own entries ``s+1..s+j``,
whose features are its previous predictions. :class:`UnrollView` is a cache
that gives the head exactly that: step 0 runs every entry causally over true
(noised) features, as teacher forcing does; step ``j >= 1`` runs one entry
per sampled chain start ``s`` (at position ``s + j``, fed the step ``j - 1``
prediction of that chain) and lets it attend to the step-0 keys at positions
``<= s`` plus the keys of steps ``1..j`` of its own chain, all in one
softmax. Only the sampled chains run past step 0, so the unroll costs
``chains / T`` of a full forward per step; gradients flow through the chain.
The test ``tests/test_feature_train.py`` checks step ``j`` against the head
drafting over a :class:`~sparsedraft.engine.cache.StaticCache`.

**Budget variant.** L_C drafts the window's last ``continuation`` entries
(step 0, true features) through BudgetDraft's :class:`~.view.BudgetView`
over the head's own step-0 keys, with the chunks a budget-B cache keeps, so
the head learns to predict under any budget it may be deployed with;
``lam = 0`` is the L_A-only ablation and skips the branch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from ..engine.cache import CAUSAL, KVCache
from ..engine.model import Capture, project
from ..errors import require
from ..speculative.feature import FeatureHead
from ..speculative.vocab import SubsetHead
from .view import BudgetView, kept_prefix


class UnrollView(KVCache):
    """The head's context at every draft step of many rounds at once (see the module docstring).

    ``starts`` [n]: chain starts (entry positions). Forward 0 takes every entry of the window at positions
    ``0..T-1``; forward ``j`` takes one entry per chain at ``starts + j``. Keys/values of every forward are
    kept per layer (``keys[step][layer]`` [B, kv_heads, T or n, head_dim]), graph included.

    ``window`` (with ``sink``): each entry sees only the entries at the first ``sink`` positions and those
    within ``window`` positions up to its own, as the head's StreamingLLM cache at true positions
    (``StreamingCache(positions="true")``) shows them at inference, draft steps included (while a chain's
    steps fit the window).

    ``positions`` [T] (ascending; default ``0..T-1``): the entries' true positions. A window read behind a
    long prefix keeps only what such a cache would show of it (:func:`~.feature_context.behind_teacher`): the
    sink's entries, then a gap, then the newest ones, so forward 0 takes ``positions`` and chain step ``j``
    the position ``positions[starts] + j``.
    """

    def __init__(self, starts: torch.Tensor, sink: int = 0, window: int | None = None,
                 positions: torch.Tensor | None = None):
        if window is not None:
            check_window((sink, window), "an UnrollView")
        self.starts, self.sink, self.window, self.positions = starts, sink, window, positions
        self.keys: list[dict[int, torch.Tensor]] = []
        self.values: list[dict[int, torch.Tensor]] = []
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._mask = None
        self._width = 0  # entries of forward 0

    @property
    def step(self) -> int:
        return len(self.keys)

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        j = self.step
        device = positions.device
        if j == 0:
            t = positions.shape[-1]
            if self.positions is None:
                self.positions = torch.arange(t, device=device)
            require(self.positions.shape == (t,) and bool((positions == self.positions).all()),
                    "an UnrollView's first forward takes the window's entries at their positions (0..T-1 unless "
                    "given)")
            self._width = t  # ascending positions: causal by entry is causal by position
            self._mask = CAUSAL if self.window is None else self._seen(self.positions, self.positions)[None, None]
        else:
            n = self.starts.numel()
            at = self.positions[self.starts] + j
            require(positions.shape[-1] == n and bool((positions == at).all()),
                    f"forward {j} of an UnrollView takes one entry per chain, at positions[starts] + {j}")
            entries = torch.arange(self._width, device=device)
            past = self._seen(at, self.positions) & (entries[None] <= self.starts[:, None])  # [n, T]
            own = torch.eye(n, dtype=torch.bool, device=device).repeat(1, j)  # its chain's steps 1..j
            self._mask = torch.cat((past, own), dim=1)[None, None]
        self._k, self._v = {}, {}
        return positions

    def _seen(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """bool [len(queries), len(keys)]: which entries (by position) each query entry attends to (see the
        class)."""
        seen = keys[None] <= queries[:, None]
        if self.window is not None:
            seen &= (keys[None] > queries[:, None] - self.window) | (keys[None] < self.sink)
        return seen

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self._k[layer], self._v[layer] = k, v
        if self.step == 0:  # contiguous: a short window without autograd takes the C++ causal kernel
            return k.contiguous(), v.contiguous(), self._mask
        keys = torch.cat([s[layer] for s in self.keys] + [k], dim=2)
        values = torch.cat([s[layer] for s in self.values] + [v], dim=2)
        return keys, values, self._mask.expand(k.shape[0], -1, -1, -1)

    def end(self) -> None:
        self.keys.append(self._k)
        self.values.append(self._v)
        self._mask = None

    def rollback(self, n: int) -> None:
        require(n == 0, "an UnrollView keeps no state to roll back")

    def reset(self) -> None:
        self.keys, self.values, self._mask = [], [], None


def check_window(window: Sequence[int] | None, name: str) -> tuple[int, int] | None:
    """A head window (SINK, WINDOW) as a tuple, None for none (or empty); ``name`` says who was given it in the
    one error a bad one gets."""
    if window is None or len(window) == 0:
        return None
    require(len(window) == 2 and window[0] >= 0 and window[1] >= 1,
            f"{name} takes SINK >= 0 and WINDOW >= 1 entries, got {list(window)}")
    return int(window[0]), int(window[1])


def trained_from(positions: torch.Tensor | None) -> int:
    """The first entry of a window's last run of consecutive positions (0 for an unbroken window): entries
    before it (a sink read behind a prefix) stand only as keys, as their next token is not the entry after."""
    if positions is None:
        return 0
    breaks = (positions[1:] != positions[:-1] + 1).nonzero()
    return int(breaks.max()) + 1 if breaks.numel() else 0


def unroll(head: FeatureHead, features: torch.Tensor, tokens: torch.Tensor, starts: torch.Tensor, steps: int,
           noise: torch.Tensor | None = None, capture: Capture | None = None,
           window: tuple[int, int] | None = None, positions: torch.Tensor | None = None,
           lookups: torch.Tensor | None = None
           ) -> tuple[list[torch.Tensor], UnrollView, list[torch.Tensor | None]]:
    """Predicted features of forward 0 ([B, T-1, H], entries 0..T-2) and of draft steps 1..``steps`` ([B, n, H],
    entries ``starts + j``), for ``features`` [B, T, H] and ``tokens`` [B, T] at ``positions`` [T] (default
    0..T-1); ``noise`` is added to forward 0's input features; ``window`` (sink, window) limits what each entry
    sees (:class:`UnrollView`). Needs ``starts + steps <= T - 2``, and chains after any gap in ``positions``.
    A lookup head reads ``lookups`` [B, T, 2], indexed as the tokens (default: ``head.lookups_for(tokens)``,
    for a window without a gap: prompt lookup reads every earlier token). Third: the lookup rows each output's
    entries read, in the outputs' shape ([B, T-1, 2], then [B, n, 2]; None without lookup), which a gated
    head's logits read too (``TokenHead.logits(pred, rows)``)."""
    t = tokens.shape[1]
    last = int(starts.max()) if starts.numel() else -1
    require(last + steps <= t - 2, f"a chain starting at {last} needs {steps} steps inside a window of {t} tokens")
    first = int(starts.min()) if starts.numel() else t
    require(first >= trained_from(positions), f"a chain starts at entry {first}, before the window's last run of "
                                              f"consecutive positions (entry {trained_from(positions)})")
    if head.lookup and lookups is None:
        require(trained_from(positions) == 0, "a head that reads prompt lookup's proposals needs every earlier "
                                              "token of a window; one read behind a prefix keeps only some, so "
                                              "pass its lookups (Window.lookups, from behind_teacher)")
        lookups = head.lookups_for(tokens)
    entry_positions = None if positions is None else positions[:-1]
    view = UnrollView(starts, *(window or (0, None)), positions=entry_positions)
    inputs = features[:, :-1] if noise is None else features[:, :-1] + noise
    at = torch.arange(t - 1, device=tokens.device) if positions is None else entry_positions

    def rows(index):  # the lookup rows of the entries whose tokens are tokens[:, index]
        return None if lookups is None else lookups[:, index]

    read = [rows(slice(1, None))]
    outs = [head(inputs, tokens[:, 1:], at, view, capture, read[0])]
    previous = outs[0][:, starts]
    for j in range(1, steps + 1):
        read.append(rows(starts + j + 1))
        previous = head(previous, tokens[:, starts + j + 1], at[starts] + j, view, None, read[j])
        outs.append(previous)
    return outs, view, read


def rows_at(rows: torch.Tensor | None, index) -> torch.Tensor | None:
    """``rows[:, index]`` of :func:`unroll`'s lookup rows, kept beside the outputs they are cut with."""
    return None if rows is None else rows[:, index]


class TokenHead:
    """Logits over the draft vocabulary (``ids``, or all tokens) and the targets mapped into it."""

    def __init__(self, head: FeatureHead, ids: torch.Tensor | None):
        self.head = head
        target = head.target
        self.proj = None if ids is None else SubsetHead(target.lm_head.weight, ids, target.cfg.vocab_size).proj
        self.ids = ids
        if ids is not None:
            self.index = torch.full((target.cfg.vocab_size,), -100, dtype=torch.long, device=ids.device)
            self.index[ids] = torch.arange(ids.numel(), device=ids.device)

    def logits(self, features: torch.Tensor, lookups: torch.Tensor | None = None) -> torch.Tensor:
        """The head's draft logits at its predicted ``features``; ``lookups``: the rows the predicting entries
        read (a gated head's bias needs them)."""
        return self.head.gate(self.target_logits(features), lookups, None if self.ids is None else self.index)

    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's own norm and head over ``features`` (no gate: the target's features, or a draft's
        before its gate)."""
        normed = self.head.target.norm(features)
        return project(self.head.target.lm_head if self.proj is None else self.proj, normed)

    def targets(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens if self.ids is None else self.index[tokens]

    def predict(self, features: torch.Tensor, lookups: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (in the full vocabulary) of the argmax."""
        return self._ids_of(self.logits(features, lookups).argmax(-1))

    def predict_sure(self, features: torch.Tensor, lookups: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`predict` and the argmax's softmax probability (what a drafter's ``draft_confidence`` reads)."""
        sure, best = self.logits(features, lookups).float().softmax(-1).max(-1)
        return self._ids_of(best), sure

    def _ids_of(self, best: torch.Tensor) -> torch.Tensor:
        return best if self.ids is None else self.ids[best]


@dataclass
class Draws:
    """What one step samples, from a generator seeded by (seed, step) so a resumed run repeats it."""

    noise: torch.Tensor | None  # [1, T-1, H] added to forward 0's input features
    ce_positions: torch.Tensor  # [m] entries of forward 0 that get the token loss
    starts: torch.Tensor  # [n] chain starts of the training-time test
    budget: int | None  # of L_C; None: no L_C this step (lam 0, or a window too short for every budget)


@dataclass
class FeatureLossParts:
    total: torch.Tensor  # differentiable
    parts: dict[str, float] = field(default_factory=dict)  # feat_j / token_j per step, loss_a, loss_c


def feature_l1(pred: torch.Tensor, target: torch.Tensor, scale: float) -> torch.Tensor:
    """Smooth-L1 between predicted and true features [B, n, H], in units of the features' RMS."""
    return F.smooth_l1_loss(pred.float() / scale, target.float() / scale)


def token_ce(tokens: TokenHead, pred: torch.Tensor, greedy: torch.Tensor,
             soft: tuple[torch.Tensor, torch.Tensor] | None = None, lookups: torch.Tensor | None = None
             ) -> torch.Tensor:
    """Cross-entropy of the draft's logits at ``pred`` [B, n, H] against the verifier's greedy tokens [B, n], or,
    with ``soft`` = (top ids, top probabilities) [B, n, K], against the verifier's top-K distribution (renormalised
    over the ids inside the draft vocabulary: a distillation target that also says how sure the verifier was);
    ``lookups``: the rows the predicting entries read (a gated head)."""
    logits = tokens.logits(pred, lookups).float()
    if soft is None:
        ce = F.cross_entropy(logits.flatten(0, 1), tokens.targets(greedy).flatten(), ignore_index=-100)
        return torch.nan_to_num(ce)  # every target outside the draft vocabulary: nothing to learn here
    index = tokens.targets(soft[0])
    weight = soft[1].float().nan_to_num(0.0) * (index >= 0)
    mass = weight.sum(-1, keepdim=True)
    rows = mass[..., 0] > 0  # positions with some verifier mass inside the draft vocabulary
    if not bool(rows.any()):
        return logits.sum() * 0.0
    picked = logits.log_softmax(-1).gather(-1, index.clamp_min(0))
    return -((weight / mass.clamp_min(1e-12)) * picked).sum(-1)[rows].mean()


def entry_loss(tokens: TokenHead, pred: torch.Tensor, target_features: torch.Tensor, greedy: torch.Tensor,
               scale: float, feature_weight: float, token_weight: float,
               soft: tuple[torch.Tensor, torch.Tensor] | None = None, lookups: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, float, float]:
    """EAGLE's per-entry pair: (weighted sum, regression, CE)."""
    feat, ce = feature_l1(pred, target_features, scale), token_ce(tokens, pred, greedy, soft, lookups)
    return feature_weight * feat + token_weight * ce, feat.item(), ce.item()


def feature_loss(head: FeatureHead, tokens: TokenHead, window_tokens: torch.Tensor, features: torch.Tensor,
                 greedy: torch.Tensor, draws: Draws, *, scale: float, feature_weight: float, token_weight: float,
                 step_decay: float, unroll_steps: int, lam: float, continuation: int, chunk_size: int,
                 obs_window: int, scoring: str,
                 soft: tuple[torch.Tensor, torch.Tensor] | None = None, window: tuple[int, int] | None = None,
                 positions: torch.Tensor | None = None, lookups: torch.Tensor | None = None) -> FeatureLossParts:
    """L_A (+ lam * L_C) of one window: tokens/greedy [1, T], features [1, T, H] (float; [1, T, (k+1) H] for a
    head that fuses k lower layers, whose top block is the regression's aim); ``soft`` = the
    verifier's (top ids, top probabilities) [1, T, K] turns every token loss into one against that distribution.
    ``window`` (sink, window): the head sees its entries as its StreamingLLM cache would; ``positions`` [T]: a
    window read behind a prefix (:class:`UnrollView`), whose entries before :func:`trained_from` get no loss, and
    ``lookups`` [1, T, 2] a lookup head's rows over its whole reading (:func:`unroll`)."""

    def at(index) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if soft is None else (soft[0][:, index], soft[1][:, index])

    sparse = bool(lam) and draws.budget is not None
    capture = Capture(layers=set(range(head.depth))) if sparse else None
    lookups = (head.lookups_for(window_tokens) if lookups is None else lookups) if head.lookup else None
    outs, view, read = unroll(head, features, window_tokens, draws.starts, unroll_steps, draws.noise, capture,
                              window, positions, lookups)
    parts: dict[str, float] = {}
    pred0 = outs[0]
    top = head.top(features)  # what the head predicts (a fusing head reads lower layers' features too)
    first = trained_from(positions)
    feat0 = feature_l1(pred0[:, first:], top[:, first + 1:], scale)  # every entry: the regression needs no head
    ce0 = token_ce(tokens, pred0[:, draws.ce_positions], greedy[:, draws.ce_positions + 1], at(draws.ce_positions + 1),
                   rows_at(read[0], draws.ce_positions))
    loss_a = feature_weight * feat0 + token_weight * ce0
    parts["feat_0"], parts["token_0"] = feat0.item(), ce0.item()
    weights = 1.0
    for j in range(1, unroll_steps + 1):
        weights += step_decay ** j
        aim = draws.starts + j + 1  # what entry starts + j predicts
        term, parts[f"feat_{j}"], parts[f"token_{j}"] = entry_loss(tokens, outs[j], top[:, aim], greedy[:, aim],
                                                                   scale, feature_weight, token_weight, at(aim),
                                                                   read[j])
        loss_a = loss_a + step_decay ** j * term
    loss_a = loss_a / weights
    parts["loss_a"] = loss_a.item()
    if not sparse:
        return FeatureLossParts(loss_a, parts)
    t = window_tokens.shape[1]
    prefix = t - 1 - continuation  # entries before the drafted ones: the prompt whose chunks are selected
    require(prefix > first, f"L_C drafts the last {continuation} entries, which must lie after the window's gap "
                            f"(entry {first})")
    kept = kept_prefix(head, capture.queries, view.keys[0], prefix, draws.budget, chunk_size, obs_window, scoring)
    inputs = features[:, prefix:t - 1] + (0 if draws.noise is None else draws.noise[:, prefix:])
    drafted = torch.arange(prefix, t - 1, device=inputs.device) if positions is None else positions[prefix:t - 1]
    drafted_rows = rows_at(lookups, slice(prefix + 1, None))
    pred = head(inputs, window_tokens[:, prefix + 1:], drafted, BudgetView(view.keys[0], view.values[0], kept),
                None, drafted_rows)
    loss_c, parts["feat_c"], parts["token_c"] = entry_loss(tokens, pred, top[:, prefix + 1:],
                                                           greedy[:, prefix + 1:], scale, feature_weight,
                                                           token_weight, at(slice(prefix + 1, None)), drafted_rows)
    parts["loss_c"] = loss_c.item()
    return FeatureLossParts(loss_a + lam * loss_c, parts)
