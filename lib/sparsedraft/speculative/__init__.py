"""Lossless speculative decoding at any depth: verification, drafters, drivers and their stats."""

from .decode import (SpecResult, check_run, prefill_target, retrieval, retrieval_drafter, speculative, triforce,
                     triforce_drafter)
from .drafters import (DraftContext, Drafter, ModelDrafter, NgramDrafter, Proposal, SpeculativeDrafter, TargetState,
                       follows_target)
from .stats import LevelStats, SpecStats, Stopwatch
from .truncate import truncated_draft
from .verify import AcceptanceRule, Verdict, standard_acceptance, verify, verify_greedy, verify_sampled

__all__ = ["AcceptanceRule", "DraftContext", "Drafter", "LevelStats", "ModelDrafter", "NgramDrafter", "Proposal",
           "SpecResult", "SpecStats", "SpeculativeDrafter", "Stopwatch", "TargetState",
           "Verdict", "check_run", "follows_target", "prefill_target", "retrieval", "retrieval_drafter", "speculative",
           "standard_acceptance", "triforce", "triforce_drafter", "truncated_draft", "verify", "verify_greedy",
           "verify_sampled"]
