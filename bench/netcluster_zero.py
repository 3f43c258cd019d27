"""Sharded data parallelism across two emulated nodes: FSDP2 HSDP (``fully_shard`` on a 2-D
(replicate, shard) mesh) against torch_monarch's ZeRO-3 (flat), ZeRO++ (hierarchical: two-hop
gathers and reduce-scatters, backward gathers inside the node) and ZeRO++ with int8 between
nodes, side by side in one run.

scripts/netcluster.sh makes 2 "nodes" (network namespaces) joined by links limited with tc
tbf (default 1 Gbit/s per direction); each node runs 2 ranks through torch_monarch.run
(torchrun's multi-node protocol). Every engine trains its own copy of the same GPT on the same
data, fp32 with AdamW; engines are interleaved step by step so machine drift hits all alike.
Per engine:

- step time (median of the timed steps, and the spread) and exposed communication: step time
  minus the median step of the same model trained with no communication at all;
- bytes across the slow link per step: each node's eth0 transmit counter (/proc/net/dev in the
  node's namespace; traffic inside a node goes over loopback), summed over nodes;
- loss curves of ZeRO++ and ZeRO++ int8 for --curve-steps steps (int8 against uncompressed).

The planner is asked, for the probed links, which dp reduction it picks for ZeRO-3 on this
mesh (flat, hierarchical, hierarchical + int8: search.cpp scores each) and what each predicts
(exposed dp communication, bytes between nodes per rank); printed beside the measurement.

Needs root (network namespaces). Prints a table and writes JSON
(default bench/results/netcluster_zero.json).

    sudo .venv/bin/python bench/netcluster_zero.py [--rate 1gbit] [--steps 20] [--curve-steps 200]
"""

import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from netcluster_dp import GPT, batch, measured_step, run_bench  # noqa: E402  (the same model, data, launch)

HIDDEN, HEADS, LAYERS, SEQ, VOCAB, BATCH_PER_RANK = 256, 8, 4, 64, 8192, 4
NODES, RANKS_PER_NODE = 2, 2

TIMED = ["compute only", "torch FSDP2 HSDP", "monarch ZeRO-3 flat", "monarch ZeRO++", "monarch ZeRO++ int8"]
CURVE = ["monarch ZeRO++", "monarch ZeRO++ int8"]


def make_model():
    torch.manual_seed(0)
    return GPT(hidden=HIDDEN, layers=LAYERS, vocab=VOCAB, seq=SEQ, heads=HEADS)


def tokens_for(step, rank, world):
    return batch(step, rank, world, vocab=VOCAB, seq=SEQ, per_rank=BATCH_PER_RANK)


class Engine:
    def __init__(self, name, mesh, hsdp_mesh):
        import torch_monarch
        model = make_model()
        self.name = name
        if name == "compute only":
            self.wrapped = model
        elif name == "torch FSDP2 HSDP":
            from torch.distributed.fsdp import fully_shard
            for block in model.blocks:
                fully_shard(block, mesh=hsdp_mesh)
            self.wrapped = fully_shard(model, mesh=hsdp_mesh)
        else:
            hierarchical = "ZeRO++" in name
            self.wrapped = torch_monarch.fully_shard(
                model, mesh=mesh, zero_stage=3, reduction="hierarchical" if hierarchical else "flat",
                inter_node_compression="int8" if "int8" in name else None)
        self.opt = torch.optim.AdamW(self.wrapped.parameters(), lr=3e-4)
        self.times, self.link_bytes, self.losses = [], [], []

    def step(self, step, rank, world, local_rank):
        elapsed, sent, loss = measured_step(self.wrapped, self.opt, tokens_for(step, rank, world), VOCAB, world,
                                            local_rank)
        self.times.append(elapsed)
        self.link_bytes.append(sent)
        self.losses.append(loss)


