"""KV-cache policies beyond the full cache: one small class per file, one protocol (see sparsedraft.engine.cache).

- :class:`StreamingCache`: StreamingLLM sinks + recent window (TriForce's level-1 draft cache).
- :class:`RetrievalCache`: TriForce's chunk-retrieval view of a full cache (level 2).
- :class:`BudgetCache`: BudgetDraft's drafter cache (best prefix chunks by attention or by keys + every later token).
- rebuild policies deciding when the retrieval view is rebuilt.
"""

from .budget import BUDGETS, BudgetCache, choose_chunks
from .rebuild import AcceptanceBelow, EveryN, MovingAverage, Never, RebuildPolicy, rebuild_policy
from .retrieval import RetrievalCache
from .streaming import StreamingCache

__all__ = ["AcceptanceBelow", "BUDGETS", "BudgetCache", "EveryN", "MovingAverage", "Never", "RebuildPolicy",
           "RetrievalCache", "StreamingCache", "choose_chunks", "rebuild_policy"]
