"""Write small GGUF files in process (llama.cpp layout) for loader tests."""

from pathlib import Path

import gguf
import numpy as np
import torch

from sparsedraft.engine.model import Transformer

_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    # llama.cpp stores each head's two RoPE halves interleaved
    out, inp = w.shape
    return w.reshape(heads, 2, out // heads // 2, inp).transpose(1, 2).reshape(out, inp)


def write_gguf(model: Transformer, path: Path, arch: str = "llama") -> Path:
    cfg = model.cfg
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for name, p in model.state_dict().items():
        t = p.detach().float()
        if name == "embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            _, layer, rest = name.split(".", 2)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_BLOCK[module]}.{kind}"
            if module in ("self_attn.q_proj", "self_attn.k_proj"):
                t = _interleave(t, cfg.num_heads if "q_proj" in module else cfg.num_kv_heads)
        w.add_tensor(gname, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
