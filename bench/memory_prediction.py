"""The planner's peak memory per rank beside the measured high-water mark, in fp32 and in bf16
mixed precision (fp32 master weights), for the layouts parallelize builds: plain replicas,
ZeRO-1/2/3, tensor parallelism and a pipeline, each with dp over the rest of 4 ranks.

The model: zero_memory.py's (8 blocks of two 2048 x 2048 linears with a tanh between, a
2048 x 2048 head; 285 MB of fp32 parameters), so that model state, not the process, dominates.
AdamW; 3 steps of 8 x 2048 per dp rank. Each (layout, dtype) runs in its own job under the
launcher; each rank reports VmHWM minus its VmRSS before the model was built (torch warmed up,
groups joined), worst rank. Predicted: planner.evaluate on the graph read from the model with
the TrainingConfig parallelize plans with (api.runtime_training: the runtime's own
accounting, e.g. fp32 master gradients under bf16), the same layout pinned.

    python3 bench/memory_prediction.py [--out bench/results/memory_prediction.json]
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from procmem import vm, warm_up_torch, worst_peak_growth, write_peak_growth  # noqa: E402
from zero_memory import BATCH, STEPS, WIDTH, make_model  # noqa: E402

RANKS = 4
# name: (pp, dp, tp, zero, micro-batches)
LAYOUTS = {
    "dp4": (1, 4, 1, 0, 1),
    "zero1 dp4": (1, 4, 1, 1, 1),
    "zero2 dp4": (1, 4, 1, 2, 1),
    "zero3 dp4": (1, 4, 1, 3, 1),
    "tp2 dp2": (1, 2, 2, 0, 1),
    "pp2 dp2 1f1b": (2, 2, 1, 0, 2),
}
DTYPES = ("fp32", "bf16")
WITHIN = 0.15  # the bar: predicted within 15% of measured


def tp_plan():
    """Each block's first linear split by columns, its second by rows (Megatron's MLP)."""
    import torch_monarch
    return {"blocks.*.a": torch_monarch.Colwise(), "blocks.*.b": torch_monarch.Rowwise()}


def predicted(layout, dtype):
    import torch
    from torch_monarch import planner
    from torch_monarch.api import model_graph, runtime_training
    pp, dp, tp, zero, m = LAYOUTS[layout]
    model = make_model()
    info, graph = model_graph(model, torch.randn(1, WIDTH), dtype=dtype, tp_plan=tp_plan() if tp > 1 else None)
    training = runtime_training(info, BATCH * dp, dtype, {"tp": tp, "pp": pp}, param_dtype=torch.float32)
    # This machine's cores shared by RANKS ranks, as cluster.detect() says (the overlap
    # contention decides the plan's zero_overlap, which the runtime then runs).
    from torch_monarch.cluster import _cores, cpu_overlap_contention
    cluster = planner.cluster("cpu", RANKS, overlap_contention=cpu_overlap_contention(RANKS, float(_cores())))
    plan = planner.evaluate(graph, cluster, training, tp=tp, pp=pp, dp=dp, zero=zero,
                            micro_batch=BATCH // m, schedule="1f1b" if pp > 1 else "none", recompute="none",
                            allow_over_memory=True)
    mem = plan.prediction.memory
    return {"total": plan.prediction.memory_bytes_per_device, "params": mem.params, "grads": mem.grads,
            "optimizer": mem.optimizer, "activations": mem.activations, "buffers": mem.buffers}


def worker(layout, dtype, out_dir):
    import torch
    import torch_monarch
    torch.set_num_threads(1)
    pp, dp, tp, zero, m = LAYOUTS[layout]
    torch_monarch.init()
    mesh = torch_monarch.device_mesh(pp=pp, dp=dp, tp=tp)
    warm_up_torch()
    baseline = vm("VmRSS")
    torch.manual_seed(0)
    # (Rebinding, as users write it: the unwrapped model's other pipeline stages are freed.)
    pm = torch_monarch.parallelize(make_model(), mesh, zero_stage=zero, micro_batches=m, tp_plan=tp_plan() if tp > 1 else None,
                                   schedule="1f1b" if pp > 1 else None,
                                   dtype=torch.bfloat16 if dtype == "bf16" else None)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(mesh.coordinate("dp"))

    def loss_fn(out, _target):
        return out.float().square().mean()

    for _ in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=g)
        opt.zero_grad(set_to_none=True)
        pm.train_step(x, torch.zeros(BATCH), loss_fn)
        opt.step()
    write_peak_growth(out_dir, baseline)


def measure(layout, dtype):
    return worst_peak_growth(__file__, RANKS, layout, dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    print(f"{RANKS} ranks, AdamW, {BATCH} x {WIDTH} per dp rank, {STEPS} steps; MiB per rank (worst rank)")
    print(f"{'layout':<14} {'dtype':<5} {'measured':>9} {'predicted':>10} {'pred/meas':>10}  "
          "predicted: params / grads / optimizer / activations / buffers")
    for layout in args.layouts:
        for dtype in DTYPES:
            got = measure(layout, dtype)
            want = predicted(layout, dtype)
            ratio = want["total"] / got
            rows.append(dict(layout=layout, dtype=dtype, measured=got, predicted=want, ratio=ratio))
            parts = " / ".join(f"{want[k] / 2**20:.0f}" for k in ("params", "grads", "optimizer", "activations",
                                                                  "buffers"))
            print(f"{layout:<14} {dtype:<5} {got / 2**20:>9.0f} {want['total'] / 2**20:>10.0f} {ratio:>10.2f}  {parts}")
    inside = sum(abs(r["ratio"] - 1) <= WITHIN for r in rows)
    print(f"within {WITHIN:.0%} of measured: {inside} of {len(rows)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(ranks=RANKS, batch=BATCH, width=WIDTH, steps=STEPS, within=WITHIN, rows=rows), f, indent=2)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
