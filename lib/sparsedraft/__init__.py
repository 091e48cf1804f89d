"""sparsedraft: lossless long-context speculative decoding with sparse-KV drafts."""

from .cache import KVCache, SequenceView, StaticCache
from .config import ModelConfig
from .errors import SparsedraftError
from .model import Capture, Transformer
from .weights import load_model, load_tokenizer

__all__ = ["Capture", "KVCache", "ModelConfig", "SequenceView", "SparsedraftError", "StaticCache",
           "Transformer", "load_model", "load_tokenizer"]
