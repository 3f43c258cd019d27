"""Reading a model from its nn.Module on the meta device and planning it: time per model
(median of 5 runs, one process), next to the size of what was read. Prints a table and
writes JSON (default bench/results/read_model.json).

    .venv/bin/python bench/bench_read_model.py --out bench/results/read_model.json
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import models  # noqa: E402
import torch_monarch  # noqa: E402
from torch_monarch import api  # noqa: E402
from torch_monarch import planner  # noqa: E402

CASES = [
    # name, factory, sequence, global batch, cluster, devices
    ("gpt3-175b", models.gpt3_175b, 2048, 1536, "a100-80gb", 1024),
    ("llama3-8b", models.llama3_8b, 8192, 512, "h100-80gb", 64),
    ("gpt2-small", models.gpt2_small, 1024, 512, "a100-80gb", 64),
]


def run_once(factory, seq, batch, cluster, devices):
    t0 = time.perf_counter()
    with torch_monarch.meta_init():
        model = factory()
    t1 = time.perf_counter()
    info, graph = api.model_graph(model, torch.zeros(1, seq, dtype=torch.long), dtype="bf16")
    t2 = time.perf_counter()
    plan = planner.plan(graph, planner.cluster(cluster, devices),
                        api.runtime_training(info, batch, "bf16"))
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, info, plan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/read_model.json")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'model':<12} {'params':>10} {'build s':>8} {'read s':>8} {'plan s':>8} {'total s':>8}  plan")
    for name, factory, seq, batch, cluster, devices in CASES:
        runs = [run_once(factory, seq, batch, cluster, devices) for _ in range(args.repeats)]
        build, read, plan_s = (statistics.median(r[k] for r in runs) for k in range(3))
        info, plan = runs[-1][3], runs[-1][4]
        total = build + read + plan_s
        rows.append({"model": name, "params": info.total_params, "layers": len(info.graph.layers),
                     "build_s": build, "read_s": read, "plan_s": plan_s, "total_s": total,
                     "cluster": f"{cluster} x {devices}", "plan": plan.summary(),
                     "predicted_step_s": plan.prediction.step_time_s})
        print(f"{name:<12} {info.total_params / 1e9:>9.2f}B {build:>8.3f} {read:>8.3f} {plan_s:>8.3f} "
              f"{total:>8.3f}  {plan.summary()}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"repeats": args.repeats, "threads": 1, "results": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
