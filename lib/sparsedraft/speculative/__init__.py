"""Lossless speculative decoding at any depth: verification, drafters, drivers and their stats."""

from .decode import (SpecResult, check_run, prefill_target, retrieval, retrieval_drafter, speculative, triforce,
                     triforce_drafter)
from .drafters import DraftContext, Drafter, ModelDrafter, NgramDrafter, Proposal, TargetState
from .hierarchy import RetrievalDrafter, SpeculativeDrafter
from .stats import (DRAFT, REBUILD, RETRIEVAL_LEVEL, SYNC, TARGET, VERIFY, LevelStats, SpecStats, Stopwatch,
                    region)
from .truncate import truncated_draft
from .verify import AcceptanceRule, Verdict, standard_acceptance, verify, verify_greedy, verify_sampled

__all__ = ["AcceptanceRule", "DRAFT", "DraftContext", "Drafter", "LevelStats", "ModelDrafter", "NgramDrafter",
           "Proposal", "REBUILD", "RETRIEVAL_LEVEL", "RetrievalDrafter", "SYNC", "SpecResult", "SpecStats",
           "SpeculativeDrafter", "Stopwatch", "TARGET", "TargetState", "VERIFY", "Verdict", "check_run",
           "prefill_target", "region", "retrieval", "retrieval_drafter", "speculative", "standard_acceptance",
           "triforce", "triforce_drafter", "truncated_draft", "verify", "verify_greedy", "verify_sampled"]
