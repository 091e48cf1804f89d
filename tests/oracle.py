"""Transformers as a test oracle: the same tiny config and weights in both engines."""

import torch
import transformers

from sparsedraft.engine.config import ModelConfig
from sparsedraft.engine.tiny import tiny_hf_config
from sparsedraft.engine.weights import from_state_dict


def hf_pair(family: str, seed: int = 0, **overrides):
    """(transformers model, our model) with identical random weights, fp32, eval."""
    hf_dict = tiny_hf_config(family, **overrides)
    hf_cfg = transformers.AutoConfig.for_model(**hf_dict)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0: perturb them so they matter
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    ours = from_state_dict(ModelConfig.from_hf(hf_dict), {k: v.clone() for k, v in hf.state_dict().items()})
    return hf, ours
