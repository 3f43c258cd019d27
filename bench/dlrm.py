"""DLRM with sharded embedding tables on 4 ranks of this machine: the planner's mix of
shardings against every table data-parallel, every table row-wise and every table
table-wise, side by side in one run; and the fused sparse lookup path against nn.EmbeddingBag + torch.optim on one process.

    python3 bench/dlrm.py [--out bench/results/dlrm.json]

Per layout (same model, same batches; tables row-wise Adagrad, dense part data-parallel
Adagrad): median step time over the timed steps (the slowest rank's), the embedding group's
bytes sent per step per rank (the communicator's counters) beside the planner's prediction,
the planner's predicted embedding time, and each rank's peak resident memory (VmHWM over the
layout's timed steps, the whole process: differences between layouts are what they hold). The
cluster is this machine as the 4 ranks see it: memory bandwidth of a gather measured in the
run, loopback all-to-all bandwidth and latency from the probe.
"""

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples", "python"))
from procmem import reset_peak, vm  # noqa: E402

STEPS, WARMUP, GLOBAL_BATCH, SCALE, LR = 6, 1, 1024, 1.0, 0.05
LAYOUTS = ["planner", "data_parallel", "row_wise", "table_wise"]
# Run first and discarded: the process's first training steps pay one-time costs (allocator
# growth, thread pools) that would land on whichever layout came first.
WARMUP_LAYOUT = "table_wise"


def _all_max(group, value):
    import torch
    t = torch.tensor([float(value)], dtype=torch.float64)
    group.all_reduce_max(t).wait()
    return t.item()


def measure_cluster(world, group):
    import torch
    from torch_monarch import cluster as cl
    c = cl.probe(cl.detect(world_size=world.size, ranks_per_node=world.size, measure=True), world, use_cache=False)
    # Lookups are gathers of rows: their rate with every rank at work.
    table = torch.randn(200_000, 16)
    ids = torch.randint(0, 200_000, (1 << 18,))
    table.index_select(0, ids)
    _all_max(group, 0)
    t0 = time.perf_counter()
    for _ in range(5):
        table.index_select(0, ids)
    gather = (time.perf_counter() - t0) / 5
    c.hbm_bytes_per_s = 2 * ids.numel() * 16 * 4 / _all_max(group, gather)
    c.cores_per_node = float(len(os.sched_getaffinity(0)))
    return c


def worker(out_dir):
    import torch
    import torch_monarch
    from torch_monarch import planner
    from torch_monarch.embeddings import shard_embeddings
    import dlrm as example

    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=600)
    everyone = torch_monarch.device_mesh(dp=world.size, world=world).group("dp")
    cluster = measure_cluster(world, everyone)
    configs = example.tables(SCALE)
    local = GLOBAL_BATCH // world.size
    batches = [example.make_batch(step, GLOBAL_BATCH, configs) for step in range(WARMUP + STEPS)]
    loss_fn = torch.nn.BCEWithLogitsLoss()
    rows = []
    for layout in [WARMUP_LAYOUT] + LAYOUTS:
        torch.manual_seed(0)
        model = example.DLRM(configs)
        pins = None if layout == "planner" else {t.name: layout for t in configs}
        gc.collect()
        plan = planner.plan_embeddings(model.embeddings.planner_tables(), cluster, world_size=world.size,
                                       batch_per_rank=local, optimizer="rowwise_adagrad", pins=pins)
        model.embeddings = shard_embeddings(model.embeddings, batch_per_rank=local, optimizer="rowwise_adagrad",
                                            lr=LR, plan=plan, world=world)
        dp = torch_monarch.DataParallel(model)
        opt = torch.optim.Adagrad(dp.parameters(), lr=LR)
        emb_group = model.embeddings._mesh.group("dp")
        times, sent, losses = [], [], []
        for step, (dense, sparse, clicks) in enumerate(batches):
            b = world.rank * local
            dense, sparse, clicks = dense[b:b + local], sparse.samples(b, b + local), clicks[b:b + local]
            if step == WARMUP:
                reset_peak()
            emb_group.reset_counters()
            _all_max(everyone, 0)
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(dp(dense, sparse), clicks)
            loss.backward()
            opt.step()
            elapsed = _all_max(everyone, time.perf_counter() - t0)
            if step >= WARMUP:
                times.append(elapsed)
                sent.append(emb_group.total_bytes_sent())
                losses.append(loss.item())
        rows.append({"layout": layout, "rank": world.rank,
                     "shardings": {p.table: str(p.sharding) for p in plan.placements},
                     "measured_s": statistics.median(times), "sent_bytes": statistics.median(sent),
                     "predicted_sent_bytes": plan.ranks[world.rank].sent_bytes,
                     "predicted_embedding_s": plan.max_rank_s, "lower_bound_s": plan.lower_bound_s,
                     "peak_bytes": vm("VmHWM"), "predicted_storage_bytes": plan.ranks[world.rank].storage_bytes,
                     "local_table_bytes": model.embeddings.local_bytes, "losses": losses})
        del dp, model, opt
        gc.collect()
    rows = rows[1:]  # the warm-up layout
    with open(os.path.join(out_dir, f"rank{world.rank}.json"), "w") as f:
        json.dump({"cluster": {"hbm": cluster.hbm_bytes_per_s, "bandwidth": cluster.intra_node_bytes_per_s,
                               "latency": cluster.intra_node_latency_s}, "rows": rows}, f)


