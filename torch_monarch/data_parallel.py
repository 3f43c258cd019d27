"""torch_monarch.DataParallel: DDP-like data parallelism driven by the C++ engine."""

import contextlib

import torch
from torch import nn

from . import _runtime
from .distributed import device_mesh
from .interop import refuse_foreign_layout


class DataParallel(nn.Module):
    """Averages gradients over the mesh's ``dp`` axis (dp x cp under context parallelism;
    experts split by ``expert_parallel`` over the mesh's ``edp`` group) while backward runs.

    Parameters and buffers are broadcast from rank 0 at construction; build any
    ``torch.optim`` optimizer over ``model.parameters()`` as usual. Gradients are packed in
    buckets of ``bucket_cap_mb`` in reverse registration order and all-reduced from autograd
    hooks. ``gradient_compression="bf16"`` halves the bytes, with error feedback.

    ``reduction="hierarchical"`` (for jobs over several nodes, where the link between nodes
    is the slow one) reduces each bucket inside the node, then between nodes 1/L of it per
    rank (L ranks per node, from ``LOCAL_WORLD_SIZE``), then gathers it inside the node;
    ``inter_node_compression="bf16"`` or ``"int8"`` (per-256-value scales) rounds only that
    slow hop, with error feedback. The plan's ``dp_reduction`` and
    ``inter_node_compression`` fields say the same.

    ``reduce_dtype`` (e.g. ``torch.bfloat16``): the buckets hold and move gradients in it,
    ``.grad`` stays in the parameters' dtype and is averaged there (mixed precision: fp32
    master weights, a bf16 plan's bf16 reduction; no error feedback).
    """

    def __init__(self, module: nn.Module, mesh=None, bucket_cap_mb: float = 25.0,
                 gradient_compression: str = None, broadcast_from_rank0: bool = True, exclude=(),
                 reduction: str = "flat", inter_node_compression: str = None, reduce_dtype=None):
        super().__init__()
        refuse_foreign_layout(module, "torch_monarch.DataParallel")
        if gradient_compression not in (None, "bf16"):
            raise ValueError(f"gradient_compression: expected None or 'bf16', got {gradient_compression!r}")
        if reduction not in ("flat", "hierarchical"):
            raise ValueError(f"reduction: expected 'flat' or 'hierarchical', got {reduction!r}")
        if inter_node_compression not in (None, "none", "bf16", "int8"):
            raise ValueError("inter_node_compression: expected None, 'bf16' or 'int8', "
                             f"got {inter_node_compression!r}")
        self.module = module
        self.mesh = mesh if mesh is not None else device_mesh()
        options = _runtime.DataParallelOptions()
        options.bucket_bytes = int(bucket_cap_mb * 1024 * 1024)
        options.bf16_compression = gradient_compression == "bf16"
        options.broadcast_from_root = broadcast_from_rank0
        options.hierarchical = reduction == "hierarchical"
        options.inter_node_compression = inter_node_compression or "none"
        if reduce_dtype is not None:
            options.reduce_dtype = str(reduce_dtype).replace("torch.", "")
        # ``exclude``: ids of parameters someone else synchronises (pipeline-tied weights).
        params = [p for p in module.parameters() if id(p) not in set(exclude)]
        # Replicas: every rank holding other tokens of the same layers, dp x cp (under context
        # parallelism the cp ranks hold other parts of the same sequences). Experts split by
        # torch_monarch.expert_parallel are replicated over fewer ranks, the mesh's edp group.
        experts = [p for p in params if getattr(p, "_monarch_expert", False)]
        params = [p for p in params if not getattr(p, "_monarch_expert", False)]
        self._engine = _runtime.DataParallelEngine(params, list(module.buffers()), self.mesh, "dp_cp", options)
        self._engines = [self._engine]
        if experts:
            # Flat over edp: a split by node is collective over the whole world, and a pipeline
            # stage without experts would never join it.
            options.hierarchical = False
            options.inter_node_compression = "none"
            self._engines.append(_runtime.DataParallelEngine(experts, [], self.mesh, "edp", options))

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():  # a forward without autograd makes no collective: not a step
            for engine in self._engines:
                engine.before_forward()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside only accumulates local gradients; the next synced backward
        averages the accumulated sum (same result as one larger batch)."""
        for engine in self._engines:
            engine.set_sync(False)
        try:
            yield
        finally:
            for engine in self._engines:
                engine.set_sync(True)

    @property
    def group(self):
        return self.mesh.group("dp_cp")

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (loads into the unwrapped model)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
