"""sparsedraft: lossless long-context speculative decoding with sparse-KV drafts.

The packages are layers; each imports only from the layers below it (the
shared leaves ``errors``, ``progress``, ``cliopts`` and ``report`` from
anywhere), which ``tests/test_layout.py`` checks; ``docs/architecture.md``
draws them. Where everything is, one hop from here, bottom to top:

- ``sparsedraft.engine``, models and the one forward: :func:`load_model`,
  :func:`load_tokenizer`, :class:`Transformer` (Llama, Mistral, Qwen2,
  Qwen3; ``engine.tiny`` for random test models), the cache protocol
  :class:`StaticCache` (``engine.cache``), the one chunked prefill
  (``engine.prefill``), plain decoding (``engine.generate``), one prefill for
  many runs :func:`prefill_prompt` / :class:`PrefilledPrompt` and its disk
  cache :class:`PrefillStore` (``engine.prefilled``, ``engine.prefill_store``;
  ``decode(..., prefilled=)``), CUDA graphs (``engine.cudagraph``), quantised
  copies (``engine.quant``), the C++ kernels (``engine.kernels``), tokenizers
  and the essays corpus (``engine.data``), bytes and FLOPs per token, measured
  bandwidth and datasheets (``engine.roofline``), the machine a figure ran on
  (``engine.machine``);
- ``sparsedraft.caches``: StreamingCache, RetrievalCache, BudgetCache, rebuild
  policies, the static-shape caches CUDA graphs need (``caches.static``) and
  retrieval as a gather or FlashInfer's indexed decode (``caches.indexed``);
- ``sparsedraft.speculative``, the decoders and their front door:
  :func:`decode` (``speculative.decoding``) with a method from :data:`METHODS`
  (``speculative.methods``: ar, spec, retrieval, triforce, budgetdraft, each
  an options dataclass); batches in lockstep, one forward per step for all
  rows (``speculative.batching``, ``speculative.lockstep``); verification,
  drafters and the drivers that chain them (``speculative.drivers``); the
  feature drafter :class:`FeatureHead` / :class:`FeatureDrafter`
  (:func:`load_feature_head`); every trained drafter's loader
  (``speculative.loading``); a draft head over frequent tokens
  (``speculative.vocab``);
- ``sparsedraft.budgetdraft``: training drafters (slice and feature, ``train-drafter``);
- ``sparsedraft.analysis``: the analyses behind the notebooks (sparsity,
  locality, cost model, acceptance fits, the batch roofline, plots);
- ``sparsedraft.bench``: :func:`compare` / :class:`CompareConfig` (the
  baseline and any methods, one process), :data:`BENCHES` (the ``ar`` bench
  also times transformers), ``bench.gpu`` (``gpu-check``), ``bench.draft_cost``
  (a draft step's cost against the verifier's), ``bench.record`` (results
  records), ``bench.kernel_timing`` (the C++ kernel against SDPA),
  ``bench.prefill_profile`` (a prefill's operators, ours and transformers');
- ``sparsedraft.runner``: the notebooks (``python -m sparsedraft run``), and
  ``sparsedraft.report``: what a notebook saves and states.
"""

from .bench import BENCHES, CompareConfig, compare
from .engine.cache import KVCache, SequenceView, StaticCache
from .engine.config import ModelConfig
from .engine.model import Capture, Transformer
from .engine.prefill_store import PrefillStore, prefill_prompt
from .engine.prefilled import PrefilledPrompt
from .engine.weights import load_model, load_tokenizer
from .errors import SparsedraftError
from .speculative.decoding import DecodeResult, decode
from .speculative.feature import FeatureHead, load_feature_head
from .speculative.feature_drafter import FeatureDrafter
from .speculative.methods import METHODS

__all__ = ["BENCHES", "METHODS", "Capture", "CompareConfig", "DecodeResult", "FeatureDrafter", "FeatureHead", "KVCache",
           "ModelConfig", "PrefillStore", "PrefilledPrompt", "SequenceView", "SparsedraftError", "StaticCache",
           "Transformer", "compare", "decode", "load_feature_head", "load_model", "load_tokenizer", "prefill_prompt"]
