"""Worker ranks of the expert-parallel parity tests (started by dist_harness). One launch runs
every layout of argv[1] (comma-separated names of LAYOUTS) one after another and saves, per
layout, the global losses it computed, its parameters (expert shards with their first expert)
and the slots its capacity dropped."""

import os
import sys

import torch
import torch.nn.functional as F

import torch_monarch
from torch_monarch.experts import ExpertParallelExperts, expert_parallel
from torch_monarch.tensor_parallel_modules import tensor_parallel, vocab_parallel_cross_entropy
from dist_harness import run_worker
from moe_model import AUX, GLOBAL_BATCH, STEPS, VOCAB, aux_loss, batch, make_model, make_optimizer

# name: (mesh, capacity factor); "zero3" in the name: ZeRO-3 (experts sharded over edp, the
# rest over dp) instead of replicas.
LAYOUTS = {
    "ep2_dp2_zero3": (dict(dp=4, ep=2), 0.0),
    "ep4": (dict(dp=4, ep=4), 0.0),
    "ep2_dp2": (dict(dp=4, ep=2), 0.0),
    "ep2_tp2": (dict(dp=2, tp=2, ep=2), 0.0),
    "ep4_capacity": (dict(dp=4, ep=4), 1.0),
    "ep2_dp2_capacity": (dict(dp=4, ep=2), 1.0),
}


def train(name):
    shape, capacity = LAYOUTS[name]
    mesh = torch_monarch.device_mesh(**shape)
    model = expert_parallel(make_model(capacity), mesh)
    tp = mesh.axis_size("tp")
    if tp > 1:
        tensor_parallel(model, mesh)
    zero = "zero3" in name
    model = torch_monarch.fully_shard(model, mesh, zero_stage=3) if zero else torch_monarch.DataParallel(model, mesh)
    opt = make_optimizer(model)
    dp, rank = mesh.axis_size("dp"), mesh.coordinate("dp")
    per_rank = GLOBAL_BATCH // dp
    losses, dropped = [], []
    for step in range(STEPS):
        inputs, targets = batch(step)
        inputs, targets = inputs[rank * per_rank:(rank + 1) * per_rank], targets[rank * per_rank:(rank + 1) * per_rank]
        logits = model(inputs)
        if tp > 1:  # the head's logits stay split along the vocabulary
            ce = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), mesh)
        else:
            ce = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss = ce + AUX * aux_loss(model.module)
        opt.zero_grad()
        loss.backward()
        if step == 0 and not zero:  # under ZeRO-3 the gradients are shards: the parameters say enough
            grads = {n: p.grad.detach().clone() for n, p in model.module.named_parameters()}
        opt.step()
        # The global batch's loss: the mean over dp of the local means (the aux loss is global).
        total = ce.detach().clone().reshape(1)
        mesh.group("dp").all_reduce(total).wait()
        losses.append(total.item() / dp + AUX * aux_loss(model.module).item())
        dropped.append(sum(m.last_route.dropped_slots for m in model.modules() if isinstance(m, ExpertParallelExperts)))
    experts = {n: m.first_expert for n, m in model.module.named_modules()
               if isinstance(m, ExpertParallelExperts)}
    # Whole parameters (ZeRO-3 gathers them: each rank gets its experts' rows, whole).
    state = model.state_dict() if zero else {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {"losses": losses, "dropped": dropped, "experts": experts, "tp": tp, "grads": grads if not zero else {},
            "state": state, "held": sum(p.numel() for p in model.parameters())}


# parallelize(model, mesh, ...) with the mesh's ep: the engine's micro-batch loop and
# whole-model state dict. name: (mesh, zero stage, micro-batches)
PARALLELIZE = {
    "parallelize_ep2_dp2_m2": (dict(dp=4, ep=2), 0, 2),
    "parallelize_ep4_zero3": (dict(dp=4, ep=4), 3, 1),
    # Context and expert parallelism together: the sequence split over cp=2 (ring attention),
    # the experts over ep=2 taken from the dp x cp ranks, replicas over dp x cp.
    "parallelize_cp2_ep2": (dict(dp=2, cp=2, ep=2), 0, 1),
    "parallelize_cp4_ep4": (dict(dp=1, cp=4, ep=4), 0, 1),  # experts over the cp ranks alone
}


def train_parallelize(name):
    shape, zero, micro_batches = PARALLELIZE[name]
    mesh = torch_monarch.device_mesh(**shape)
    model = make_model()
    pm = torch_monarch.parallelize(model, mesh, zero_stage=zero, micro_batches=micro_batches)
    opt = make_optimizer(pm)
    dp, rank = mesh.axis_size("dp"), mesh.coordinate("dp")
    per_rank = GLOBAL_BATCH // dp

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + AUX * aux_loss(model)

    losses = []
    for step in range(STEPS):
        inputs, targets = batch(step)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        losses.append(pm.train_step(inputs[rows], targets[rows], loss_fn=loss_fn))
        opt.step()
    full = pm.state_dict()  # the whole model: every ep rank's experts gathered
    pm.load_state_dict(full)  # cut back into this rank's experts
    again = pm.state_dict()
    return {"losses": losses, "full": full, "reload_diff": max((again[k] - v).abs().max().item() for k, v in full.items()),
            "local_experts": [m.local_experts for m in model.modules() if isinstance(m, ExpertParallelExperts)]}


def main(names):
    out = {name: (train_parallelize(name) if name in PARALLELIZE else train(name)) for name in names.split(",")}
    torch.save(out, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    run_worker(main, sys.argv[1])
