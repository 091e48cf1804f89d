"""How well a feature drafter agrees with its target: three measures, from cheapest to closest to decoding.

(a) :func:`window_agreement`: teacher-forced first-draft agreement on held-out
    essay windows (the head's argmax at each entry, true features in, against
    the target's greedy token), plus the agreement of unrolled draft steps
    1..J (the head fed its own predicted features, as in decoding).
(b) :func:`continuation_report` ``first_draft``: the same first-draft
    agreement on the target's own greedy continuations of held-out prompts
    at long context (:func:`greedy_continuations`: each prompt prefilled, then
    decoded greedily, every feature kept). Those are exactly the
    positions a greedy speculative decoder's first draft faces.
    It also splits that agreement by the target's own top-1 probability
    at each position (:func:`by_confidence`).
(c) :func:`continuation_report` ``gamma``: greedy speculation simulated on
    those continuations with a full cache: each round drafts gamma tokens on
    the head's own predicted features, accepts the longest prefix equal to
    the target's tokens, and the next round starts after the target's bonus
    token. Drafting rounds at every start come from one
    :func:`~.feature_loss.unroll` (its chains are decoding's rounds), so the
    figure is the speculative decoder's, without running it. ``chain``
    says where rounds stop (:func:`chain_conditionals`): how often draft j
    equals the target's token once drafts 1..j-1 all did. ``stop`` runs the
    same rounds for a drafter that ends a proposal after a draft less sure
    than each of :data:`STOP_AT` (``draft_confidence``): drafts and accepted
    drafts per round, so the rows a verification saves show beside what
    they cost in accepted tokens. ``lookup`` runs prompt lookup's rounds on
    the same text, and ``lookup_first`` those of
    :class:`~sparsedraft.speculative.lookup_first.LookupFirst` (lookup unless
    the head is sure of another token) at each of :data:`LOOKUP_OVERRIDES`.

(d) :func:`training_fit`: (a)'s first draft on the run's own training
    windows, per source (the sampled ones on their continued part only).
    Beside (a) and (b) it says whether a head learnt a rule or its text: a
    head far better on its training continuations than on held-out ones has
    memorised them.

Every measure is given for the full head and, when a draft vocabulary is
passed, for the restricted head over it. The continuation set is cached on
disk like the training teacher.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from safetensors.torch import load_file

from ..engine.data import Tokenizer, prompt_tokens
from ..engine.model import Capture, Transformer
from ..errors import require
from ..progress import bar
from ..speculative.drafters import ngram_lookup
from ..speculative.feature import FeatureHead
from ..speculative.lookup_first import asks_model, overrides
from .feature_data import (FEATURE_DATA_VERSION, Window, continue_with_teacher, digest, layers_key, save_tensors,
                           token_hash)
from .feature_loss import TokenHead, rows_at, trained_from, unroll
from .view import BudgetView, kept_prefix

if TYPE_CHECKING:
    from .feature_config import FeatureTrainConfig

GAMMAS = (2, 3, 4, 5, 6)
STOP_AT = (0.3, 0.4, 0.5, 0.6, 0.7)  # drafter confidences (draft_confidence) whose early stops (c) simulates
LOOKUP_OVERRIDES = (0.5, 0.7, 1.0)  # draft_lookup values whose rounds (c) simulates, beside prompt lookup alone
# Buckets of the target's own top-1 probability at a scored position (continuation_report's by_target_confidence)
CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


@torch.no_grad()
def window_agreement(head: FeatureHead, window: Window, ids: torch.Tensor | None, steps: int,
                     stride: int = 4, head_window: tuple[int, int] | None = None) -> dict[str, float]:
    """(a) on one window: ``first_draft`` (full head), ``first_draft_vocab`` (restricted head, when ``ids``),
    and ``step_j`` for unrolled steps 1..``steps`` at every ``stride``-th chain start (full head); the head
    sees its entries through ``head_window`` (sink, window) when given."""
    device = head.device
    tokens, greedy = window.tokens[None].to(device), window.greedy[None].to(device)
    t = tokens.shape[1]
    starts = torch.arange(0, t - 1 - steps, stride, device=device)
    outs, _, read = unroll(head, window.features[None].to(device).float(), tokens, starts, steps, window=head_window)
    full = TokenHead(head, None)
    out = {"first_draft": float((full.predict(outs[0], read[0]) == greedy[:, 1:]).float().mean())}
    if ids is not None:
        out["first_draft_vocab"] = float((TokenHead(head, ids.to(device)).predict(outs[0], read[0]) == greedy[:, 1:])
                                         .float().mean())
    for j in range(1, steps + 1):
        out[f"step_{j}"] = float((full.predict(outs[j], read[j]) == greedy[:, starts + j + 1]).float().mean())
    return out


FIT_WINDOWS = 16  # training windows per source that training_fit reads (evenly spaced)


@torch.no_grad()
def training_fit(head: FeatureHead, windows: Sequence[Window], sampled_prompt: int,
                 per_source: int = FIT_WINDOWS, window: tuple[int, int] | None = None) -> dict[str, float]:
    """(d): the share of entries whose first draft (full head, true features in, the entries it trained
    seeing: ``window``) is the target's greedy token, over up to ``per_source`` of the training ``windows`` of
    each source; a sampled window is scored from its ``sampled_prompt``-th token on, the target's own text,
    and one read behind a prefix from its prompt's on."""
    device, out = head.device, {}
    for source in dict.fromkeys(w.source for w in windows):
        mine = [w for w in windows if w.source == source]
        hits = total = 0
        for w in mine[::max(1, len(mine) // per_source)][:per_source]:
            tokens = w.tokens[None].to(device)
            positions = None if w.positions is None else w.positions.to(device)
            lookups = None if w.lookups is None or not head.lookup else w.lookups[None].to(device)
            outs, _, read = unroll(head, w.features[None].to(device).float(), tokens,
                                   torch.zeros(0, dtype=torch.long, device=device), 0, window=window,
                                   positions=positions, lookups=lookups)
            right = TokenHead(head, None).predict(outs[0], read[0])[0] == w.greedy[1:].to(device)
            if source == "behind":  # the prefix's sink and newest entries (what the window shows), then the text
                require(window is not None, "a window read behind a prefix is scored through the head's window")
                right = right[trained_from(w.positions) + window[1]:]
            if source in ("sampled", "behind"):
                right = right[sampled_prompt - 1:]
            hits, total = hits + int(right.sum()), total + right.numel()
        out[source] = hits / total
    return out


@torch.no_grad()
def budgeted_agreement(head: FeatureHead, window: Window, budgets: Sequence[int], continuation: int,
                       chunk_size: int, obs_window: int, scoring: str = "attention") -> dict[str, float]:
    """First-draft agreement on a window's last ``continuation`` entries drafted through the budget-B view of
    the head's own KV (what L_C trains; the robustness proxy), per budget, beside the full view's
    (``full``) at the same entries: the figure that tells L_A + lambda * L_C from L_A alone."""
    device = head.device
    tokens, greedy = window.tokens[None].to(device), window.greedy[None].to(device)
    features = window.features[None].to(device).float()
    t = tokens.shape[1]
    prefix = t - 1 - continuation
    require(prefix > max(budgets), f"a window of {t} tokens leaves a prefix of {prefix} entries, not more than the "
                                   f"largest budget {max(budgets)}; use a shorter continuation")
    capture = Capture(layers=set(range(head.depth)))
    lookups = head.lookups_for(tokens)
    outs, view, read = unroll(head, features, tokens, torch.zeros(0, dtype=torch.long, device=device), 0, None,
                              capture, lookups=lookups)
    tok = TokenHead(head, None)
    wanted = greedy[:, prefix + 1:]
    drafted_rows = rows_at(lookups, slice(prefix + 1, None))
    out = {"full": float((tok.predict(outs[0][:, prefix:], drafted_rows) == wanted).float().mean())}
    positions = torch.arange(prefix, t - 1, device=device)
    for budget in budgets:
        kept = kept_prefix(head, capture.queries, view.keys[0], prefix, budget, chunk_size, obs_window, scoring)
        pred = head(features[:, prefix:t - 1], tokens[:, prefix + 1:], positions,
                    BudgetView(view.keys[0], view.values[0], kept), None, drafted_rows)
        out[str(budget)] = float((tok.predict(pred, drafted_rows) == wanted).float().mean())
    return out


@dataclass
class Continuations:
    """Held-out prompts and the target's greedy continuations, with the target's feature at every token."""

    tokens: torch.Tensor  # [P, L + N] int64
    features: torch.Tensor  # [P, L + N, hidden] bf16 ([P, L + N, (k+1) hidden] with k fused lower layers)
    prompt_len: int  # L


def greedy_continuations(target: Transformer, target_id: str, tokenizer: Tokenizer, cache_dir: str | Path,
                         prompts: int = 6, context: int = 4096, new_tokens: int = 160,
                         compute: bool = True, fuse_layers: tuple[int, ...] = ()) -> Continuations:
    """``prompts`` consecutive held-out essay prompts of ``context`` tokens and ``new_tokens`` greedy tokens
    after each (cached on disk, keyed by the target and the prompts). One prompt per decode: a batched prefill
    of six 4K prompts peaked at 11.5 GB (its chunks' attention scores are per row), one at a time at a sixth."""
    rows = torch.stack([prompt_tokens(tokenizer, context, split="heldout", variant=i) for i in range(prompts)])
    key = {"version": FEATURE_DATA_VERSION, "target": target_id, "config": asdict(target.cfg),
           "dtype": str(target.dtype), "prompts": token_hash(rows),
           "new_tokens": new_tokens, "rows_per_decode": 1, **layers_key(fuse_layers)}
    path = Path(cache_dir) / f"continuations-{digest(key)}.safetensors"
    if not path.is_file():
        require(compute, f"the greedy continuations are not cached (expected {path})")
        outs = [continue_with_teacher(target, row[None], new_tokens, prompt_teacher=False, fuse_layers=fuse_layers)
                for row in bar(rows, desc="greedy continuations", unit="prompt")]
        save_tensors({"tokens": torch.cat([o["tokens"] for o in outs]),
                      "features": torch.cat([o["features"] for o in outs])}, path,
                     {"key": json.dumps(key, default=str)})
    stored = load_file(str(path))
    return Continuations(stored["tokens"], stored["features"], context)


def accepted_per_round(matches: torch.Tensor, gamma: int) -> list[int]:
    """Greedy rounds over ``matches`` [starts, >= gamma] bool (row r: the round whose drafting starts at the r-th
    entry, column j: its draft j equals the target's token): accepted drafts of each round, in order; a round
    that accepts a drafts is followed by the target's own token, so the next starts a + 1 rows later."""
    return [accepted for _, accepted in stopped_rounds(matches, gamma)]


def stopped_rounds(matches: torch.Tensor, gamma: int, sure: torch.Tensor | None = None,
                   lengths: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """(drafted, accepted) of each round of :func:`accepted_per_round`; with ``sure`` [starts, >= gamma] bool
    (draft j's own top-1 probability reached the drafter's ``confidence``), a round ends after its first draft
    that is not sure, as :func:`~sparsedraft.speculative.drafters.sure` makes a drafter stop; with ``lengths``
    [starts], a round drafts no more than the proposal at its start holds (prompt lookup's may be short or
    empty)."""
    out, row = [], 0
    while row < matches.shape[0]:
        drafted = gamma
        if sure is not None:
            unsure = (~sure[row, :gamma]).nonzero()
            drafted = int(unsure[0]) + 1 if unsure.numel() else gamma
        if lengths is not None:
            drafted = min(drafted, int(lengths[row]))
        accepted = int(matches[row, :drafted].long().cumprod(0).sum())
        out.append((drafted, accepted))
        row += accepted + 1
    return out


def chain_conditionals(matches: torch.Tensor) -> list[dict[str, Any]]:
    """Per draft j of ``matches`` [starts, J] bool (a round drafting from every start): of the rounds whose drafts
    1..j-1 all equal the target's tokens (``reached``), how many keep draft j too (``kept``) and their share
    (``rate``, None when no round got that far). The product of the rates is the chance a round keeps all J; a
    rate below the draft's own agreement means drafts fail together rather than apart."""
    prefix = matches.long().cumprod(1)
    reached = torch.cat((torch.full_like(prefix[:, :1], 1), prefix[:, :-1]), 1).sum(0)
    kept = prefix.sum(0)
    return [{"draft": j + 1, "reached": int(n), "kept": int(k), "rate": float(k) / int(n) if int(n) else None}
            for j, (n, k) in enumerate(zip(reached, kept))]


@dataclass
class Lookups:
    """Prompt lookup's proposal at each of a continuation's entries (:func:`lookup_matches`)."""

    matches: torch.Tensor  # [entries, gamma] bool: draft j equals the target's token (False past the proposal)
    lengths: torch.Tensor  # [entries] the proposal's length (0: nothing found)
    first: torch.Tensor  # [entries] its first token (-1 where it found none)
    matched: torch.Tensor  # [entries] tokens of the match it came from (0: none)

    def __getitem__(self, rows: slice) -> "Lookups":
        return Lookups(self.matches[rows], self.lengths[rows], self.first[rows], self.matched[rows])


def lookup_matches(tokens: torch.Tensor, entries: torch.Tensor, gamma: int) -> Lookups:
    """Prompt lookup at each of ``entries`` of one continuation ``tokens`` [T] (entry e: the committed text is
    ``tokens[:e + 2]``, as for the head's draft from entry e), as :class:`Lookups`."""
    matches = torch.zeros(entries.numel(), gamma, dtype=torch.bool)
    lengths, matched = torch.zeros(entries.numel(), dtype=torch.long), torch.zeros(entries.numel(), dtype=torch.long)
    first = torch.full((entries.numel(),), -1, dtype=torch.long)
    for i, e in enumerate(entries.tolist()):
        found, matched[i] = ngram_lookup(tokens[:e + 2], gamma)
        truth = tokens[e + 2:e + 2 + found.numel()]
        n = truth.numel()
        matches[i, :n], lengths[i] = found[:n] == truth, found.numel()
        if found.numel():
            first[i] = found[0]
    return Lookups(matches, lengths, first, matched)


def lookup_first_choice(head_matches: torch.Tensor, head_first: torch.Tensor, head_sure: torch.Tensor,
                        found: Lookups, override: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`~sparsedraft.speculative.lookup_first.LookupFirst`'s choice at each entry: the head's drafts
    (``head_matches``) where lookup found nothing, or where the head is asked and its first draft (``head_first``,
    its top-1 probability ``head_sure``) is another token at >= ``override``; lookup's elsewhere. Returns the chosen
    matches, the proposals' lengths (the head's: all of ``head_matches``' columns) and where lookup went."""
    taken = asks_model(found.matched, override) & overrides(head_sure, head_first, found.first, override)
    by_lookup = (found.lengths > 0) & ~taken
    matches = torch.where(by_lookup[:, None], found.matches[:, :head_matches.shape[1]], head_matches)
    lengths = torch.where(by_lookup, found.lengths, torch.full_like(found.lengths, head_matches.shape[1]))
    return matches, lengths, by_lookup


@torch.no_grad()
def continuation_report(head: FeatureHead, data: Continuations, ids: torch.Tensor | None = None,
                        gammas: Sequence[int] = GAMMAS, window: tuple[int, int] | None = None) -> dict[str, Any]:
    """(b) ``first_draft`` and (c) per gamma ``accepted_per_round`` / ``tokens_per_round`` (accepted + the
    target's own token), for the full head (and ``*_vocab`` for the restricted head over ``ids``); the same two
    for prompt lookup alone (``lookup``) and for lookup first with the head (``lookup_first``). ``window``
    (sink, window): the head sees its entries as a StreamingLLM cache of that size at true positions shows them."""
    require(len(gammas) >= 1 and min(gammas) >= 1, f"gammas must be >= 1, got {list(gammas)}")
    device, top = head.device, max(gammas)
    heads = {"": TokenHead(head, None)}
    if ids is not None:
        heads["_vocab"] = TokenHead(head, ids.to(device))
    first = {k: [] for k in heads}
    confidence = []  # the target's top-1 probability of each position first[""] scores
    chains = []  # the full head's matches of every round start, for chain_conditionals
    rounds: dict[str, dict[int, list[int]]] = {k: {g: [] for g in gammas} for k in heads}
    stops = {k: {at: {g: [] for g in gammas} for at in STOP_AT} for k in heads}  # (drafted, accepted) per round
    # Prompt lookup alone, and LookupFirst with each head at each override: first-draft hits, then rounds
    lookup: dict[str, Any] = {"first": [], "rounds": {g: [] for g in gammas}}
    mixed = {k: {c: {"first": [], "rounds": {g: [] for g in gammas}, "by_lookup": []} for c in LOOKUP_OVERRIDES}
             for k in heads}
    length = data.prompt_len
    for row in bar(range(data.tokens.shape[0]), desc="agreement", unit="prompt"):
        tokens = data.tokens[row:row + 1].to(device)
        t = tokens.shape[1]
        starts = torch.arange(length - 1, t - top - 1, device=device)  # rounds whose gamma drafts all have a token
        outs, _, read = unroll(head, data.features[row:row + 1].to(device).float(), tokens, starts, top - 1,
                               window=window)
        true = head.top(data.features[row:row + 1, length:t - 1]).to(device).float()  # the target's before them
        confidence.append(heads[""].target_logits(true).float().softmax(-1).amax(-1).flatten())
        entries = torch.arange(length - 1, t - 2)  # every first draft's entry; the chain starts lead them
        found = lookup_matches(tokens[0].cpu(), entries, top)
        lookup["first"].append(found.matches[:, 0].float())
        at_starts = found[:starts.numel()]
        for g in gammas:
            lookup["rounds"][g] += stopped_rounds(at_starts.matches, g, lengths=at_starts.lengths)
        for name, tok in heads.items():
            drafts, drafts_sure = tok.predict_sure(outs[0][:, length - 1:t - 2],  # entry e predicts token e + 2
                                                   rows_at(read[0], slice(length - 1, t - 2)))
            hits = drafts == tokens[:, length + 1:]
            first[name].append(hits.float().flatten())
            steps = [outs[0][:, starts]] + outs[1:]  # draft j of the round starting at each chain start
            step_rows = [rows_at(read[0], starts)] + read[1:]
            drafted = [tok.predict_sure(steps[j], step_rows[j]) for j in range(top)]  # (ids, top-1 prob.) per draft
            chain = torch.stack([ids[0] == tokens[0, starts + j + 2] for j, (ids, _) in enumerate(drafted)], dim=1)
            surest = torch.stack([sure[0] for _, sure in drafted], dim=1)
            for g in gammas:
                rounds[name][g] += accepted_per_round(chain, g)
                for at in STOP_AT:
                    stops[name][at][g] += stopped_rounds(chain, g, surest >= at)
            for c, seen in mixed[name].items():
                chosen, _, _ = lookup_first_choice(hits.cpu().T, drafts[0].cpu(), drafts_sure[0].cpu(), found, c)
                seen["first"].append(chosen[:, 0].float())
                chosen, lengths, by_lookup = lookup_first_choice(chain.cpu(), drafted[0][0][0].cpu(),
                                                                 drafted[0][1][0].cpu(), at_starts, c)
                for g in gammas:
                    seen["rounds"][g] += stopped_rounds(chosen, g, lengths=lengths)
                seen["by_lookup"].append(by_lookup.float())
            if not name:
                chains.append(chain)
    report: dict[str, Any] = {"positions": int(sum(x.numel() for x in first[""])), "prompt_len": length,
                              "prompts": int(data.tokens.shape[0])}
    report["target_top1_mean"] = float(torch.cat(confidence).mean())
    report["by_target_confidence"] = by_confidence(torch.cat(first[""]), torch.cat(confidence))
    report["chain"] = chain_conditionals(torch.cat(chains))
    report["lookup"] = {"first_draft": float(torch.cat(lookup["first"]).mean()),
                        "gamma": {g: drafted_and_kept(r) for g, r in lookup["rounds"].items()}}
    for name in heads:
        report[f"lookup_first{name}"] = {
            c: {"first_draft": float(torch.cat(seen["first"]).mean()),
                "lookup_starts": float(torch.cat(seen["by_lookup"]).mean()),
                "gamma": {g: drafted_and_kept(r) for g, r in seen["rounds"].items()}}
            for c, seen in mixed[name].items()}
    for name in heads:
        report[f"first_draft{name}"] = float(torch.cat(first[name]).mean())
        report[f"gamma{name}"] = {g: {"accepted_per_round": sum(r) / len(r), "tokens_per_round": 1 + sum(r) / len(r),
                                      "rounds": len(r)} for g, r in rounds[name].items()}
        report[f"stop{name}"] = {at: {g: drafted_and_kept(r) for g, r in by_gamma.items()}
                                 for at, by_gamma in stops[name].items()}
    return report


def drafted_and_kept(rounds: list[tuple[int, int]]) -> dict[str, float]:
    """Drafted and accepted drafts per round of (drafted, accepted) ``rounds``, and how many rounds."""
    return {"drafted_per_round": sum(d for d, _ in rounds) / len(rounds),
            "accepted_per_round": sum(a for _, a in rounds) / len(rounds), "rounds": len(rounds)}


def by_confidence(hits: torch.Tensor, confidence: torch.Tensor,
                  edges: Sequence[float] = CONFIDENCE_EDGES) -> list[dict[str, float]]:
    """First-draft agreement split by how sure the target itself was of its greedy token (its top-1
    probability at the position, in buckets ``[edges[i], edges[i+1])``, the last one closed): per bucket the share
    of positions and the agreement there (None where a bucket is empty). A one-layer head can hardly pick the
    target's argmax where the target barely prefers it, so this says how much of the gap is the target's own
    uncertainty rather than the head."""
    require(hits.shape == confidence.shape and hits.numel() > 0, "hits and confidence: one value per position")
    out = []
    for i, (low, high) in enumerate(zip(edges[:-1], edges[1:])):
        upper = confidence <= high if i == len(edges) - 2 else confidence < high
        inside = (confidence >= low) & upper
        n = int(inside.sum())
        out.append({"from": float(low), "to": float(high), "share": n / confidence.numel(),
                    "first_draft": float(hits[inside].float().mean()) if n else None})
    return out


@torch.no_grad()
def slice_first_draft(drafter: Transformer, data: Continuations) -> float:
    """(b) for a standalone drafter (BudgetDraft's slice): its teacher-forced argmax after each continuation
    token vs the target's next token, at the positions :func:`continuation_report` scores."""
    hits = []
    for row in range(data.tokens.shape[0]):
        tokens = data.tokens[row:row + 1].to(drafter.device)
        logits = drafter(tokens[:, :-1])[:, data.prompt_len:]  # after x_L .. x_{T-2}
        hits.append((logits.argmax(-1) == tokens[:, data.prompt_len + 1:]).float().flatten())
    return float(torch.cat(hits).mean())


def agreement_report(head: FeatureHead, target_id: str, tokenizer: Tokenizer, cache_dir: str | Path,
                     prompts: int, context: int, new_tokens: int, draft_vocab: int = 0,
                     slice_run: str | Path = "", compute: bool = True,
                     window: tuple[int, int] | None = None) -> dict[str, Any]:
    """(b) and (c) of ``head`` on ``prompts`` greedy continuations of ``new_tokens`` after held-out prompts of
    ``context`` tokens (cached in ``cache_dir``), full head and, with ``draft_vocab``, the restricted one; with
    ``slice_run``, (b) for the slice drafter there too (the report says so when that folder holds none). What a
    training run's end-of-run check and ``bench.agreement`` both measure, so the two figures compare. ``window``
    (sink, window): the head's view of its own entries, as :func:`continuation_report` takes it."""
    from ..speculative.loading import has_checkpoint, load_drafter
    from ..speculative.vocab import frequent_tokens
    target = head.target
    data = greedy_continuations(target, target_id, tokenizer, cache_dir, prompts, context, new_tokens, compute,
                                head.fuse_layers)
    ids = frequent_tokens(tokenizer, draft_vocab, target.cfg.vocab_size) if draft_vocab else None
    report = continuation_report(head, data, ids, window=window)
    if slice_run and has_checkpoint(Path(slice_run)):
        drafter = load_drafter(slice_run, dtype=target.dtype, device=target.device)
        report["slice_first_draft"] = {"run": str(slice_run), "first_draft": slice_first_draft(drafter, data)}
    elif slice_run:
        report["slice_first_draft"] = f"no slice drafter in {slice_run}: not measured"
    return report


def final_report(cfg: "FeatureTrainConfig", slice_run: str | Path = "outputs/budgetdraft/default"
                 ) -> Callable[[FeatureHead], dict[str, Any]]:
    """The end-of-run check of ``cfg`` as a function of the trained head: :func:`agreement_report` on
    ``cfg.final_prompts`` greedy continuations at ``cfg.final_context``, with the slice drafter in ``slice_run``,
    the head seeing its entries through the window it trained with (``cfg.head_window``), if any."""
    def evaluate(head: FeatureHead) -> dict[str, Any]:
        from ..engine.data import model_tokenizer
        return agreement_report(head, cfg.verifier, model_tokenizer(cfg.verifier), cfg.teacher_dir,
                                cfg.final_prompts, cfg.final_context, cfg.final_tokens, cfg.draft_vocab, slice_run,
                                cfg.teacher, cfg.window)
    return evaluate


def agreement_summary(record: dict[str, Any]) -> dict[str, Any]:
    """The agreement figures a training run wrote into its drafter's record, flat: (a) ``first_draft_held_out``,
    (b) ``first_draft_continuations``, (c) at the gamma that keeps the most tokens per round ``best_gamma`` and
    ``kept_per_round``, and the slice drafter's (b) where the run measured one (else None); with the run's
    steps, training tokens, date and commit, and for a warm-started drafter the runs behind it (``runs``: the
    records nested under ``started_from`` and its own, a resumed run counting once; the steps of all of them; the
    run folder it started from), so a table of drafters names where each figure came from."""
    measured, held = record.get("measured", {}), record.get("held_out_agreement", {})
    gammas = measured.get("gamma", {})
    best = max(gammas, key=lambda g: gammas[g]["tokens_per_round"]) if gammas else None
    slice_seen = measured.get("slice_first_draft")
    chain = [record]
    while isinstance(chain[-1].get("started_from"), dict):
        chain.append(chain[-1]["started_from"])
    parent = re.search(r"--out-dir[= ](\S+)", chain[1].get("command", "")) if len(chain) > 1 else None
    return {"steps": record.get("steps"), "train_tokens": record.get("data", {}).get("train_tokens"),
            "runs": len(chain), "steps_all_runs": sum(run.get("steps") or 0 for run in chain),
            "started_from": parent.group(1) if parent else "", "first_draft_held_out": held.get("first_draft"),
            "first_draft_continuations": measured.get("first_draft"), "best_gamma": int(best) if best else None,
            "kept_per_round": gammas[best]["accepted_per_round"] if best else None,
            "slice_first_draft_continuations": slice_seen.get("first_draft") if isinstance(slice_seen, dict) else None,
            "date": record.get("date"), "commit": str(record.get("commit") or "")[:7]}
