"""Lossless verification of a block of drafted tokens against the verifier's distributions.

One rule serves every level of the hierarchy. Greedy verification keeps the
drafted prefix that equals the verifier's argmax and replaces the first
mismatch by that argmax. Sampling uses speculative sampling (Leviathan et al.;
Chen et al.): draft token x is accepted with probability min(1, p(x)/q(x));
the first rejection is replaced by a draw from norm(max(0, p - q)); when every
draft survives, a bonus token is drawn from the verifier's next distribution.
Each emitted token then has exactly the verifier's distribution given its
prefix, whatever q was -- provided q is the distribution the draft token was
really drawn from.

The acceptance probability is a parameter (:data:`AcceptanceRule`) so the
statistical tests can inject a broken rule into the very code the decoders run
and watch the losslessness test fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import require

AcceptanceRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(p(x) [g], q(x) [g]) of the drafted tokens -> acceptance probabilities [g] in [0, 1]."""


def standard_acceptance(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)): the rule that makes speculative sampling lossless."""
    return (p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)).clamp(max=1.0)


@dataclass(frozen=True)
class Verdict:
    accepted: int  # leading draft tokens kept, 0..g
    token: int  # the verifier's correction (after a rejection) or bonus token (all kept)


def verify_greedy(draft: torch.Tensor, p: torch.Tensor) -> Verdict:
    """draft [g] ids, p [g+1, V] verifier distributions (argmax taken) -> Verdict.

    Exact argmax matching; needs no random numbers, so a greedy run consumes
    none and cannot drift from plain greedy decoding.
    """
    _check_shapes(draft, None, p)
    target = p.argmax(-1)  # [g+1]
    matches = (draft == target[:-1]).int()
    accepted = int(matches.cumprod(0).sum()) if draft.numel() else 0
    return Verdict(accepted, int(target[accepted]))


def verify_sampled(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None,
                   acceptance: AcceptanceRule = standard_acceptance) -> Verdict:
    """draft [g] ids drawn from q [g, V]; p [g+1, V] verifier distributions -> Verdict.

    Draws g uniforms and then one token, in that order, so a seeded generator
    reproduces a run exactly.
    """
    _check_shapes(draft, q, p)
    g = draft.numel()
    if g:
        rows = torch.arange(g, device=draft.device)
        ratio = acceptance(p[rows, draft], q[rows, draft])
        u = torch.rand(g, generator=generator, device=p.device)
        keep = (u < ratio).int()
        accepted = int(keep.cumprod(0).sum())
    else:
        accepted = 0
    if accepted < g:
        residual = (p[accepted] - q[accepted]).clamp_min(0)
        # p == q up to rounding leaves no residual mass; p itself is then the exact law.
        dist = residual if float(residual.sum()) > 0 else p[accepted]
    else:
        dist = p[g]
    token = torch.multinomial(dist, 1, generator=generator)
    return Verdict(accepted, int(token))


def verify(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, greedy: bool,
           generator: torch.Generator | None, acceptance: AcceptanceRule = standard_acceptance) -> Verdict:
    """Dispatch on the sampling mode: argmax matching when greedy, speculative sampling otherwise."""
    if greedy:
        return verify_greedy(draft, p)
    return verify_sampled(draft, q, p, generator, acceptance)


def _check_shapes(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor) -> None:
    require(draft.dim() == 1 and p.dim() == 2 and p.shape[0] == draft.numel() + 1,
            f"verification needs draft [g] and p [g+1, V]; got draft {tuple(draft.shape)}, p {tuple(p.shape)}")
    if q is not None:
        require(tuple(q.shape) == (draft.numel(), p.shape[1]),
                f"proposal distributions q must be [g, V] = [{draft.numel()}, {p.shape[1]}], "
                f"got {tuple(q.shape)}; the draft and verifier vocabularies must match")
