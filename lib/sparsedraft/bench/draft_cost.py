"""What one draft step costs next to one verifier step at a long context.

A drafter pays only if its forward is a small fraction of the verifier's: with
acceptance ``a`` per draft and ``gamma`` drafts, a round costs ``gamma * c + v``
for ``(1 - a^(gamma+1)) / (1 - a)`` tokens, so ``c / v`` caps the speedup as
much as ``a`` does. This times both forwards in one process, taking turns:
the verifier decoding one token over a full cache of ``context`` tokens
(random keys and values: the work does not depend on them), and the drafter
drafting one token over its own sparse cache -- a :class:`BudgetCache` the
drafter filled from a real prompt of ``context`` tokens -- once per head
(the full one and each :func:`~sparsedraft.speculative.vocab.restrict_head`
size), and beside them a (gamma + 1)-token verification over the full cache,
the other term of a round's cost. Every forward is rolled back, so each sees
the same cache. A feature drafter (:class:`~sparsedraft.speculative.feature.FeatureHead`)
is timed the same way: its one layer over a BudgetCache of its own entries
(random features: the work does not depend on them either) plus the head.

Not a test: ``python -m sparsedraft.bench.draft_cost --draft data/drafters/feature --context 8192
--draft-vocab 0 8192 --record docs/results/draft-cost-8k.json`` times a trained drafter folder (either kind)
against the verifier its record names, prints the rows and the read bandwidth, and records them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..caches.budget import BudgetCache
from ..engine import machine
from ..engine.data import corpus_tokens, model_tokenizer
from ..engine.machine import provenance
from ..engine.model import Transformer
from ..engine.roofline import measure_read_bandwidth, step_cost
from ..engine.runtime import dtype_name, synchronize
from ..engine.weights import load_model
from ..errors import exit_with, require
from ..speculative.feature import Entries, FeatureHead
from ..speculative.loading import load_trained, trained_scoring, trained_verifier
from ..speculative.vocab import coverage, frequent_tokens, restrict_head
from .ar import random_cache
from .record import finish_module
from .steps import StepRow, step_row, steps_table


@dataclass(frozen=True)
class DraftCostRow:
    draft_vocab: int  # tokens the draft's head scores (the full vocabulary for the unrestricted head)
    heldout_coverage: float  # share of held-out tokens among them: how often the draft can be right at most
    draft_ms: float  # median draft step over its budget cache
    verifier_ms: float  # median verifier step over the full cache, timed in the same rounds
    ratio: float  # draft_ms / verifier_ms
    verify_tokens: int  # tokens of the verification timed beside them (gamma + 1)
    verify_ratio: float  # that verification's median time / verifier_ms


def _step_ms(model: Transformer, cache, tokens: torch.Tensor) -> float:
    synchronize(model.device)
    start = time.perf_counter()
    model(tokens, cache=cache)
    synchronize(model.device)
    elapsed = time.perf_counter() - start
    cache.rollback(tokens.shape[1])
    return 1000 * elapsed


@torch.inference_mode()
def draft_step_costs(verifier: Transformer, drafter: Transformer | FeatureHead, prompt: torch.Tensor, budget: int,
                     draft_vocabs: list[int], tokenizer, repeats: int = 30, chunk_size: int = 8,
                     scoring: str = "attention", verify_tokens: int = 5) -> list[DraftCostRow]:
    """One row per entry of ``draft_vocabs`` (0: the full head), timed at ``prompt``'s length [1, T], with a
    ``verify_tokens``-token verification over the full cache timed in the same rounds."""
    from ..speculative.budget import budget_prefill

    context = prompt.shape[1]
    vocab = verifier.cfg.vocab_size
    require(prompt.dim() == 2 and prompt.shape[0] == 1, f"prompt must be [1, T], got {tuple(prompt.shape)}")
    require(all(0 <= n < vocab for n in draft_vocabs),
            f"draft_vocabs {draft_vocabs} must lie in [0, {vocab}) (0: the full head)")
    require(repeats >= 3, f"repeats must be >= 3 for a median, got {repeats}")
    require(verify_tokens >= 1, f"verify_tokens must be >= 1, got {verify_tokens}")
    full = random_cache(verifier, context, verify_tokens)
    cache = BudgetCache(drafter.cfg, budget, context + 1, chunk_size, scoring=scoring, dtype=drafter.dtype,
                        device=drafter.device)
    kept = {n: frequent_tokens(tokenizer, n, vocab) if n else torch.arange(vocab) for n in draft_vocabs}
    if isinstance(drafter, FeatureHead):  # entry t = (f_t, x_{t+1}): the prompt's tokens from the second on
        feats = torch.randn(1, context + 1, drafter.cfg.hidden_size, dtype=drafter.dtype, device=drafter.device)
        lookups = drafter.lookups_for(torch.cat((prompt, prompt[:, -1:]), 1).to(drafter.device))  # the step's too
        budget_prefill(Entries(drafter, feats, lookups), cache, prompt[:, 1:].to(drafter.device))
        heads = {n: Entries(drafter.restricted(ids) if n else drafter, feats, lookups) for n, ids in kept.items()}
    else:
        budget_prefill(drafter, cache, prompt.to(drafter.device))
        heads = {n: restrict_head(drafter, ids) if n else drafter for n, ids in kept.items()}
    token = prompt[:, -1:].to(verifier.device)
    block = prompt[:, -verify_tokens:].to(verifier.device)
    times: dict[object, list[float]] = {"verifier": [], "verify": [], **{n: [] for n in heads}}
    for round_ in range(repeats + 1):  # round 0 warms every path up and is dropped
        for name in times:
            if name in ("verifier", "verify"):
                ms = _step_ms(verifier, full, token if name == "verifier" else block)
            else:
                ms = _step_ms(heads[name], cache, token)
            if round_:
                times[name].append(ms)
    verifier_ms = statistics.median(times["verifier"])
    verify_ratio = statistics.median(times["verify"]) / verifier_ms
    rows = []
    for n, ids in kept.items():
        draft_ms = statistics.median(times[n])
        rows.append(DraftCostRow(n or vocab, coverage(tokenizer, ids) if n else 1.0, draft_ms, verifier_ms,
                                 draft_ms / verifier_ms, verify_tokens, verify_ratio))
    return rows


def step_roofline(verifier: Transformer, drafter: Transformer | FeatureHead, rows: list[DraftCostRow],
                  context: int, budget: int, read_bytes_per_s: float, peak_gflops: float) -> list[StepRow]:
    """The timed steps of ``rows`` beside this machine's roofline (:mod:`.steps`): the verifier's decode and
    (gamma + 1)-token verification over ``context`` cached tokens, and each head's draft step over its
    ``budget``-token cache. A feature head's step is its layers (the target's shape) plus its input projection
    (read once per step, counted as weights) and the head over its draft vocabulary; a slice drafter's is its
    own layers and head. Weights and cache are counted at the verifier's dtype."""
    size = verifier.dtype.itemsize
    dtype = dtype_name(verifier.dtype)
    first = rows[0]
    layer = drafter.cfg  # a feature head's own config holds its layers only
    out = [step_row("decode", dtype, first.verifier_ms, step_cost(verifier.cfg, context, 1, size), read_bytes_per_s,
                    peak_gflops),
           step_row(f"verify-{first.verify_tokens}", dtype, first.verify_ratio * first.verifier_ms,
                    step_cost(verifier.cfg, context, first.verify_tokens, size), read_bytes_per_s, peak_gflops)]
    for row in rows:
        cost = step_cost(layer.replace(vocab_size=row.draft_vocab), budget, 1, size)
        if isinstance(drafter, FeatureHead):  # fc: [feature width + hidden] -> hidden, one matvec a step
            fc = drafter.fc.weight.numel()
            cost = replace(cost, weight_bytes=cost.weight_bytes + fc * size, weight_flops=cost.weight_flops + 2 * fc)
        out.append(step_row(f"draft (head {row.draft_vocab})", dtype, row.draft_ms, cost, read_bytes_per_s,
                            peak_gflops))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True, help="a trained drafter folder (train-drafter, either kind)")
    parser.add_argument("--model", default="", help="the verifier (default: the one the drafter's record names)")
    parser.add_argument("--context", type=int, default=8192, help="tokens in the verifier's cache")
    parser.add_argument("--budget", type=int, default=1024, help="the drafter's budget cache size")
    parser.add_argument("--draft-vocab", type=int, nargs="+", default=[0, 8192],
                        help="draft heads to time: 0 the full one, N the N most frequent train-split tokens")
    parser.add_argument("--gamma", type=int, default=4, help="drafts per round: a gamma + 1-token verification "
                                                             "is timed beside the steps")
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds (medians over them)")
    parser.add_argument("--split", default="heldout", help="essay split of the drafter's prompt")
    parser.add_argument("--record", default="", metavar="PATH.json", help="also write a results record")
    args = parser.parse_args(argv)
    require(not args.record or args.record.endswith(".json"), f"--record takes a .json path, got {args.record!r}")
    require(Path(args.draft).is_dir(), f"no drafter folder {args.draft}")
    require(args.context > args.budget > 0, f"--context {args.context} must exceed --budget {args.budget} > 0")
    require(args.gamma >= 1, f"--gamma must be >= 1, got {args.gamma}")
    model = args.model or trained_verifier(args.draft)
    started = provenance()
    target = load_model(model).eval()
    require(args.context <= target.cfg.max_position_embeddings,
            f"--context {args.context} exceeds {model}'s {target.cfg.max_position_embeddings} positions")
    drafter = load_trained(args.draft, target)
    tokenizer = model_tokenizer(model)
    prompt = corpus_tokens(tokenizer, args.split)[:args.context][None]
    require(prompt.shape[1] == args.context, f"the {args.split} split holds {prompt.shape[1]} tokens, fewer than "
                                             f"--context {args.context}; pick a shorter context or another split")
    path = machine.report(target.device)  # which kernels ran, printed before the timing
    read = measure_read_bandwidth(target.device)
    peak = machine.peak_gflops(["fp32"], target.device)["fp32"]
    rows = draft_step_costs(target, drafter, prompt, args.budget, args.draft_vocab, tokenizer, args.repeats,
                            scoring=trained_scoring(args.draft), verify_tokens=args.gamma + 1)
    steps = step_roofline(target, drafter, rows, args.context, args.budget, read, peak)
    kind = "feature" if isinstance(drafter, FeatureHead) else "slice"
    print(f"{path}; read {read / 1e9:.1f} GB/s, fp32 matmul peak {peak:.0f} GFLOP/s")
    print(f"{kind} drafter {args.draft} over a {args.budget}-token budget cache, verifier {model} at "
          f"{args.context:,} tokens ({rows[0].verifier_ms:.1f} ms per decode step; a {args.gamma + 1}-token "
          f"verification {rows[0].verify_ratio:.2f} of them)")
    for row in rows:
        print(f"  head over {row.draft_vocab:,} tokens ({row.heldout_coverage:.1%} of held-out text): "
              f"{row.draft_ms:.2f} ms, {row.ratio:.1%} of a decode step")
    print(steps_table(steps))
    result = {"bench": "draft_cost", "isa": path.to_dict(), "read_gb_s": read / 1e9, "peak_gflops": {"fp32": peak},
              "draft": args.draft, "kind": kind, "model": model, "context": args.context, "budget": args.budget,
              "gamma": args.gamma, "repeats": args.repeats, "threads": torch.get_num_threads(),
              "rows": [asdict(r) for r in rows], "steps": [asdict(s) for s in steps]}
    finish_module(args.record, 'draft_cost', argv, result, started, read / 1e9)


if __name__ == "__main__":
    exit_with(main)
