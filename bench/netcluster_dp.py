"""Data parallelism across two emulated nodes: torch DDP vs torch_monarch.DataParallel (flat,
hierarchical, hierarchical with bf16 or int8 on the slow hop), side by side in one run.

scripts/netcluster.sh makes 2 "nodes" (network namespaces) joined by links limited with tc
tbf (default 1 Gbit/s per direction); each node runs 2 ranks through torch_monarch.run
(torchrun's multi-node protocol: --nnodes 2 --node-rank K --master-addr node 0). Every
engine trains its own copy of the same GPT (~20M parameters) on the same data; the engines
are interleaved step by step so machine drift hits all alike. Per engine:

- step time (median of the timed steps) and exposed communication: step time minus the
  median step of the same model trained with no communication at all (interleaved too);
- bytes across the slow link per step: each node's eth0 transmit counter (/proc/net/dev in
  the node's namespace; traffic inside a node goes over loopback), summed over nodes,
  between barriers; the engines' own byte counters beside it;
- the loss curve (global mean loss per step) of the hierarchical engine for --curve-steps
  steps: int8 on the slow hop against uncompressed (bf16's curve covers the timed steps).

The planner's prediction of the same setup is printed beside the measurement: the probe
(torch_monarch.cluster.probe) times the two link levels on the real groups, and the
planner's collective model (planner/collectives.h: flat ring or hierarchical decomposition)
turns them into the reduction time; predicted step = measured compute-only step + the part
of the reduction not hidden behind backward (the cost model's overlap rule, with the overlap
contention detect() sets for CPU ranks: 1 when a node's ranks use every core). The prediction is computed after the run from the stored
inputs (--replot recomputes it from a results file).

Needs root (network namespaces). Prints a table and writes JSON
(default bench/results/netcluster_dp.json).

    sudo .venv/bin/python bench/netcluster_dp.py [--rate 1gbit] [--steps 20] [--curve-steps 200]
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
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HIDDEN, HEADS, LAYERS, SEQ, VOCAB, BATCH_PER_RANK = 512, 8, 5, 32, 8192, 2
NODES, RANKS_PER_NODE = 2, 2

TIMED = ["compute only", "torch DDP", "monarch DP flat", "monarch DP hierarchical",
         "monarch DP hierarchical bf16", "monarch DP hierarchical int8"]
CURVE = ["monarch DP hierarchical", "monarch DP hierarchical int8"]


class Block(nn.Module):
    def __init__(self, hidden=HIDDEN, heads=HEADS):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        heads = self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, heads, h // heads).permute(2, 0, 3, 1, 4)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        a = ((q @ k.transpose(-2, -1)) / (h // heads) ** 0.5).masked_fill(causal, float("-inf")).softmax(-1)
        x = x + self.proj((a @ v).transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, hidden=HIDDEN, layers=LAYERS, vocab=VOCAB, seq=SEQ, heads=HEADS):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList([Block(hidden, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, t):
        x = self.wte(t) + self.wpe(torch.arange(t.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def eth0_tx_bytes():
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
    raise RuntimeError("no eth0 in this namespace: run through scripts/netcluster.sh")


def batch(step, rank, world, vocab=VOCAB, seq=SEQ, per_rank=BATCH_PER_RANK):
    """The global batch of a step (same on every engine), this rank's slice of it."""
    g = torch.Generator().manual_seed(1000 + step)
    # A learnable stream: each sequence counts up from a random start (mod vocab).
    start = torch.randint(vocab, (world * per_rank, 1), generator=g)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[rank * per_rank:(rank + 1) * per_rank]


class Engine:
    def __init__(self, name, mesh):
        import torch_monarch
        torch.manual_seed(0)
        model = GPT()
        self.name, self.mesh = name, mesh
        if name == "compute only":
            self.wrapped = model
        elif name == "torch DDP":
            self.wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        else:
            hierarchical = "hierarchical" in name
            compression = "int8" if "int8" in name else "bf16" if "bf16" in name else None
            self.wrapped = torch_monarch.DataParallel(model, mesh=mesh, bucket_cap_mb=25,
                                                      reduction="hierarchical" if hierarchical else "flat",
                                                      inter_node_compression=compression)
        self.opt = torch.optim.AdamW(self.wrapped.parameters(), lr=3e-4)
        self.times, self.link_bytes, self.losses = [], [], []

    def step(self, step, rank, world, local_rank):
        elapsed, sent, loss = measured_step(self.wrapped, self.opt, batch(step, rank, world), VOCAB, world,
                                            local_rank)
        self.times.append(elapsed)
        self.link_bytes.append(sent)
        self.losses.append(loss)


