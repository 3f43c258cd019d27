"""The plan's compute dtype for layouts whose engine does not cast (plain replicas, tensor and
pipeline parallelism, weights ZeRO leaves out): the parameters stay in their own dtype (the
fp32 master weights the optimizer steps on, with fp32 gradients and optimizer state), and
each forward computes with copies cast to the compute dtype, as FSDP's ``MixedPrecision``
(``param_dtype``) and ZeRO's mixed precision do (Micikevicius et al. 2018, "Mixed Precision
Training", Sec. 3.1: an fp32 master copy, fp16/bf16 forward and backward).

How: the stage module's forward pre-hook casts every parameter once (a differentiable cast,
so the gradient reaches the master parameter in its dtype) and puts the copy in the owning
module's instance ``__dict__``, where attribute lookup finds it before ``nn.Module`` looks
in ``_parameters``; ``state_dict``, ``parameters()`` and the optimizer still see the masters.
Floating-point inputs are cast too (FSDP2's ``cast_forward_inputs``). The copies stay until
the backward of every forward that needs them has run (recomputation re-runs a block's
forward inside backward and must see the same copies), then go: between steps
``module.weight`` is the master again. A forward with autograd on whose backward never
runs keeps them until ``release()`` (``ParallelModel.train_step`` releases at its end,
whatever happened; a loop of its own that runs such forwards calls
``model.release_cast_copies()``).
"""

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map


def _cast_input(dtype):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x
    return cast


class CastParameters:
    """Casts ``module``'s parameters (those in ``only``, when given: ids) to ``dtype`` for its
    forwards; ``remove()`` undoes it."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, only=None):
        if not dtype.is_floating_point:
            raise ValueError(f"mixed precision: compute dtype {dtype} is not a floating-point dtype")
        self.module = module
        self.dtype = dtype
        # (owner module, attribute name, master parameter) for every place a parameter sits:
        # a tied weight sits in two modules and is cast once per forward.
        self._slots = [(m, n, p) for m in module.modules() for n, p in m._parameters.items()
                       if p is not None and p.is_floating_point() and p.dtype != dtype
                       and (only is None or id(p) in only)]
        self._pending = 0  # forwards whose backward has not run yet
        self._saved = []  # per forward in progress: the copies a no-grad forward displaced
        self._handles = [module.register_forward_pre_hook(self._before, with_kwargs=True),
                         module.register_forward_hook(self._after)]

    def _before(self, _module, args, kwargs):
        # What a forward without autograd replaces is put back after it: copies a pending
        # backward (its recomputation) still needs.
        self._saved.append({(id(owner), name): owner.__dict__[name] for owner, name, _ in self._slots
                            if name in owner.__dict__} if not torch.is_grad_enabled() else None)
        copies = {}
        for owner, name, p in self._slots:
            c = copies.get(id(p))
            if c is None:
                c = copies[id(p)] = p.to(self.dtype)
            owner.__dict__[name] = c
        cast = _cast_input(self.dtype)
        return tree_map(cast, args), tree_map(cast, kwargs)

    def _after(self, _module, _args, output):
        saved = self._saved.pop() if self._saved else None
        needs_grad = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not needs_grad:
            if self._pending == 0:
                self.release()
            elif saved is not None:
                for owner, name, _ in self._slots:
                    if (id(owner), name) in saved:
                        owner.__dict__[name] = saved[(id(owner), name)]
            return
        self._pending += 1
        state = {"done": False}

        def backward_started(grad):
            if not state["done"]:
                state["done"] = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            return grad

        for t in needs_grad:
            t.register_hook(backward_started)

    def _backward_done(self):
        self._pending = max(0, self._pending - 1)
        if self._pending == 0:
            self.release()

    def release(self):
        """Drops the cast copies: attribute lookup finds the master parameters again. Also
        what ends a step whose backward never came (a forward with autograd on and no
        backward, a loss or backward that raised): ParallelModel.train_step calls it."""
        self._pending = 0
        self._saved = []
        for owner, name, _ in self._slots:
            owner.__dict__.pop(name, None)

    def remove(self):
        self.release()
        for h in self._handles:
            h.remove()
        self._handles = []
