"""What a long context does to the feature head, with the text held fixed.

Why: behind 4K held-out prompts the head's first draft fell 12 points below its figure behind 256-token ones,
while prompt lookup, reading the same kinds of continuation, did not move (docs/feature-drafter.md). Two
prompt lengths also mean two sets of texts. Here each continuation (its prompt and the target's greedy tokens)
is read twice by the target: alone, and behind ``N`` tokens of other text. The head drafts on the same
positions of the same tokens both times, each against the target's own next-token argmax in that reading
(the prefix changes a few of them). So whatever differs is the context: the head's attention over more
entries (``window`` limits it, as a streaming cache would) and the target's features behind a long prompt.
``bench.agreement --behind N`` reports it.

The same reading makes training windows (``train-drafter --behind N --behind-sequences K --head-window SINK
WINDOW``): a head trained on windows of at most 1K-2K tokens copies worse behind a long prompt, and reading a
whole long prefix through the head at every step would cost ~5x a step. A head that drafts through a
StreamingLLM cache at true positions never sees more than its sink and window of that prefix, so a window
keeps only those entries (:func:`behind_teacher`), and :class:`~.feature_loss.UnrollView` runs them at their
true positions: the target's features behind the long prefix, at the cost of a short window.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load_file

from ..engine.cache import StaticCache
from ..engine.data import Tokenizer, prompt_tokens
from ..engine.model import Transformer
from ..errors import require
from ..progress import bar
from ..speculative.feature import FeatureHead
from ..speculative.lookup_input import lookup_table
from .feature_data import FEATURE_DATA_VERSION, Window, digest, layers_key, save_tensors, teacher_of, token_hash
from .feature_eval import Continuations
from .feature_loss import TokenHead, rows_at, unroll


@torch.no_grad()
def first_draft_behind(head: FeatureHead, data: Continuations, prefixes: torch.Tensor,
                       window: tuple[int, int] | None = None) -> dict[str, Any]:
    """First-draft agreement on every continued position of ``data``, read alone and behind ``prefixes``
    [P, N] (row r before continuation r), each against the target's argmax in that reading; and the share of
    those positions where the prefix left the target's argmax as it was. One target forward per reading
    (:func:`~.feature_data.teacher_of`)."""
    rows = data.tokens.shape[0]
    require(prefixes.dim() == 2 and prefixes.shape[0] == rows and prefixes.shape[1] >= 1,
            f"one prefix of >= 1 tokens per continuation: [{rows}, N], got {list(prefixes.shape)}")
    device, tok = head.device, TokenHead(head, None)
    hits: dict[str, list[torch.Tensor]] = {"alone": [], "behind": []}
    unchanged = []
    for row in bar(range(rows), desc="alone and behind a prefix", unit="prompt"):
        text = data.tokens[row]
        argmax = {}
        for name, seq in (("alone", text), ("behind", torch.cat((prefixes[row], text)))):
            teacher = teacher_of(head.target, seq, head.fuse_layers)
            start = seq.numel() - text.numel() + data.prompt_len  # position of the first continued token
            outs, _, read = unroll(head, teacher["features"][None].to(device).float(), seq[None].to(device),
                                   torch.zeros(0, dtype=torch.long, device=device), 0, window=window)
            drafted = slice(start - 1, seq.numel() - 2)  # entry e drafts token e + 2
            drafts = tok.predict(outs[0][:, drafted], rows_at(read[0], drafted))[0].cpu()
            argmax[name] = teacher["greedy"][start:-1]  # the target's token at start + 1 .. end
            hits[name].append((drafts == argmax[name]).float())
        unchanged.append((argmax["alone"] == argmax["behind"]).float())
    return {"prefix": int(prefixes.shape[1]), "positions": int(sum(h.numel() for h in hits["alone"])),
            "first_draft_alone": float(torch.cat(hits["alone"]).mean()),
            "first_draft_behind": float(torch.cat(hits["behind"]).mean()),
            "target_argmax_unchanged": float(torch.cat(unchanged).mean())}


CHECK_PREFIXES = 16  # train-split windows 0..15: what bench.agreement --behind reads behind held-out text
BEHIND_PREFIXES = 8  # distinct prefixes that training windows are read behind (each computed once), after those


def prefix_windows(tokenizer: Tokenizer, n: int, count: int, first: int = 0) -> torch.Tensor:
    """[count, n]: consecutive train-split windows of ``n`` tokens from window ``first`` on, to read text behind."""
    return torch.stack([prompt_tokens(tokenizer, n, split="train", variant=first + i) for i in range(count)])


def training_prefixes(tokenizer: Tokenizer, n: int) -> torch.Tensor:
    """[BEHIND_PREFIXES, n] train-split text that training continuations are read behind: the windows after
    the ones ``bench.agreement --behind`` reads, so that check stays clean."""
    return prefix_windows(tokenizer, n, BEHIND_PREFIXES, first=CHECK_PREFIXES)


def behind_teacher(target: Transformer, target_id: str, texts: list[Window], prefixes: torch.Tensor, sink: int,
                   window: int, cache_dir: str | Path, compute: bool = True, progress: bool = False,
                   fuse_layers: tuple[int, ...] = (), lookups: bool = False) -> list[Window]:
    """Each of ``texts`` read behind prefix ``i % len(prefixes)``, kept as a head whose StreamingLLM cache holds
    ``sink`` + ``window`` entries sees it: the prefix's first ``sink + 1`` tokens (the last only to be entry
    ``sink - 1``'s next token: no query sees its entry), its ``window`` newest, then the text, at their true
    positions, with the target's teacher in that reading. One forward over each prefix, kept in a cache
    that each text then extends and rolls back: a text costs one forward of its own length. Cached on disk, one
    file per window, so a run over more texts reuses a shorter run's. ``lookups``: each window also carries
    prompt lookup's rows over its whole reading (prefix and text) at the kept positions, for a lookup head."""
    rows, n = len(prefixes), prefixes.shape[1]
    require(n > sink + window, f"a prefix of {n} tokens leaves no gap before a sink of {sink} and a window of "
                               f"{window}; read behind more than {sink + window} tokens")
    keys = [{"version": FEATURE_DATA_VERSION, "target": target_id, "config": asdict(target.cfg),
             "dtype": str(target.dtype), "prefix": token_hash(prefixes[i % rows]), "text": token_hash(w.tokens),
             "sink": sink, "window": window, **layers_key(fuse_layers)} for i, w in enumerate(texts)]
    paths = [Path(cache_dir) / f"behind-{digest(key)}.safetensors" for key in keys]
    missing = [i for i, path in enumerate(paths) if not path.is_file()]
    require(compute or not missing, f"the teacher of {len(missing)} of {len(texts)} continuations read behind a "
                                    f"prefix is not cached (first expected: {paths[missing[0]] if missing else ''}); "
                                    "run once without --no-teacher")
    done = bar(total=len(missing), desc="behind a prefix", unit="win", show=progress)
    for p in range(rows):
        mine = [i for i in missing if i % rows == p]
        if mine:
            for i, read in zip(mine, _read_behind(target, prefixes[p], [texts[i].tokens for i in mine], sink, window,
                                                  fuse_layers)):
                save_tensors(read, paths[i], {"key": json.dumps(keys[i], sort_keys=True, default=str)})
                done.update(1)
    done.close()
    stored = [load_file(str(path)) for path in paths]

    def read_lookups(i: int, w: dict[str, torch.Tensor]) -> torch.Tensor | None:
        return lookup_table(torch.cat((prefixes[i % rows], texts[i].tokens))[None])[0][w["positions"]] \
            if lookups else None
    return [Window(w["tokens"], w["features"], w["greedy"], w["top_ids"], w["top_probs"], "behind", w["positions"],
                   read_lookups(i, w)) for i, w in enumerate(stored)]


@torch.inference_mode()
def _read_behind(target: Transformer, prefix: torch.Tensor, texts: list[torch.Tensor], sink: int, window: int,
                 fuse_layers: tuple[int, ...]) -> Iterator[dict[str, torch.Tensor]]:
    """The window of each of ``texts`` read behind ``prefix`` (see :func:`behind_teacher`), one at a time."""
    n = prefix.numel()
    cache = StaticCache(target.cfg, n + max(t.numel() for t in texts), 1, target.dtype, target.device)

    def read(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"tokens": tokens.to(torch.int64), **teacher_of(target, tokens, fuse_layers, cache)}

    kept = torch.cat((torch.arange(sink + 1), torch.arange(n - window, n)))
    head = {k: v[kept] for k, v in read(prefix).items()}
    for text in texts:
        cache.rollback(cache.length - n)
        yield {**{k: torch.cat((head[k], v)) for k, v in read(text).items()},
               "positions": torch.cat((kept, n + torch.arange(text.numel())))}
