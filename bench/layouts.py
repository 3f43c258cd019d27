"""Predicted vs measured, on this machine: step time and peak memory of a small GPT trained
in several layouts on 4 ranks, beside what the planner predicts for each on a cluster
description measured in the same run.

One launch through the launcher (`python3 -m torch_monarch.run`, torchrun's protocol). Every
rank first measures the machine as the job sees it, all ranks at once (ranks share the
cores, so a rank's rate is what it gets while the others work too):
  * matmul FLOP/s per rank: the model's own GEMM shapes (tokens x hidden x 4 hidden);
  * memory bandwidth per rank: a large add (2 reads, 1 write);
  * loopback links: all-reduce latency and bandwidth fitted at 4 sizes (cluster.probe).
Then, per layout: planner.evaluate on that cluster (pinned), parallelize(model, plan=plan),
in each of ROUNDS rounds over all layouts one warm-up step and STEPS timed steps (forward,
backward, AdamW step; the slowest rank's time per step; the median over all rounds), and the
peak resident memory per rank over the first round's timed steps (VmHWM, glibc told to
return freed memory at once) minus the rank's memory before the model was built. Before
the layouts, every rank measures a profile of the model (torch_monarch.profile: each
layer's forward and backward at micro-batch sizes 1 to 16, all ranks at once), and each
layout is predicted twice: by the analytic model and from the profile. The planner's picks
for this job (search on the same cluster, the runtime's options, with each estimator) are
measured too.

    python3 bench/layouts.py [--out bench/results/layouts.json]

Printed: per layout, both predicted and the measured step time, peak memory (predicted on
the most loaded rank, measured on the most loaded rank); per estimator, Spearman's rank
correlation of predicted and measured times and where its pick finished.
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
sys.path.insert(0, HERE)
from procmem import reset_peak, vm
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

STEPS = 2   # timed steps per layout and round
ROUNDS = 2
VOCAB, HIDDEN, HEADS, LAYERS, SEQ, GLOBAL_BATCH = 1024, 256, 8, 4, 128, 16
# (name, pins): every kind of layout the runtime builds, on 4 ranks.
LAYOUTS = [
    ("dp4", dict(dp=4, tp=1, pp=1, zero=0, micro_batch=4, schedule="none")),
    ("dp4 m2", dict(dp=4, tp=1, pp=1, zero=0, micro_batch=2, schedule="none")),
    ("zero1", dict(dp=4, tp=1, pp=1, zero=1, micro_batch=4, schedule="none")),
    ("zero2", dict(dp=4, tp=1, pp=1, zero=2, micro_batch=4, schedule="none")),
    ("zero3", dict(dp=4, tp=1, pp=1, zero=3, micro_batch=4, schedule="none")),
    ("dp4 full recompute", dict(dp=4, tp=1, pp=1, zero=0, micro_batch=4, schedule="none", recompute="full")),
    ("tp2 dp2", dict(dp=2, tp=2, pp=1, zero=0, micro_batch=8, schedule="none")),
    ("tp4", dict(dp=1, tp=4, pp=1, zero=0, micro_batch=16, schedule="none")),
    ("pp2 dp2 1f1b", dict(dp=2, tp=1, pp=2, zero=0, micro_batch=2, schedule="1f1b")),
    ("pp2 dp2 zb_h1", dict(dp=2, tp=1, pp=2, zero=0, micro_batch=2, schedule="zb_h1")),
    ("pp4 gpipe", dict(dp=1, tp=1, pp=4, zero=0, micro_batch=4, schedule="gpipe")),
    ("pp2 tp2 1f1b", dict(dp=1, tp=2, pp=2, zero=0, micro_batch=4, schedule="1f1b")),
    # Recomputation: the layouts whose cost differs by more than this machine's noise.
    ("dp4 selective", dict(dp=4, tp=1, pp=1, zero=0, micro_batch=4, schedule="none", recompute="selective")),
    ("zero3 full recompute", dict(dp=4, tp=1, pp=1, zero=3, micro_batch=4, schedule="none", recompute="full")),
    ("pp2 dp2 full recompute", dict(dp=2, tp=1, pp=2, zero=0, micro_batch=2, schedule="1f1b", recompute="full")),
]


def make_model():
    import torch
    from models import GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(vocab=VOCAB, hidden=HIDDEN, heads=HEADS, layers=LAYERS, max_positions=SEQ, dropout=0.0)


def batch(step):
    import torch
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _all_max(group, value):
    import torch
    t = torch.tensor([float(value)], dtype=torch.float64)
    group.all_reduce_max(t).wait()
    return t.item()


def measure_cluster(world, everyone, graph):
    """The planner's Cluster for this machine as 4 ranks see it (all measuring at once)."""
    import torch
    from torch_monarch import cluster as cl
    c = cl.detect(world_size=world.size, ranks_per_node=world.size, measure=False)
    tokens = GLOBAL_BATCH * SEQ // world.size
    a, b = torch.randn(tokens, HIDDEN), torch.randn(HIDDEN, 4 * HIDDEN)
    x, y = torch.randn(8 << 20), torch.randn(8 << 20)

    def timed(fn, repeats):
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats

    _all_max(everyone, 0)  # line everyone up
    mm = timed(lambda: a @ b, 20)
    flops = 2.0 * tokens * HIDDEN * 4 * HIDDEN / _all_max(everyone, mm)
    _all_max(everyone, 0)
    add = timed(lambda: torch.add(x, y), 10)
    hbm = 3 * x.numel() * 4 / _all_max(everyone, add)
    c.peak_flops_fp32 = c.peak_flops_tf32 = c.peak_flops_bf16 = flops
    c.hbm_bytes_per_s = hbm
    c.cores_per_node = float(len(os.sched_getaffinity(0)))  # the rates above are with all ranks busy
    # A profile of one block (forward, backward) at 4 sequences per rank: the share of the
    # GEMM rate the whole block reaches once its memory-bound ops are counted at the measured
    # bandwidth (matmul_efficiency), and backward / forward.
    block = make_model().transformer.h[0]
    inp = torch.randn(4, SEQ, HIDDEN, requires_grad=True)
    fwd, bwd = [], []
    _all_max(everyone, 0)
    for _ in range(4):
        t0 = time.perf_counter()
        out = block(inp)
        t1 = time.perf_counter()
        out.sum().backward()
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    fwd_s = _all_max(everyone, sorted(fwd)[1])
    bwd_s = _all_max(everyone, sorted(bwd)[1])
    layer = next(l for l in graph.layers if str(l.kind).endswith("block"))
    a = layer.activations
    stored = 4 * (a.replicated + a.tp_sharded + a.attention_scores)
    gemm_s = max(fwd_s - 2 * stored / hbm, 1e-9)
    c.matmul_efficiency = min(1.0, 4 * layer.forward_flops_per_sample / flops / gemm_s)
    c.backward_forward_ratio = bwd_s / fwd_s
    c = cl.probe(c, world, use_cache=False)
    return c


