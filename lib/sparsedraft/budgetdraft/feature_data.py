"""Teacher data for a feature drafter: token windows, and the target's features and greedy tokens over them.

A feature head learns from what the target computes: its top-layer features
``f_t`` (before the final norm), its greedy next token and its top-k
probabilities, at every position of a window. On two CPU cores the target
reads ~100-300 tokens/s, which makes the teacher the costliest part of a
training run, so every window's teacher is computed once by our own engine
and cached on disk, one safetensors file per window, named by a hash of
everything it depends on (format version, target id, config and dtype, the
window's tokens). A run that is stopped keeps the windows it finished; the
next one computes only the rest. Features are stored in bf16 (2 bytes per
number: 2.4 MB per 2K window of SmolLM2).

Three sources of windows, because the essays' train split (~112K tokens) is
too little text for a head that EAGLE trains on millions of tokens:

- ``essays``: consecutive windows of the essays' train split;
- ``pydoc``: Python's documentation topics (``pydoc_data.topics``, ~465K
  characters of English prose shipped with every Python), in windows;
- ``sampled``: the target's own continuations of train-split essay prompts,
  sampled at temperature ~0.8 in one batched decode: the text a speculative
  decoder's drafter faces. Their teacher comes from the decode's own
  forwards (:func:`continue_with_teacher`), so this text costs one decode
  shared by the batch instead of a second forward. The samples need no
  bit-for-bit batch independence, so the batch multiplies through torch's
  GEMM (:func:`~sparsedraft.engine.model.gemm_batches`) rather than the
  row-exact few-row kernel (level with it at 32 rows, 1.2x at 64:
  ``bench.sampler``). It is
  cached as one file keyed by the prompts and the sampling law.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..engine.cache import StaticCache
from ..engine.data import Tokenizer, corpus_tokens
from ..engine.model import Capture, Transformer, gemm_batches
from ..engine.prefill import prefill
from ..engine.runtime import mapped_blocks
from ..errors import require
from ..progress import bar
from .teacher import corpus_windows

FEATURE_DATA_VERSION = 1  # bump when a cached file's meaning changes
SOURCES = ("essays", "pydoc", "sampled")
TOP_K = 8  # teacher probabilities kept per position (for a KL loss; the greedy token is the first)


@dataclass
class Window:
    """One training window and its teacher."""

    tokens: torch.Tensor  # [T] int64
    features: torch.Tensor  # [T, hidden] bf16: the target's top-layer output at every position (after the
    # outputs of the lower layers a fusing head reads: [T, (k+1) * hidden])
    greedy: torch.Tensor  # [T] int64: the target's argmax after tokens[:t+1] (what greedy verification accepts)
    top_ids: torch.Tensor  # [T, TOP_K] int64
    top_probs: torch.Tensor  # [T, TOP_K] fp16
    source: str = ""
    positions: torch.Tensor | None = None  # [T] int64 true positions, for a window read behind a prefix
    # (feature_context.behind_teacher: a sink, a gap, the newest entries); None: 0..T-1
    lookups: torch.Tensor | None = None  # [T, 2] prompt lookup's rows over the whole reading, for a lookup head
    # (a window read behind a prefix keeps only some of the tokens lookup reads); None: computed from tokens


def digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    tmp.replace(path)


def pydoc_text() -> str:
    """Python's documentation topics as one text (sorted by topic, so the same on every machine)."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def text_windows(tokenizer: Tokenizer, source: str, seq_len: int, count: int) -> torch.Tensor:
    """[count, seq_len] non-overlapping windows of the essays' train split or of the pydoc text."""
    require(source in ("essays", "pydoc"), f"text windows come from 'essays' or 'pydoc', got {source!r}")
    if count == 0:
        return torch.zeros(0, seq_len, dtype=torch.long)
    if source == "essays":
        return corpus_windows(tokenizer, seq_len, count, "train")
    tokens = torch.tensor(tokenizer.encode(pydoc_text(), add_special_tokens=False), dtype=torch.long)
    available = tokens.numel() // seq_len
    require(count <= available, f"the pydoc text holds only {available} windows of {seq_len} tokens, {count} were "
                                f"asked for; use pydoc_sequences <= {available} or a shorter seq_len")
    return tokens[:count * seq_len].view(count, seq_len)


