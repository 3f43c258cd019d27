"""Weight gradients that wait for the zero-bubble schedule's W pass (Qi et al. 2023, "Zero
Bubble Pipeline Parallelism"): every plain ``nn.Linear`` of the model runs through the C++
``deferred_linear``, whose backward returns the input gradient and, inside the pipeline
executor's input-gradient pass (B), queues (x, dL/dy) instead of computing dL/dW = dL/dyᵀ x;
the executor's weight pass (W) computes those GEMMs. B + W then cost one backward, where a
W that replays the stage's backward cost about 1.5. Everything else (norms, embeddings,
tensor-parallel linears, convolutions) gets its gradient in B, as before. Outside B (a
plain backward, 1F1B, inference) a deferred linear is an ordinary linear.
"""

from torch import nn

from . import _runtime


def _deferred_forward(module, x):
    return _runtime.deferred_linear(x, module.weight, module.bias)


def defer_weight_gradients(model: nn.Module) -> int:
    """Routes ``model``'s plain ``nn.Linear`` modules through ``deferred_linear``; returns how
    many. Left as they are: subclasses with their own forward, a forward already replaced on
    the instance (e.g. recomputation's checkpoint wrapper), and weights computed by hooks or
    parametrizations (weight norm): their gradients come in B as before."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
            if getattr(module, "_monarch_deferred_weight_grad", False) or "forward" in module.__dict__:
                continue
            if module._forward_pre_hooks or getattr(module, "parametrizations", None) is not None:
                continue
            module.forward = _deferred_forward.__get__(module)
            module._monarch_deferred_weight_grad = True
            count += 1
    return count