def measured_step(wrapped, opt, tokens, vocab, world, local_rank):
    """One training step between barriers: (its seconds, the bytes it put on the links between
    nodes, summed over the nodes' eth0 counters, the global mean loss)."""
    dist.barrier()
    before = eth0_tx_bytes() if local_rank == 0 else 0
    t0 = time.perf_counter()
    opt.zero_grad()
    logits = wrapped(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    elapsed = time.perf_counter() - t0
    dist.barrier()
    sent = eth0_tx_bytes() - before if local_rank == 0 else 0
    stats = torch.tensor([loss.item(), float(sent)], dtype=torch.float64)
    dist.all_reduce(stats)
    return elapsed, stats[1].item(), stats[0].item() / world


def predict(links, compute_s, backward_s, grads_bytes, bucket_bytes):
    """The planner's reduction time for each engine from the probed links, and the step it
    implies: compute + the part of the reduction that does not hide behind backward, by the
    cost model's rule (cost_model.cpp: last bucket + overlapped(backward, rest, contention) -
    backward) with the overlap contention torch_monarch.cluster.detect() sets for CPU ranks."""
    from torch_monarch._C import planner as P
    from torch_monarch.cluster import _cores, cpu_overlap_contention
    cluster = P.cluster_preset("cpu", NODES * RANKS_PER_NODE)
    for k, v in links.items():
        setattr(cluster, k, v)
    # What detect() set on the ranks (stored since it does; for older result files, the same
    # rule on this machine's cores).
    c = links.get("overlap_contention", cpu_overlap_contention(RANKS_PER_NODE, _cores()))
    out = {}
    for name, hierarchical, compression in (("torch DDP", False, "none"), ("monarch DP flat", False, "none"),
                                            ("monarch DP hierarchical", True, "none"),
                                            ("monarch DP hierarchical bf16", True, "bf16"),
                                            ("monarch DP hierarchical int8", True, "int8")):
        world = NODES * RANKS_PER_NODE
        reduce_s = P.dp_reduction_seconds(cluster, world, grads_bytes, hierarchical, compression)
        last = P.dp_reduction_seconds(cluster, world, min(bucket_bytes, grads_bytes), hierarchical, compression)
        rest = reduce_s - last
        exposed = last + max(backward_s, rest) + c * min(backward_s, rest) - backward_s
        out[name] = {"reduction_s": reduce_s, "exposed_s": exposed, "step_s": compute_s + exposed,
                     "overlap_contention": c}
    return out


def worker(args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import torch_monarch
    from torch_monarch.cluster import detect, probe
    world_handle = torch_monarch.init(timeout=300)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    mesh = torch_monarch.device_mesh()
    engines = {name: Engine(name, mesh) for name in TIMED}
    backward = []
    for step in range(max(args.steps, args.curve_steps)):
        for name in (TIMED if step < args.steps else CURVE):
            engines[name].step(step, rank, world, local_rank)
        if step < args.steps:  # the compute-only engine's backward share, for the overlap rule
            e = engines["compute only"]
            tokens = batch(step, rank, world)
            t0 = time.perf_counter()
            loss = F.cross_entropy(e.wrapped(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            t1 = time.perf_counter()
            loss.backward()
            backward.append((time.perf_counter() - t1) / (time.perf_counter() - t0))
            e.opt.zero_grad()
        if rank == 0 and (step + 1) % 20 == 0:
            print(f"step {step + 1}: " + ", ".join(f"{n} {engines[n].losses[-1]:.4f}" for n in CURVE), flush=True)
    cluster = probe(detect(), world_handle, use_cache=False)
    params = sum(p.numel() for p in GPT().parameters())
    warm = slice(3, args.steps)
    results = []
    compute = statistics.median(engines["compute only"].times[warm])
    backward_s = compute * statistics.median(backward[3:])
    for name in TIMED:
        e = engines[name]
        step_s = statistics.median(e.times[warm])
        r = {"engine": name, "median_step_s": step_s, "exposed_comm_s": step_s - compute,
             "link_bytes_per_step": statistics.median(e.link_bytes[warm]),
             "losses": e.losses}
        results.append(r)
    if rank == 0:
        with open(args.raw, "w") as f:
            links = {k: getattr(cluster, k) for k in ("nodes", "devices_per_node", "intra_node_bytes_per_s",
                                                      "intra_node_latency_s", "inter_node_bytes_per_s",
                                                      "inter_node_latency_s", "overlap_contention")}
            json.dump({"params": params, "probed_links": links, "compute_only_s": compute,
                       "compute_only_backward_s": backward_s, "results": results}, f)
    dist.barrier()


def main():
    run_bench(__file__, worker, report, "netcluster_dp.json", "hierarchical engines")


def run_bench(script, worker_fn, report_fn, out_name, curve_engines):
    """The command line both two-node benches share: --worker runs ``worker_fn(args)`` on a
    rank; otherwise as root scripts/netcluster.sh starts NODES nodes of RANKS_PER_NODE ranks
    running ``script --worker`` through torch_monarch.run (torchrun's multi-node protocol),
    rank 0 writes the raw results and ``report_fn(data, args, wall_s)`` prints and saves them;
    --replot reports a results file again."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="1gbit", help="bandwidth between nodes, per direction (tc syntax)")
    ap.add_argument("--steps", type=int, default=20, help="interleaved timed steps of every engine")
    ap.add_argument("--curve-steps", type=int, default=200, help=f"steps of the loss curves ({curve_engines})")
    ap.add_argument("--out", default=os.path.join(HERE, "results", out_name))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--raw", help=argparse.SUPPRESS)
    ap.add_argument("--replot", metavar="RESULTS_JSON", help="recompute the table and predictions from a results file")
    args = ap.parse_args()
    if args.worker:
        worker_fn(args)
        return
    if args.replot:
        with open(args.replot) as f:
            data = json.load(f)
        args.rate, args.steps = data["rate"], data["timed_steps"]
        report_fn(data, args, data["wall_s"])
        return
    name = os.path.basename(script)
    if os.geteuid() != 0:
        sys.exit(f"bench/{name} needs root (network namespaces; scripts/netcluster.sh)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = tempfile.mktemp(suffix=".json")
    node_cmd = (f"exec {sys.executable} -m torch_monarch.run --nnodes {NODES} --nproc-per-node {RANKS_PER_NODE} "
                f"--node-rank \"$NODE_RANK\" --master-addr \"$MASTER_ADDR\" --master-port {port} "
                f"{os.path.abspath(script)} --worker --steps {args.steps} --curve-steps {args.curve_steps} "
                f"--raw {raw}")
    env = dict(os.environ, OMP_NUM_THREADS="1", MONARCH_LOG_LEVEL="warn")
    started = time.time()
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "netcluster.sh"), "run", str(NODES), "--rate", args.rate,
                        "--", "bash", "-c", node_cmd], env=env)
    if p.returncode != 0:
        sys.exit(f"bench failed: exit status {p.returncode}")
    with open(raw) as f:
        data = json.load(f)
    report_fn(data, args, time.time() - started)


def report(data, args, wall_s):
    predicted = predict(data["probed_links"], data["compute_only_s"], data["compute_only_backward_s"],
                        4.0 * data["params"], 25 * 1024 * 1024)
    for r in data["results"]:
        if r["engine"] in predicted:
            r["predicted"] = predicted[r["engine"]]
    results = {r["engine"]: r for r in data["results"]}
    ddp = results["torch DDP"]
    print(f"{NODES} nodes x {RANKS_PER_NODE} ranks (Gloo), {args.rate} per direction between nodes, "
          f"GPT {LAYERS}x{HIDDEN} vocab {VOCAB} ({data['params'] / 1e6:.1f}M params, fp32 grads "
          f"{4 * data['params'] / 1e6:.0f} MB), batch {BATCH_PER_RANK}x{SEQ} per rank, median of "
          f"{args.steps - 3} interleaved steps; predicted: planner collectives on probed links")
    print(f"{'engine':<30}{'step s':>8}{'vs DDP':>8}{'exposed s':>10}{'vs DDP':>8}{'MB on link':>11}{'vs DDP':>8}"
          f"{'pred step':>10}{'pred/meas':>10}")
    for r in data["results"]:
        r["step_ratio_vs_ddp"] = r["median_step_s"] / ddp["median_step_s"]
        r["exposed_ratio_vs_ddp"] = r["exposed_comm_s"] / ddp["exposed_comm_s"]
        r["link_bytes_ratio_vs_ddp"] = r["link_bytes_per_step"] / ddp["link_bytes_per_step"]
        pred = r.get("predicted", {}).get("step_s")
        if pred is not None:
            r["predicted_over_measured"] = pred / r["median_step_s"]
        print(f"{r['engine']:<30}{r['median_step_s']:>8.3f}{r['step_ratio_vs_ddp']:>8.3f}{r['exposed_comm_s']:>10.3f}"
              f"{r['exposed_ratio_vs_ddp']:>8.3f}{r['link_bytes_per_step'] / 1e6:>11.1f}"
              f"{r['link_bytes_ratio_vs_ddp']:>8.3f}" + (f"{pred:>10.3f}{pred / r['median_step_s']:>10.3f}"
                                                        if pred is not None else ""))
    base = results["monarch DP hierarchical"]["losses"]
    curves = {}
    for name in ("monarch DP hierarchical int8",):
        losses = results[name]["losses"]
        # The curve's tail (last 20 steps' mean) against uncompressed, and the worst step.
        tail = statistics.mean(losses[-20:]) / statistics.mean(base[-20:]) - 1
        worst = max(abs(a / b - 1) for a, b in zip(losses, base))
        curves[name] = {"steps": len(losses), "tail_rel_diff": tail, "max_step_rel_diff": worst}
        print(f"{name}: {len(losses)}-step loss curve vs uncompressed: last-20 mean {100 * tail:+.2f}%, "
              f"worst single step {100 * worst:.2f}% (loss {base[0]:.3f} -> {base[-1]:.3f})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    data.update({"nodes": NODES, "ranks_per_node": RANKS_PER_NODE, "rate": args.rate, "timed_steps": args.steps,
                 "curves": curves, "wall_s": wall_s})
    with open(args.out, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