@torch.inference_mode()
def continue_with_teacher(target: Transformer, prompts: torch.Tensor, new_tokens: int, temperature: float = 0.0,
                          seed: int = 0, prompt_teacher: bool = True, exact: bool = True,
                          fuse_layers: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Continue equal-length ``prompts`` [B, P] by ``new_tokens`` (greedy at temperature 0, else sampled from
    softmax(logits / temperature)) in one batched cache, keeping the teacher of every token from the decode's
    own forwards: no second pass over the text. Returns ``tokens`` [B, P+N], ``features`` [B, P+N, hidden] bf16,
    and with ``prompt_teacher`` (one unchunked prompt forward: its logits are B x P x vocab floats) ``greedy``,
    ``top_ids``, ``top_probs`` over every position; without it the prompt is prefilled in chunks and the
    teacher of its tokens but the last is not kept (``greedy`` -1 there). ``exact=False`` multiplies a batch
    through torch's GEMM (:func:`~sparsedraft.engine.model.gemm_batches`): faster, but a row's bits then depend
    on its batch. ``fuse_layers``: the features also hold those lower layers' outputs (before the top's)."""
    with contextlib.nullcontext() if exact else gemm_batches():
        return _continue(target, prompts, new_tokens, temperature, seed, prompt_teacher, fuse_layers)


def _continue(target: Transformer, prompts: torch.Tensor, new_tokens: int, temperature: float, seed: int,
              prompt_teacher: bool, fuse_layers: tuple[int, ...]) -> dict[str, torch.Tensor]:
    b, p = prompts.shape
    gen = torch.Generator().manual_seed(seed)
    cache = StaticCache(target.cfg, p + new_tokens, b, target.dtype, target.device)
    capture = Capture(layers=set(), hidden=True, hidden_layers=fuse_layers)
    prompts = prompts.to(target.device)
    if prompt_teacher:
        logits = target(prompts, cache=cache, capture=capture).float()
    else:
        logits = prefill(target, cache, prompts, capture=capture)[:, None].float()
        logits = torch.cat((logits.new_full((b, p - 1, logits.shape[-1]), float("nan")), logits), dim=1)
    tokens, features, tops = [prompts.cpu()], [capture.features.to(torch.bfloat16).cpu()], [_top(logits)]
    for _ in range(new_tokens):
        last = logits[:, -1]
        if temperature:
            nxt = torch.multinomial((last / temperature).softmax(-1).cpu(), 1, generator=gen).to(target.device)
        else:
            nxt = last.argmax(-1, keepdim=True)
        capture = Capture(layers=set(), hidden=True, hidden_layers=fuse_layers)
        logits = target(nxt, cache=cache, capture=capture).float()
        tokens.append(nxt.cpu())
        features.append(capture.features.to(torch.bfloat16).cpu())
        tops.append(_top(logits))
    probs, ids = (torch.cat(parts, dim=1) for parts in zip(*tops))
    greedy = torch.where(probs[..., 0].isnan(), -1, ids[..., 0])
    return {"tokens": torch.cat(tokens, dim=1), "features": torch.cat(features, dim=1), "greedy": greedy,
            "top_ids": ids, "top_probs": probs.to(torch.float16)}


def _top(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    return probs.cpu(), ids.cpu()


def sampled_teacher(target: Transformer, target_id: str, tokenizer: Tokenizer, count: int, prompt_len: int,
                    new_tokens: int, temperature: float, seed: int, cache_dir: str | Path, compute: bool = True,
                    batch: int = 32, progress: bool = False, fuse_layers: tuple[int, ...] = (),
                    offset: int = 0) -> list[Window]:
    """``count`` windows of ``prompt_len + new_tokens``: prompts spread evenly over the essays' train split
    (``offset`` tokens into each stride: other prompts, so continuations a head never trained on) and
    the target's sampled continuations of them, ``batch`` rows per decode (through torch's GEMM), with the
    teacher the decode computed anyway; cached on disk as one file. With ``fuse_layers`` the text is the
    top-only file's (sampled once, whatever layers a head reads) and the features come from one forward per
    window over it, in a file of their own."""
    if count == 0:
        return []
    corpus = corpus_tokens(tokenizer, "train")
    stride = corpus.numel() // count
    require(stride >= offset + prompt_len, f"{count} prompts of {prompt_len} tokens, {offset} tokens into each "
                                           f"stride, do not fit in the train split's {corpus.numel()} tokens; ask "
                                           "for fewer sampled_sequences, shorter prompts or a smaller offset")
    prompts = torch.stack([corpus[i * stride + offset:i * stride + offset + prompt_len] for i in range(count)])
    key = {"version": FEATURE_DATA_VERSION, "target": target_id, "config": asdict(target.cfg),
           "dtype": str(target.dtype), "prompts": token_hash(prompts),
           "new_tokens": new_tokens, "temperature": temperature, "seed": seed, "batch": batch, "linear": "gemm",
           **layers_key(fuse_layers)}
    path = Path(cache_dir) / f"sampled-{digest(key)}.safetensors"
    if not path.is_file() and fuse_layers:
        text = sampled_teacher(target, target_id, tokenizer, count, prompt_len, new_tokens, temperature, seed,
                               cache_dir, compute, batch, progress, offset=offset)
        require(compute, f"the fused features of the sampled continuations are not cached (expected {path}); run "
                         "once without --no-teacher")
        features = [teacher_of(target, w.tokens, fuse_layers)["features"]
                    for w in bar(text, desc="sampled features", unit="win", show=progress)]
        save_tensors({"tokens": torch.stack([w.tokens for w in text]), "features": torch.stack(features),
                      **{k: torch.stack([getattr(w, k) for w in text]) for k in ("greedy", "top_ids", "top_probs")}},
                     path, {"key": json.dumps(key, sort_keys=True, default=str)})
    if not path.is_file():
        require(compute, f"the sampled continuations are not cached (expected {path}); run once without "
                         "--no-teacher")
        with mapped_blocks():  # else the heap grows without bound over the decode steps (runtime.py says why)
            parts = [continue_with_teacher(target, prompts[i:i + batch], new_tokens, temperature, seed + i,
                                           exact=False)
                     for i in bar(range(0, count, batch), desc="sampled", unit="batch", show=progress)]
        save_tensors({k: torch.cat([part[k] for part in parts]) for k in parts[0]}, path,
                     {"key": json.dumps(key, sort_keys=True, default=str)})
    stored = load_file(str(path))
    return [Window(stored["tokens"][i], stored["features"][i], stored["greedy"][i], stored["top_ids"][i],
                   stored["top_probs"][i], "sampled") for i in range(count)]


@torch.inference_mode()
def teacher_of(target: Transformer, tokens: torch.Tensor, fuse_layers: tuple[int, ...] = (),
               cache: StaticCache | None = None) -> dict[str, torch.Tensor]:
    """One target forward over ``tokens`` [T] (after what ``cache`` holds, if given): features (after
    ``fuse_layers``' outputs), greedy tokens and top-k probabilities (CPU)."""
    capture = Capture(layers=set(), hidden=True, hidden_layers=fuse_layers)
    logits = target(tokens[None].to(target.device), cache=cache, capture=capture)[0].float()
    probs, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    return {"features": capture.features[0].to(torch.bfloat16).cpu(), "greedy": ids[:, 0].cpu(),
            "top_ids": ids.cpu(), "top_probs": probs.to(torch.float16).cpu()}


def token_hash(tokens: torch.Tensor) -> str:
    """What a cache key says of a token tensor."""
    return hashlib.sha256(tokens.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def layers_key(fuse_layers: tuple[int, ...]) -> dict[str, Any]:
    """The cache-key part that names the lower layers kept beside the top one (none for EAGLE's top-only
    features, so their files keep the names they had)."""
    return {"fuse_layers": list(fuse_layers)} if fuse_layers else {}


def window_file(cache_dir: str | Path, target_id: str, target: Transformer, tokens: torch.Tensor,
                fuse_layers: tuple[int, ...] = ()) -> Path:
    key = {"version": FEATURE_DATA_VERSION, "target": target_id, "config": asdict(target.cfg),
           "dtype": str(target.dtype), "tokens": token_hash(tokens),
           **layers_key(fuse_layers)}
    return Path(cache_dir) / f"window-{digest(key)}.safetensors"


def teacher_windows(target: Transformer, target_id: str, windows: torch.Tensor, source: str, cache_dir: str | Path,
                    compute: bool = True, progress: bool = False, fuse_layers: tuple[int, ...] = ()) -> list[Window]:
    """The teacher of every row of ``windows`` [N, T], from the disk cache or one target forward each."""
    out = []
    for row in bar(windows, desc=f"features ({source})", unit="win", show=progress):
        path = window_file(cache_dir, target_id, target, row, fuse_layers)
        if path.is_file():
            stored = load_file(str(path))
            require(torch.equal(stored["tokens"], row.to(torch.int64)),
                    f"feature cache {path} holds other tokens than its name claims; delete the file")
        else:
            require(compute, f"the teacher of a {source} window is not cached (expected {path}); run once without "
                             "--no-teacher to compute it")
            stored = {"tokens": row.to(torch.int64), **teacher_of(target, row, fuse_layers)}
            save_tensors(stored, path)
        out.append(Window(stored["tokens"], stored["features"], stored["greedy"], stored["top_ids"],
                          stored["top_probs"], source))
    return out


def feature_scales(windows: list[Window], hidden: int) -> list[float]:
    """Each feature block's root mean square over (a sample of) the windows, lower layers first and the top
    layer's last: the top's is the unit of the regression loss, and each block's the unit of its input noise
    (and of a fusing head's ``fuse_gain``), so all mean the same on any target."""
    require(len(windows) > 0, "no training windows: ask for essays, pydoc or sampled sequences")
    sample = torch.cat([w.features[::16].float() for w in windows[:64]])
    blocks = sample.view(sample.shape[0], -1, hidden)
    return [float(x) for x in blocks.pow(2).mean((0, 2)).sqrt()]
