"""A streamed block's norms, recomputed in the backward instead of kept.

Llama's, Phi-3's and their kin's RMSNorm compute in float32: under bf16 autocast each keeps a float32 copy of its
input for the backward, twice the bytes of the block's own hidden state. A Phi-4 block keeps two, 80 MB at 128 x 16
tokens of the 899 MB its recompute and backward hold with a sliced MLP (tracked on a CPU). Run under PyTorch's
non-reentrant checkpoint a norm keeps only its input (half the bytes, and often kept by the block's other layers
anyway) and computes its float32 copy again when its gradient is taken: a few elementwise passes over one hidden
state, where the block's matmuls pass over its weights. Tracked, the block held 60 MB less (839 MB). Without a
gradient (the no-grad forward, generation, export) a norm runs as its class does.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _is_norm(module: nn.Module) -> bool:
    """A normalisation layer: a leaf module whose class is named a norm (RMSNorm, LayerNorm, Gemma's, T5's). Not
    a batch norm: its forward in training updates running statistics, which a recompute would update again."""
    if isinstance(module, nn.modules.batchnorm._NormBase):
        return False
    return "norm" in type(module).__name__.lower() and next(module.children(), None) is None


def _recomputed_forward(self: nn.Module, *args, **kwargs):
    """The class's forward, under checkpoint when a gradient will flow through it."""
    forward = type(self).forward
    if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return forward(self, *args, **kwargs)
    # a norm draws nothing at random: no random state to save and restore around its recompute
    return checkpoint(forward, self, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def recompute_norms(blocks: list[nn.Module], on: bool = True) -> int:
    """Recompute the norms of `blocks` in the backward from now on (`on`), or keep what they save again;
    returns how many norms are recomputed."""
    count = 0
    for module in (m for block in blocks for m in block.modules()):
        if getattr(module.__dict__.get("forward"), "__func__", None) is _recomputed_forward:
            del module.forward  # the class's own forward again
        if on and _is_norm(module):
            module.forward = types.MethodType(_recomputed_forward, module)
            count += 1
    return count