def worker(out_dir):
    import torch
    import torch_monarch
    from torch_monarch import planner
    from torch_monarch.api import model_graph, runtime_training
    from torch_monarch.profile import measure as measure_profile
    from torch_monarch.tensor_parallel_modules import vocab_parallel_cross_entropy
    import torch.nn.functional as F

    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=300)
    everyone = torch_monarch._runtime.DeviceMesh(world, pp=1, dp=world.size, tp=1).group("dp")
    x0, _ = batch(0)
    with torch_monarch.meta_init():
        meta = make_model()
    info, graph = model_graph(meta, x0[:1], dtype="fp32")
    cluster = measure_cluster(world, everyone, graph)
    training = runtime_training(info, GLOBAL_BATCH, dtype="fp32")

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    # The measured profile: every layer's forward and backward on the real model, all ranks at
    # once, at the micro-batch sizes the layouts use.
    torch.manual_seed(0)
    model = make_model()
    xs, ys = batch(0)
    t0 = time.perf_counter()
    prof = measure_profile(model, lambda b: (xs[:b], ys[:b]), layers=info.layer_modules, loss_fn=loss_fn,
                           micro_batches=(1, 2, 4, 8, 16), repeats=3, world=world, links_from=cluster,
                           source="bench/layouts.py: 4 ranks on this machine, measuring at once")
    profile_s = time.perf_counter() - t0
    del model
    if world.rank == 0:
        planner.save_profile(prof, os.path.join(out_dir, "profile.json"))
    picks = {"analytic": planner.plan(graph, cluster, training, alternatives=0),
             "profile": planner.plan(graph, cluster, training, alternatives=0, profile=prof)}
    layouts = list(LAYOUTS)
    for estimator, pick in picks.items():
        pick_pins = dict(dp=pick.mesh.dp, tp=pick.mesh.tp, pp=pick.mesh.pp, zero=pick.zero_stage,
                         micro_batch=pick.micro_batch_size, schedule=str(pick.schedule).split(".")[-1],
                         recompute=str(pick.recompute).split(".")[-1], sequence_parallel=pick.sequence_parallel)
        known = [{"recompute": "none", "sequence_parallel": False, **p} for _, p in layouts]
        if pick_pins not in known:
            layouts.append((f"pick ({estimator})", pick_pins))

    # Rounds: every layout runs a warm-up and STEPS timed steps in each of ROUNDS rounds, the
    # rounds one after another over all layouts, so a slow spell of this shared machine lands
    # on several layouts instead of all of one; the measured time is the median of all its
    # timed steps. Peak memory and losses come from the first round.
    def both_plans(pins):
        pins = dict(pins)
        recompute = pins.pop("recompute", "none")
        sp = pins.pop("sequence_parallel", False)
        return tuple(planner.evaluate(graph, cluster, training, recompute=recompute, sequence_parallel=sp,
                                      allow_over_memory=True, profile=p, **pins) for p in (None, prof))

    def row(name, plan, from_profile):
        return {"layout": name, "plan": plan.summary(), "rank": world.rank,
                "pick": plan.summary() == picks["analytic"].summary(),
                "pick_profile": from_profile.summary() == picks["profile"].summary(),
                "predicted_s": plan.prediction.step_time_s,
                "predicted_profile_s": from_profile.prediction.step_time_s,
                "predicted_bytes": plan.prediction.memory_bytes_per_device,
                "predicted_breakdown": {k: getattr(plan.prediction.time, k) for k in
                                        ("compute", "recompute", "tp_comm", "dp_comm", "pp_comm", "bubble",
                                         "optimizer")},
                "times": [], "peak_bytes": 0, "losses": []}

    rows = {}
    plans = {name: both_plans(pins) for name, pins in layouts}
    rounds = 0 if os.environ.get("MONARCH_LAYOUTS_PREDICT_ONLY") else ROUNDS
    if not rounds:  # predictions only (--predict-only): every layout scored, none run
        for name, _ in layouts:
            rows[name] = dict(row(name, *plans[name]), times=[float("nan")])
    for rnd in range(rounds):
        for name, pins in layouts:
            plan, from_profile = plans[name]
            gc.collect()
            base = vm("VmRSS")
            pm = torch_monarch.parallelize(make_model(), plan=plan)
            mesh = pm.mesh
            opt = torch.optim.AdamW([p for _, p in pm.named_parameters()], lr=1e-3)
            loss = (lambda out, y, mesh=mesh: vocab_parallel_cross_entropy(out, y, mesh)) if pm.tp > 1 else loss_fn
            times, losses = [], []
            for step in range(STEPS + 1):
                if step == 1 and rnd == 0:
                    gc.collect()
                    reset_peak()
                x, y = batch(step)
                _all_max(everyone, 0)  # every rank starts the step together
                t0 = time.perf_counter()
                opt.zero_grad()
                losses.append(pm.train_step(*pm.local_batch(x, y), loss))
                opt.step()
                elapsed = _all_max(everyone, time.perf_counter() - t0)  # the slowest rank's step
                if step >= 1:
                    times.append(elapsed)
            if rnd == 0:
                rows[name] = dict(row(name, plan, from_profile), peak_bytes=vm("VmHWM") - base,
                                  losses=[float(v) for v in losses])
            rows[name]["times"] += times
            del pm, opt
            gc.collect()
    rows = list(rows.values())
    for r in rows:
        r["measured_s"] = statistics.median(r["times"])
    with open(os.path.join(out_dir, f"rank{world.rank}.json"), "w") as f:
        json.dump({"cluster": {"flops": cluster.peak_flops_fp32, "hbm": cluster.hbm_bytes_per_s,
                               "efficiency": cluster.matmul_efficiency,
                               "backward_forward_ratio": cluster.backward_forward_ratio,
                               "latency": cluster.intra_node_latency_s, "bandwidth": cluster.intra_node_bytes_per_s,
                               "profile_seconds": profile_s},
                   "picks": {k: v.summary() for k, v in picks.items()},
                   "tie_breaks": {k: v.tie_break for k, v in picks.items()},
                   "rows": rows}, f)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spearman(a, b):
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):  # ties share their mean rank
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb)


