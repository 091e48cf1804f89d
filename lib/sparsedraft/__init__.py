"""sparsedraft: lossless long-context speculative decoding with sparse-KV drafts."""

from .cache import KVCache, SequenceView, StaticCache
from .config import ModelConfig
from .decoding import DecodeResult, decode
from .errors import SparsedraftError
from .methods import METHODS
from .model import Capture, Transformer
from .weights import load_model, load_tokenizer

__all__ = ["METHODS", "Capture", "DecodeResult", "KVCache", "ModelConfig", "SequenceView", "SparsedraftError", "StaticCache",
           "Transformer", "decode", "load_model", "load_tokenizer"]
