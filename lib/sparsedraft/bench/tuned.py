"""Per-context defaults of ``bench triforce`` and ``bench retrieval``: the best settings measured.

Notebook 05's speedup-vs-context section runs every retrieval budget and
(γ1, γ2) of its grid at each context and names the fastest greedy setting per
method; :data:`TUNED` holds those settings for the contexts it measured, with
:data:`SOURCE` saying which run. A bench given no option of its own takes the
row of the largest tuned context at or below its ``--context``; an option
given on the command line always wins, and below the smallest tuned context
the method's dataclass defaults apply. The notebook reports whether this table
still names its best settings (``curve_bench_defaults_are_best``): timing
noise can reorder close settings from one run to the next.
"""

from __future__ import annotations

from typing import Any

SOURCE = ("notebook 05's speedup-vs-context grid on smollm2-135m-yarn32k, held-out prompts, greedy, 128 tokens; "
          "cpu profile, fresh-clone make reproduce of 2026-12-02 on a 2-core CPU at 489b5b7")

# Level 1 is prompt lookup (the methods' default draft) in every row; chunk size 8. TriForce's rows were also
# the best in an earlier run of the grid (at 572d888, timed while other jobs shared the CPU); retrieval's best
# budget or gamma differed there at 8K and 32K, by less than one run's noise (about 0.1x).
TUNED: dict[str, dict[int, dict[str, int]]] = {
    "triforce": {8000: {"budget": 1024, "gamma1": 2, "gamma2": 6},
                 16000: {"budget": 1024, "gamma1": 4, "gamma2": 8},
                 32000: {"budget": 2048, "gamma1": 2, "gamma2": 6}},
    "retrieval": {8000: {"budget": 1024, "gamma": 8},
                  16000: {"budget": 1024, "gamma": 8},
                  32000: {"budget": 2048, "gamma": 6}},
}


def tuned_context(method: str, context: int) -> int | None:
    """The tuned context whose settings ``method`` takes at ``context`` (None: no tuned row applies)."""
    reached = [c for c in TUNED.get(method, {}) if c <= context]
    return max(reached) if reached else None


def tuned_options(method: str, context: int) -> dict[str, Any]:
    """The tuned options of ``method`` at ``context`` ({} when no tuned row applies)."""
    at = tuned_context(method, context)
    return {} if at is None else dict(TUNED[method][at])