def run(ranks, timeout=3600):
    out = tempfile.mkdtemp(prefix="monarch-layouts-")
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-m", "torch_monarch.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), __file__, "--worker", out]
    subprocess.run(cmd, check=True, timeout=timeout, env=env)
    per_rank = []
    for r in range(ranks):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            per_rank.append(json.load(f))
    table = []
    for i, row in enumerate(per_rank[0]["rows"]):
        rows = [p["rows"][i] for p in per_rank]
        table.append({"layout": row["layout"], "plan": row["plan"], "pick": row["pick"],
                      "pick_profile": row["pick_profile"],
                      "predicted_s": row["predicted_s"], "predicted_profile_s": row["predicted_profile_s"],
                      "profile_ratio": row["measured_s"] / row["predicted_profile_s"],
                      "measured_s": row["measured_s"], "ratio": row["measured_s"] / row["predicted_s"],
                      "predicted_bytes": row["predicted_bytes"],
                      "peak_bytes": max(r["peak_bytes"] for r in rows),
                      "peak_bytes_per_rank": [r["peak_bytes"] for r in rows],
                      "predicted_breakdown": row["predicted_breakdown"], "losses": row["losses"]})
    extra = {"picks": per_rank[0]["picks"], "tie_breaks": per_rank[0]["tie_breaks"]}
    return per_rank[0]["cluster"], table, extra


