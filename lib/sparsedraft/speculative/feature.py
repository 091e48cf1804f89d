"""A one-layer feature drafter (EAGLE's shape): the target's own features in, the target's own head out.

SmolLM2 has no smaller pretrained sibling, and a slice of its own layers is a
poor drafter (6-16% accepted). EAGLE's answer: one decoder layer that reads
the target's top-layer features (the hidden state before the final norm) and
the embedding of the token that follows, ``x_t = fc([f_t; e(x_{t+1})])``, and
predicts the next feature ``f_{t+1}``; the target's frozen final norm and LM
head turn that into a token. Everything the target has read is summarised in
``f_t``, so one layer of 30 is enough to guess the next token often, and a
draft step costs one layer plus the head (a restricted head, ``draft_vocab``,
makes the head cheap too).

:class:`FeatureHead` owns only ``fc`` and its layer. The embedding, the final
norm, the head and the rotary embedding (YaRN included) are the target's,
attached by reference (:meth:`FeatureHead.attach`), never copied into the
drafter's file. That file is a safetensors of the owned weights beside a JSON
record of the target's :func:`fingerprint`, so a drafter loaded against another
target is refused before any forward.

``lookup`` adds prompt lookup's proposal to the input (:mod:`.lookup_input`): the head reads
``fc([f_t; e(x_{t+1})]) + lookup_fc([e(L_t); n_t])``, where ``L_t`` is what prompt lookup proposes for
``x_{t+2}`` from the tokens up to ``x_{t+1}`` and ``n_t`` the length of its match, so it can learn when the
context already holds the next token (a learnt form of :mod:`.lookup_first`). ``lookup_gate`` adds to that
a learnt logit bias on ``L_t`` per match length ``n_t``, read from the match alone: however unfamiliar the
target's features (behind a long prompt the lookup head stops trusting lookup, docs/feature-drafter.md), a
long match still pulls the draft toward the copy.

``depth`` stacks more decoder layers in the head (EAGLE's is one): capacity, the
lever left once more of the target's own text stopped moving the one-layer head
(``docs/feature-drafter.md``). A draft step then costs ``depth`` layers.

The head's own KV cache is any :class:`~sparsedraft.engine.cache.KVCache` of the
head's own config (``head.cfg``, :meth:`FeatureHead.layer_config`): a full
:class:`~sparsedraft.engine.cache.StaticCache`, a StreamingLLM window, or
BudgetDraft's budgeted cache. Position ``t`` of that cache holds the entry
``(f_t, x_{t+1})``.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..engine.cache import KVCache, SequenceView
from ..engine.config import ModelConfig
from ..engine.model import Block, Capture, Transformer, project, run_layers
from ..errors import SparsedraftError, require
from .lookup_input import MAX_NGRAM, lookup_table
from .vocab import SubsetHead

WEIGHTS = "feature_drafter.safetensors"
RECORD = "feature_drafter.json"
KIND = "feature"
FORMAT = 1  # bump when the owned weights or the record change meaning
GATE_GAIN = 32.0  # the bias is GATE_GAIN x its parameter: AdamW moves a parameter ~lr a step, and the bias
# that pays is a few nats (docs/feature-drafter.md), so at 5e-4 a few hundred steps reach it


class FeatureHead(nn.Module):
    """``fc`` [2*hidden -> hidden] and ``depth`` decoder layers of the target's family (EAGLE: one); the rest is
    the target's.

    ``fuse_layers`` (lower target layers, ascending; EAGLE-3's low and middle features) adds ``fuse``
    [(k+1)*hidden -> hidden]: the head then reads the target's features as those layers' outputs followed by
    the top layer's (``Capture(hidden_layers=...)``), each block scaled by ``fuse_gain`` (fixed at training's
    start so every block is as loud as the top one), and fuses them into one feature. Its own predictions are
    top-layer features, fed back as they are. Without it the head is EAGLE's.

    ``lookup`` adds ``lookup_fc`` [hidden + MAX_NGRAM + 1 -> hidden], started at zero (the head computes what
    it did without it), over the proposed token's embedding and a one-hot of its match length, scaled by
    ``lookup_gain`` (the embedding's 1/RMS in, the features' RMS out, fixed at its start). ``lookup_gate``
    (a lookup head only) adds ``lookup_bias`` [MAX_NGRAM + 1], started at zero: :meth:`logits` adds
    ``GATE_GAIN * lookup_bias[n]`` to the logit of the proposed token where lookup matched ``n`` tokens."""

    def __init__(self, cfg: ModelConfig, fuse_layers: tuple[int, ...] = (), depth: int = 1, lookup: bool = False,
                 lookup_gate: bool = False):
        super().__init__()
        self.cfg = self.layer_config(cfg, check_depth(depth, cfg.num_layers))
        hidden = cfg.hidden_size
        self.fuse_layers = check_fuse_layers(fuse_layers, cfg.num_layers)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(Block(self.cfg, i) for i in range(depth))
        if self.fuse_layers:
            width = (len(self.fuse_layers) + 1) * hidden
            self.fuse = nn.Linear(width, hidden, bias=False)
            self.register_buffer("fuse_gain", torch.ones(width))
        self.lookup = bool(lookup)
        if self.lookup:
            self.lookup_fc = nn.Linear(hidden + MAX_NGRAM + 1, hidden, bias=False)
            nn.init.zeros_(self.lookup_fc.weight)
            self.register_buffer("lookup_gain", torch.ones(2))
        require(lookup or not lookup_gate, "a lookup gate biases prompt lookup's proposal: it needs lookup=True")
        self.lookup_gate = bool(lookup_gate)
        if self.lookup_gate:
            self.lookup_bias = nn.Parameter(torch.zeros(MAX_NGRAM + 1))
        self._borrow(None, None)

    @property
    def feature_width(self) -> int:
        """Width of the target features this head reads (hidden, or (k+1)*hidden when it fuses k lower layers)."""
        return (len(self.fuse_layers) + 1) * self.cfg.hidden_size

    def top(self, features: torch.Tensor) -> torch.Tensor:
        """The top layer's part of target features [..., feature_width] (what the head predicts)."""
        return features[..., -self.cfg.hidden_size:]

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., feature_width] as the one feature the layer reads; a predicted (top-layer)
        feature [..., hidden] passes as it is."""
        if not self.fuse_layers or features.shape[-1] == self.cfg.hidden_size:
            return features.to(self.dtype)
        require(features.shape[-1] == self.feature_width,
                f"this head fuses target layers {list(self.fuse_layers)} and the top one: features of width "
                f"{self.feature_width}, got {features.shape[-1]}; capture them with "
                f"Capture(hidden=True, hidden_layers={self.fuse_layers})")
        return project(self.fuse, features.to(self.dtype) * self.fuse_gain)

    @property
    def depth(self) -> int:
        return self.cfg.num_layers

    @staticmethod
    def layer_config(cfg: ModelConfig, depth: int = 1) -> ModelConfig:
        """The target's config cut to the head's ``depth`` layers: what the head's KV caches are sized with."""
        return cfg.replace(num_layers=depth)

    def attach(self, target: Transformer, head: nn.Module | None = None) -> "FeatureHead":
        """Borrow ``target``'s embedding, norm, rotary embedding and LM head (or ``head``, e.g. a
        :class:`~sparsedraft.speculative.vocab.SubsetHead` over the target's head). Held outside the module
        tree, so they are neither saved with the drafter nor trained."""
        require(target.cfg.hidden_size == self.cfg.hidden_size and target.cfg.vocab_size == self.cfg.vocab_size,
                f"a feature head for hidden {self.cfg.hidden_size} / vocab {self.cfg.vocab_size} cannot read a target "
                f"with hidden {target.cfg.hidden_size} / vocab {target.cfg.vocab_size}")
        self._borrow(target, head if head is not None else target.lm_head)
        return self

    def _borrow(self, target: Transformer | None, head: nn.Module | None) -> None:
        # object.__setattr__: assigned normally, a module would join this one's parameters and state_dict
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_head", head)

    def restricted(self, ids: torch.Tensor) -> "FeatureHead":
        """A view of this head (same weights, same target) whose logits score only ``ids`` (a
        :class:`~sparsedraft.speculative.vocab.SubsetHead` over the target's head); this head is unchanged."""
        target = self.target
        view = copy.copy(self)
        return view.attach(target, SubsetHead(target.lm_head.weight, ids, target.cfg.vocab_size))

    @property
    def target(self) -> Transformer:
        require(self._target is not None, "this FeatureHead is not attached to a target; call attach(target) first")
        return self._target

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def init_from(self, target: Transformer) -> "FeatureHead":
        """EAGLE's start: the layer copies the target's top block, ``fc`` passes the feature through (the
        embedding half starts at zero), so the untrained head predicts 'the same feature again'. Layers past
        the first start as :meth:`init_layers` makes them, so a deeper untrained head is the one-layer one."""
        self.layers[0].load_state_dict(target.layers[-1].state_dict())
        hidden = self.cfg.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden] = torch.eye(hidden, dtype=self.dtype, device=self.device)
        return self.init_layers(target, 1).init_fuse().init_lookup(target)

    def init_layers(self, target: Transformer, first: int) -> "FeatureHead":
        """Layers ``first..depth-1`` as the target's top block with their output projections (``o_proj``,
        ``down_proj``) at zero: each adds nothing to its input, so the head computes what its first ``first``
        layers did (a trained shallower head keeps its predictions at the start of a deeper run), while its
        norms and attention start as the target's own, with gradients from the first step."""
        top = target.layers[-1].state_dict()
        with torch.no_grad():
            for layer in self.layers[first:]:
                layer.load_state_dict(top)
                for out in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    out.weight.zero_()
                    if out.bias is not None:
                        out.bias.zero_()
        return self

    def init_fuse(self, scales: list[float] | None = None) -> "FeatureHead":
        """``fuse`` as the top block's pass-through, the lower layers silent (so the head computes what it did
        reading the top layer alone), and with ``scales`` (each block's RMS, the top's last) ``fuse_gain``
        lifting each block to the top's loudness. Nothing for a head that fuses no layers."""
        if self.fuse_layers:
            hidden = self.cfg.hidden_size
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, -hidden:] = torch.eye(hidden, dtype=self.dtype, device=self.device)
                if scales is not None:
                    gains = torch.tensor([scales[-1] / s for s in scales], dtype=self.dtype, device=self.device)
                    self.fuse_gain.copy_(gains.repeat_interleave(hidden))
        return self

    def init_lookup(self, target: Transformer, feature_rms: float | None = None) -> "FeatureHead":
        """``lookup_fc`` at zero (silent: the head computes what it did without lookup) and ``lookup_gain``
        bringing the proposed token's embedding to unit RMS in and the output to ``feature_rms`` (the top
        features' RMS, so a learnt lookup is heard as loud as the feature). Nothing without lookup."""
        if self.lookup:
            embed_rms = float(target.embed_tokens.weight.detach().float().pow(2).mean().sqrt())
            with torch.no_grad():
                self.lookup_fc.weight.zero_()
                self.lookup_gain.copy_(torch.tensor([1.0 / embed_rms, feature_rms or 1.0]))
        return self

    def lookups_for(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Prompt lookup's table over ``tokens`` [B, L] ([B, L, 2], :func:`~.lookup_input.lookup_table`) for a
        lookup head, indexed as the tokens are; None for a head without lookup."""
        return lookup_table(tokens) if self.lookup else None

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, capture: Capture | None = None,
                lookups: torch.Tensor | None = None) -> torch.Tensor:
        """features [B, T, hidden] (f_t), tokens [B, T] (x_{t+1}) -> predicted features [B, T, hidden] (f_{t+1}).

        ``positions`` (of the features, [B, T] or [T]) default to ``cache.length + arange(T)``; without a cache
        the entries attend causally to each other only (training). ``lookups`` [B, T, 2]: a lookup head's
        (proposed token, match length) per entry, the rows of :meth:`lookups_for` at the tokens' own indices;
        required by a lookup head, refused by any other."""
        require((lookups is not None) == self.lookup,
                "a lookup head reads prompt lookup's proposal at every entry: pass lookups (the rows of "
                "head.lookups_for(tokens) at the tokens' indices)" if self.lookup
                else "this head does not read prompt lookup's proposals; pass no lookups")
        if cache is None:
            cache = SequenceView(self.cfg.sliding_window)
        if positions is None:
            start = getattr(cache, "length", 0)
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = project(self.fc, torch.cat((self.fused(features), self.target.embed_tokens(tokens)), -1))
        if lookups is not None:
            x = x + self.lookup_input(lookups)
        return run_layers(self.layers, self.target.rotary, x, positions, cache, capture)

    def lookup_input(self, lookups: torch.Tensor) -> torch.Tensor:
        """lookup_fc over [e(proposed) / RMS(e), one-hot of the match length], times the features' RMS."""
        matched = lookups[..., 1]
        proposed = self.target.embed_tokens(lookups[..., 0]).to(self.dtype) * (matched > 0).unsqueeze(-1)
        length = torch.nn.functional.one_hot(matched, MAX_NGRAM + 1).to(self.dtype)
        return project(self.lookup_fc, torch.cat((proposed * self.lookup_gain[0], length), -1)) * self.lookup_gain[1]

    def logits(self, features: torch.Tensor, lookups: torch.Tensor | None = None) -> torch.Tensor:
        """The target's final norm and head (or the attached restricted head) over features [..., hidden]; a
        gated head adds its bias for ``lookups`` [..., 2], the rows its entries read (:meth:`gate`)."""
        return self.gate(project(self._head, self.target.norm(features)), lookups)

    def gate(self, logits: torch.Tensor, lookups: torch.Tensor | None, columns: torch.Tensor | None = None
             ) -> torch.Tensor:
        """``logits`` [..., V] with ``GATE_GAIN * lookup_bias[n]`` added at each row's proposed token, for the
        (token, n) ``lookups`` [..., 2] of the entries that predicted them; ``columns`` maps a token to its
        column (-100: none) for logits over a restricted vocabulary. A head without a gate returns ``logits``
        as they are; a gated one refuses to score without the rows."""
        if not self.lookup_gate:
            return logits
        require(lookups is not None, "a gated head's draft logits read the lookup rows of the entries that "
                                     "predicted them: pass them (unroll's third output, or the drafter's table)")
        require(lookups.shape[:-1] == logits.shape[:-1], lambda: f"one lookup row per logits row: lookups "
                                                                 f"{list(lookups.shape)}, logits {list(logits.shape)}")
        token, n = lookups[..., 0], lookups[..., 1]
        column = token if columns is None else columns[token]
        bias = (GATE_GAIN * self.lookup_bias).to(logits.dtype)[n] * ((n > 0) & (column >= 0))
        return logits.scatter_add(-1, column.clamp_min(0)[..., None], bias[..., None])


class Entries:
    """The head seen as a model by the prefills that fill caches (``prefill``, BudgetDraft's ``fill_prefix``):
    tokens in, features looked up by position in ``features`` [B, T, hidden], logits out."""

    def __init__(self, head: FeatureHead, features: torch.Tensor, lookups: torch.Tensor | None = None):
        self.head, self.features, self.cfg, self.device = head, features, head.cfg, head.device
        self.lookups = lookups  # a lookup head's table [B, L, 2] over the sequence: entry t reads row t + 1

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None, *,
                 last_only: bool = False, capture: Capture | None = None) -> torch.Tensor:
        start = getattr(cache, "length", 0) if positions is None else int(positions.reshape(-1)[0])
        n = tokens.shape[1]
        feats = self.features[:, start:start + n]
        lookups = None if self.lookups is None else self.lookups[:, start + 1:start + 1 + n]
        out = self.head(feats, tokens, positions, cache, capture, lookups)
        if last_only:
            out, lookups = out[:, -1:], None if lookups is None else lookups[:, -1:]
        return self.head.logits(out, lookups)


