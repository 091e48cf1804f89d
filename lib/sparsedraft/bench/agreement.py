"""A trained feature drafter's agreement with its target, measured on a folder as it stands, without training.

The training run measures it once, at its end (``budgetdraft.feature_eval.final_report``). This command
measures any drafter folder the same way, on the same cached positions: the target's own greedy
continuations of held-out prompts (what a greedy speculative decoder's first draft faces). It prints and
records the first draft's agreement, the drafts kept per round that those continuations imply at each gamma
(and how often draft j is kept once drafts 1..j-1 were, which says where rounds stop), the same for a
drafter that stops on its own confidence (``draft_confidence``: drafts and kept drafts per round), the same
rounds for prompt lookup alone and for lookup first with the head (``draft_lookup``),
that agreement split by the target's own top-1 probability at each position (how much of the gap is the
target's uncertainty), and, given ``--slice``, the slice drafter's first draft on the same positions. With
``--head-window SINK WINDOW`` the head sees its own entries as a StreamingLLM cache of that size at true
positions shows them (``FeatureDrafter.create(cache="streaming", positions="true")``), instead of all of them. With ``--behind N``
it also reads each continuation behind N tokens of train-split essay text and reports the head's first draft
on the same positions alone and behind it (``budgetdraft.feature_context``): the context's share of a
shortfall, with the text held fixed.

Not a test: ``python -m sparsedraft.bench.agreement --draft data/drafters/feature --slice outputs/budgetdraft/default
--record docs/results/feature-agreement-4k.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..budgetdraft.feature_context import CHECK_PREFIXES, first_draft_behind, prefix_windows
from ..budgetdraft.feature_eval import GAMMAS, agreement_report, greedy_continuations
from ..budgetdraft.feature_loss import check_window
from ..engine.data import model_tokenizer
from ..engine.machine import provenance
from ..engine.weights import load_model
from ..errors import exit_with, require
from ..speculative.feature import load_feature_head
from ..speculative.loading import has_checkpoint, trained_verifier
from .record import finish_module


def measure(draft: str, context: int = 4096, prompts: int = 6, tokens: int = 160, draft_vocab: int = 8192,
            slice_run: str = "", cache_dir: str = "data/cache/feature",
            window: tuple[int, int] | None = None, prefixes: torch.Tensor | None = None) -> dict:
    """The agreement report of the drafter in ``draft`` against the target its record names (its head seeing a
    (sink, window) view of its entries when ``window`` is given; with ``prefixes`` (:func:`behind_prefixes`),
    also ``report["behind"]``: the first draft on the same continuations read behind them)."""
    verifier = trained_verifier(draft)
    require(not slice_run or has_checkpoint(Path(slice_run)), f"no slice drafter in {slice_run}: pass a BudgetDraft "
                                                              "run folder (train-drafter --kind slice) or leave --slice out")
    require(prefixes is None or (prefixes.dim() == 2 and prefixes.shape[0] == prompts),
            lambda: f"one prefix per prompt: [{prompts}, N], got {list(prefixes.shape)}; make them with "
                    "behind_prefixes(draft, N, prompts)")
    target = load_model(verifier)
    head = load_feature_head(draft, target).eval()
    tokenizer = model_tokenizer(verifier)
    report = agreement_report(head, verifier, tokenizer, cache_dir, prompts, context, tokens, draft_vocab,
                              slice_run, window=window)
    if prefixes is not None:
        data = greedy_continuations(target, verifier, tokenizer, cache_dir, prompts, context, tokens, False,
                                    head.fuse_layers)
        report["behind"] = first_draft_behind(head, data, prefixes, window)
    return {"bench": "agreement", "draft": draft, "model": verifier, "context": context, "prompts": prompts,
            "new_tokens": tokens, "draft_vocab": draft_vocab, **({} if window is None else {"head_window": window}),
            "threads": torch.get_num_threads(), "report": report}


def behind_prefixes(draft: str, n: int, prompts: int) -> torch.Tensor:
    """[prompts, n]: train-split essay text to read before each held-out continuation (consecutive windows; the
    held-out prompts come from another split, so no prefix holds its continuation's text; the windows
    training reads behind come after them)."""
    require(prompts <= CHECK_PREFIXES, f"--behind reads train-split windows 0..{CHECK_PREFIXES - 1}, the ones "
                                       f"training never reads behind; give --prompts <= {CHECK_PREFIXES}, not "
                                       f"{prompts}")
    return prefix_windows(model_tokenizer(trained_verifier(draft)), n, prompts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True, help="a feature drafter folder (train-drafter --kind feature)")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens of each held-out prompt")
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts")
    parser.add_argument("--tokens", type=int, default=160, help="greedy tokens after each prompt")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="also the head restricted to N tokens (0: not)")
    parser.add_argument("--slice", default="", help="a slice drafter's run folder, measured on the same positions")
    parser.add_argument("--cache-dir", default="data/cache/feature", help="where the continuations are cached")
    parser.add_argument("--behind", type=int, default=0, metavar="N",
                        help="also read each continuation behind N tokens of train-split text: the head's first "
                             "draft on the same positions, alone and behind (two target forwards per prompt)")
    parser.add_argument("--head-window", type=int, nargs=2, metavar=("SINK", "WINDOW"), default=None,
                        help="the head sees its first SINK entries and its WINDOW newest (a streaming cache's view)")
    parser.add_argument("--record", default="", metavar="PATH.json", help="also write a results record")
    args = parser.parse_args(argv)
    require(not args.record or args.record.endswith(".json"), f"--record takes a .json path, got {args.record!r}")
    require(Path(args.draft).is_dir(), f"no drafter folder {args.draft}")
    longest = max(GAMMAS)
    require(args.draft_vocab >= 0, f"--draft-vocab is a token count >= 0 (0: the full head), got {args.draft_vocab}")
    require(args.context >= 3 and args.prompts >= 1 and args.tokens >= longest + 2,
            f"--context >= 3, --prompts >= 1 and --tokens >= {longest + 2} (the longest simulated round drafts "
            f"{longest})")
    window = check_window(args.head_window, "--head-window")
    require(args.behind >= 0, f"--behind takes a prefix length in tokens (0: none), got {args.behind}")
    prefixes = behind_prefixes(args.draft, args.behind, args.prompts) if args.behind else None  # before the model
    started = provenance()
    result = measure(args.draft, args.context, args.prompts, args.tokens, args.draft_vocab, args.slice,
                     args.cache_dir, window, prefixes)
    report = result["report"]
    print(f"first draft = the target's greedy token: {report['first_draft']:.1%} of {report['positions']} positions "
          f"({report['prompts']} prompts of {report['prompt_len']} tokens); target's own top-1 probability "
          f"there {report['target_top1_mean']:.2f} on average")
    for bucket in report["by_target_confidence"]:
        seen = "-" if bucket["first_draft"] is None else f"{bucket['first_draft']:.1%}"
        print(f"  target top-1 in [{bucket['from']:.1f}, {bucket['to']:.1f}]: {bucket['share']:.1%} of positions, "
              f"first draft {seen}")
    for link in report["chain"]:
        rate = "-" if link["rate"] is None else f"{link['rate']:.1%}"
        j = link["draft"]
        after = "" if j == 1 else " when draft 1 was" if j == 2 else f" when drafts 1..{j - 1} were"
        print(f"  draft {j} kept{after}: {rate} of {link['reached']} rounds")
    for gamma, row in report["gamma"].items():
        print(f"  gamma {gamma}: {row['accepted_per_round']:.2f} drafts kept per round")
    for at, by_gamma in report["stop"].items():
        cells = ", ".join(f"gamma {g} {row['accepted_per_round']:.2f} of {row['drafted_per_round']:.2f}"
                          for g, row in by_gamma.items())
        print(f"  stopping after a draft less sure than {at}: drafts kept of drafted per round: {cells}")
    alone = report["lookup"]
    print(f"prompt lookup alone: first draft {alone['first_draft']:.1%}; drafts kept of drafted per round: "
          + ", ".join(f"gamma {g} {row['accepted_per_round']:.2f} of {row['drafted_per_round']:.2f}"
                      for g, row in alone["gamma"].items()))
    for name, label in (("", "full head"), ("_vocab", f"head over {args.draft_vocab} tokens")):
        for c, row in report.get(f"lookup_first{name}", {}).items():
            cells = ", ".join(f"gamma {g} {r['accepted_per_round']:.2f} of {r['drafted_per_round']:.2f}"
                              for g, r in row["gamma"].items())
            print(f"lookup first, {label}, draft_lookup {c}: first draft {row['first_draft']:.1%}, lookup drafts at "
                  f"{row['lookup_starts']:.0%} of starts; kept of drafted per round: {cells}")
    if "behind" in report:
        b = report["behind"]
        print(f"the same {b['positions']} positions behind {b['prefix']} tokens of other text: first draft "
              f"{b['first_draft_behind']:.1%}, alone {b['first_draft_alone']:.1%} (each against the target's argmax "
              f"in that reading; the prefix left it unchanged at {b['target_argmax_unchanged']:.1%})")
    if "slice_first_draft" in report:
        print(f"slice drafter {args.slice}: first draft {report['slice_first_draft']['first_draft']:.1%}")
    finish_module(args.record, 'agreement', argv, result, started)


if __name__ == "__main__":
    exit_with(main)