def ordered_pairs(rows, margin):
    """Pairs of layouts whose predicted times differ by more than `margin` (relative), and how
    many of them the measurement orders the same way."""
    pairs = agree = 0
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            lo, hi = sorted((a, b), key=lambda r: r["predicted_s"])
            if hi["predicted_s"] > lo["predicted_s"] * (1 + margin):
                pairs += 1
                agree += hi["measured_s"] > lo["measured_s"]
    return pairs, agree


def summarize(cluster, table, extra):
    """Per estimator (analytic, measured profile): rank correlation over the pinned layouts,
    worst deviation, and where its pick finished among all measured layouts."""
    pinned = [r for r in table if not r["layout"].startswith("pick (")]
    fastest = min(r["measured_s"] for r in table)
    out = {"cluster": cluster, "fastest": min(table, key=lambda r: r["measured_s"])["plan"],
           "fastest_s": fastest}
    for estimator, key, flag in (("analytic", "predicted_s", "pick"), ("profile", "predicted_profile_s", "pick_profile")):
        shown = [dict(r, predicted_s=r[key]) for r in pinned]
        pairs, agree = ordered_pairs(shown, 0.10)
        pick = next((r for r in table if r[flag]), None)
        if pick is None:  # --predict-only: the pick was not among the layouts measured earlier
            pick = {"measured_s": float("nan")}
        out[estimator] = {
            "spearman": spearman([r[key] for r in pinned], [r["measured_s"] for r in pinned]),
            "pairs_apart_10pct": pairs, "pairs_ordered_right": agree,
            "worst_time_deviation": max(abs(r["measured_s"] / r[key] - 1) for r in table),
            "pick": extra["picks"][estimator], "tie_break": extra["tie_breaks"][estimator],
            "pick_measured_s": pick["measured_s"], "pick_vs_fastest": pick["measured_s"] / fastest}
    out["layouts"] = table
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "layouts.json"))
    ap.add_argument("--predict-only", metavar="MEASURED_JSON",
                    help="measure the cluster and the profile, predict every layout with both estimators, "
                         "and compare with the measured times of an earlier run's results file (no training)")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    if args.predict_only:
        with open(args.predict_only) as f:
            earlier = {r["plan"]: r for r in json.load(f)["layouts"]}
        os.environ["MONARCH_LAYOUTS_PREDICT_ONLY"] = "1"
        cluster, table, extra = run(args.ranks)
        missing = [r["plan"] for r in table if r["plan"] not in earlier]
        table = [r for r in table if r["plan"] in earlier]
        for r in table:
            m = earlier[r["plan"]]
            r.update(measured_s=m["measured_s"], ratio=m["measured_s"] / r["predicted_s"],
                     profile_ratio=m["measured_s"] / r["predicted_profile_s"], peak_bytes=m["peak_bytes"])
        if missing:
            print(f"not in {args.predict_only} (not compared): {missing}")
        print(f"measured times from {args.predict_only}; predictions from this run")
    else:
        cluster, table, extra = run(args.ranks)
    s = summarize(cluster, table, extra)
    print(f"GPT-2 style, {LAYERS} blocks, hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, vocab {VOCAB}, global batch "
          f"{GLOBAL_BATCH}, fp32, AdamW, {args.ranks} ranks on this machine")
    print(f"measured cluster: matmul {cluster['flops'] / 1e9:.1f} GFLOP/s per rank (a block reaches "
          f"{cluster['efficiency']:.2f} of it), backward/forward {cluster['backward_forward_ratio']:.2f}, memory "
          f"{cluster['hbm'] / 1e9:.1f} GB/s per rank, loopback {cluster['bandwidth'] / 1e9:.2f} GB/s, "
          f"latency {cluster['latency'] * 1e6:.0f} us")
    print(f"{'layout':<24}{'plan':<52}{'analytic s':>11}{'profile s':>10}{'meas s':>8}{'pred MiB':>10}{'peak MiB':>10}")
    for r in table:
        mark = ("*" if r["pick"] else "") + ("+" if r["pick_profile"] else "")
        print(f"{r['layout'] + (' ' + mark if mark else ''):<24}{r['plan']:<52}{r['predicted_s']:>11.3f}"
              f"{r['predicted_profile_s']:>10.3f}{r['measured_s']:>8.3f}"
              f"{r['predicted_bytes'] / 2**20:>10.0f}{r['peak_bytes'] / 2**20:>10.0f}")
    print("* the planner's pick from the analytic model; + its pick from the measured profile "
          f"(profiled in {cluster['profile_seconds']:.0f} s)")
    for estimator in ("analytic", "profile"):
        e = s[estimator]
        print(f"{estimator:>8}: Spearman (pinned layouts, predicted vs measured) {e['spearman']:.2f}; worst deviation "
              f"{e['worst_time_deviation'] * 100:.0f}%; pairs predicted >10% apart {e['pairs_apart_10pct']}, measured in "
              f"the same order {e['pairs_ordered_right']}; pick {e['pick']} is {(e['pick_vs_fastest'] - 1) * 100:.1f}% "
              f"behind the measured fastest ({s['fastest']})")
        if e["tie_break"]:
            print(f"          tie break: {e['tie_break']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(s, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
