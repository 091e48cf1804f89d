"""The engine: one model forward, its cache protocol, plain decoding and the one prefill, and nothing above.

Every other package builds on this one and it imports none of them (only the
shared leaves ``errors`` and ``progress``), so the model, its weights and its
costs can be read without knowing about speculation.

- the model: :mod:`.config` (``ModelConfig``), :mod:`.model` (``Transformer``,
  one forward for Llama, Mistral, Qwen2, Qwen3), :mod:`.rope`, :mod:`.weights`
  (``load_model`` from GGUF, safetensors or a Hugging Face id),
  :mod:`.tiny` (random test models), :mod:`.quant` (int8/int4 copies),
  :mod:`.kernels` (the optional C++ attention and few-row linear kernels);
- the cache protocol: :mod:`.cache` (``KVCache``, ``StaticCache``,
  ``SequenceView``); the sparse caches live one layer up, in
  :mod:`sparsedraft.caches`;
- running a prompt: :mod:`.prefill` (the one chunked prefill),
  :mod:`.prefilled` (one prefill shared by many runs), :mod:`.prefill_store`
  (its disk cache and ``prefill_prompt``), :mod:`.generate` (plain decoding,
  the baseline), :mod:`.sampling`, :mod:`.cudagraph` (fixed-size steps
  replayed from a CUDA graph);
- where and what it runs on: :mod:`.runtime` (dtypes, devices, sync),
  :mod:`.machine` (the CPU path, provenance of a figure), :mod:`.roofline`
  (bytes and FLOPs per token, measured bandwidth, hardware datasheets);
- text: :mod:`.data` (tokenizers, the essays corpus, bench prompts).

Names import from their modules (``from sparsedraft.engine.model import
Transformer``); the package front door :mod:`sparsedraft` re-exports the
everyday ones.
"""
