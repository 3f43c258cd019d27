"""Tensor parallelism of PyTorch's own attention block, nn.MultiheadAttention
(ParallelMultiheadAttention: its heads split over tp, found by structure, not by name), on
4 ranks (tp=2 x dp=2), one launch for three variants (mha_workers.py): plain (the fused
scaled_dot_product_attention path), need_weights=True (the averaged attention weights all-
reduced over the heads), and add_bias_kv. Each trains 4 AdamW steps with a causal mask and
padded keys against one process.

Tolerances: losses 1e-5 relative, parameters 1e-4 relative in norm (fp32; the tp all-reduces
and dp averages add in another order; measured 1e-8 to 1e-6), except the key part of
in_proj_bias, whose exact gradient is zero: 1e-4 absolute; the returned attention weights 1e-5."""

import functools

import pytest
import torch

from dist_harness import launch
from mha_model import GLOBAL_BATCH, STEPS, batch, loss_fn, make_model
from mha_workers import VARIANTS


@functools.lru_cache(maxsize=None)
def results():
    r = launch(4, "all", timeout=300, worker="mha_workers.py")
    assert r.ok, r.describe()
    return [torch.load(r.result_path(k)) for k in range(4)]


@functools.lru_cache(maxsize=None)
def reference(variant):
    torch.set_num_threads(1)
    model = make_model(**VARIANTS[variant])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    losses, weights = [], None
    for step in range(STEPS):
        x, y, pad = batch(step)
        opt.zero_grad()
        loss = loss_fn(model(x, pad), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0 and model.blocks[0].weights is not None:
            weights = model.blocks[0].weights.clone()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, weights


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_multihead_attention_split_by_heads_matches_one_process(variant):
    want_losses, want_state, want_weights = reference(variant)
    for rank, res in enumerate(results()):
        r = res[variant]
        assert r["split"] == ["ParallelMultiheadAttention"] * 2, f"rank {rank}: {r['split']}"
        assert r["local_heads"] == [2, 2], f"rank {rank}: {r['local_heads']}"
        for step, (got, want) in enumerate(zip(r["losses"], want_losses)):
            assert got == pytest.approx(want, rel=1e-5), f"{variant} rank {rank}: loss of step {step}"
        if want_weights is not None:
            # This rank's dp slice of the batch (either half): the weights averaged over all 4 heads.
            local = GLOBAL_BATCH // 2
            got = r["weights"]
            assert got.shape == (local,) + tuple(want_weights.shape[1:])
            matches = [((got - want_weights[k * local:(k + 1) * local]).abs().max().item()) for k in range(2)]
            assert min(matches) <= 1e-5, f"{variant} rank {rank}: attention weights differ by {min(matches):.2e}"
    state = results()[0][variant]["full"]
    assert set(state) == set(want_state)
    for key, want in want_state.items():
        got = state[key]
        if key.endswith("in_proj_bias"):
            # The key bias's exact gradient is zero (softmax ignores a shift shared by every key):
            # both sides move it by rounding noise alone (measured 1e-5 in norm): absolute bound.
            (gq, gk, gv), (wq, wk, wv) = got.chunk(3), want.chunk(3)
            assert (gk - wk).norm().item() <= 1e-4, f"{variant}: {key} (key part)"
            got, want = torch.cat([gq, gv]), torch.cat([wq, wv])
        rel = ((got - want).norm() / max(want.norm().item(), 1e-2)).item()
        assert rel <= 1e-4, f"{variant}: {key} differs by {rel:.2e} in norm"


def test_multihead_attention_is_planned_for_tensor_parallelism():
    """The planner sees the attention's heads: tp=2 is a layout it can plan (before, "pins.tp:
    2 splits nothing")."""
    from torch_monarch import api, planner
    model = make_model()
    x, _, pad = batch(0)
    plan = api.plan(model, (x[:2], pad[:2]), GLOBAL_BATCH, planner.cluster("cpu", 4), tp=2)
    assert plan.mesh.tp == 2, plan.summary()
