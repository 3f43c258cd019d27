"""Activation recomputation (torch_monarch/recompute.py, selective.py): full and selective
recompute keep the memory the planner predicts and change no gradient (dropout included).
Parity of recompute composed with dp, ZeRO, tp + sp and pipelines is in test_parallelize.py."""

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from torch import nn

import torch_monarch
from torch_monarch import recompute

from dist_harness import HERE

ROOT = os.path.dirname(os.path.dirname(HERE))


def test_recompute_cuts_peak_activation_memory_as_the_planner_predicts():
    out = tempfile.mktemp(suffix=".json")
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "recompute_memory.py"), "--out", out], check=True,
                   cwd=ROOT, timeout=600)
    with open(out) as f:
        r = json.load(f)
    for mode in ("none", "selective", "full"):
        # Peak growth over the forward and backward (high-water mark) vs the planner's
        # activation bytes (what is stored + the one block's rebuilt workspace).
        assert r[mode]["peak_bytes"] == pytest.approx(r[mode]["predicted_bytes"], rel=0.15), (mode, r)
        # Same loss: the blocks (or their attention cores) re-ran with their dropout masks.
        assert r[mode]["loss"] == r["none"]["loss"]
    for mode in ("selective", "full"):
        assert r[mode]["measured_factor"] == pytest.approx(r[mode]["predicted_factor"], rel=0.15), (mode, r)
    assert r["full"]["measured_factor"] < 0.5, r  # they do cut memory
    assert r["selective"]["measured_factor"] < 0.8, r
    assert r["grad_max_rel_diff"] < 1e-6, r


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.calls = 0

    def forward(self, x, scale=1.0):
        self.calls += 1
        return self.drop(torch.tanh(self.fc(x))) * scale


def test_full_recompute_reruns_each_block_once_in_backward_with_kwargs_and_hooks():
    torch.manual_seed(0)
    blocks = nn.ModuleList([Block(), Block()])
    hooks = []
    for b in blocks:
        b.register_forward_pre_hook(lambda m, i: hooks.append(m))
    recompute.apply(blocks, "full")
    x = torch.randn(4, 8, requires_grad=True)
    y = x
    for b in blocks:
        y = b(y, scale=2.0)
    assert [b.calls for b in blocks] == [1, 1]
    y.sum().backward()
    assert [b.calls for b in blocks] == [2, 2]  # re-run during backward
    assert len(hooks) == 2  # module hooks (ZeRO's gather / free) run once, outside the recomputed part
    with torch.no_grad():  # inference stores nothing: no checkpoint, one call
        blocks[0](x)
    assert blocks[0].calls == 3


def _gpt(dropout):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from models import GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(vocab=64, hidden=32, heads=4, layers=2, max_positions=16, dropout=dropout)


def _train_once(model, mode):
    from torch_monarch.sharded import _default_units
    recompute.apply(_default_units(model), mode)
    tokens = torch.randint(64, (3, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)  # dropout masks
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1)).backward()
    return {n: p.grad for n, p in model.named_parameters()}, torch.rand(1).item()


def test_selective_rebuilds_the_attention_core_of_an_inline_attention_bit_for_bit():
    from torch_monarch import selective
    plain, after = _train_once(_gpt(0.2), "none")
    before = dict(selective.STATS)
    grads, after_selective = _train_once(_gpt(0.2), "selective")
    dropped = selective.STATS["dropped"] - before["dropped"]
    # Per block: the softmax output, the dropout mask and the dropped-out scores A V reads.
    assert dropped == 2 * 3, selective.STATS
    assert selective.STATS["rebuilt"] - before["rebuilt"] == dropped
    for name, g in plain.items():
        assert torch.equal(grads[name], g), name  # same dropout masks, same ops: identical
    assert after_selective == after  # the caller's random stream is where a plain backward leaves it


