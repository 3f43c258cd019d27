"""Data-parallel engines vs torch.nn.parallel.DistributedDataParallel, side by side in one run.

Two ranks with Gloo on loopback train the same GPT-style model on the same data with:
torch DDP, torch_monarch.DataParallel, DataParallel with bf16 compression, and
torch_monarch.fully_shard (ZeRO-3), interleaved step by step; DP and ZeRO-3 also run with
collective agreement off (MONARCH_CHECK_COLLECTIVES=off) to show what the checks cost. Reports the median step time (and its ratio to DDP),
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


class Engine:
    """One engine under test: its own copy of the model, optimizer and data stream."""

    def __init__(self, name, rank, world):
        import torch_monarch
        torch.manual_seed(0)
        model = GPT()
        self.name, self.world = name, world
        self.mesh = None
        if name == "torch DDP":
            self.wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        elif name.startswith("monarch DP"):
            self.mesh = self.make_mesh(name)
            self.wrapped = torch_monarch.DataParallel(
                model, mesh=self.mesh, bucket_cap_mb=25,
                gradient_compression="bf16" if "bf16" in name else None)
        else:  # monarch ZeRO-3
            self.mesh = self.make_mesh(name)
            self.wrapped = torch_monarch.fully_shard(model, mesh=self.mesh, zero_stage=3)
        self.params = list(self.wrapped.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=1e-3)
        if self.mesh is not None:
            self.mesh.group("dp").reset_counters()  # count training steps only
        self.gen = torch.Generator().manual_seed(rank)
        self.times = []
        self.steps = 0

    @staticmethod
    def make_mesh(name):
        """Collective agreement (fingerprints before each collective) is read per group when
        the mesh is made: "checks off" engines run without it, to show what it costs."""
        import torch_monarch
        os.environ["MONARCH_CHECK_COLLECTIVES"] = "off" if "checks off" in name else "all"
        try:
            return torch_monarch.device_mesh()
        finally:
            del os.environ["MONARCH_CHECK_COLLECTIVES"]

    def step(self):
        tokens = torch.randint(VOCAB, (BATCH_PER_RANK, SEQ + 1), generator=self.gen)
        dist.barrier()
        t0 = time.perf_counter()
        self.opt.zero_grad()
        logits = self.wrapped(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        self.opt.step()
        self.times.append(time.perf_counter() - t0)
        self.steps += 1

    def bytes_per_step(self):
        if self.mesh is not None:
            return self.mesh.group("dp").total_bytes_sent() / self.steps
        # DDP: a counting comm hook on one extra step (the timed steps ran without it).
        counted = {"bytes": 0.0}
        n = self.world

        def counting_hook(state, bucket):  # ring all-reduce bytes, as torch_monarch counts them
            buf = bucket.buffer()
            counted["bytes"] += 2 * (n - 1) / n * buf.numel() * buf.element_size()
            return default_hooks.allreduce_hook(None, bucket)
        self.wrapped.register_comm_hook(None, counting_hook)
        self.step()
        return counted["bytes"]

    def result(self):
        warm = self.times[3:]
        grads = [p.grad for p in self.params]
        state = [v for s in self.opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        return {"engine": self.name, "median_step_s": statistics.median(warm), "steps_timed": len(warm),
                "bytes_sent_per_step": self.bytes_per_step(),
                "persistent_bytes_per_rank": tensor_bytes(self.params) + tensor_bytes(grads) + tensor_bytes(state)}


def worker(steps, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import torch_monarch
    torch_monarch.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    engines = [Engine(name, rank, world)
               for name in ("torch DDP", "monarch DP", "monarch DP checks off", "monarch DP bf16",
                            "monarch ZeRO-3", "monarch ZeRO-3 checks off")]
    # Interleaved: every round runs one step of each engine, so drifts in machine speed
    # (frequency, other load) hit all engines alike.
    for _ in range(steps):
        for e in engines:
            e.step()
    results = [e.result() for e in engines]
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
          f"batch {BATCH_PER_RANK}x{SEQ} per rank, median of {ddp['steps_timed']} steps, engines interleaved")
    print(f"{'engine':<26}{'step ms':>10}{'vs DDP':>9}{'MB sent/step':>15}{'vs DDP':>9}{'persistent MB/rank':>20}{'vs DDP':>9}")
    for r in results:
        r["step_time_ratio_vs_ddp"] = r["median_step_s"] / ddp["median_step_s"]
        r["bytes_ratio_vs_ddp"] = r["bytes_sent_per_step"] / ddp["bytes_sent_per_step"]
        r["persistent_ratio_vs_ddp"] = r["persistent_bytes_per_rank"] / ddp["persistent_bytes_per_rank"]
        print(f"{r['engine']:<26}{1e3 * r['median_step_s']:>10.1f}{r['step_time_ratio_vs_ddp']:>9.3f}"
              f"{r['bytes_sent_per_step'] / 1e6:>15.2f}{r['bytes_ratio_vs_ddp']:>9.3f}"
              f"{r['persistent_bytes_per_rank'] / 1e6:>20.2f}{r['persistent_ratio_vs_ddp']:>9.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"world_size": 2, "backend": "gloo", "params": params, "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
