"""Lossless speculative decoding at any depth, and the one door to every decoder.

- :func:`decode` (:mod:`.decoding`) runs any method of :data:`METHODS`
  (:mod:`.methods`: ar, spec, retrieval, triforce, budgetdraft, each an
  options dataclass) on a prompt or a batch of prompts; a batch runs each
  row's batch-1 decoder in lockstep, one forward per step for all rows
  (:mod:`.batching`, :mod:`.lockstep`);
- verification (:mod:`.verify`, an injectable acceptance rule), drafters
  (:mod:`.drafters`, :mod:`.hierarchy`, :mod:`.truncate`, :mod:`.budget`,
  :mod:`.feature` / :mod:`.feature_drafter`, :mod:`.vocab`, :mod:`.lookup_first`), the drivers that
  chain them (:mod:`.drivers`: speculative, retrieval, triforce) and their
  stats (:mod:`.stats`);
- trained drafters, whatever their kind, are read by :mod:`.loading`
  (training, which writes them, lives above in :mod:`sparsedraft.budgetdraft`).
"""

from .decoding import DecodeResult, decode
from .drafters import DraftContext, Drafter, ModelDrafter, NgramDrafter, Proposal, TargetState
from .drivers import (SpecResult, check_run, prefill_target, retrieval, retrieval_drafter, speculative, triforce,
                      triforce_drafter)
from .feature import FeatureHead, load_feature_head
from .feature_drafter import FeatureDrafter
from .hierarchy import RetrievalDrafter, SpeculativeDrafter
from .lookup_first import LookupFirst
from .loading import drafter_kind, load_trained
from .methods import METHODS, load_draft, method_options
from .stats import (DRAFT, REBUILD, RETRIEVAL_LEVEL, SYNC, TARGET, VERIFY, LevelStats, SpecStats, Stopwatch,
                    region)
from .truncate import truncated_draft
from .verify import AcceptanceRule, Verdict, standard_acceptance, verify, verify_greedy, verify_sampled

__all__ = ["AcceptanceRule", "DRAFT", "DecodeResult", "DraftContext", "Drafter", "FeatureDrafter", "FeatureHead",
           "LevelStats", "LookupFirst", "METHODS", "ModelDrafter", "NgramDrafter", "Proposal", "REBUILD",
           "RETRIEVAL_LEVEL", "RetrievalDrafter", "SYNC", "SpecResult", "SpecStats", "SpeculativeDrafter",
           "Stopwatch", "TARGET", "TargetState", "VERIFY", "Verdict", "check_run", "decode", "drafter_kind",
           "load_draft", "load_feature_head", "load_trained", "method_options", "prefill_target", "region",
           "retrieval", "retrieval_drafter", "speculative", "standard_acceptance", "triforce", "triforce_drafter",
           "truncated_draft", "verify", "verify_greedy", "verify_sampled"]
