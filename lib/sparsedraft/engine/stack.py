"""A decode or verification step's whole decoder stack in one C++ call, where nothing between its kernel calls
needs Python.

Why: a step makes three kernel calls a layer (``kernels.layer_head``, ``attend``, ``layer_tail``), and the Python
between them (module calls, the cache's index writes, argument checks) took about 2 ms of a 14 ms bf16
SmolLM2-135M decode on a 2-core Zen 4 EPYC whatever its context (the replayed kernel calls alone took the rest;
scratch, in the message of the commit that added this file), a seventh of the step and more of a draft level's.
``kernels.layer_stack`` makes the same calls in the same order in C++, so every row keeps the Python path's bits
(``tests/test_layer_stack.py``).

Where: :func:`model.run_layers` asks :func:`run` first. It runs a step whose cache's step is plain
(:meth:`KVCache.step_slots`: a :class:`StaticCache`, a :class:`RetrievalCache` over full-precision or int8
slots once its mask is causal, or a :class:`BudgetCache` after its chunk selection), whose every layer takes
the fused layer kernels, and that captures no per-layer queries or attention weights. The stack (the layers'
tensors and the cache's buffers) is made once per cache, set of weights and kernel build (``kernels.running``
swaps builds for an A/B), kept on the cache, and remade when any of them changes. :func:`stack_steps` turns it
off, for an A/B in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import kernels

_ON = True
_KEPT = 4  # stacks kept per cache: one per model and kernel build that steps over it (an A/B of two builds: 2)


def stack_steps(on: bool) -> bool:
    """Run eligible steps' layers in one C++ call (the default) or layer by layer from Python, so a bench can
    time both in one process. Returns the previous choice."""
    global _ON
    before, _ON = _ON, bool(on)
    return before


def run(layers: Sequence[torch.nn.Module], x: torch.Tensor, rows: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        cache, keep: Sequence[int], fused: Callable[[torch.nn.Module, torch.Tensor], tuple | None]
        ) -> list[torch.Tensor] | None:
    """The outputs of the layers in ``keep``, then the last layer's, for the step ``x`` [B, T, hidden] over
    ``cache`` (``rows()``: the step's cos, sin [B, T, D]); None where the step does not qualify (then nothing
    was written). ``fused(block, x)``: the block's (layer_head, layer_tail) linears, or None where the block
    does not take the fused kernels."""
    if not _ON:
        return None
    slots = cache.step_slots()
    if slots is None:
        return None
    linears = []
    for block in layers:  # stops at the first block without them (every block of a prefill chunk)
        lin = fused(block, x)
        if lin is None:
            return None
        linears.append(lin)
    codes = cache.step_codes()
    key = (id(kernels.current()), x.dtype, *map(id, cache.k), *map(id, cache.v), *map(id, linears),
           *((id(n.weight), n.eps) for block in layers for n in _norms(block)),
           *(() if codes is None else (*(id(t) for part in codes[:4] for t in part), codes[4])))
    stacks = cache.__dict__.setdefault("_layer_stacks", {})
    made = stacks.get(key)
    if made is None:
        if len(stacks) >= _KEPT:  # weights or buffers replaced: the old stacks would only hold them alive
            stacks.clear()
        # kept with the objects whose ids the key holds, so no id in it can pass to a new object meanwhile
        made = stacks[key] = _stack(layers, linears, cache, codes), linears, [n.weight for block in layers
                                                                             for n in _norms(block)]
    cos, sin = rows()
    return made[0].run(x, slots[0], slots[1], cos, sin, list(keep))


def _norms(block: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    return block.input_layernorm, block.post_attention_layernorm


def _stack(layers: Sequence[torch.nn.Module], linears: list[tuple], cache, codes):
    heads, tails = zip(*map(_norms, layers))
    attention = layers[0].self_attn
    return kernels.layer_stack([n.weight for n in heads], [n.eps for n in heads], [lin[0] for lin in linears],
                               [n.weight for n in tails], [n.eps for n in tails], [lin[1] for lin in linears],
                               list(cache.k), list(cache.v), attention.cfg.num_heads, attention.scale,
                               not cache.keys_prerope, codes)
