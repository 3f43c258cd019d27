"""Data-parallel engines vs torch.nn.parallel.DistributedDataParallel, side by side in one run.

Two ranks with Gloo on loopback train the same GPT-style model on the same data with:
torch DDP, torch_monarch.DataParallel, DataParallel with bf16 compression, and
torch_monarch.fully_shard (ZeRO-3). Reports the median step time (and its ratio to DDP),
bytes each rank sends per step, and each rank's persistent parameter + gradient +
optimizer storage. Prints a table and writes JSON (default bench/results/data_parallel.json).

    .venv/bin/python bench/bench_data_parallel.py [--steps 30] [--out path]
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

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch import nn
import torch.nn.functional as F

HIDDEN, HEADS, LAYERS, SEQ, VOCAB, BATCH_PER_RANK = 256, 8, 4, 64, 2048, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, h // HEADS).permute(2, 0, 3, 1, 4)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        a = ((q @ k.transpose(-2, -1)) / (h // HEADS) ** 0.5).masked_fill(causal, float("-inf")).softmax(-1)
        x = x + self.proj((a @ v).transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(HIDDEN)

    def forward(self, t):
        x = self.wte(t) + self.wpe(torch.arange(t.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.ln_f(x) @ self.wte.weight.t()


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def run_engine(name, steps, rank, world):
    import torch_monarch
    torch.manual_seed(0)
    model = GPT()
    counted = {"bytes": 0.0}
    if name == "torch DDP":
        wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        n = world

        def counting_hook(state, bucket):  # ring all-reduce bytes, as torch_monarch counts them
            counted["bytes"] += 2 * (n - 1) / n * bucket.buffer().numel() * bucket.buffer().element_size()
            return default_hooks.allreduce_hook(None, bucket)
        params = list(wrapped.parameters())
    elif name.startswith("monarch DP"):
        mesh = torch_monarch.device_mesh()
        wrapped = torch_monarch.DataParallel(model, mesh=mesh, bucket_cap_mb=25,
                                             gradient_compression="bf16" if "bf16" in name else None)
        params = list(wrapped.parameters())
    else:  # monarch ZeRO-3
        mesh = torch_monarch.device_mesh()
        wrapped = torch_monarch.fully_shard(model, mesh=mesh, zero_stage=3)
        params = list(wrapped.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    if name != "torch DDP":
        mesh.group("dp").reset_counters()  # count training steps only, not the initial broadcast
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps):
        tokens = torch.randint(VOCAB, (BATCH_PER_RANK, SEQ + 1), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = wrapped(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    warm = times[3:]
    # Bytes per step: torch_monarch's counters; DDP's from a counting comm hook on one extra
    # step (the timed steps run without the hook).
    if name == "torch DDP":
        wrapped.register_comm_hook(None, counting_hook)
        opt.zero_grad()
        tokens = torch.randint(VOCAB, (BATCH_PER_RANK, SEQ + 1), generator=g)
        F.cross_entropy(wrapped(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        bytes_per_step = counted["bytes"]
    else:
        group = mesh.group("dp")
        bytes_per_step = group.total_bytes_sent() / steps
    grads = [p.grad for p in params]
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    persistent = tensor_bytes(params) + tensor_bytes(grads) + tensor_bytes(state)
    return {"engine": name, "median_step_s": statistics.median(warm), "steps_timed": len(warm),
            "bytes_sent_per_step": bytes_per_step, "persistent_bytes_per_rank": persistent}


def worker(steps, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import torch_monarch
    torch_monarch.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = [run_engine(name, steps, rank, world)
               for name in ("torch DDP", "monarch DP", "monarch DP bf16", "monarch ZeRO-3")]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "data_parallel.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--raw", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.steps, args.raw)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = tempfile.mktemp(suffix=".json")
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--steps", str(args.steps),
                                       "--raw", raw], env=env))
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        sys.exit(f"bench workers failed: exit codes {codes}")
    with open(raw) as f:
        results = json.load(f)
    ddp = results[0]
    params = sum(p.numel() for p in GPT().parameters())
    print(f"2 ranks, Gloo on loopback, GPT {LAYERS}x{HIDDEN} ({params / 1e6:.2f}M params), "
          f"batch {BATCH_PER_RANK}x{SEQ} per rank, median of {ddp['steps_timed']} steps")
    print(f"{'engine':<18}{'step ms':>10}{'vs DDP':>9}{'MB sent/step':>15}{'vs DDP':>9}{'persistent MB/rank':>20}{'vs DDP':>9}")
    for r in results:
        r["step_time_ratio_vs_ddp"] = r["median_step_s"] / ddp["median_step_s"]
        r["bytes_ratio_vs_ddp"] = r["bytes_sent_per_step"] / ddp["bytes_sent_per_step"]
        r["persistent_ratio_vs_ddp"] = r["persistent_bytes_per_rank"] / ddp["persistent_bytes_per_rank"]
        print(f"{r['engine']:<18}{1e3 * r['median_step_s']:>10.1f}{r['step_time_ratio_vs_ddp']:>9.3f}"
              f"{r['bytes_sent_per_step'] / 1e6:>15.2f}{r['bytes_ratio_vs_ddp']:>9.3f}"
              f"{r['persistent_bytes_per_rank'] / 1e6:>20.2f}{r['persistent_ratio_vs_ddp']:>9.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"world_size": 2, "backend": "gloo", "params": params, "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
