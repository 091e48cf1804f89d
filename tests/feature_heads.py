"""What the feature-head tests share: EAGLE's initial head of a tiny target, perturbed so that it drafts wrong
tokens too (rejections are exercised); the target, prompt and plain greedy output it races; a greedy
speculative run over one cache kind, checked against that output; and a tiny training run to warm-start from."""

import torch

from sparsedraft.budgetdraft.feature_config import FeatureTrainConfig
from sparsedraft.engine.generate import generate
from sparsedraft.engine.tiny import tiny_model
from sparsedraft.speculative import speculative
from sparsedraft.speculative.feature import FeatureHead
from sparsedraft.speculative.feature_drafter import FeatureDrafter


def perturbed_head(target, fuse_layers=(), depth: int = 1, seed: int = 1, noise: float = 0.2,
                   floor: float = 0.0, lookup: bool = False, gate: bool = False) -> tuple[FeatureHead, torch.Generator]:
    """``FeatureHead(...).init_from(target)`` with every weight moved by ``noise * (its std + floor)`` times a
    normal draw (``floor`` > 0 moves weights that start at zero, such as a deeper head's new projections or a
    lookup head's ``lookup_fc``); returns the generator too, for callers that perturb more."""
    head = FeatureHead(target.cfg, fuse_layers, depth, lookup, gate).init_from(target).attach(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(noise * (p.std() + floor) * torch.randn(p.shape, generator=gen))
    return head.requires_grad_(False), gen


def raced(make_head, new: int):
    """(target, head, prompt, plain greedy tokens): a qwen3-shaped tiny target (a seed whose greedy text the
    initial head gets partly right), ``make_head(target)``, a 48-token prompt and ``new`` greedy tokens."""
    target = tiny_model("qwen3", seed=2)
    prompt = torch.randint(0, target.cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    return target, make_head(target), prompt, generate(target, prompt, new).tokens


def small_run(tmp_path, name: str, **changes):
    """A 3-step training run on ``tiny-llama`` into ``tmp_path / name`` (teacher data shared under
    ``tmp_path``): the shape the warm-start tests grow a drafter from."""
    base = dict(verifier="tiny-llama", seq_len=64, sequences=2, pydoc_sequences=0, sampled_sequences=0,
                eval_sequences=1, draft_vocab=64, chains=16, continuation=16, budgets=(16, 32), obs_window=8,
                steps=3, warmup=1, lr=3e-3, checkpoint_every=3, eval_every=0, final_context=0,
                teacher_dir=str(tmp_path / "teacher"), out_dir=str(tmp_path / name))
    return FeatureTrainConfig(**{**base, **changes})


def greedy_run(pair, cache: str, gamma: int = 3):
    """Speculative greedy decoding of ``pair`` (:func:`raced`) with its head over a fresh cache of kind
    ``cache`` (small sink, window and budget, so every kind selects); asserts the tokens are the plain greedy
    ones and returns the run for the caller's own checks."""
    target, head, prompt, ar = pair
    new = ar.shape[1]  # the plain run's new tokens
    drafter = FeatureDrafter.create(head, cache, prompt.shape[1] + new, gamma=gamma, sink=4, window=8, budget=16,
                                    chunk_size=4)
    out = speculative(target, drafter, prompt, new, gamma)
    assert torch.equal(out.tokens, ar)
    return out
