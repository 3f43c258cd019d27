"""Activation recomputation (torch_monarch/recompute.py): full recompute keeps the memory the
planner predicts and changes no gradient (dropout included); selective is refused by name.
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


def test_full_recompute_cuts_peak_activation_memory_as_the_planner_predicts():
    out = tempfile.mktemp(suffix=".json")
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "recompute_memory.py"), "--out", out], check=True,
                   cwd=ROOT, timeout=600)
    with open(out) as f:
        r = json.load(f)
    for mode in ("none", "full"):
        # Peak growth over the forward and backward (high-water mark) vs the planner's
        # activation bytes (what is stored + full recompute's one-block workspace).
        assert r[mode]["peak_bytes"] == pytest.approx(r[mode]["predicted_bytes"], rel=0.15), (mode, r)
    assert r["measured_factor"] == pytest.approx(r["predicted_factor"], rel=0.15), r
    assert r["measured_factor"] < 0.5, r  # it does cut memory
    # Same loss, same gradients: the blocks re-ran with their dropout masks.
    assert r["none"]["loss"] == r["full"]["loss"]
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


def test_selective_and_unknown_modes_are_refused_by_name():
    with pytest.raises(ValueError, match="'selective'.*not supported by the runtime"):
        recompute.apply([nn.Linear(2, 2)], "selective")
    with pytest.raises(ValueError, match="unknown mode 'sometimes'"):
        recompute.check_mode("sometimes")
    # A plan asking for it is refused with the field named, before any group exists.
    from torch_monarch.api import _runtime_problems
    plan = torch_monarch.planner.Plan()
    plan.recompute = torch_monarch.planner.Recompute.selective
    assert "recompute: the plan recomputes the attention core only" in _runtime_problems(plan)[0]
    plan.recompute = torch_monarch.planner.Recompute.full
    assert _runtime_problems(plan) == []
