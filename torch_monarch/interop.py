"""What torch_monarch refuses to wrap: a model already laid out by PyTorch's own distributed
wrappers. torch_monarch shards, splits and synchronises a model from its plan; a parameter
that is already a DTensor (DTensor tensor parallelism, FSDP2's ``fully_shard``) or a module
already under DDP / FSDP would be sharded or reduced twice, or not at all, so it is refused
with one error naming the module, never wrapped silently."""

import sys

from torch import nn


# Only wrappers whose modules are already imported are looked for: a model cannot hold an FSDP
# module or a DTensor unless the user's code imported them, and importing
# torch.distributed.fsdp / torch.distributed.tensor here would cost every call about a second
# (measured: 0.98 s of a 1.04 s fully_shard on a tiny model).
def _loaded(module: str, name: str):
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def _foreign_kinds():
    """(class, how to name it) of the wrappers the user's code has loaded."""
    kinds = [(nn.parallel.DistributedDataParallel, "DistributedDataParallel")]
    for name, what in (("FullyShardedDataParallel", "FSDP (FullyShardedDataParallel)"),
                       ("FSDPModule", "FSDP2 (fully_shard)")):
        cls = _loaded("torch.distributed.fsdp", name)
        if cls is not None:
            kinds.append((cls, what))
    return kinds


def _dtensor_class():
    # torch.distributed._tensor (the old name) imports this module too.
    return _loaded("torch.distributed.tensor", "DTensor")


def foreign_layout(model: nn.Module):
    """(module or parameter name, what lays it out) for the first part of ``model`` that a
    PyTorch distributed wrapper already owns, or None."""
    kinds = _foreign_kinds()
    for name, module in model.named_modules():
        for cls, what in kinds:
            if isinstance(module, cls):
                return name or "the model itself", what
    dtensor = _dtensor_class()
    if dtensor is not None:
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if isinstance(tensor, dtensor):
                return name, "DTensor (parallelize_module / distribute_tensor)"
    return None


def refuse_foreign_layout(model: nn.Module, caller: str):
    """Raises ValueError if PyTorch's distributed wrappers already lay out part of ``model``."""
    found = foreign_layout(model)
    if found is None:
        return
    where, what = found
    raise ValueError(f"{caller}: '{where}' is already laid out by {what}; torch_monarch shards, splits and "
                     "synchronises the model itself from its plan, and cannot run on top of another wrapper: "
                     "pass the plain module (before fully_shard, parallelize_module, DDP or FSDP)")
