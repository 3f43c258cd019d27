"""Bytes on the wire per optimizer step: the communicators' counters against the planner's
prediction (planner.bytes_per_step), per mesh axis, for each kind of layout.

One launch through the launcher (`python3 -m torch_monarch.run`, torchrun's protocol) on 4
ranks; every layout is a plan from planner.evaluate (pinned), applied with
parallelize(model, plan=plan), trained for STEPS steps with gradient accumulation where the
plan has several micro-batches. Counted from the second step on (construction's broadcasts
are one-off), averaged per step, on every rank (with pp=2 the pipeline ends' group is the
pp group: its "pp" column holds both); the table shows the most loaded rank
of each layout and the worst ratio of any rank and axis.

    python3 bench/traffic.py [--ranks 4] [--out bench/results/traffic.json]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "test", "python"))

STEPS = 3
LAYERS = 4
# (name, pins): the model is the tiny GPT (tied embedding and head), global batch 8.
LAYOUTS = [
    ("dp", dict(dp=4, tp=1, pp=1, zero=0, micro_batch=1, schedule="none")),
    ("zero1", dict(dp=4, tp=1, pp=1, zero=1, micro_batch=1, schedule="none")),
    ("zero2", dict(dp=4, tp=1, pp=1, zero=2, micro_batch=1, schedule="none")),
    ("zero3", dict(dp=4, tp=1, pp=1, zero=3, micro_batch=1, schedule="none")),
    ("tp2 dp2", dict(dp=2, tp=2, pp=1, zero=0, micro_batch=2, schedule="none")),
    ("tp2 dp2 sp", dict(dp=2, tp=2, pp=1, zero=0, micro_batch=2, schedule="none", sequence_parallel=True)),
    ("pp2 dp2 1f1b", dict(dp=2, tp=1, pp=2, zero=0, micro_batch=1, schedule="1f1b")),
    ("pp2 dp2 zero1", dict(dp=2, tp=1, pp=2, zero=1, micro_batch=1, schedule="1f1b")),
    ("pp2 tp2", dict(dp=1, tp=2, pp=2, zero=0, micro_batch=2, schedule="1f1b")),
    ("pp4 gpipe", dict(dp=1, tp=1, pp=4, zero=0, micro_batch=2, schedule="gpipe")),
]
AXES = ("dp", "tp", "pp", "ends")


def worker(out_dir):
    import torch
    import torch_monarch
    from torch_monarch import planner
    from torch_monarch.tensor_parallel_modules import vocab_parallel_cross_entropy
    from tiny_gpt import GLOBAL_BATCH, batch, loss_fn, make_model, make_optimizer

    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=120)
    from torch_monarch.api import model_graph
    # The graph read from the model itself (torch.fx), as parallelize(example_input=...) reads it.
    _, graph = model_graph(make_model(layers=LAYERS), batch(0, GLOBAL_BATCH)[0][:1], dtype="fp32")
    # fp32 everything: what the CPU runtime moves.
    training = planner.training(GLOBAL_BATCH, compute_dtype="fp32", param_bytes=4.0, grad_bytes=4.0,
                                activation_bytes=4.0, schedules=["1f1b", "gpipe"])
    rows = []
    for name, pins in LAYOUTS:
        pins = dict(pins)
        sp = pins.pop("sequence_parallel", False)
        plan = planner.evaluate(graph, planner.cluster("cpu", world.size), training, recompute="none",
                                sequence_parallel=sp, allow_over_memory=True, **pins)
        pm = torch_monarch.parallelize(make_model(layers=LAYERS), plan=plan)
        mesh = pm.mesh
        groups = {axis: mesh.group(axis) for axis in ("dp", "tp", "pp")}
        # With two pipeline ranks the ends' group is the pp group itself: its counter holds both.
        if mesh.has_pipeline_ends_group and pm.pp > 2:
            groups["ends"] = mesh.pipeline_ends_group()
        opt = make_optimizer(pm.named_parameters())
        if pm.tp > 1:
            def loss(logits, y, mesh=mesh):
                return vocab_parallel_cross_entropy(logits, y, mesh)
        else:
            loss = loss_fn
        # One step before counting: ZeRO-1/2 all-gather a step's update at the next forward, so
        # the counted steps each carry one gather.
        for step in range(STEPS + 1):
            if step == 1:
                for g in groups.values():
                    g.reset_counters()
            x, y = batch(step, GLOBAL_BATCH)
            opt.zero_grad()
            pm.train_step(*pm.local_batch(x, y), loss)
            opt.step()
        measured = {axis: g.total_bytes_sent() / STEPS for axis, g in groups.items()}
        predicted = dict(planner.bytes_per_step(graph, plan)[mesh.coordinate("pp")])
        if pm.pp == 2:
            predicted["pp"] += predicted.pop("ends")
            predicted["ends"] = 0.0
        rows.append({"layout": name, "plan": plan.summary(), "micro_batches": plan.num_micro_batches,
                     "rank": world.rank, "pp_rank": mesh.coordinate("pp"),
                     "measured": {a: measured.get(a, 0.0) for a in AXES},
                     "predicted": {a: predicted[a] for a in AXES}})
    with open(os.path.join(out_dir, f"rank{world.rank}.json"), "w") as f:
        json.dump(rows, f)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ratio(measured, predicted):
    if predicted == 0:
        return 1.0 if measured == 0 else float("inf")
    return measured / predicted


def run(ranks, timeout=600):
    out = tempfile.mkdtemp(prefix="monarch-traffic-")
    cmd = [sys.executable, "-m", "torch_monarch.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), __file__, "--worker", out]
    subprocess.run(cmd, check=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    per_rank = []
    for r in range(ranks):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            per_rank.append(json.load(f))
    table = []
    for i, (name, _) in enumerate(LAYOUTS):
        rows = [rank_rows[i] for rank_rows in per_rank]
        worst = max(abs(ratio(r["measured"][a], r["predicted"][a]) - 1) for r in rows for a in AXES)
        top = max(rows, key=lambda r: sum(r["measured"].values()))
        table.append({"layout": name, "plan": top["plan"], "micro_batches": top["micro_batches"],
                      "rank": top["rank"], "measured": top["measured"], "predicted": top["predicted"],
                      "worst_deviation": worst, "ranks": rows})
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "traffic.json"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    table = run(args.ranks)
    print(f"Bytes per optimizer step and rank, tiny GPT ({LAYERS} blocks, tied head, batch 8, fp32), "
          f"{args.ranks} ranks: communicator counters vs planner.bytes_per_step (KiB)")
    print(f"{'layout':<15}{'m':>3}" + "".join(f"{a + ' meas':>11}{a + ' pred':>11}" for a in AXES) + f"{'worst':>8}")
    for r in table:
        cells = "".join(f"{r['measured'][a] / 1024:>11.1f}{r['predicted'][a] / 1024:>11.1f}" for a in AXES)
        print(f"{r['layout']:<15}{r['micro_batches']:>3}{cells}{r['worst_deviation'] * 100:>7.1f}%")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"ranks": args.ranks, "steps": STEPS, "layouts": table}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
