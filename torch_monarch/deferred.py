"""Deferred initialization: a model built on the meta device (``torch_monarch.meta_init()``)
is planned and cut first; each rank then materializes only what it keeps.

``materialize(module, init_fn)`` gives every meta parameter and buffer under ``module`` real
storage and initializes it: the submodule's own ``reset_parameters()`` where it has one, then
``init_fn(submodule)`` when given (e.g. a Hugging Face model's ``_init_weights``). Every materialized
tensor starts as NaN (integers as their minimum): one still NaN afterwards was initialized
by nobody, and is an error naming it, never silent garbage. Tied weights stay tied: every
module holding the same meta tensor receives the same new one.
"""

import torch
from torch import nn


def is_deferred(module: nn.Module):
    """True if any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def _blank(t):
    out = torch.empty(t.shape, dtype=t.dtype)
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    elif out.dtype == torch.bool:
        out.fill_(False)
    else:
        out.fill_(torch.iinfo(out.dtype).min)
    return out


def _untouched(t):
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).min).any())


def materialize(module: nn.Module, init_fn=None, skip=(), root=None, buffers_only=False):
    """Materializes the meta tensors of ``module`` (not those inside the modules in ``skip``)
    and initializes them. ``root``: the module tree in which aliases of the same tensor are
    rebound too (default ``module``). ``buffers_only``: the buffers, parameters left on meta
    (initializers run on the modules then see meta parameters, which they leave as they
    are). Returns the number of elements materialized."""
    root = root if root is not None else module
    skipped = {id(m) for s in skip for m in s.modules()}
    replaced = {}
    touched = []
    for name, sub in module.named_modules():
        if id(sub) in skipped:
            continue
        own = False
        for kind in ("_buffers",) if buffers_only else ("_parameters", "_buffers"):
            table = getattr(sub, kind)
            for key, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in replaced:
                    data = _blank(t)
                    new = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
                    # What was noted on the meta tensor stays (how tensor parallelism cut it:
                    # a shard must not be taken for a replicated weight).
                    new.__dict__.update(getattr(t, "__dict__", {}))
                    replaced[id(t)] = (t, new)  # the old tensor kept alive: its id stays unique
                table[key] = replaced[id(t)][1]
                own = True
        if own:
            touched.append((name, sub))
    if not replaced:
        return 0
    _rebind(root, replaced)
    with torch.no_grad():
        for name, sub in touched:
            # The module's own initialization, then the model's (as a Hugging Face model
            # runs _init_weights after its modules are built).
            if hasattr(sub, "reset_parameters"):
                sub.reset_parameters()
            if init_fn is not None:
                # A tensor-parallel module is shown to init_fn as the module it replaced,
                # holding its shards (tensor_parallel_modules._init_proxy).
                init_fn(sub.init_proxy() if hasattr(sub, "init_proxy") else sub)
    new_ids = {id(new) for _, new in replaced.values()}
    missed = []
    for name, sub in touched:
        for kind in ("_parameters", "_buffers"):
            for key, t in getattr(sub, kind).items():
                if t is not None and id(t) in new_ids and _untouched(t.detach()):
                    missed.append(f"{name}.{key}" if name else key)
    if missed:
        shown = ", ".join(missed[:8]) + (f" and {len(missed) - 8} more" if len(missed) > 8 else "")
        how = "reset_parameters()" + (" or init_fn" if init_fn is not None else "")
        raise ValueError(f"deferred initialization: {shown} were not initialized by {how}; pass "
                         "init_fn=fn(module) to parallelize, or give the module a reset_parameters()")
    return sum(new.numel() for _, new in replaced.values())


def _rebind(root, replaced):
    """Every module under ``root`` that still holds a replaced meta tensor gets the new one."""
    for sub in root.modules():
        for kind in ("_parameters", "_buffers"):
            table = getattr(sub, kind)
            for key, t in list(table.items()):
                if t is not None and id(t) in replaced:
                    table[key] = replaced[id(t)][1]
