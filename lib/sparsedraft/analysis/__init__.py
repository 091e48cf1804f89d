"""Analyses behind TriForce's three observations and its cost model (issue 5).

- :mod:`sparsedraft.engine.roofline` (re-exported here): bytes and FLOPs per token,
  weights vs KV, hardware profiles and ideal latency (Obs. 1, Fig. 1).
- :mod:`.sparsity`: attention mass a KV budget recovers, per policy (Obs. 2).
- :mod:`.locality`: how long a selection stays useful (Obs. 3).
- :mod:`.costmodel`: ms/token of two- and three-level speculation, the
  hand-computed walkthroughs as explicit schedules, and the speedup-vs-context
  bound.
- :mod:`.explore`: what notebook 04's sliders show for one set of slider
  values (costs, prediction, schedules, sweep, bound); its figures load
  matplotlib only when drawn.
- :mod:`.acceptance`: per-level acceptance rate fitted from per-round records,
  and whether acceptance comes in bursts.
- :mod:`.plots` (import it directly; it loads matplotlib): figures from the
  data frames above.
"""

from ..engine.roofline import (HARDWARE, MODELS, Hardware, bytes_per_token_table, crossover_context, fig1_table,
                               flops_per_token_table, footprint_bytes, ideal_latency_ms, latency_table,
                               measure_read_bandwidth, parameter_count, this_machine)
from .acceptance import BurstinessTest, burstiness_test, fit_alpha
from .costmodel import (WALKTHROUGH_COSTS, HierarchySetup, LevelCosts, Prediction, Schedule, Step, acceptance_sweep,
                        build_schedule, expected_tokens_per_verify, measured_level_costs, predict_ms_per_token,
                        predict_two_level, predicted_speedup, speedup_vs_context, walkthrough_collapse_schedule,
                        walkthrough_normal_schedule)
from .explore import Exploration, explore, explore_figures, typical_schedule
from .locality import LocalityConfig, LocalityResult, contextual_locality
from .sparsity import SparsityConfig, attention_recovery, last_positions, summarize_recovery

__all__ = [
    "HARDWARE", "MODELS", "WALKTHROUGH_COSTS", "BurstinessTest", "Exploration", "Hardware", "HierarchySetup",
    "LevelCosts", "LocalityConfig", "LocalityResult", "Prediction", "Schedule", "SparsityConfig", "Step",
    "acceptance_sweep", "attention_recovery", "build_schedule", "burstiness_test", "bytes_per_token_table",
    "contextual_locality", "crossover_context", "expected_tokens_per_verify", "explore", "explore_figures",
    "fig1_table", "fit_alpha", "flops_per_token_table", "footprint_bytes", "ideal_latency_ms", "last_positions",
    "latency_table", "measure_read_bandwidth", "measured_level_costs", "parameter_count", "predict_ms_per_token",
    "predict_two_level", "predicted_speedup", "speedup_vs_context", "summarize_recovery", "this_machine", "typical_schedule",
    "walkthrough_collapse_schedule", "walkthrough_normal_schedule",
]
