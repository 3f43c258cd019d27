"""Worker ranks for the compiled-block tests (started by dist_harness, 4 ranks): the tiny GPT
trained with ``parallelize(..., compile=True)`` in several layouts, one after another in one
launch (one startup and one Inductor cache for all). Each layout saves its losses, Dynamo's
graph-break and graph counts over its steps, how many blocks were compiled and the final
whole-model state (rank 0); the same layout run eagerly is saved beside it ("eager")."""

import os

import torch
from torch._dynamo.utils import counters

import torch_monarch
from dist_harness import run_worker
from torch_monarch.tensor_parallel_modules import vocab_parallel_cross_entropy
from tiny_gpt import GLOBAL_BATCH, batch, loss_fn, make_model, make_optimizer

STEPS = 4
# name: (mesh axes, parallelize keywords, layers)
LAYOUTS = {
    "dp4": (dict(dp=4), dict(), 2),
    "zero3_dp4": (dict(dp=4), dict(zero_stage=3), 2),
    "tp2_dp2": (dict(tp=2, dp=2), dict(), 2),
    "tp2_sp_zero3_dp2": (dict(tp=2, dp=2), dict(sequence_parallel=True, zero_stage=3), 2),
    "pp2_dp2": (dict(pp=2, dp=2), dict(schedule="1f1b", micro_batches=2), 4),
    "pp2_tp2_recompute_bf16": (dict(pp=2, tp=2), dict(schedule="interleaved_1f1b", micro_batches=4,
                                                      virtual_stages=2, recompute="full", dtype=torch.bfloat16), 4),
}


def run(name, compiled):
    axes, keywords, layers = LAYOUTS[name]
    model = make_model(layers=layers)
    mesh = torch_monarch.device_mesh(**axes)
    torch._dynamo.reset()  # each layout compiles its own graphs (Inductor's disk cache still helps)
    pm = torch_monarch.parallelize(model, mesh, compile=compiled, **keywords)
    opt = make_optimizer(pm.named_parameters())
    tp, dp, dp_rank = mesh.axis_size("tp"), mesh.axis_size("dp"), mesh.coordinate("dp")

    def loss(logits, targets):
        if tp == 1:
            return loss_fn(logits.float(), targets)
        return vocab_parallel_cross_entropy(logits, targets, mesh)

    local = GLOBAL_BATCH // dp
    losses = []
    counters.clear()
    for step in range(STEPS):
        inputs, targets = batch(step, GLOBAL_BATCH)
        x, y = inputs[dp_rank * local:(dp_rank + 1) * local], targets[dp_rank * local:(dp_rank + 1) * local]
        opt.zero_grad()
        losses.append(pm.train_step(x, y, loss))
        opt.step()
    return {"losses": losses, "graph_breaks": {k: dict(v) if isinstance(v, dict) else v
                                               for k, v in counters["graph_break"].items()},
            "unique_graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"].get("ok", 0),
            "compiled_blocks": sum(getattr(b, "_monarch_compiled", False) for b in model.blocks),
            "full": pm.state_dict()}


def main():
    # argv[1] names one layout or "all".
    import sys
    torch.set_num_threads(1)
    torch_monarch.init(timeout=float(os.environ.get("MONARCH_TIMEOUT_S", "300")))
    names = list(LAYOUTS) if sys.argv[1] == "all" else sys.argv[1].split(",")
    results = {}
    for name in names:
        results[name] = run(name, True)
        results[name]["eager"] = run(name, False)
    if os.environ["RANK"] != "0":
        for r in results.values():
            r.pop("full")
            r["eager"].pop("full")
    torch.save(results, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{os.environ['RANK']}.pt"))
    return 0


if __name__ == "__main__":
    run_worker(main)