def lookup_worker(out_dir):
    """One process: ids per second through forward, backward and the update, fused row-wise
    Adagrad (the engine) against nn.EmbeddingBag with sparse gradients + torch.optim.Adagrad
    and with dense gradients + torch.optim.Adagrad."""
    import torch
    import torch_monarch
    from torch_monarch import planner
    from torch_monarch.embeddings import EmbeddingBagCollection, EmbeddingBagConfig, JaggedBatch, shard_embeddings

    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=300)
    rows, dim, batch, pooling = 1_000_000, 64, 4096, 8
    g = torch.Generator().manual_seed(0)
    batches = [(torch.rand(batch * pooling, generator=g).pow(3) * rows).long() for _ in range(6)]
    lengths = torch.full((batch,), pooling, dtype=torch.long)
    offsets = torch.arange(0, batch * pooling, pooling)
    results = {}

    def timed(step):
        step(batches[0])
        t0 = time.perf_counter()
        for ids in batches[1:]:
            step(ids)
        return (len(batches) - 1) * batch * pooling / (time.perf_counter() - t0)

    ebc = EmbeddingBagCollection([EmbeddingBagConfig("t", rows, dim, features=["f"], pooling_factor=pooling)])
    fused = shard_embeddings(ebc, batch_per_rank=batch, optimizer="rowwise_adagrad", lr=0.01, world=world,
                             cluster=planner.cluster("cpu", 1))
    results["fused rowwise_adagrad (torch_monarch)"] = timed(
        lambda ids: fused(JaggedBatch(["f"], ids, lengths)).sum().backward())
    for sparse in (True, False):
        torch.manual_seed(0)
        bag = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse)
        opt = torch.optim.Adagrad(bag.parameters(), lr=0.01)

        def step(ids, bag=bag, opt=opt):
            opt.zero_grad()
            bag(ids, offsets).sum().backward()
            opt.step()
        name = f"nn.EmbeddingBag(sparse={sparse}) + torch.optim.Adagrad"
        results[name] = timed(step)
    with open(os.path.join(out_dir, "lookup.json"), "w") as f:
        json.dump({"rows": rows, "dim": dim, "batch": batch, "pooling": pooling, "ids_per_s": results}, f)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks, mode, out, timeout=1200):
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-m", "torch_monarch.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), __file__, mode, out]
    subprocess.run(cmd, check=True, timeout=timeout, env=env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="main")
    ap.add_argument("worker_out", nargs="?")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "dlrm.json"))
    args = ap.parse_args()
    if args.mode == "worker":
        return worker(args.worker_out) or 0
    if args.mode == "lookup":
        return lookup_worker(args.worker_out) or 0
    out = tempfile.mkdtemp(prefix="monarch-dlrm-")
    launch(args.ranks, "worker", out)
    launch(1, "lookup", out)
    per_rank = []
    for r in range(args.ranks):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            per_rank.append(json.load(f))
    with open(os.path.join(out, "lookup.json")) as f:
        lookup = json.load(f)
    table = []
    for i, row in enumerate(per_rank[0]["rows"]):
        ranks = [p["rows"][i] for p in per_rank]
        errors = [abs(r["sent_bytes"] / r["predicted_sent_bytes"] - 1) if r["predicted_sent_bytes"] else 0.0
                  for r in ranks]
        table.append({"layout": row["layout"], "shardings": row["shardings"], "measured_s": row["measured_s"],
                      "predicted_embedding_s": row["predicted_embedding_s"], "lower_bound_s": row["lower_bound_s"],
                      "sent_bytes_per_rank": [r["sent_bytes"] for r in ranks],
                      "predicted_sent_bytes_per_rank": [r["predicted_sent_bytes"] for r in ranks],
                      "worst_bytes_error": max(errors),
                      "peak_bytes_per_rank": [r["peak_bytes"] for r in ranks],
                      "local_table_bytes_per_rank": [r["local_table_bytes"] for r in ranks],
                      "predicted_storage_bytes_per_rank": [r["predicted_storage_bytes"] for r in ranks],
                      "losses": row["losses"]})
    print(f"DLRM: 8 tables (100k to 100 rows x 16), global batch {GLOBAL_BATCH}, {args.ranks} ranks, row-wise "
          f"Adagrad tables, data-parallel dense part; cluster: gather {per_rank[0]['cluster']['hbm'] / 1e9:.1f} GB/s, "
          f"loopback {per_rank[0]['cluster']['bandwidth'] / 1e9:.2f} GB/s")
    print(f"{'layout':<15}{'step ms':>9}{'pred emb ms':>13}{'sent KiB (max rank)':>21}{'pred KiB':>10}"
          f"{'bytes err':>11}{'tables MiB':>12}{'peak MiB':>10}")
    for r in table:
        worst = max(range(args.ranks), key=lambda k: r["sent_bytes_per_rank"][k])
        print(f"{r['layout']:<15}{r['measured_s'] * 1e3:>9.1f}{r['predicted_embedding_s'] * 1e3:>13.2f}"
              f"{r['sent_bytes_per_rank'][worst] / 1024:>21.1f}{r['predicted_sent_bytes_per_rank'][worst] / 1024:>10.1f}"
              f"{r['worst_bytes_error'] * 100:>10.1f}%{max(r['local_table_bytes_per_rank']) / 2**20:>12.2f}"
              f"{max(r['peak_bytes_per_rank']) / 2**20:>10.1f}")
    print("planner's mix:", table[0]["shardings"])
    print(f"lookups (one process, {lookup['rows']} x {lookup['dim']} table, batch {lookup['batch']} x "
          f"{lookup['pooling']} ids, forward + backward + update):")
    for name, rate in lookup["ids_per_s"].items():
        print(f"  {name:<55}{rate / 1e6:>8.2f} M ids/s")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"layouts": table, "lookup": lookup, "cluster": per_rank[0]["cluster"]}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
