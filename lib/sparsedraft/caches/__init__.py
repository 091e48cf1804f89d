"""KV-cache policies beyond the full cache: one small class per file, one protocol (see sparsedraft.cache).

- :class:`StreamingCache`: StreamingLLM sinks + recent window (TriForce's level-1 draft cache).
- :class:`RetrievalCache`: TriForce's chunk-retrieval view of a full cache (level 2).
- rebuild policies deciding when the retrieval view is rebuilt.
"""

from .rebuild import AcceptanceBelow, EveryN, MovingAverage, Never, RebuildPolicy, rebuild_policy
from .retrieval import RetrievalCache
from .streaming import StreamingCache

__all__ = ["AcceptanceBelow", "EveryN", "MovingAverage", "Never", "RebuildPolicy", "RetrievalCache",
           "StreamingCache", "rebuild_policy"]
