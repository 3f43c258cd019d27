"""CPU cost of the data-parallel gradient reduction alone: torch DDP against
torch_monarch.DataParallel (flat, hierarchical, hierarchical with bf16 or int8 between nodes),
side by side in one run.

4 ranks as 2 "nodes" x 2 ranks: two launchers (`torch_monarch.run --nnodes 2`, torchrun's
protocol) on 127.0.0.1, so there is no link limit and what is timed is the CPU the reduction
takes (copies, sums, rounding, socket work, page faults) on ranks that share this machine's
cores. The model is a few large parameters whose backward is trivial (gradient = the input), so
a step is almost only the reduction. Engines are interleaved step by step; per engine the median
and the minimum step over the timed steps (the first is warm-up).

    .venv/bin/python bench/dp_reduction_cpu.py [--numel 24000000] [--steps 6] [--out FILE]

Prints a table and writes JSON (default bench/results/dp_reduction_cpu.json).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINES = ["no communication", "torch DDP", "monarch DP flat", "monarch DP hierarchical",
           "monarch DP hierarchical bf16", "monarch DP hierarchical int8"]


def worker(args):
    import torch
    import torch.distributed as dist
    from torch import nn
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import torch_monarch
    torch_monarch.init(timeout=300)
    mesh = torch_monarch.device_mesh()
    pieces = 8

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = nn.ParameterList([nn.Parameter(torch.zeros(args.numel // pieces)) for _ in range(pieces)])

        def forward(self, x):
            return sum((p * x).sum() for p in self.ps)

    engines = {}
    for name in ENGINES:
        if name == "no communication":
            engines[name] = Wide()
        elif name == "torch DDP":
            engines[name] = nn.parallel.DistributedDataParallel(Wide(), bucket_cap_mb=25)
        else:
            compression = "int8" if "int8" in name else "bf16" if "bf16" in name else None
            engines[name] = torch_monarch.DataParallel(
                Wide(), mesh=mesh, bucket_cap_mb=25, reduction="hierarchical" if "hierarchical" in name else "flat",
                inter_node_compression=compression)
    x = torch.randn(args.numel // pieces)
    times = {name: [] for name in ENGINES}
    for _ in range(args.steps + 1):
        for name, model in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            model(x).backward()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
            times[name].append(elapsed.item())
    if dist.get_rank() == 0:
        with open(args.raw, "w") as f:
            json.dump({name: t[1:] for name, t in times.items()}, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=24_000_000, help="gradient values (fp32)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per engine (after one warm-up)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "dp_reduction_cpu.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--raw", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, OMP_NUM_THREADS="1", MONARCH_LOG_LEVEL="warn")
    started = time.time()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch_monarch.run", "--nnodes", "2", "--node-rank", str(k),
                               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               os.path.abspath(__file__), "--worker", "--numel", str(args.numel),
                               "--steps", str(args.steps), "--raw", raw], env=env)
             for k in range(2)]
    codes = [p.wait() for p in nodes]
    if any(codes):
        sys.exit(f"bench failed: launcher exit statuses {codes}")
    with open(raw) as f:
        times = json.load(f)
    os.unlink(raw)
    ddp = statistics.median(times["torch DDP"])
    rows = []
    print(f"reduction of {args.numel / 1e6:.1f}M fp32 gradients, 2 nodes x 2 ranks on loopback, "
          f"{args.steps} interleaved steps")
    print(f"{'engine':<32}{'median s':>10}{'min s':>8}{'vs DDP':>8}")
    for name in ENGINES:
        median = statistics.median(times[name])
        rows.append({"engine": name, "median_s": median, "min_s": min(times[name]), "vs_ddp": median / ddp,
                     "times_s": times[name]})
        print(f"{name:<32}{median:>10.3f}{min(times[name]):>8.3f}{median / ddp:>8.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"numel": args.numel, "steps": args.steps, "nodes": 2, "ranks_per_node": 2,
                   "wall_s": time.time() - started, "results": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
