"""Does a RoPE-extended model still predict text past its training context? (issue 11)

The long-context stand-in (``smollm2-135m-yarn32k``) is only faithful if its
next-token loss holds past the 8,192 positions SmolLM2 was trained on. This
module measures the per-position negative log-likelihood of a long prompt,
averages it in fixed position bins, and judges an extension by three rules:

- *holds*: mean NLL over the bins past the trained context at most
  ``mean_margin`` (0.05 nats) above the mean over the bins inside it;
- *no spike*: no bin past the trained context more than ``bin_margin``
  (0.3 nats) above the worst bin inside it;
- *cheap*: mean NLL inside the trained context within ``cost_margin``
  (0.15 nats) of the unscaled model's on the same text.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import pandas as pd
import torch

from ..engine.cache import StaticCache
from ..engine.model import Transformer
from ..engine.prefill import PREFILL_CHUNK, prefill_spans
from ..errors import require


@torch.inference_mode()
def position_nll(model: Transformer, tokens: torch.Tensor, chunk: int = PREFILL_CHUNK, *,
                 past_limit: bool = False) -> torch.Tensor:
    """NLL in nats of ``tokens[1:]`` given everything before, as a float64 tensor of ``len(tokens) - 1``.

    ``tokens`` is 1-D; it is run through one full cache in prefill chunks (the
    engine's own spans), so a 32K prompt costs one prefill and never holds more
    than ``chunk`` rows of logits. ``past_limit=True`` runs a model beyond its
    declared positions on purpose: how an unscaled model breaks there is what
    the quality check shows.
    """
    require(tokens.dim() == 1 and tokens.numel() >= 2, f"position_nll takes 1-D tokens, >= 2 of them, got shape "
            f"{tuple(tokens.shape)}")
    require(past_limit or tokens.numel() <= model.cfg.max_position_embeddings,
            f"{tokens.numel()} tokens exceed the model's {model.cfg.max_position_embeddings} positions; "
            "use an extended model (e.g. smollm2-135m-yarn32k), a shorter prompt, or past_limit=True to measure "
            "how it breaks")
    cache = StaticCache(model.cfg, tokens.numel(), 1, model.dtype, model.device)  # new_cache would refuse past_limit
    ids = tokens.to(model.device)[None]
    out = []
    for start, stop in prefill_spans(tokens.numel(), chunk):
        logits = model(ids[:, start:stop], cache=cache)[0].float()
        targets = tokens[start + 1:stop + 1].to(model.device)
        logp = torch.log_softmax(logits[:targets.numel()], dim=-1)
        out.append(-logp.gather(1, targets[:, None])[:, 0].double())
    return torch.cat(out).cpu()


def nll_by_bin(nll: torch.Tensor, bin_size: int = 1024) -> pd.DataFrame:
    """Mean NLL and perplexity per bin of ``bin_size`` predicted positions (position = index of the predicted
    token, so bin 0 holds positions 1 .. bin_size - 1 and a partial last bin is kept)."""
    require(bin_size >= 1, f"bin_size must be >= 1, got {bin_size}")
    positions = torch.arange(1, nll.numel() + 1)
    rows = []
    for start in range(0, int(positions[-1]) + 1, bin_size):
        inside = (positions >= start) & (positions < start + bin_size)
        if inside.any():
            mean = float(nll[inside].mean())
            rows.append({"bin_start": start, "bin_end": start + bin_size, "tokens": int(inside.sum()),
                         "nll": mean, "ppl": math.exp(mean)})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class ExtensionVerdict:
    """The three rules for one extended model; each number is what its rule compares."""

    trained: int            # the base model's training context (positions)
    mean_inside: float      # mean bin NLL over bins ending at or before ``trained``
    mean_past: float        # mean bin NLL over bins starting at or after ``trained``
    worst_inside: float     # highest bin NLL inside
    worst_past: float       # highest bin NLL past
    base_mean_inside: float  # the unscaled model's mean inside, same text
    mean_margin: float = 0.05
    bin_margin: float = 0.3
    cost_margin: float = 0.15

    @property
    def holds(self) -> bool:
        return self.mean_past - self.mean_inside <= self.mean_margin

    @property
    def no_spike(self) -> bool:
        return self.worst_past - self.worst_inside <= self.bin_margin

    @property
    def cheap(self) -> bool:
        return abs(self.mean_inside - self.base_mean_inside) <= self.cost_margin

    @property
    def passes(self) -> bool:
        return self.holds and self.no_spike and self.cheap

    def as_row(self) -> dict:
        return {**asdict(self), "holds": self.holds, "no_spike": self.no_spike, "cheap": self.cheap,
                "passes": self.passes}


def judge_extension(bins: pd.DataFrame, base_bins: pd.DataFrame, trained: int, **margins: float) -> ExtensionVerdict:
    """Apply the three rules to ``bins`` (from :func:`nll_by_bin`, averaged over prompts if several) of an
    extended model, against ``base_bins`` of the unscaled model on the same text; bins must align with
    ``trained`` (a bin straddling it belongs to neither side and is refused)."""
    for name, frame in (("bins", bins), ("base_bins", base_bins)):
        require({"bin_start", "bin_end", "nll"} <= set(frame.columns), f"{name} needs bin_start, bin_end and nll "
                "columns (nll_by_bin's frame)")
        straddle = frame[(frame.bin_start < trained) & (frame.bin_end > trained)]
        require(straddle.empty, f"{name}: bin {straddle.bin_start.tolist()} straddles the trained context {trained}; "
                "pick a bin size that divides it")
    inside = bins[bins.bin_end <= trained].nll
    past = bins[bins.bin_start >= trained].nll
    base_inside = base_bins[base_bins.bin_end <= trained].nll
    require(len(inside) > 0 and len(past) > 0 and len(base_inside) > 0,
            f"need bins both inside and past the trained context {trained} (and base bins inside it); got "
            f"{len(inside)} inside, {len(past)} past, {len(base_inside)} base inside: use a prompt longer than {trained}")
    return ExtensionVerdict(trained=trained, mean_inside=float(inside.mean()), mean_past=float(past.mean()),
                            worst_inside=float(inside.max()), worst_past=float(past.max()),
                            base_mean_inside=float(base_inside.mean()), **margins)


def mean_bins(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Average several prompts' bin frames bin by bin (token-weighted NLL; perplexity recomputed)."""
    require(len(frames) >= 1, "mean_bins needs at least one frame")
    both = pd.concat(frames)
    both = both.assign(weighted=both.nll * both.tokens)
    grouped = both.groupby(["bin_start", "bin_end"], as_index=False).agg(tokens=("tokens", "sum"),
                                                                          weighted=("weighted", "sum"))
    grouped["nll"] = grouped.weighted / grouped.tokens
    grouped["ppl"] = grouped.nll.map(math.exp)
    return grouped.drop(columns="weighted")
