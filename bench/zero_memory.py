"""Peak memory per rank (high-water mark) of ZeRO-1/2/3 vs data parallelism, side by side,
with torch's DistributedDataParallel as the baseline, on 2 and 4 ranks.

The model: 8 blocks of two 2048 x 2048 linears (+ bias, tanh) and a 2048 x 2048 head, fp32,
256 MiB of parameters; AdamW; 3 steps of a batch of 8 x 2048 per rank. Each layout runs in
its own job (started by the launcher); each rank reports its peak resident memory over the
whole run (VmHWM) minus its resident memory before the model was built (torch imported,
process group joined): parameters, gradients, optimizer state, communication buffers and
activations at their worst moment. glibc's mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_)
so freed tensors leave the process at once.

    python3 bench/zero_memory.py [--ranks 2 4] [--out bench/results/zero_memory.json]
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from procmem import vm, warm_up_torch, worst_peak_growth, write_peak_growth
WIDTH, BLOCKS, BATCH, STEPS = 2048, 8, 8, 3
LAYOUTS = ["torch_ddp", "dp", "zero1", "zero2", "zero3"]


def make_model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return x + torch.tanh(self.b(torch.tanh(self.a(x))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
            self.head = nn.Linear(WIDTH, WIDTH, bias=False)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    return Model()


def predicted_peak(layout, ranks):
    """The planner's memory for this layout (planner.evaluate on the graph read from the model,
    a `cpu` cluster of `ranks` devices, fp32 weights, gradients and activations, AdamW's two
    fp32 moments): parameters + gradients + optimizer state + activations + buffers (ZeRO-3's
    gathered units and unsharded gradients of the units in flight)."""
    import torch
    from torch_monarch import planner
    from torch_monarch.api import model_graph
    _, graph = model_graph(make_model(), torch.randn(1, WIDTH), dtype="fp32")
    training = planner.training(BATCH * ranks, compute_dtype="fp32", param_bytes=4.0, grad_bytes=4.0,
                                optimizer_bytes=8.0, activation_bytes=4.0)
    zero = 0 if layout in ("dp", "torch_ddp") else int(layout[-1])
    plan = planner.evaluate(graph, planner.cluster("cpu", ranks), training, tp=1, pp=1, dp=ranks, zero=zero,
                            micro_batch=BATCH, schedule="none", recompute="none", allow_over_memory=True)
    m = plan.prediction.memory
    return {"total": plan.prediction.memory_bytes_per_device, "params": m.params, "grads": m.grads,
            "optimizer": m.optimizer, "activations": m.activations, "buffers": m.buffers}


def worker(layout, out_dir):
    import torch
    import torch_monarch
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if layout == "torch_ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo")
    else:
        torch_monarch.init()
        mesh = torch_monarch.device_mesh()
    warm_up_torch()
    baseline = vm("VmRSS")

    torch.manual_seed(0)
    model = make_model()
    if layout == "torch_ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        params = list(wrapped.parameters())
    elif layout == "dp":
        wrapped = torch_monarch.DataParallel(model, mesh=mesh)
        params = list(wrapped.parameters())
    else:
        wrapped = torch_monarch.fully_shard(model, mesh=mesh, zero_stage=int(layout[-1]))
        params = list(wrapped.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=g)
        opt.zero_grad(set_to_none=True)
        wrapped(x).square().mean().backward()
        opt.step()
    write_peak_growth(out_dir, baseline)


def run(layout, ranks):
    return worst_peak_growth(__file__, ranks, layout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS)
    parser.add_argument("--out")
    args = parser.parse_args()
    model_bytes = (BLOCKS * 2 * (WIDTH * WIDTH + WIDTH) + WIDTH * WIDTH) * 4
    results = {"model_bytes": model_bytes, "steps": STEPS, "batch_per_rank": BATCH, "ranks": {}, "predicted": {}}
    print(f"model {model_bytes / 2**20:.0f} MiB fp32, AdamW; peak growth per rank (worst rank), MiB, "
          f"measured / planner's prediction")
    print(f"{'ranks':>5} " + " ".join(f"{l:>16}" for l in args.layouts) + "   zero3/dp")
    for n in args.ranks:
        row = {layout: run(layout, n) for layout in args.layouts}
        predicted = {layout: predicted_peak(layout, n) for layout in args.layouts}
        results["ranks"][str(n)] = row
        results["predicted"][str(n)] = predicted
        ratio = row["zero3"] / row["dp"] if "zero3" in row and "dp" in row else float("nan")
        cells = " ".join(f"{row[l] / 2**20:>8.0f} /{predicted[l]['total'] / 2**20:>6.0f}" for l in args.layouts)
        print(f"{n:>5} {cells}   {ratio:>8.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