def worker(args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import torch_monarch
    from torch.distributed.device_mesh import init_device_mesh
    from torch_monarch.cluster import detect, probe
    world_handle = torch_monarch.init(timeout=300)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    mesh = torch_monarch.device_mesh()
    # HSDP: shard inside the node (ranks 2k, 2k+1), replicate across nodes.
    hsdp_mesh = init_device_mesh("cpu", (NODES, RANKS_PER_NODE), mesh_dim_names=("replicate", "shard"))
    engines = {name: Engine(name, mesh, hsdp_mesh) for name in TIMED}
    for step in range(max(args.steps, args.curve_steps)):
        for name in (TIMED if step < args.steps else CURVE):
            engines[name].step(step, rank, world, local_rank)
        if rank == 0 and (step + 1) % 20 == 0:
            print(f"step {step + 1}: " + ", ".join(f"{n} {engines[n].losses[-1]:.4f}" for n in CURVE), flush=True)
    cluster = probe(detect(), world_handle, use_cache=False)
    warm = slice(3, args.steps)
    compute = statistics.median(engines["compute only"].times[warm])
    results = []
    for name in TIMED:
        e = engines[name]
        times = e.times[warm]
        results.append({"engine": name, "median_step_s": statistics.median(times), "best_step_s": min(times),
                        "worst_step_s": max(times), "exposed_comm_s": statistics.median(times) - compute,
                        "link_bytes_per_step": statistics.median(e.link_bytes[warm]), "losses": e.losses})
    if rank == 0:
        links = {k: getattr(cluster, k) for k in ("nodes", "devices_per_node", "intra_node_bytes_per_s",
                                                  "intra_node_latency_s", "inter_node_bytes_per_s",
                                                  "inter_node_latency_s", "overlap_contention")}
        with open(args.raw, "w") as f:
            json.dump({"params": sum(p.numel() for p in make_model().parameters()), "probed_links": links,
                       "compute_only_s": compute, "results": results}, f)
    dist.barrier()


def planner_view(links):
    """The planner's pick of the dp reduction for ZeRO-3 on this mesh and links, and what it
    predicts for each option (search.cpp scores flat, hierarchical, hierarchical + int8)."""
    from torch_monarch import planner as P
    from torch_monarch.api import runtime_training
    from torch_monarch.graph import read_model
    info = read_model(make_model(), torch.zeros(BATCH_PER_RANK, SEQ, dtype=torch.long))
    cluster = P.cluster("cpu", NODES * RANKS_PER_NODE, **links)
    out = {}
    for label, allow, compression in (("flat", False, "none"), ("hierarchical", True, "none"),
                                      ("hierarchical int8", True, "int8")):
        t = runtime_training(info, NODES * RANKS_PER_NODE * BATCH_PER_RANK, dtype="fp32")
        t.allow_hierarchical_dp = allow
        t.inter_node_compression = compression
        plan = P.plan(info.graph, cluster, t, tp=1, pp=1, dp=NODES * RANKS_PER_NODE, zero=3,
                      micro_batch=BATCH_PER_RANK, recompute="none", tie_tolerance=0)
        rank = plan.prediction.ranks[0]
        picked = plan.dp_reduction + ("" if plan.inter_node_compression == "none" else " " + plan.inter_node_compression)
        # On the link: under the hierarchical layout every rank's inter hop crosses; in a flat
        # ring over the nodes in order only one edge per node does (each carrying a rank's
        # ring volume), which the per-rank figure counts as inter-node for every rank.
        crossing = NODES * (RANKS_PER_NODE if plan.dp_reduction == "hierarchical" else 1)
        out[label] = {"picked": picked,
                      "exposed_dp_comm_s": plan.prediction.time.dp_comm,
                      "inter_node_bytes_per_rank": rank.dp_inter_node_bytes,
                      "link_bytes_per_step": rank.dp_inter_node_bytes * crossing,
                      "memory_bytes": plan.prediction.memory_bytes_per_device}
    return out


def main():
    run_bench(__file__, worker, report, "netcluster_zero.json", "ZeRO++ engines")


def report(data, args, wall_s):
    results = {r["engine"]: r for r in data["results"]}
    hsdp = results["torch FSDP2 HSDP"]
    print(f"{NODES} nodes x {RANKS_PER_NODE} ranks (Gloo), {args.rate} per direction between nodes, GPT "
          f"{LAYERS}x{HIDDEN} vocab {VOCAB} ({data['params'] / 1e6:.1f}M params, fp32, AdamW), batch "
          f"{BATCH_PER_RANK}x{SEQ} per rank; median of {args.steps - 3} interleaved steps (min-max)")
    print(f"{'engine':<22}{'step s':>8}{'min-max':>14}{'vs HSDP':>8}{'exposed s':>10}{'vs HSDP':>8}"
          f"{'MB on link':>11}{'vs HSDP':>8}")
    for r in data["results"]:
        r["step_ratio_vs_hsdp"] = r["median_step_s"] / hsdp["median_step_s"]
        r["exposed_ratio_vs_hsdp"] = r["exposed_comm_s"] / hsdp["exposed_comm_s"]
        r["link_bytes_ratio_vs_hsdp"] = r["link_bytes_per_step"] / hsdp["link_bytes_per_step"]
        print(f"{r['engine']:<22}{r['median_step_s']:>8.3f}{r['best_step_s']:>7.2f}-{r['worst_step_s']:<6.2f}"
              f"{r['step_ratio_vs_hsdp']:>8.3f}{r['exposed_comm_s']:>10.3f}{r['exposed_ratio_vs_hsdp']:>8.3f}"
              f"{r['link_bytes_per_step'] / 1e6:>11.1f}{r['link_bytes_ratio_vs_hsdp']:>8.3f}")
    base, int8 = results["monarch ZeRO++"]["losses"], results["monarch ZeRO++ int8"]["losses"]
    final = statistics.mean(int8[-10:]) / statistics.mean(base[-10:]) - 1
    worst = max(abs(a / b - 1) for a, b in zip(int8, base))
    curves = {"steps": len(int8), "final_rel_diff": final, "max_step_rel_diff": worst,
              "first_loss": base[0], "last_loss": base[-1]}
    print(f"ZeRO++ int8 vs ZeRO++: {len(int8)}-step loss curves, last-10 mean {100 * final:+.2f}%, worst single "
          f"step {100 * worst:.2f}% (loss {base[0]:.3f} -> {base[-1]:.3f})")
    view = planner_view(data["probed_links"])
    print("planner (probed links), ZeRO-3 dp=4: reductions allowed -> its pick; predicted exposed dp "
          "communication and MB on the link per step, beside the measured engine")
    measured = {"flat": "monarch ZeRO-3 flat", "hierarchical": "monarch ZeRO++", "hierarchical int8": "monarch ZeRO++ int8"}
    for label, v in view.items():
        m = results[measured[v["picked"]]]
        print(f"  {label:<18} -> {v['picked']:<18} exposed {v['exposed_dp_comm_s']:.3f} s (measured "
              f"{m['exposed_comm_s']:.3f}), link {v['link_bytes_per_step'] / 1e6:.1f} MB (measured "
              f"{m['link_bytes_per_step'] / 1e6:.1f})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    data.update({"nodes": NODES, "ranks_per_node": RANKS_PER_NODE, "rate": args.rate, "timed_steps": args.steps,
                 "curves": curves, "planner": view, "wall_s": wall_s})
    with open(args.out, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
