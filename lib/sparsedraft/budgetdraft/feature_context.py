"""What a long context does to the feature head, with the text held fixed.

Why: behind 4K held-out prompts the head's first draft fell 12 points below its figure behind 256-token ones,
while prompt lookup, reading the same kinds of continuation, did not move (docs/feature-drafter.md). Two
prompt lengths also mean two sets of texts. Here each continuation (its prompt and the target's greedy tokens)
is read twice by the target: alone, and behind ``N`` tokens of other text. The head drafts on the same
positions of the same tokens both times, each against the target's own next-token argmax in that reading
(the prefix changes a few of them). So whatever differs is the context: the head's attention over more
entries (``window`` limits it, as a streaming cache would) and the target's features behind a long prompt.
``bench.agreement --behind N`` reports it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import require
from ..speculative.feature import FeatureHead
from .feature_data import teacher_of
from .feature_eval import Continuations
from .feature_loss import TokenHead, unroll


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
    for row in range(rows):
        text = data.tokens[row]
        argmax = {}
        for name, seq in (("alone", text), ("behind", torch.cat((prefixes[row], text)))):
            teacher = teacher_of(head.target, seq, head.fuse_layers)
            start = seq.numel() - text.numel() + data.prompt_len  # position of the first continued token
            outs, _ = unroll(head, teacher["features"][None].to(device).float(), seq[None].to(device),
                             torch.zeros(0, dtype=torch.long, device=device), 0, window=window)
            drafts = tok.predict(outs[0][:, start - 1:seq.numel() - 2])[0].cpu()  # entry e drafts token e + 2
            argmax[name] = teacher["greedy"][start:-1]  # the target's token at start + 1 .. end
            hits[name].append((drafts == argmax[name]).float())
        unchanged.append((argmax["alone"] == argmax["behind"]).float())
    return {"prefix": int(prefixes.shape[1]), "positions": int(sum(h.numel() for h in hits["alone"])),
            "first_draft_alone": float(torch.cat(hits["alone"]).mean()),
            "first_draft_behind": float(torch.cat(hits["behind"]).mean()),
            "target_argmax_unchanged": float(torch.cat(unchanged).mean())}