def test_selective_under_mixed_precision_drops_only_the_attention_core():
    """Computing with bf16 copies of the weights (torch_monarch.mixed_precision puts them in the
    modules' instance dicts), a block's linears still read weights, not a second activation: the
    core is the same 3 tensors per block as in fp32 (it was every linear's output too, and the block
    kept more than without recomputation)."""
    from torch_monarch import selective
    from torch_monarch.mixed_precision import CastParameters
    from torch_monarch.sharded import _default_units
    model = _gpt(0.2)
    recompute.apply(_default_units(model), "selective")
    CastParameters(model, torch.bfloat16)
    before = dict(selective.STATS)
    tokens = torch.randint(64, (3, 17), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.float().reshape(-1, 64), tokens[:, 1:].reshape(-1)).backward()
    assert selective.STATS["dropped"] - before["dropped"] == 2 * 3, selective.STATS
    assert selective.STATS["rebuilt"] - before["rebuilt"] == 2 * 3


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_selective_on_a_block_without_attention_keeps_everything():
    from torch_monarch import selective
    torch.manual_seed(0)
    block = Mlp()
    recompute.apply([block], "selective")
    before = dict(selective.STATS)
    x = torch.randn(4, 8, requires_grad=True)
    block(x).sum().backward()
    assert selective.STATS == before  # no product of two activations: nothing to drop
    ref = Mlp()
    ref.load_state_dict(block.state_dict())
    x2 = x.detach().clone().requires_grad_()
    ref(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad)


class MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x, mask):
        q, k = self.qk(x).chunk(2, dim=-1)
        scores = (q @ k.transpose(-1, -2)).masked_fill(mask, -1e9)
        return scores.softmax(-1) @ x


def test_selective_refuses_to_rebuild_from_an_input_changed_in_place():
    torch.manual_seed(0)
    block = MaskedAttention()
    recompute.apply([block], "selective")
    x = torch.randn(2, 5, 8, requires_grad=True)
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    y = block(x, mask)
    mask.fill_(False)  # the attention core read it: rebuilding now would give other values
    with pytest.raises(RuntimeError, match="selective recompute: an input of aten.masked_fill.* was modified in "
                                           "place after the forward"):
        y.sum().backward()


def test_unknown_modes_and_two_modes_on_one_block_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown mode 'sometimes'"):
        recompute.check_mode("sometimes")
    block = Mlp()
    recompute.apply([block], "full")
    with pytest.raises(ValueError, match="already recomputes 'full'; cannot also recompute 'selective'"):
        recompute.apply([block], "selective")
    # Every planner mode is carried out: a plan asking for any of them is accepted.
    from torch_monarch.api import _runtime_problems
    plan = torch_monarch.planner.Plan()
    for mode in ("none", "selective", "full"):
        plan.recompute = getattr(torch_monarch.planner.Recompute, mode)
        assert _runtime_problems(plan) == []


def test_selective_keeps_autograd_checks_for_the_tensors_it_keeps():
    torch.manual_seed(0)
    block = Mlp()
    recompute.apply([block], "selective")
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 1.0
    y = block(h)  # its first linear saved h
    h.add_(1.0)   # changed in place before backward: the gradient would be wrong
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()



def test_selective_supports_double_backward_through_forwards_graph():
    # Unpacked tensors are re-attached to forward's nodes by autograd, so second derivatives
    # (a gradient penalty) equal those without recomputation.
    from torch_monarch.sharded import _default_units
    results = {}
    for mode in ("none", "selective"):
        block = _default_units(_gpt(0.0))[0]
        recompute.apply([block], mode)
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3)).requires_grad_()
        g, = torch.autograd.grad(block(x).pow(2).sum(), [x], create_graph=True)
        gg, = torch.autograd.grad(g.pow(2).sum(), [x])
        results[mode] = (g.detach(), gg)
    assert torch.allclose(results["none"][0], results["selective"][0], rtol=0, atol=0)
    assert torch.allclose(results["none"][1], results["selective"][1], rtol=1e-6, atol=1e-7)


class InPlaceAfterSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, dim=-1)
        probs = (q @ k.transpose(-1, -2)).softmax(-1)  # softmax saves its output
        probs.mul_(0.5)  # ... which is then changed in place
        return probs @ x


def test_selective_refuses_an_in_place_change_of_a_core_tensor_backward_needs():
    block = InPlaceAfterSoftmax()
    recompute.apply([block], "selective")
    with pytest.raises(RuntimeError, match="modifies in place a tensor of the attention core that backward needs"):
        block(torch.randn(2, 5, 8, requires_grad=True))
