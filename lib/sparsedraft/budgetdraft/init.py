"""Where the drafter starts: a copy of the verifier's first layers, a random body, or another model.

Every option ends with the verifier's vocabulary (greedy verification
compares token ids) and owns its tensors: training must never move the
verifier's weights, so the layer-truncated init *copies* what
:func:`~sparsedraft.speculative.truncated_draft` would share.

- ``verifier``: layers ``0..k-1``, final norm, embedding and head of the
  verifier -- an early-exit draft that already agrees with the verifier on
  easy tokens, the cheapest start on a CPU.
- ``scratch``: a random body of ``k`` layers of the verifier's width. The
  embedding and head are still the verifier's: 28M embedding parameters
  cannot be learned from scratch on a CPU budget, and a shared output space
  is what agreement needs.
- any other string: a model spec for :func:`~sparsedraft.engine.weights.load_model`
  (Hugging Face folder or id, GGUF), trained as a whole; it must use the
  verifier's tokenizer, which we check through the vocabulary size.
"""

from __future__ import annotations

import torch

from ..engine.model import Transformer
from ..engine.weights import from_state_dict, load_model
from ..errors import require
from .config import TrainConfig


def init_drafter(verifier: Transformer, cfg: TrainConfig) -> Transformer:
    """A trainable drafter (train mode, fp32, on the verifier's device) per ``cfg.drafter_init``."""
    if cfg.drafter_init in ("verifier", "scratch"):
        layers = verifier.cfg.num_layers
        require(cfg.layers < layers, f"the drafter keeps layers < the verifier's {layers}; got layers={cfg.layers}")
        drafter = copy_first_layers(verifier, cfg.layers)
        if cfg.drafter_init == "scratch":
            randomize_layers(drafter, cfg.seed)
    else:
        drafter = load_model(cfg.drafter_init, device=verifier.device)
        require(drafter.cfg.vocab_size == verifier.cfg.vocab_size,
                f"drafter {cfg.drafter_init!r} has a vocabulary of {drafter.cfg.vocab_size} tokens but the verifier "
                f"has {verifier.cfg.vocab_size}; a drafter must use the verifier's tokenizer")
    require(cfg.seq_len <= drafter.cfg.max_position_embeddings,
            f"seq_len ({cfg.seq_len}) exceeds the drafter's context ({drafter.cfg.max_position_embeddings}); "
            "use a shorter seq_len")
    set_trainable(drafter, cfg.train_embeddings)
    return drafter.float().train()


def copy_first_layers(verifier: Transformer, k: int) -> Transformer:
    """Layers 0..k-1 + norm + embedding + head of ``verifier`` as a new model with its own tensors."""
    keep = {name: t.detach().clone() for name, t in verifier.state_dict().items()
            if not name.startswith("layers.") or int(name.split(".")[1]) < k}
    return from_state_dict(verifier.cfg.replace(num_layers=k), keep, dtype=torch.float32, device=verifier.device)


@torch.no_grad()
def randomize_layers(model: Transformer, seed: int) -> None:
    """Re-initialise the transformer blocks (weights ~ N(0, 0.02), norms 1), seeded."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.layers.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))


def set_trainable(model: Transformer, train_embeddings: bool) -> None:
    """Everything trains except (unless asked) the token embedding and the head (tied or not)."""
    for p in model.parameters():
        p.requires_grad_(True)
    for p in (model.embed_tokens.weight, model.lm_head.weight):
        p.requires_grad_(train_embeddings)


def trainable_parameters(model: Transformer) -> dict[str, torch.nn.Parameter]:
    """Named parameters that get gradients (a tied head appears once, under the embedding's name)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}
