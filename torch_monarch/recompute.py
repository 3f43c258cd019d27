"""Activation recomputation as a plan says (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Sec. 5).

``full``: each block keeps only its input during forward; its backward first re-runs the
block's forward (same RNG state, so dropout masks match) to rebuild what it needs. Built on
non-reentrant checkpointing (saved-tensor hooks): gradients still reach the parameters
through the original graph, so the data-parallel and ZeRO engines' gradient hooks fire once,
as without recomputation, and module hooks outside the block (ZeRO's gather / free) run
once.

``selective``: only the attention core is re-run (``selective.py``: found at the operator
level, so it works on modules that compute attention inline).
"""

import functools

import torch
from torch.utils.checkpoint import checkpoint

from . import selective

MODES = ("none", "selective", "full")


def mode_name(mode):
    return str(mode).split(".")[-1] if mode is not None else "none"


def check_mode(mode):
    """Refuses a mode the runtime cannot carry out, naming it."""
    name = mode_name(mode)
    if name not in MODES:
        raise ValueError(f"recompute: unknown mode {mode!r} (expected one of {MODES})")
    return name


def apply(blocks, mode):
    """Makes each block recompute its activations during backward: all of them (``full``) or
    its attention core's (``selective``); ``none`` leaves them as they are. The block's own
    forward is wrapped, inside its module hooks."""
    name = check_mode(mode)
    if name == "none":
        return
    for block in blocks:
        done = getattr(block, "_monarch_recompute", None)
        if done == name:
            continue
        if done:
            raise ValueError(f"recompute: block {type(block).__name__} already recomputes '{done}'; cannot also "
                             f"recompute '{name}'")
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, _block=block, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)  # inference keeps nothing anyway
            if name == "selective":
                return selective.run(_inner, _block, *args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._monarch_recompute = name