def check_depth(depth: int, num_layers: int) -> int:
    """``depth`` after checking it is a whole number of layers from 1 to the target's own."""
    require(isinstance(depth, int) and 1 <= depth <= num_layers,
            f"a feature head's depth is 1..{num_layers} decoder layers (the target's own count), got {depth!r}")
    return depth


def check_fuse_layers(layers: tuple[int, ...] | list[int], num_layers: int) -> tuple[int, ...]:
    """``layers`` as a tuple after checking they are distinct lower layers of a ``num_layers``-layer target,
    ascending (the top layer is always read, last)."""
    layers = tuple(int(i) for i in layers)
    require(all(0 <= i < num_layers - 1 for i in layers) and list(layers) == sorted(set(layers)),
            f"fuse_layers must be distinct target layers below the top one (0..{num_layers - 2}), ascending; "
            f"got {list(layers)}")
    return layers


def _digest(tensors: list[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, t in tensors:  # bf16 first: the same target loaded in fp32 or bf16 gives one fingerprint
        h.update(name.encode())
        h.update(t.detach().to(torch.bfloat16).reshape(-1).contiguous().cpu().view(torch.uint8).numpy().data)
    return h.hexdigest()[:16]


def fingerprint(target: Transformer) -> dict[str, Any]:
    """What a feature drafter is tied to: the target's source, shape and RoPE settings, and a digest of the
    weights it reads (embedding, final norm, head, top block). JSON-ready."""
    cfg = target.cfg
    named = [("embed", target.embed_tokens.weight), ("norm", target.norm.weight), ("head", target.lm_head.weight),
             *sorted(target.layers[-1].state_dict().items())]
    return {"source": getattr(target, "source", None), "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers, "rope_theta": cfg.rope_theta,
            "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None, "weights": _digest(named)}


def is_feature_drafter(folder: str | Path) -> bool:
    return (Path(folder) / RECORD).is_file()


def feature_layers_of(*drafts: Any) -> tuple[int, ...]:
    """The lower target layers that any of ``drafts`` (feature heads, drafter folders, or anything else a
    ``draft=`` option takes) fuses: what a prefill shared by their runs keeps (``prefill_prompt(...,
    feature_layers=)``)."""
    layers: set[int] = set()
    for draft in drafts:
        if isinstance(draft, FeatureHead):
            layers.update(draft.fuse_layers)
        elif isinstance(draft, (str, Path)) and is_feature_drafter(draft):
            layers.update(read_record(draft).get("fuse_layers", ()))
    return tuple(sorted(layers))


def save_feature_head(head: FeatureHead, folder: str | Path, target: Transformer,
                      extra: dict[str, Any] | None = None) -> Path:
    """Write the owned weights (bf16 keeps the file small; the head is cast to the target's dtype on load) and
    the record; ``extra`` (training recipe, measurements) is stored in the record as it is."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in head.state_dict().items()},
              str(folder / WEIGHTS))
    record = {"kind": KIND, "format": FORMAT, "target": fingerprint(target), **(extra or {})}
    if head.fuse_layers:
        record["fuse_layers"] = list(head.fuse_layers)
    if head.depth > 1:  # a one-layer head's record stays as before the option
        record["depth"] = head.depth
    if head.lookup:
        record["lookup_input"] = True
    if head.lookup_gate:
        record["lookup_gate"] = True
    tmp = folder / (RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(folder / RECORD)
    return folder


def read_record(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SparsedraftError(f"cannot read the feature drafter record {path}: {exc}") from exc
    require(record.get("kind") == KIND and record.get("format") == FORMAT,
            f"{path} is a drafter of kind {record.get('kind')!r}, format {record.get('format')!r}; this library reads "
            f"kind {KIND!r}, format {FORMAT}: retrain it (sparsedraft train-drafter --kind feature)")
    return record


def check_feature_drafter(folder: str | Path, target: Transformer) -> dict[str, Any]:
    """The folder's record, after checking it was trained for ``target``; one error naming both otherwise."""
    record = read_record(folder)
    require((Path(folder) / WEIGHTS).is_file(), f"{folder} has a record but no {WEIGHTS}; copy the whole folder")
    theirs, mine = record["target"], fingerprint(target)
    differs = sorted(k for k in mine if mine[k] != theirs.get(k))
    require(not differs, f"the feature drafter in {folder} was trained for target {theirs.get('source')!r} "
                         f"({', '.join(f'{k}={theirs.get(k)!r}' for k in differs)}), not for this target "
                         f"{mine.get('source')!r} ({', '.join(f'{k}={mine[k]!r}' for k in differs)}); load the target "
                         "it was trained for, or train a drafter for this one")
    return record


def load_feature_head(folder: str | Path, target: Transformer) -> FeatureHead:
    """The drafter in ``folder``, checked against ``target`` first, on its device and dtype and attached."""
    record = check_feature_drafter(folder, target)
    head = FeatureHead(target.cfg, tuple(record.get("fuse_layers", ())), int(record.get("depth", 1)),
                       bool(record.get("lookup_input", False)), bool(record.get("lookup_gate", False)))
    weights = load_file(str(Path(folder) / WEIGHTS))
    missing = set(head.state_dict()) ^ set(weights)
    require(not missing, f"{folder}/{WEIGHTS} does not hold a feature head's weights (mismatched: {sorted(missing)})")
    head.load_state_dict(weights)
    return head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False).attach(target)
