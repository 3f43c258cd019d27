"""Workers for test_checkpoint_experts.py: checkpoints of expert-parallel models (moe_model.py's
MoE decoder, 8 experts) saved in one ep and loaded into another, on 4 ranks, in one launch.

argv[1] = ROOT: ROOT/plain holds the one-process checkpoint (written by the test before the
launch). The workers

  * train K steps in each source layout, save to ROOT/<source>, dump this rank's state (the
    saved model's, to assemble its full state from), train K more (the uninterrupted run);
  * for each (source, target) of RESUMES: build a fresh model in the target layout, load the
    checkpoint, dump this rank's state right after the load, train K steps.

Layouts (all on dp=4 ranks): "dp_ep2" / "dp_ep4": DataParallel around expert_parallel (experts
replicated over edp); "zero3_ep2" / "zero3_ep4": parallelize(zero_stage=3) (experts ZeRO-sharded
over edp, the rest over dp).

A dump is, per parameter name (the model's): the local parameter, its AdamW state, and where it
sits: {"first": first expert or None, "rows": rows of the tensor ZeRO cut (the ep-local tensor),
"zero": (rank, size) of the group ZeRO shards it over, or None}. The test assembles full tensors
from these with the engines' documented rules (experts.py: ep rank r holds experts
[r E/ep, (r+1) E/ep); fully_shard: rank i of n holds rows [i c, (i+1) c) of the tensor,
c = ceil(rows / n)), independently of checkpoint.py's placements.
"""

import os
import sys
import time

import torch
import torch.nn.functional as F

import torch_monarch
from torch_monarch import checkpoint
from torch_monarch.experts import ExpertParallelExperts, expert_parallel
from dist_harness import run_worker
from moe_model import AUX, GLOBAL_BATCH, VOCAB, aux_loss, batch, make_model

K = 2
SOURCES = ["dp_ep2", "zero3_ep2"]
# (checkpoint, target layout): ep2 -> ep4 (both kinds), ep2 -> ep2 of the other kind, the same
# layout (bitwise), and the one-process checkpoint into ep2 (both kinds).
RESUMES = [("dp_ep2", "dp_ep4"), ("dp_ep2", "zero3_ep2"), ("dp_ep2", "dp_ep2"),
           ("zero3_ep2", "zero3_ep4"), ("zero3_ep2", "dp_ep2"), ("zero3_ep2", "zero3_ep2"),
           ("plain", "zero3_ep2"), ("plain", "dp_ep2")]


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)


def build(layout):
    kind, ep = layout.split("_ep")
    mesh = torch_monarch.device_mesh(dp=4, ep=int(ep))
    model = make_model()
    dp, rank = mesh.axis_size("dp"), mesh.coordinate("dp")
    rows = slice(rank * GLOBAL_BATCH // dp, (rank + 1) * GLOBAL_BATCH // dp)
    if kind == "dp":
        wrapped = torch_monarch.DataParallel(expert_parallel(model, mesh), mesh)

        def step(inputs, targets):
            logits = wrapped(inputs[rows])
            ce = F.cross_entropy(logits.reshape(-1, VOCAB), targets[rows].reshape(-1))
            (ce + AUX * aux_loss(model)).backward()
            total = ce.detach().clone().reshape(1)
            mesh.group("dp").all_reduce(total).wait()  # the global batch's loss
            return total.item() / dp + AUX * aux_loss(model).item()
    else:
        wrapped = torch_monarch.parallelize(model, mesh, zero_stage=3)

        def loss_fn(logits, targets):
            return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + AUX * aux_loss(model)

        def step(inputs, targets):
            return float(wrapped.train_step(inputs[rows], targets[rows], loss_fn=loss_fn))
    return mesh, model, wrapped, make_optimizer(wrapped.parameters()), step


def train(opt, step, first, count):
    losses = []
    for s in range(first, first + count):
        opt.zero_grad()
        losses.append(step(*batch(s)))
        opt.step()
    return losses


def dump(mesh, model, wrapped, opt):
    """This rank's parameters and AdamW state with where they sit (see the module's doc)."""
    first = {}
    for mname, m in model.named_modules():
        if isinstance(m, ExpertParallelExperts):
            for pname in ("gate_up_proj", "down_proj"):
                first[f"{mname}.{pname}"] = m.first_expert
    zero = not isinstance(wrapped, torch_monarch.DataParallel)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()} if not zero else \
        {n: s for st in wrapped.stages for n, s in st._shapes.items()}
    named = wrapped.named_parameters() if zero else wrapped.module.named_parameters()
    out = {}
    for name, p in named:
        group = mesh.group("edp" if name in first else "dp") if zero else None
        state = {k: (v.detach().clone() if torch.is_tensor(v) else torch.tensor(v))
                 for k, v in opt.state.get(p, {}).items()}
        out[name] = {"param": p.detach().clone(), "state": state, "first": first.get(name),
                     "rows": shapes[name][0], "zero": (group.rank, group.size) if group is not None else None}
    return out


def main(root):
    torch.set_num_threads(1)
    out = {"sources": {}, "resumes": {}, "seconds": {}}
    for source in SOURCES:
        t = time.perf_counter()
        mesh, model, wrapped, opt, step = build(source)
        before = train(opt, step, 0, K)
        checkpoint.save(wrapped, opt, os.path.join(root, source), step=K)
        state = dump(mesh, model, wrapped, opt)
        full = wrapped.state_dict() if source.startswith("zero3") else None  # the engine's gather
        after = train(opt, step, K, K)
        out["sources"][source] = {"losses": before + after, "dump": state, "full": full}
        out["seconds"][f"save {source}"] = time.perf_counter() - t
    # Experts split but no mesh on the model (no DataParallel, no parallelize): every rank
    # would take itself for one process and write over the others. Refused.
    mesh = torch_monarch.device_mesh(dp=4, ep=2)
    try:
        checkpoint.save(expert_parallel(make_model(), mesh), None, os.path.join(root, "refused"))
        out["refused"] = None
    except checkpoint.CheckpointError as e:
        out["refused"] = str(e)
    for source, target in RESUMES:
        t = time.perf_counter()
        mesh, model, wrapped, opt, step = build(target)
        info = checkpoint.load(wrapped, opt, os.path.join(root, source))
        state = dump(mesh, model, wrapped, opt)
        full = wrapped.state_dict() if target.startswith("zero3") else None
        out["resumes"][f"{source}->{target}"] = {"step": info["step"], "dump": state, "full": full,
                                                 "losses": train(opt, step, K, K)}
        out["seconds"][f"{source}->{target}"] = time.perf_counter() - t
    torch.save(out, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    run_worker(main, sys.argv[1])
