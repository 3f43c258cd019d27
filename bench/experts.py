"""Expert parallelism (torch_monarch.expert_parallel, monarch::experts): one MoE layer trained
on 4 ranks with its experts split over ep ranks, against the plain one-process loop over
experts and against the same layer data-parallel. Step time, bytes sent per rank per step by
group (the ep all-to-all against the formula; the gradient all-reduces), expert parameter
bytes held per rank and peak memory. Prints a table and writes JSON.

    python3 bench/experts.py [--steps 5] [--out bench/results/experts.json]

The layer: examples/models.py's MoEBlock (softmax router, top-2 of 16 experts, each a gated
SiLU MLP hidden 256 -> ffn 512 -> 256, no shared expert, dropless), fp32, AdamW, loss = MSE
against a random target + 0.01 x the load-balancing loss. The layer's input requires grad (as
inside a model: its gradient is what the layer below needs, and under ep it is what the
backward all-to-all of the dispatch carries). 4 x 2048 tokens: 2048 per rank; one process
gets all 8192. Each run: 2 warm-up steps, then STEPS timed steps (forward, backward, AdamW).

Runs, each its own launch (torch_monarch.run; MALLOC_MMAP_THRESHOLD_=1 MiB so freed tensors
leave the process at once, for the memory numbers):
  loop      1 process, the global batch, MoEExperts.forward (a Python loop over experts:
            gather each expert's tokens, two linears, index_add back); torch on both cores.
  loop_1t   the same with one torch thread (two-thread GEMMs stall when another process holds
            a core, as on this shared machine: the one-thread number shows how much).
  dp4       4 ranks, torch_monarch.DataParallel over dp=4: every rank holds all 16 experts and
            loops over them on its 2048 tokens; the gradients of all of them all-reduced.
  ep4       4 ranks, expert_parallel(mesh dp=4, ep=4) + DataParallel: 4 experts per rank,
            tokens sent to them and back by all-to-all (grouped_mlp: one GEMM loop in C++);
            only the router's gradient crosses ranks (edp has one rank).
  ep2xdp2   4 ranks, mesh dp=4, ep=2: 8 experts per rank, each expert on 2 ranks (edp=2),
            its gradient averaged over those 2.
Under ep the load-balancing loss is the global batch's (GlobalLoadBalancingLoss: three small
all-reduces over dp_cp per step); dp4 keeps the plain per-rank loss (what a user of DDP has).

Bytes per rank per step from the communicators' counters (reset after warm-up): a2a = the ep
group's all_to_all bytes (rows out, both directions, plus the per-expert row counts exchanged
by plan_expert_dispatch, 16 int64); all-reduce = the dp_cp and edp groups' all_reduce bytes
(counted once when they are one group). Predicted all-to-all bytes per step (fp32, B = 4):
  uniform  4 x tokens_per_rank x top_k x hidden x B x (ep - 1) / ep   (dispatch and combine,
           forward and backward, every slot's expert uniformly random)
  exact    2 x (rows sent to other ep ranks + rows received from them) x hidden x B
           + the counts (16 x 8 B x (ep - 1) / ep), from each step's route (send_rows,
           recv_rows of ExpertParallelExperts.last_route): the dispatch sends send_rows, the
           combine sends back what was received (recv_rows), and backward reverses both.
The routed fraction is the share of this rank's slots that left it (send_rows to other
ranks / (tokens x top_k)). Predicted all-reduce: 2 (n-1)/n x gradient bytes per group (the
ring formula the counters use) + the load-balancing loss's 3 all-reduces of 16-17 floats.

Peak memory: VmHWM growth over the resident memory just before the layer is built (torch
warmed up, ranks joined), largest rank: parameters, gradients, AdamW state, data-parallel
buckets, communication buffers, and the activations of a step (one process: of the whole
global batch).

WHAT 2 SHARED CORES MEAN: the 4 ranks are 4 processes on 2 CPU cores (1 thread each), talking
by Gloo over loopback; the one-process loop has the same 2 cores to itself (2 threads). So
the wall-clock columns compare 4 ranks sharing 2 cores with 1 process using them: they do not
show what 4 GPUs show (each rank its own device, the all-to-all on NVLink/InfiniBand). Bytes,
parameter bytes and memory per rank are what they would be on a cluster; the times are
not. The 4-rank times also include the Gloo transfers over loopback done by the same cores.
The machine is also shared with other work (builds, tests): the table prints every step's
range and the load average, and the times move by tens of percent from run to run. The CPU
seconds per step (every rank's threads summed) are the work the cores did, less moved by the
other processes (but threads that spin while waiting count in them). The kernels differ too:
ep runs the C++ grouped_mlp (one GEMM pair per expert on rows already grouped), loop and dp4
MoEExperts' Python loop (a gather, the GEMMs and an index_add per expert), so a time ratio
mixes the layout with the implementation.
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
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

HIDDEN, FFN, EXPERTS, TOP_K = 256, 512, 16, 2
RANKS, TOKENS_PER_RANK = 4, 2048
AUX = 0.01
WARMUP = 2
BYTES = 4  # fp32
# name: (ranks, torch threads per rank, mesh {dp, ep} or None for one process, what it runs)
RUNS = {
    "loop": (1, 2, None, "1 process, loop over experts, global batch, 2 threads"),
    "loop_1t": (1, 1, None, "1 process, loop over experts, global batch, 1 thread"),
    "dp4": (4, 1, dict(dp=4, ep=1), "4 ranks, DataParallel dp=4, loop over experts"),
    "ep4": (4, 1, dict(dp=4, ep=4), "4 ranks, expert_parallel ep=4"),
    "ep2xdp2": (4, 1, dict(dp=4, ep=2), "4 ranks, expert_parallel ep=2 x dp=2"),
}


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name, steps):
    ranks, threads = RUNS[name][:2]
    out = tempfile.mkdtemp(prefix="monarch-experts-")
    cmd = [sys.executable, "-m", "torch_monarch.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), __file__, "--worker", name, "--steps", str(steps), out]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    subprocess.run(cmd, check=True, timeout=900, stdout=subprocess.DEVNULL, env=env)
    results = []
    for r in range(ranks):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


def rank_data(rank):
    """Rank ``rank``'s tokens and target (the one process concatenates all ranks')."""
    import torch
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(TOKENS_PER_RANK, HIDDEN, generator=g), torch.randn(TOKENS_PER_RANK, HIDDEN, generator=g)


# ---------------------------------------------------------------------------------------
# Worker

def worker(name, steps, out):
    import torch
    import torch.nn.functional as F
    import models
    import torch_monarch
    from procmem import reset_peak, vm, warm_up_torch
    from torch_monarch import _runtime
    from torch_monarch.experts import ExpertParallelExperts, expert_parallel

    ranks, threads, shape, _ = RUNS[name]
    torch.set_num_threads(threads)
    warm_up_torch()
    rank = int(os.environ["RANK"])
    mesh = None
    if ranks > 1:
        torch_monarch.init(timeout=600)
        mesh = torch_monarch.device_mesh(**shape)
    if shape is None:
        data = [rank_data(r) for r in range(RANKS)]
        x, target = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
    else:
        x, target = rank_data(rank)
    x.requires_grad_(True)

    baseline = vm("VmRSS")
    reset_peak()
    torch.manual_seed(0)
    block = models.MoEBlock(HIDDEN, FFN, EXPERTS, TOP_K)
    if shape is not None and shape["ep"] > 1:
        block = expert_parallel(block, mesh)
    model = torch_monarch.DataParallel(block, mesh) if mesh is not None else block
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    experts_module = block.experts
    expert_bytes = (experts_module.gate_up_proj.numel() + experts_module.down_proj.numel()) * BYTES
    param_bytes = sum(p.numel() for p in model.parameters()) * BYTES

    # The mesh keeps one communicator per set of ranks, whatever name asks for it (ep=4 on 4
    # ranks: "ep" and "dp_cp" are one group): count each communicator once.
    live, aliases = {}, {}
    if mesh is not None:
        for g in (("ep", "dp_cp", "edp") if shape["ep"] > 1 else ("dp_cp",)):
            group = mesh.group(g)
            same = [k for k, v in live.items() if v is group]
            if same:
                aliases[g] = same[0]
            else:
                live[g] = group

    times, cpu, losses, sent_rows, recv_rows = [], [], [], [], []
    for step in range(WARMUP + steps):
        if step == WARMUP:
            for g in live.values():
                g.reset_counters()
            first = time.perf_counter()
        start, start_cpu = time.perf_counter(), time.process_time()
        out_ = model(x)
        mse = F.mse_loss(out_, target)
        loss = mse + AUX * block.aux_loss
        opt.zero_grad(set_to_none=True)
        x.grad = None
        loss.backward()
        opt.step()
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if step == 0:
            losses.append(mse.item())
        if step >= WARMUP:
            times.append(elapsed)
            cpu.append(elapsed_cpu)
            if isinstance(experts_module, ExpertParallelExperts):
                route = experts_module.last_route
                me = mesh.group("ep").rank
                sent_rows.append(sum(n for j, n in enumerate(route.send_rows) if j != me))
                recv_rows.append(sum(n for j, n in enumerate(route.recv_rows) if j != me))
    total = time.perf_counter() - first
    load = os.getloadavg()[0]
    peak = vm("VmHWM") - baseline

    measured = {}
    for g, group in live.items():
        measured[g] = {"all_to_all": group.bytes_sent(_runtime.CollectiveKind.all_to_all) / steps,
                       "all_reduce": group.bytes_sent(_runtime.CollectiveKind.all_reduce) / steps,
                       "total": group.total_bytes_sent() / steps, "size": group.size}
    result = {"rank": rank, "times": times, "cpu": cpu, "total": total, "loss0": losses[0], "load_after": load,
              "peak_growth": peak,
              "expert_param_bytes": expert_bytes, "param_bytes": param_bytes, "groups": measured,
              "aliases": aliases,
              "tokens": int(x.shape[0]), "sent_rows": sent_rows, "recv_rows": recv_rows}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------
# Predictions and the table

def uniform_a2a(ep):
    return 4 * TOKENS_PER_RANK * TOP_K * HIDDEN * BYTES * (ep - 1) / ep


def counts_a2a(ep):
    return EXPERTS * 8 * (ep - 1) / ep  # plan_expert_dispatch's per-expert row counts, one forward


def ring(n, nbytes):
    return 2 * (n - 1) / n * nbytes


def summarize(name, results, steps):
    ranks, threads, shape, what = RUNS[name]
    router_bytes = EXPERTS * HIDDEN * BYTES
    all_expert_bytes = EXPERTS * 3 * FFN * HIDDEN * BYTES
    medians = [statistics.median(r["times"]) for r in results]
    wall = max(r["total"] for r in results) / steps  # the slowest rank's mean step, timed steps
    row = {"run": name, "what": what, "ranks": ranks, "threads_per_rank": threads, "mesh": shape,
           "steps": steps, "median_step_ms_per_rank": [m * 1e3 for m in medians],
           "median_step_ms": max(medians) * 1e3,
           "step_ms_range": [min(min(r["times"]) for r in results) * 1e3, max(max(r["times"]) for r in results) * 1e3],
           # CPU seconds of a step, all ranks' processes (all their threads) together: the work,
           # less sensitive to other processes on the machine than wall-clock (spinning threads
           # and Gloo's waiting count in it).
           "cpu_s_per_step_all_ranks": statistics.median(
               [sum(r["cpu"][i] for r in results) for i in range(steps)]),
           "load_average_1min_after": max(r["load_after"] for r in results), "mean_step_ms_slowest_rank": wall * 1e3,
           "tokens_per_s": RANKS * TOKENS_PER_RANK / max(medians),
           "loss_step0": sum(r["loss0"] for r in results) / ranks,
           "expert_param_bytes_per_rank": results[0]["expert_param_bytes"],
           "param_bytes_per_rank": results[0]["param_bytes"],
           "param_grad_adam_bytes_per_rank": 4 * results[0]["param_bytes"],
           "peak_growth_per_rank": [r["peak_growth"] for r in results],
           "peak_growth": max(r["peak_growth"] for r in results)}
    if shape is None:
        row.update(a2a=0.0, allreduce=0.0)
        return row
    ep, dp = shape["ep"], shape["dp"]
    edp = dp // ep
    lb = 0.0 if ep == 1 else ring(dp, (3 * EXPERTS + 1) * 4)  # GlobalLoadBalancingLoss's all-reduces
    if ep == 1:
        grad = ring(dp, router_bytes + all_expert_bytes)
    else:
        grad = ring(dp, router_bytes) + ring(edp, all_expert_bytes // ep)
    per_rank = []
    for r in results:
        g = r["groups"]
        a2a = g["ep"]["all_to_all"] if "ep" in g else 0.0  # "ep" is always its own entry (checked first)
        allreduce = sum(v["all_reduce"] for k, v in g.items())
        other = sum(v["total"] - v["all_reduce"] - v["all_to_all"] for v in g.values())
        entry = {"rank": r["rank"], "a2a": a2a, "allreduce": allreduce, "other": other,
                 "by_group": g, "aliases": r["aliases"]}
        if ep > 1:
            s, v = statistics.mean(r["sent_rows"]), statistics.mean(r["recv_rows"])
            exact = 2 * (s + v) * HIDDEN * BYTES + counts_a2a(ep)
            entry.update(routed_out_fraction=s / (TOKENS_PER_RANK * TOP_K), exact_a2a=exact,
                         exact_deviation=a2a / exact - 1, uniform_deviation=a2a / uniform_a2a(ep) - 1,
                         rows_sent_per_step=s, rows_received_per_step=v)
        per_rank.append(entry)
    row.update(a2a=per_rank[0]["a2a"], allreduce=per_rank[0]["allreduce"],
               a2a_max=max(e["a2a"] for e in per_rank), allreduce_max=max(e["allreduce"] for e in per_rank),
               predicted_allreduce=grad + lb, predicted_gradient_allreduce=grad, predicted_balance_loss=lb,
               worst_allreduce_deviation=max(abs(e["allreduce"] / (grad + lb) - 1) for e in per_rank),
               per_rank=per_rank)
    if ep > 1:
        row.update(uniform_a2a=uniform_a2a(ep), exact_a2a=per_rank[0]["exact_a2a"],
                   routed_out_fraction=per_rank[0]["routed_out_fraction"],
                   uniform_out_fraction=(ep - 1) / ep,
                   worst_exact_deviation=max(abs(e["exact_deviation"]) for e in per_rank),
                   worst_uniform_deviation=max(abs(e["uniform_deviation"]) for e in per_rank))
    return row


def print_table(rows, steps):
    kib, mib = 1024.0, 2.0 ** 20
    print(f"MoE layer (MoEBlock: {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, ffn {FFN}, fp32, AdamW), "
          f"{RANKS} x {TOKENS_PER_RANK} tokens; {WARMUP} warm-up + {steps} timed steps (fwd + bwd + AdamW)")
    print("Times: 2 CPU cores shared by everything. 4 ranks = 4 one-thread processes on 2 cores + Gloo over "
          "loopback;\n'loop' = 1 process with both cores. Time ratios here are NOT what a GPU cluster shows; "
          "bytes and memory per rank are.")
    print(f"{'run':<9} {'thr':>3} {'step ms':>8} {'tok/s':>7} {'loss0':>8} {'a2a KiB':>9} {'uniform':>9} "
          f"{'exact':>9} {'dev':>7} {'out frac':>8} {'allred KiB':>10} {'pred':>9} {'expert MiB':>10} "
          f"{'peak MiB':>9} {'step ms min-max':>16} {'cpu s':>6} {'load':>5}")
    for r in rows:
        ep = (r["mesh"] or {}).get("ep", 1)
        if ep > 1:
            a2a = (f"{r['a2a'] / kib:>9.1f} {r['uniform_a2a'] / kib:>9.1f} {r['exact_a2a'] / kib:>9.1f} "
                   f"{r['worst_exact_deviation']:>7.3%} {r['routed_out_fraction']:>8.4f}")
        else:
            a2a = f"{r['a2a'] / kib:>9.1f} {'-':>9} {'-':>9} {'-':>7} {'-':>8}"
        pred = f"{r['predicted_allreduce'] / kib:>9.1f}" if "predicted_allreduce" in r else f"{'-':>9}"
        print(f"{r['run']:<9} {r['threads_per_rank']:>3} {r['median_step_ms']:>8.0f} {r['tokens_per_s']:>7.0f} "
              f"{r['loss_step0']:>8.5f} {a2a} {r['allreduce'] / kib:>10.1f} {pred} "
              f"{r['expert_param_bytes_per_rank'] / mib:>10.2f} {r['peak_growth'] / mib:>9.1f} "
              f"{r['step_ms_range'][0]:>7.0f}-{r['step_ms_range'][1]:<8.0f} {r['cpu_s_per_step_all_ranks']:>6.2f} "
              f"{r['load_average_1min_after']:>5.1f}")
    print("step ms: median per rank, slowest rank; tok/s: global batch / that. loss0: first step's MSE (mean over "
          "ranks; the same data and weights in every run).\na2a: ep group's all-to-all bytes sent per rank per step "
          "(rank 0); uniform / exact: predictions (docstring); dev: worst |measured/exact - 1| over ranks;\nout frac: "
          "share of rank 0's slots routed to other ranks (uniform: (ep-1)/ep). allred: gradient (+ global "
          "balance-loss) all-reduce bytes\nper rank per step over dp_cp and edp; pred: ring formula. expert MiB: "
          "expert parameters held per rank. peak: VmHWM growth over the\nresident memory before the layer was built "
          "(params, grads, AdamW, buffers, activations), largest rank.\nstep ms min-max: every timed step of every "
          "rank. cpu s: CPU seconds per step, every rank's threads summed (median step). load: 1-minute load\n"
          "average at the end of the run: above 2, other processes shared the 2 cores with the bench and inflated "
          "its times (two-thread\nGEMMs the most: their threads spin waiting for each other).")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--runs", nargs="*", default=list(RUNS))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "experts.json"))
    ap.add_argument("rest", nargs="*")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.rest[0])
    began = time.perf_counter()
    rows = [summarize(name, launch(name, args.steps), args.steps) for name in args.runs]
    print_table(rows, args.steps)
    by_name = {r["run"]: r for r in rows}
    dp4 = by_name.get("dp4")
    for r in rows:
        if r["ranks"] == 1:
            continue
        notes = [f"step time {r['median_step_ms'] / by_name[b]['median_step_ms']:.2f}x {b}'s"
                 for b in ("loop", "loop_1t") if b in by_name]
        if dp4 and r is not dp4:
            total = r["a2a"] + r["allreduce"]
            notes.append(f"bytes sent {total / (dp4['a2a'] + dp4['allreduce']):.3f}x dp4's, "
                         f"peak memory {r['peak_growth'] / dp4['peak_growth']:.2f}x dp4's")
        print(f"  {r['run']}: " + "; ".join(notes))
    import torch
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "cores": os.cpu_count(), "hidden": HIDDEN, "ffn": FFN,
                   "experts": EXPERTS, "top_k": TOP_K, "ranks": RANKS, "tokens_per_rank": TOKENS_PER_RANK,
                   "warmup": WARMUP, "steps": args.steps, "bench_seconds": time.perf_counter() - began,
                   "runs": rows}, f, indent=1)
    print(f"({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
