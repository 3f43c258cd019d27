"""Worker ranks for the mixed-precision tests (started by dist_harness, 4 ranks): the tiny
GPT trained in bf16 over fp32 master weights in several layouts, one after another in one
launch. Each layout saves its losses, the dtypes the blocks computed in, the master
parameters' and gradients' dtypes, the bytes its dp group all-reduced and the final
whole-model state (rank 0)."""

import os

import torch

import torch_monarch
from dist_harness import run_worker
from torch_monarch.tensor_parallel_modules import vocab_parallel_cross_entropy
from tiny_gpt import GLOBAL_BATCH, batch, loss_fn, make_model, make_optimizer

STEPS = 6
# name: (mesh axes, parallelize keywords, layers, compute dtype)
LAYOUTS = {
    "dp4_fp32": (dict(dp=4), dict(), 2, None),
    "dp4": (dict(dp=4), dict(), 2, torch.bfloat16),
    "zero3_dp4": (dict(dp=4), dict(zero_stage=3), 2, torch.bfloat16),
    "tp2_dp2": (dict(tp=2, dp=2), dict(sequence_parallel=True), 2, torch.bfloat16),
    "pp2_dp2": (dict(pp=2, dp=2), dict(schedule="1f1b", micro_batches=2), 4, torch.bfloat16),
    "pp2_tp2_recompute": (dict(pp=2, tp=2), dict(schedule="interleaved_1f1b", micro_batches=4, virtual_stages=2,
                                                   recompute="full"), 4, torch.bfloat16),
    # A plan saying bf16 (its JSON round trip included), laid out by parallelize(plan=...).
    "plan_tp2_dp2": (dict(tp=2, dp=2), dict(zero_stage=0), 2, "plan"),
}


def run(name):
    axes, keywords, layers, dtype = LAYOUTS[name]
    model = make_model(layers=layers)
    computed = set()
    for block in model.blocks:
        block.register_forward_hook(lambda _m, _i, out: computed.add(str(out.dtype)))
    if dtype == "plan":
        from torch_monarch import planner
        world = axes.get("tp", 1) * axes.get("dp", 1) * axes.get("pp", 1)
        plan = torch_monarch.plan(model, batch(0, 1)[0], GLOBAL_BATCH, planner.cluster("a100-80gb", world),
                                  dtype="bf16", pp=1, micro_batch=GLOBAL_BATCH // axes["dp"], **axes, **keywords)
        plan = planner.loads(planner.dumps(plan))
        pm = torch_monarch.parallelize(model, plan=plan)
        mesh = pm.mesh
    else:
        mesh = torch_monarch.device_mesh(**axes)
        pm = torch_monarch.parallelize(model, mesh, dtype=dtype, **keywords)
    computed.clear()  # (planning read the model on meta, in its own fp32)
    opt = make_optimizer(pm.named_parameters())
    tp, dp, dp_rank = mesh.axis_size("tp"), mesh.axis_size("dp"), mesh.coordinate("dp")

    def loss(logits, targets):
        if tp == 1:
            return loss_fn(logits.float(), targets)
        return vocab_parallel_cross_entropy(logits, targets, mesh)

    local = GLOBAL_BATCH // dp
    losses = []
    dp_group = mesh.group("dp")
    before = dp_group.bytes_sent(torch_monarch._runtime.CollectiveKind.all_reduce)
    for step in range(STEPS):
        inputs, targets = batch(step, GLOBAL_BATCH)
        x, y = inputs[dp_rank * local:(dp_rank + 1) * local], targets[dp_rank * local:(dp_rank + 1) * local]
        opt.zero_grad()
        losses.append(pm.train_step(x, y, loss))
        if step == 0:
            grad_dtypes = sorted({str(p.grad.dtype) for p in pm.parameters() if p.grad is not None})
        opt.step()
    reduced = dp_group.bytes_sent(torch_monarch._runtime.CollectiveKind.all_reduce) - before
    # Between steps the modules show their master parameters again.
    leftovers = [n for n, m in model.named_modules() for k in m._parameters if k in m.__dict__]
    return {"losses": losses, "computed": sorted(computed), "grad_dtypes": grad_dtypes,
            "param_dtypes": sorted({str(p.dtype) for p in pm.parameters()}), "dp_all_reduce_bytes": reduced,
            "leftovers": leftovers, "full": pm.state_dict()}


def main():
    # argv[1] is ignored: every layout runs in one launch (one startup for all).
    torch.set_num_threads(1)
    torch_monarch.init(timeout=float(os.environ.get("MONARCH_TIMEOUT_S", "120")))
    results = {name: run(name) for name in LAYOUTS}
    if os.environ["RANK"] != "0":
        for r in results.values():
            r.pop("full")
    torch.save(results, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{os.environ['RANK']}.pt"))
    return 0


if __name__ == "__main__":
    run_worker(main)
