"""Worker for test_hf_models.py: Hugging Face models through ``torch_monarch.parallelize``
on N ranks, each trained a few steps with its own loss (``labels=``) and padded batches, and
the same model trained by one process beside it (rank 0 runs that reference itself).

Scenarios (argv[1]):
  planned          every architecture, the layout the planner picks for it
  pinned:<json>    {"arch": {pins}, ...}: those architectures with those pins
Rank 0 writes {arch: {"plan", "losses", "reference_losses", "max_param_rel_diff", "error"}}
to MONARCH_TEST_OUTPUT/rank0.pt.
"""

import copy
import json
import os
import sys

import torch
from torch._dynamo.utils import counters

from dist_harness import run_worker
from hf_models import ARCHITECTURES, batch, build

# Adam's eps at 1e-6: a parameter whose exact gradient is zero (the key bias: softmax ignores a
# shift shared by all keys) gets rounding noise of ~1e-10 as gradient, which eps=1e-8 would
# turn into updates of lr size that differ run to run; 1e-6 keeps them at noise level.
GLOBAL_BATCH, STEPS, LR, EPS = 8, 3, 1e-3, 1e-6


def train(name, pins, rank):
    import torch_monarch
    pins = dict(pins)
    unlabelled = pins.pop("_unlabelled_rows", None)  # rows whose labels are all -100, every step
    model = build(name)
    reference = copy.deepcopy(model) if rank == 0 else None
    batches = [batch(name, GLOBAL_BATCH, seed=s) for s in range(STEPS)]
    if unlabelled:
        for b in batches:
            b["labels"][unlabelled[0]:unlabelled[1]] = -100
    example = {k: v[:2] for k, v in batches[0].items()}
    pm = torch_monarch.parallelize(model, example_input=example, global_batch=GLOBAL_BATCH, **pins)
    counters.clear()
    dp, r = pm.dp, pm.mesh.coordinate("dp")
    local = GLOBAL_BATCH // dp
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    losses = []
    for b in batches:
        opt.zero_grad()
        losses.append(pm.train_step({k: v[r * local:(r + 1) * local] for k, v in b.items()}))
        opt.step()
    state = pm.state_dict()  # collective under ZeRO / tp: every rank calls it
    out = {"plan": pm.plan.summary(), "losses": losses, "deferred_linears": pm.deferred_linears}
    if pins.get("compile"):
        # Dynamo's counts over the steps: graph breaks (with their reasons) and graphs made.
        out.update(graph_breaks={str(k): v for k, v in counters["graph_break"].items()},
                   unique_graphs=counters["stats"]["unique_graphs"],
                   compiled_blocks=sum(getattr(m, "_monarch_compiled", False) for m in model.modules()))
    if reference is not None:
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=EPS)
        ref_losses = []
        for b in batches:
            ref_opt.zero_grad()
            loss = reference(**b).loss
            loss.backward()
            ref_opt.step()
            ref_losses.append(loss.item())
        worst, worst_name, missing = 0.0, None, []
        for key, want in reference.state_dict().items():
            if key not in state:
                missing.append(key)
                continue
            # Relative in norm, against at least 1e-2 per element (biases start at zero).
            scale = max(want.float().norm().item(), 1e-2 * want.numel() ** 0.5)
            diff = (state[key].float() - want.float()).norm().item() / scale
            if diff > worst:
                worst, worst_name = diff, key
        out.update(reference_losses=ref_losses, max_param_rel_diff=worst, worst_param=worst_name, missing=missing)
    return out


def main(scenario):
    import torch_monarch
    torch.set_num_threads(1)
    torch_monarch.init(timeout=180)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ["RANK"])
    if scenario == "planned":
        jobs = {name: {} for name in ARCHITECTURES}
    elif scenario.startswith("pinned:"):
        jobs = json.loads(scenario[len("pinned:"):])
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    results = {}
    for key, pins in jobs.items():
        name = key.split("@")[0]  # "llama@tp2": the same architecture under several pins
        try:
            results[key] = train(name, pins, rank)
        except Exception as e:  # noqa: BLE001 - every architecture is reported, the test asserts
            import traceback
            traceback.print_exc()  # every rank's, in its log (rank 0's error is the one reported)
            results[key] = {"error": f"{type(e).__name__}: {e}"}
    if rank == 0:
        torch.save(results, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], "rank0.pt"))
    return 0


if __name__ == "__main__":
    run_worker(main, sys.argv[1])
