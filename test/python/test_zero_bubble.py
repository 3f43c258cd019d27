"""ZB-H1's split backward without replay (torch_monarch.zero_bubble): the input-gradient pass
(B) and the weight-gradient pass (W) of a stage give exactly the plain backward's gradients,
each parameter's hooks run once (in W), and a deferred linear outside B is a plain linear."""

import copy

import torch
from torch import nn

from torch_monarch import _runtime
from torch_monarch.zero_bubble import defer_weight_gradients


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.down = nn.Linear(16, 8, bias=False)
        self.shared = nn.Linear(8, 8)  # used twice: its deferred gradients add up

    def forward(self, x):
        h = self.down(torch.relu(self.norm(self.up(x))))
        return self.shared(self.shared(h) + x)


def work_for(model):
    return _runtime.AutogradStageWork(2, 1, lambda stage, mb, inputs: [model(inputs[0])], None, 1.0,
                                      lambda stage: list(model.parameters()))


def test_split_backward_equals_plain_backward_with_hooks_once():
    plain = Stage()
    split = copy.deepcopy(plain)
    assert defer_weight_gradients(split) == 3
    x = torch.randn(4, 5, 8)
    dy = torch.randn(4, 5, 8)
    inp = x.clone().requires_grad_()
    w = work_for(plain)
    w.forward(0, 0, [inp])
    (want_dx,) = w.backward(0, 0, [dy])
    calls = {}
    for name, p in split.named_parameters():
        p.register_hook(lambda g, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    inp2 = x.clone().requires_grad_()
    w2 = work_for(split)
    w2.forward(0, 0, [inp2])
    (dx,) = w2.backward_input(0, 0, [dy])
    assert torch.allclose(dx, want_dx, rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in split.parameters()), "B must not accumulate parameter gradients"
    assert calls == {}
    w2.backward_weight(0, 0)
    for (name, p), q in zip(split.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
    assert calls == {name: 1 for name, _ in split.named_parameters()}


def test_deferred_linear_outside_the_split_pass_is_a_plain_linear():
    plain = Stage()
    split = copy.deepcopy(plain)
    defer_weight_gradients(split)
    x = torch.randn(3, 8, requires_grad=True)
    plain(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    split(x2).square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, rtol=1e-6)
    for p, q in zip(split.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_split_backward_under_full_recompute_reaches_the_parameters():
    """Non-reentrant checkpointing hands saved tensors back as new tensors: W must still
    accumulate into the parameters themselves (no engine holding their accumulators here)."""
    from torch_monarch import recompute

    plain = Stage()
    split = copy.deepcopy(plain)
    defer_weight_gradients(split)
    recompute.apply([split], "full")  # the whole stage re-runs in backward
    x = torch.randn(4, 5, 8)
    dy = torch.randn(4, 5, 8)
    w = work_for(plain)
    w.forward(0, 0, [x.clone().requires_grad_()])
    w.backward(0, 0, [dy])
    w2 = work_for(split)
    w2.forward(0, 0, [x.clone().requires_grad_()])
    w2.backward_input(0, 0, [dy])
    w2.backward_weight(0, 0)
    for (name, p), q in zip(split.named_parameters(), plain.parameters()):
        assert p.grad is not None, name
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name


def test_frozen_and_recomputed_linears_are_left_as_they_are():
    from torch_monarch import recompute

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    recompute.apply([model[0]], "full")  # its forward is the checkpoint wrapper now
    assert defer_weight_gradients(model) == 1
    assert not getattr(model[0], "_monarch_deferred_weight_grad", False)
