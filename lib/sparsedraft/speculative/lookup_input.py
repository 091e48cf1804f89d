"""Prompt lookup's proposal at every position, as an input a feature head can learn to weigh.

Why: on the target's own greedy text the context often already holds the next
tokens, and prompt lookup (:func:`~.drafters.ngram_lookup`) copies them where
the one-layer head, rebuilding them from the target's features, mostly does
not. :class:`~.lookup_first.LookupFirst` chooses between the two by a fixed
rule; a head built with ``lookup=True`` reads lookup's proposal beside the
feature and the token instead, and learns when to copy it
(docs/feature-drafter.md, "A learnt lookup").

Entry ``p`` of a table is what prompt lookup would propose for token ``p + 1``
from tokens ``0..p``: the token after the newest earlier occurrence of the last
n tokens (n from :data:`MAX_NGRAM` down to 1), and that n (0 and token 0 when
nothing matches). It depends on tokens ``0..p`` alone, so a drafter keeps it
incrementally as its history grows and shrinks (:class:`LookupTable`), and
training computes it for a whole window at once (:func:`lookup_table`): both
give the same rows.
"""

from __future__ import annotations

import torch

from ..errors import require

MAX_NGRAM = 3  # the longest match prompt lookup looks for (NgramDrafter, LookupFirst and a lookup head)


class LookupTable:
    """Prompt lookup's proposal at each position of a growing and shrinking token history."""

    def __init__(self, max_ngram: int = MAX_NGRAM):
        require(max_ngram >= 1, f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.rows: list[tuple[int, int]] = []  # (proposed token, n) per position
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the positions it ends at, ascending

    def __len__(self) -> int:
        return len(self.tokens)

    def _grams(self, p: int):
        for n in range(min(self.max_ngram, p + 1), 0, -1):
            yield tuple(self.tokens[p - n + 1:p + 1])

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            p = len(self.tokens) - 1
            row = (0, 0)
            for gram in self._grams(p):  # longest first; every stored end is < p, so its successor is known
                ends = self.ends.get(gram)
                if ends:
                    row = (self.tokens[ends[-1] + 1], len(gram))
                    break
            self.rows.append(row)
            for gram in self._grams(p):
                self.ends.setdefault(gram, []).append(p)

    def truncate(self, length: int) -> None:
        """Forget positions ``length`` on (tokens rewound)."""
        require(0 <= length <= len(self.tokens), f"cannot truncate {len(self.tokens)} tokens to {length}")
        for p in range(len(self.tokens) - 1, length - 1, -1):
            for gram in self._grams(p):
                ends = self.ends[gram]
                ends.pop()
                if not ends:
                    del self.ends[gram]
            self.tokens.pop()
            self.rows.pop()

    def table(self, start: int, stop: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows ``start..stop-1`` as a long tensor [stop - start, 2] (token, n)."""
        require(0 <= start <= stop <= len(self.rows), f"rows {start}..{stop} of a table of {len(self.rows)}")
        return torch.tensor(self.rows[start:stop], dtype=torch.long, device=device).reshape(-1, 2)


def lookup_table(tokens: torch.Tensor, max_ngram: int = MAX_NGRAM) -> torch.Tensor:
    """tokens [B, L] -> [B, L, 2]: each row's :class:`LookupTable` over its whole length."""
    rows = []
    for row in tokens.tolist():
        table = LookupTable(max_ngram)
        table.extend(row)
        rows.append(table.table(0, len(row)))
    return torch.stack(rows).to(tokens.device) if rows else tokens.new_zeros(0, tokens.shape[1], 2)
