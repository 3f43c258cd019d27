"""Worker for test_loss_parallel.py: tiny_gpt's model on 2 ranks, planned on a cluster whose
links are fast enough that the planner splits it over tp=2 by itself, trained 3 steps per case
with a plain cross-entropy or torch_monarch.vocab_parallel_cross_entropy; rank 0 trains one
process beside each case. Writes rank<r>.pt: {case: {"plan", "tp", "logits_width", "losses",
"reference_losses", "max_param_rel_diff"} or {"error"}}.

Cases:
  planned_plain     no pins, F.cross_entropy: train_step's one clear error (split logits)
  planned_vocab     no pins, vocab_parallel_cross_entropy (the quickstart's loop)
  planned_gather    no pins, loss_parallel=False, F.cross_entropy
  pinned_tp2        tp=2 pinned, vocab_parallel_cross_entropy
  pinned_gather     tp=2 pinned, loss_parallel=False, vocab_parallel_cross_entropy on whole logits
  declared_split    no pins, loss_parallel=True, a loss of its own on the split logits (the
                    runtime's per-token losses, not vocab_parallel_cross_entropy): no check
"""

import copy
import os
import sys

import torch

import torch_monarch
from torch_monarch import _runtime, planner
from tiny_gpt import VOCAB, batch, loss_fn, make_model

# One sequence per step: no dp layout can split it, so the fast links make the planner choose
# between tp and pp (tp: its all-reduces cost next to nothing; pp: a bubble with one micro-batch).
GLOBAL_BATCH, STEPS, LR = 1, 3, 1e-3
CASES = {
    "planned_plain": ({}, "plain"),
    "planned_vocab": ({}, "vocab"),
    "planned_gather": ({"loss_parallel": False}, "plain"),
    "pinned_tp2": ({"tp": 2}, "vocab"),
    "pinned_gather": ({"tp": 2, "loss_parallel": False}, "vocab"),
    "declared_split": ({"loss_parallel": True}, "own"),
}


def fast_cluster(world_size):
    """This machine's preset with links a thousand times faster than loopback Gloo: tp's
    all-reduces cost next to nothing, so splitting the model wins."""
    c = planner.cluster("cpu", world_size)
    c.intra_node_latency_s = c.inter_node_latency_s = 1e-8
    c.intra_node_bytes_per_s = c.inter_node_bytes_per_s = 1e13
    return c


def run_case(kwargs, loss_kind, rank, world):
    model = make_model()
    reference = copy.deepcopy(model)
    x0, _ = batch(0, GLOBAL_BATCH)
    pm = torch_monarch.parallelize(model, example_input=x0[:1], global_batch=GLOBAL_BATCH,
                                   cluster=fast_cluster(world.size), **kwargs)
    if loss_kind == "vocab":
        def loss(logits, y):
            return torch_monarch.vocab_parallel_cross_entropy(logits, y, pm.mesh)
    elif loss_kind == "own":  # a loss that handles split logits itself
        def loss(logits, y):
            group = pm.mesh.group("tp")
            return _runtime.vocab_parallel_cross_entropy(logits.contiguous(), y, group.rank * logits.shape[-1],
                                                         group, -100).mean()
    else:
        loss = loss_fn
    widths = []
    pm.stages[0].register_forward_hook(lambda m, i, out: widths.append(out.shape[-1]))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, GLOBAL_BATCH)
        opt.zero_grad()
        losses.append(pm.train_step(*pm.local_batch(x, y), loss))
        opt.step()
    state = pm.state_dict()
    out = {"plan": pm.plan.summary(), "tp": pm.tp, "logits_width": sorted(set(widths)), "losses": losses}
    if rank == 0:
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
        ref_losses = []
        for step in range(STEPS):
            x, y = batch(step, GLOBAL_BATCH)
            ref_opt.zero_grad()
            value = loss_fn(reference(x), y)
            value.backward()
            ref_opt.step()
            ref_losses.append(value.item())
        worst = 0.0
        for key, want in reference.state_dict().items():
            diff = (state[key] - want).norm().item() / max(want.norm().item(), 1e-2 * want.numel() ** 0.5)
            worst = max(worst, diff)
        out.update(reference_losses=ref_losses, max_param_rel_diff=worst)
    return out


def main():
    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=120)
    results = {}
    for name, (kwargs, loss_kind) in CASES.items():
        try:
            results[name] = run_case(kwargs, loss_kind, world.rank, world)
        except Exception as e:  # noqa: BLE001 - every case is reported, the test asserts
            import traceback
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    torch.save(results, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{world.rank}.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
