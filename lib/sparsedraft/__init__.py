"""sparsedraft: lossless long-context speculative decoding with sparse-KV drafts.

Where everything is, one hop from here:

- decode anything: :func:`decode` (``sparsedraft.decoding``) with a method from
  :data:`METHODS` (``sparsedraft.methods``: ar, spec, retrieval, triforce,
  budgetdraft, each an options dataclass);
- batches: ``decode`` with a list of prompts runs each row's batch-1 decoder
  in lockstep, one forward per step for all rows (``sparsedraft.batching``,
  ``sparsedraft.lockstep``; the batch roofline in ``analysis.batching``);
- one prefill for many runs: :func:`prefill_prompt` / :class:`PrefilledPrompt`
  (``sparsedraft.prefilled``; ``decode(..., prefilled=)``) and its disk cache
  :class:`PrefillStore` (``sparsedraft.prefill_store``);
- benchmark: :func:`compare` / :class:`CompareConfig` (the baseline and any
  methods, one process) and :data:`BENCHES` (``sparsedraft.bench``; the ``ar``
  bench also times transformers);
- models: :func:`load_model`, :func:`load_tokenizer`, :class:`Transformer`
  (one forward for Llama, Mistral, Qwen2, Qwen3), ``sparsedraft.tiny`` for
  random test models;
- caches: :class:`StaticCache` (``sparsedraft.cache``, the protocol) and
  ``sparsedraft.caches`` (StreamingCache, RetrievalCache, BudgetCache, rebuild
  policies);
- the decoders themselves: ``sparsedraft.speculative`` (verification,
  drafters, drivers; ``speculative.vocab``: a draft head over frequent tokens) and ``sparsedraft.generate`` (plain decoding, the one
  chunked prefill);
- the GPU path: ``sparsedraft.cudagraph`` (fixed-size steps replayed from a
  CUDA graph), ``sparsedraft.caches.static`` (static-shape caches it needs),
  ``sparsedraft.caches.indexed`` (retrieval as a gather or FlashInfer's
  indexed decode) and ``sparsedraft.bench.gpu`` (``gpu-check``);
- BudgetDraft training: ``sparsedraft.budgetdraft`` (a draft step's cost against the
  verifier's: ``sparsedraft.bench.draft_cost``);
- analyses behind the notebooks: ``sparsedraft.analysis`` (sparsity, locality,
  cost model, acceptance fits, plots) and ``sparsedraft.roofline`` (bytes and
  FLOPs per token, measured read bandwidth, hardware datasheets);
- notebooks: ``sparsedraft.runner`` (``python -m sparsedraft run``) and
  ``sparsedraft.report`` (what a notebook saves and states).
"""

from .bench import BENCHES, CompareConfig, compare
from .cache import KVCache, SequenceView, StaticCache
from .config import ModelConfig
from .decoding import DecodeResult, decode
from .errors import SparsedraftError
from .methods import METHODS
from .model import Capture, Transformer
from .prefill_store import PrefillStore, prefill_prompt
from .prefilled import PrefilledPrompt
from .weights import load_model, load_tokenizer

__all__ = ["BENCHES", "METHODS", "Capture", "CompareConfig", "DecodeResult", "KVCache", "ModelConfig",
           "PrefillStore", "PrefilledPrompt", "SequenceView", "SparsedraftError", "StaticCache", "Transformer",
           "compare", "decode", "load_model", "load_tokenizer", "prefill_prompt"]
