"""Expert parallelism: a Mixture-of-Experts model's experts split over the mesh's ``ep`` ranks,
tokens sent to them and back by all-to-all (GShard, Lepikhin et al. 2020).

The model keeps its own router; what is swapped is the module holding the experts, the way
Hugging Face's transformers 5 lays them out (Mixtral, Qwen2/3-MoE, ...): one module with
``gate_up_proj`` [experts, 2 * ffn, hidden] and ``down_proj`` [experts, hidden, ffn], called as
``experts(hidden_states, top_k_index, top_k_weights)``. Each ep rank keeps its experts' rows of
both tensors (a shard along dim 0, under the same names) and runs them on the tokens every ep
rank routed there; the token movement, the per-expert GEMMs and the load-balancing loss's
reductions are the C++ engine's (monarch/runtime/experts.h), shared with the C++ frontend.

    mesh = torch_monarch.device_mesh(dp=4, ep=2)        # experts over 2 ranks, each replicated twice
    model = expert_parallel(model, mesh)                 # swaps every experts module
    model = torch_monarch.DataParallel(model, mesh)      # experts averaged over "edp", the rest over dp

Gradients: an expert's weights see the tokens of every rank of their ep group; the loss each
rank computes is the mean over its own tokens, so the expert's gradient is scaled by 1 / ep in
backward, and averaging over the expert's replicas (the mesh's ``edp`` group, dp x cp / ep
ranks) then gives the gradient of the global mean, as for every other parameter.
"""

import math

import torch
from torch import nn

from . import _runtime

# Activation modules the engine's grouped MLP knows by name (others run as the model's own
# callable, expert by expert, in Python).
_ACTIVATIONS = {nn.SiLU: "silu", nn.ReLU: "relu"}


