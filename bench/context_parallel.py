"""Context parallelism (torch_monarch.context_parallel, monarch::cp): bytes the ring sends per
training step against the formula, and peak activation memory with cp = 2 and 4 against
cp = 1. Prints two tables and writes JSON.

    python3 bench/context_parallel.py [--out bench/results/context_parallel.json]

Model: examples/models.py's LlamaForCausalLM (rotary, 8 query heads over 2 key/value heads,
head dim 8, 2 layers, fp32), causal.

Bytes: 4 ranks through the launcher, dp=2 x cp=2 and cp=4, batch 2 x 1024 tokens per dp
rank; one step to warm up, then STEPS counted steps (forward + backward); measured = the cp
group's send counter per step (every byte the ring sends; the small all-gather that checks
the ranks' shapes per attention call is counted apart, as "checks"). Predicted, per attention
layer and step, b = batch per dp rank, s/cp = local tokens:
    forward  (cp - 1) x 2 x b x s/cp x kv_heads x head_dim x 4 B   (k and v, one hop per step)
    backward twice forward (k, v and the fp32 dk, dv accumulators; cp - 1 hops each)
the same as the planner's cp_ring_step_bytes x (cp - 1), doubled for backward
(docs/cost_model.md, Context parallelism) for fp32; the table also shows the planner's own
number (planner.bytes_per_step, cp row, for the same model and layout).

Memory: the peak resident growth (VmHWM, /proc) of one forward + backward of one sequence of
SEQ_MEMORY tokens over the resident memory just before it, after a first step (so gradients,
the data-parallel buckets and torch's lazy imports are in the baseline), with glibc's mmap
threshold at 1 MiB so freed tensors leave at once (bench/procmem.py). Two one-process
baselines: the plain model (its attention keeps the s x s probabilities for backward: what
a user runs without cp, the issue's cp=1) and the same model with ring attention on a group
of one rank (tiled blockwise attention, no exchange: the per-token activations alone, which
cp divides). cp = 2 and 4 run context_parallel(model) on 2 and 4 ranks (the largest rank's
growth is reported).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

STEPS = 2
VOCAB = 256
# Bytes: a small model (the ring's bytes depend on kv_heads x head_dim x tokens only).
LAYERS, HIDDEN, HEADS, KV_HEADS = 2, 64, 8, 2
HEAD_DIM = HIDDEN // HEADS
BATCH_PER_DP, SEQ_BYTES = 2, 1024
BYTE_LAYOUTS = [("dp2 x cp2", 2, 2), ("cp4", 1, 4)]  # (name, dp, cp) on 4 ranks
# Memory: wide enough that the per-token activations (norms, projections, MLP) weigh, not
# only the attention; (layers, hidden, heads, kv_heads, intermediate).
MEMORY_MODEL = (4, 256, 4, 2, 1024)
SEQ_MEMORY = 4096
# (name, ranks, what): the plain model on one rank; the same with ring attention on a group
# of one rank (tiled blockwise attention, no exchange); context_parallel on 2 and 4 ranks.
MEMORY_RUNS = [("cp=1 plain", 1, "plain"), ("cp=1 blockwise", 1, "ring"), ("cp=2", 2, "ring"), ("cp=4", 4, "ring")]


def make_model(layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, intermediate=2 * HIDDEN):
    import torch
    import models
    torch.manual_seed(0)
    return models.LlamaForCausalLM(vocab=VOCAB, hidden=hidden, heads=heads, kv_heads=kv_heads,
                                   intermediate=intermediate, layers=layers)


def predicted_bytes(cp, batch, seq):
    """(forward, backward) bytes one rank's ring sends per step, over all layers (fp32)."""
    forward = LAYERS * (cp - 1) * 2 * batch * (seq // cp) * KV_HEADS * HEAD_DIM * 4
    return forward, 2 * forward


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks, args, out, env=None):
    cmd = [sys.executable, "-m", "torch_monarch.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), __file__, *args, out]
    subprocess.run(cmd, check=True, timeout=900, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    results = []
    for r in range(ranks):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


# ---------------------------------------------------------------------------------------
# Workers

def bytes_worker(out):
    import torch
    import torch.nn.functional as F
    import torch_monarch
    from torch_monarch import _runtime
    from torch_monarch.context_parallel import context_parallel, shard_sequence
    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=300)
    rows = []
    for name, dp, cp in BYTE_LAYOUTS:
        mesh = torch_monarch.device_mesh(dp=dp, cp=cp)
        group = mesh.group("cp")
        model = torch_monarch.DataParallel(context_parallel(make_model(), mesh), mesh)
        g = torch.Generator().manual_seed(1 + mesh.coordinate("dp"))
        tokens = torch.randint(VOCAB, (BATCH_PER_DP, SEQ_BYTES + 1), generator=g)
        x, y = shard_sequence(tokens[:, :-1], mesh), shard_sequence(tokens[:, 1:], mesh)
        forward = backward = 0.0
        for step in range(STEPS + 1):
            if step == 1:
                group.reset_counters()
                forward = backward = 0.0
            before = group.bytes_sent(_runtime.CollectiveKind.send)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            middle = group.bytes_sent(_runtime.CollectiveKind.send)
            loss.backward()
            model.module.zero_grad()
            forward += middle - before
            backward += group.bytes_sent(_runtime.CollectiveKind.send) - middle
        checks = group.bytes_sent(_runtime.CollectiveKind.all_gather)
        rows.append({"layout": name, "dp": dp, "cp": cp, "rank": world.rank,
                     "forward": forward / STEPS, "backward": backward / STEPS, "checks": checks / STEPS})
    with open(os.path.join(out, f"rank{world.rank}.json"), "w") as f:
        json.dump(rows, f)


def memory_worker(what, out):
    import torch
    import torch.nn.functional as F
    import torch_monarch
    from procmem import reset_peak, vm, warm_up_torch
    from torch_monarch.context_parallel import context_parallel, shard_sequence
    torch.set_num_threads(1)
    warm_up_torch()
    world = torch_monarch.init(timeout=300)
    model = make_model(*MEMORY_MODEL)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(VOCAB, (1, SEQ_MEMORY + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if world.size > 1:
        mesh = torch_monarch.device_mesh(cp=world.size)
        model = torch_monarch.DataParallel(context_parallel(model, mesh), mesh)
        x, y = shard_sequence(x, mesh), shard_sequence(y, mesh)
    elif what == "ring":
        mesh = torch_monarch.device_mesh()
        context_parallel(model, mesh.group("dp"))  # a group of one rank: ring attention with no exchange

    def step():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        return loss

    step()  # gradients, buckets and lazy imports allocated before the baseline
    baseline = vm("VmRSS")
    reset_peak()
    step()
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"peak_growth": vm("VmHWM") - baseline, "local_tokens": int(x.numel())}, f)


# ---------------------------------------------------------------------------------------

def planner_cp_bytes(dp, cp):
    """The planner's prediction of this rank's cp bytes per step (planner.bytes_per_step's cp
    row) for the same model, batch and layout, fp32."""
    from torch_monarch import planner
    graph = planner.transformer(LAYERS, HIDDEN, HEADS, SEQ_BYTES, VOCAB, kv_heads=KV_HEADS, ffn=2 * HIDDEN,
                                gated_mlp=True, dtype="fp32")
    training = planner.training(BATCH_PER_DP * dp, compute_dtype="fp32", param_bytes=4.0, grad_bytes=4.0,
                                activation_bytes=4.0)
    plan = planner.evaluate(graph, planner.cluster("cpu", dp * cp), training, recompute="none",
                            allow_over_memory=True, dp=dp, tp=1, pp=1, cp=cp, zero=0, micro_batch=BATCH_PER_DP,
                            schedule="none")
    return planner.bytes_per_step(graph, plan)[0]["cp"]


def run_bytes():
    out = tempfile.mkdtemp(prefix="monarch-cp-bytes-")
    per_rank = launch(4, ["--bytes-worker"], out)
    table = []
    for i, (name, dp, cp) in enumerate(BYTE_LAYOUTS):
        rows = [r[i] for r in per_rank]
        fwd, bwd = predicted_bytes(cp, BATCH_PER_DP, SEQ_BYTES)
        worst = max(max(abs(r["forward"] / fwd - 1), abs(r["backward"] / bwd - 1)) for r in rows)
        plan_bytes = planner_cp_bytes(dp, cp)
        worst_planner = max(abs((r["forward"] + r["backward"]) / plan_bytes - 1) for r in rows)
        table.append({"layout": name, "dp": dp, "cp": cp, "batch_per_dp": BATCH_PER_DP, "seq": SEQ_BYTES,
                      "predicted": {"forward": fwd, "backward": bwd}, "planner_cp_bytes": plan_bytes,
                      "worst_deviation_from_planner": worst_planner,
                      "measured": {"forward": rows[0]["forward"], "backward": rows[0]["backward"]},
                      "checks_bytes": rows[0]["checks"], "worst_deviation_any_rank": worst, "ranks": rows})
    return table


def run_memory():
    rows = []
    for name, ranks, what in MEMORY_RUNS:
        out = tempfile.mkdtemp(prefix="monarch-cp-memory-")
        results = launch(ranks, ["--memory-worker", what], out, env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
        rows.append({"run": name, "cp": ranks, "seq": SEQ_MEMORY, "local_tokens": results[0]["local_tokens"],
                     "peak_growth": max(r["peak_growth"] for r in results),
                     "per_rank": [r["peak_growth"] for r in results]})
    plain, blockwise = rows[0]["peak_growth"], rows[1]["peak_growth"]
    for r in rows:
        r["ratio_to_cp1_plain"] = r["peak_growth"] / plain
        r["ratio_to_cp1_blockwise"] = r["peak_growth"] / blockwise
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes-worker", action="store_true")
    ap.add_argument("--memory-worker")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "context_parallel.json"))
    ap.add_argument("rest", nargs="*")
    args = ap.parse_args()
    if args.bytes_worker:
        return bytes_worker(args.rest[0])
    if args.memory_worker:
        return memory_worker(args.memory_worker, args.rest[0])
    traffic = run_bytes()
    print(f"Ring attention bytes per step per rank (Llama {LAYERS} layers, kv_heads {KV_HEADS}, head dim {HEAD_DIM}, "
          f"fp32, batch {BATCH_PER_DP} x {SEQ_BYTES} per dp rank), KiB")
    print(f"{'layout':<11} {'fwd meas':>10} {'fwd pred':>10} {'bwd meas':>10} {'bwd pred':>10} {'worst dev':>10} "
          f"{'planner':>10} {'dev':>7} {'checks':>8}")
    for t in traffic:
        print(f"{t['layout']:<11} {t['measured']['forward'] / 1024:>10.1f} {t['predicted']['forward'] / 1024:>10.1f} "
              f"{t['measured']['backward'] / 1024:>10.1f} {t['predicted']['backward'] / 1024:>10.1f} "
              f"{t['worst_deviation_any_rank']:>10.2%} {t['planner_cp_bytes'] / 1024:>10.1f} "
              f"{t['worst_deviation_from_planner']:>7.2%} {t['checks_bytes'] / 1024:>8.2f}")
    print("(planner: planner.bytes_per_step's cp row, forward + backward, for the same model, batch and layout; "
          "checks: the per-call all-gather of the ranks' shapes, on the cp group)")
    memory = run_memory()
    layers, hidden, heads, kv_heads, inter = MEMORY_MODEL
    print(f"\nPeak activation memory of one forward + backward, one sequence of {SEQ_MEMORY} tokens (largest rank; "
          f"Llama {layers} layers, hidden {hidden}, {heads} heads / {kv_heads} kv, MLP {inter}, fp32)")
    print(f"{'run':<15} {'local tokens':>13} {'peak MiB':>10} {'x plain':>8} {'x blockwise':>12}")
    for r in memory:
        print(f"{r['run']:<15} {r['local_tokens']:>13} {r['peak_growth'] / 2**20:>10.1f} "
              f"{r['ratio_to_cp1_plain']:>8.3f} {r['ratio_to_cp1_blockwise']:>12.3f}")
    import torch
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "bytes": traffic, "memory": memory}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