def _activation_name(act):
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    for cls, name in _ACTIVATIONS.items():
        if isinstance(act, cls):
            return name
    # Hugging Face's ACT2FN classes (SiLUActivation, GELUActivation, ...) are plain modules
    # named after the function.
    known = {"SiLUActivation": "silu", "SiLU": "silu", "GELUActivation": "gelu", "ReLU": "relu",
             "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh"}
    return known.get(type(act).__name__)


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` holds a MoE layer's experts in transformers 5's layout."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and gate_up.shape[0] == down.shape[0])


class ExpertParallelExperts(nn.Module):
    """This ep rank's experts of one MoE layer. ``gate_up_proj`` / ``down_proj`` hold experts
    [first_expert, first_expert + local_experts) of ``num_experts``; ``forward`` takes every
    token of this rank with its top-k experts and weights and returns the weighted sum of their
    outputs, as the unsplit module does.

    ``capacity_factor``: None keeps the wrapped module's (``capacity_factor`` attribute, 0 if
    it has none); 0 is dropless; otherwise each expert takes at most
    ceil(capacity_factor * tokens * top_k / experts) slots of the global micro-batch (tokens
    of every rank of the mesh's dp x cp group), first choices first, then earlier tokens in
    rank order (the rule ``examples/models.py``'s MoEExperts applies on one process)."""

    def __init__(self, experts: nn.Module, mesh, capacity_factor=None, name=None):
        super().__init__()
        where = f"'{name}' ({type(experts).__name__})" if name else type(experts).__name__
        if not is_experts_module(experts):
            raise ValueError(f"expert_parallel: {where} has no gate_up_proj [experts, 2 * ffn, "
                             "hidden] and down_proj [experts, hidden, ffn] parameters")
        # What this module computes is the gated MLP of those two tensors: anything else the
        # replaced module holds (biases, other weights) would be silently dropped.
        others = [n for n, _ in experts.named_parameters() if n not in ("gate_up_proj", "down_proj")]
        if others:
            raise ValueError(f"expert_parallel: {where} also holds {others}; only experts made of gate_up_proj "
                             "and down_proj (a gated MLP without biases) are split")
        self.mesh = mesh
        ep = mesh.axis_size("ep")
        if ep < 2:
            raise ValueError("expert_parallel: the mesh has ep=1: nothing to split (data parallelism alone "
                             "replicates the experts; build the mesh with ep > 1)")
        num_experts = experts.gate_up_proj.shape[0]
        if num_experts % ep:
            raise ValueError(f"expert_parallel: {where}: {num_experts} experts do not split over ep={ep} ranks "
                             "(ep must divide the number of experts)")
        self.num_experts = num_experts
        self.local_experts = num_experts // ep
        rank = mesh.group("ep").rank
        self.first_expert = rank * self.local_experts
        rows = slice(self.first_expert, self.first_expert + self.local_experts)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[rows].clone(),
                                         requires_grad=experts.gate_up_proj.requires_grad)
        self.down_proj = nn.Parameter(experts.down_proj.detach()[rows].clone(),
                                      requires_grad=experts.down_proj.requires_grad)
        for p in (self.gate_up_proj, self.down_proj):
            p._monarch_expert = True  # DataParallel averages these over the mesh's edp group
        if not hasattr(experts, "act_fn"):
            raise ValueError(f"expert_parallel: {where} has no act_fn (the activation between gate and up)")
        self.act_fn = experts.act_fn
        self.activation = _activation_name(self.act_fn)
        if capacity_factor is None:
            capacity_factor = float(getattr(experts, "capacity_factor", 0.0) or 0.0)
        if capacity_factor < 0 or not math.isfinite(capacity_factor):
            raise ValueError(f"expert_parallel: capacity_factor must be >= 0 (0: dropless), got {capacity_factor}")
        self.capacity_factor = float(capacity_factor)
        self.ep = ep
        self.last_route = None

    def extra_repr(self):
        return (f"experts {self.first_expert}..{self.first_expert + self.local_experts - 1} of {self.num_experts}, "
                f"ep={self.ep}, capacity_factor={self.capacity_factor}")

    def forward(self, hidden_states, top_k_index, top_k_weights):
        route = _runtime.plan_expert_dispatch(top_k_index, self.num_experts, self.capacity_factor,
                                              self.mesh.group("ep"), self.mesh.group("dp_cp"))
        self.last_route = route
        rows = _runtime.expert_dispatch(hidden_states, route)
        scale = 1.0 / self.ep
        gate_up = _ScaleGradient.apply(self.gate_up_proj, scale) if scale != 1.0 else self.gate_up_proj
        down = _ScaleGradient.apply(self.down_proj, scale) if scale != 1.0 else self.down_proj
        counts = list(route.rows_per_local_expert)
        if self.activation is not None:
            out = _runtime.grouped_mlp(rows, counts, gate_up, down, self.activation)
        else:
            outs = []
            for j, part in enumerate(rows.split(counts)):
                gate, up = torch.nn.functional.linear(part, gate_up[j]).chunk(2, dim=-1)
                outs.append(torch.nn.functional.linear(self.act_fn(gate) * up, down[j]))
            out = torch.cat(outs)
        return _runtime.expert_combine(out, top_k_weights, route)


class GlobalLoadBalancingLoss(nn.Module):
    """A load-balancing loss over the whole micro-batch: the expert shares and mean
    probabilities are summed over the mesh's dp x cp ranks, so every rank computes the value
    one process computes on the global batch (and its gradient, see experts.h)."""

    def __init__(self, num_experts, mesh):
        super().__init__()
        self.num_experts = num_experts
        self.mesh = mesh

    def forward(self, router_probs, top_k_index):
        return _runtime.load_balancing_loss(router_probs, top_k_index, self.num_experts, self.mesh.group("dp_cp"))


def _is_balance_loss(module):
    # examples/models.py's LoadBalancingLoss, or any module declaring itself one.
    return getattr(module, "monarch_load_balancing_loss", False) or type(module).__name__ == "LoadBalancingLoss"


def expert_parallel(model: nn.Module, mesh, capacity_factor=None):
    """Splits every experts module of ``model`` (see ``is_experts_module``) over the mesh's ep
    ranks, in place, and returns ``model``. Load-balancing loss modules (a module named
    ``LoadBalancingLoss`` with ``num_experts``, or with ``monarch_load_balancing_loss = True``)
    are swapped for ``GlobalLoadBalancingLoss`` so the loss is the global batch's. Every rank
    of the mesh must call it. A model without experts modules is an error."""
    swaps = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if is_experts_module(child):
                swaps.append((module, child_name, ExpertParallelExperts(child, mesh, capacity_factor, name=full)))
            elif _is_balance_loss(child) and mesh.axis_size("dp_cp") > 1:
                swaps.append((module, child_name, GlobalLoadBalancingLoss(child.num_experts, mesh)))
    if not any(isinstance(new, ExpertParallelExperts) for _, _, new in swaps):
        raise ValueError(f"expert_parallel: {type(model).__name__} has no experts module (a module with "
                         "gate_up_proj [experts, 2 * ffn, hidden] and down_proj [experts, hidden, ffn])")
    for parent, child_name, new in swaps:
        setattr(parent, child_name, new)
    return model


def expert_parameters(model: nn.Module):
    """The parameters expert_parallel split (averaged over the mesh's edp group)."""
    return [p for p in model.parameters() if getattr(p, "_monarch_expert", False)]
