"""Pipeline bubbles and tensor-parallel bytes, measured next to the planner's predictions.

1. Pipeline: for each schedule (GPipe, 1F1B, interleaved 1F1B with v=2, ZB-H1) at p=2 and
   p=4, the C++ executor runs the planner's action lists over Gloo with stage work of known
   cost (sleeps: forward F, input-gradient Bi, weight-gradient W per micro-batch and virtual
   stage; a full backward is Bi + W). Bubble = time a rank is not computing within the
   step's makespan / the makespan, averaged over ranks (median of the timed steps), next to
   planner.simulate(...) on the same action lists and costs. "Computing" is the time inside
   the stage calls, so sleep overshoot and per-call overhead count as compute.
2. Tensor parallel: bytes one tp rank sends per training step of a 4-block GPT (all tp
   collectives, counted by the communicator), next to planner.tp_bytes_per_step.

    python bench/bench_parallel.py [--out bench/results/parallel.json]
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
sys.path.insert(0, os.path.join(HERE, "..", "test", "python"))  # the tiny GPT of the tests

F_S, BI_S, W_S = 0.010, 0.010, 0.010
MICRO_BATCHES = 8
STEPS, WARMUP = 4, 1
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]


# ----------------------------------------------------------------------------- workers

def pipeline_worker(cfg):
    import torch
    import torch_monarch
    from torch_monarch import _runtime, planner

    world = torch_monarch.init(timeout=120)
    mesh = torch_monarch.device_mesh(pp=world.size)
    v = cfg["v"]
    f, bi, w = F_S / v, BI_S / v, W_S / v  # a virtual stage holds 1/v of the rank's layers

    class TimedWork(_runtime.StageWork):
        def forward(self, stage, mb, inputs):
            time.sleep(f)
            return [torch.zeros(1, requires_grad=True)]

        def backward(self, stage, mb, grads):
            time.sleep(bi + w)
            return [torch.zeros(1)] if stage > 0 else []

        def backward_input(self, stage, mb, grads):
            time.sleep(bi)
            return [torch.zeros(1)] if stage > 0 else []

        def backward_weight(self, stage, mb):
            time.sleep(w)

    # One-way latency of a small message between neighbours (ping-pong, median), the p2p
    # cost the simulation is also given.
    pp = mesh.group("pp")
    buf = torch.zeros(1)
    trips = []
    for _ in range(30):
        t0 = time.perf_counter()
        if pp.rank == 0:
            pp.send(buf, 1, 99).wait()
            pp.recv(buf, 1, 99).wait()
        elif pp.rank == 1:
            pp.recv(buf, 0, 99).wait()
            pp.send(buf, 0, 99).wait()
        trips.append(time.perf_counter() - t0)
    latency = torch.tensor([statistics.median(trips) / 2 if pp.rank == 0 else 0.0], dtype=torch.float64)
    pp.broadcast(latency, 0).wait()
    p2p_s = latency.item()

    schedule = planner.schedule(cfg["kind"], world.size, MICRO_BATCHES, v)
    executor = _runtime.PipelineExecutor(schedule, mesh)
    work = TimedWork()
    steps = []
    for step in range(WARMUP + STEPS):
        mesh.group("pp").barrier()
        stats = executor.run(work)
        if step >= WARMUP:
            steps.append({"total_s": stats["total_s"], "compute_s": stats["compute_s"], "wait_s": stats["wait_s"]})
    sim = planner.simulate(schedule, [planner.StageCosts(f, bi, w, 0.0)] * (world.size * v))
    sim_p2p = planner.simulate(schedule, [planner.StageCosts(f, bi, w, p2p_s)] * (world.size * v))
    return {"steps": steps, "predicted_bubble": sim.bubble_fraction, "predicted_makespan_s": sim.makespan_s,
            "p2p_s": p2p_s, "predicted_bubble_p2p": sim_p2p.bubble_fraction,
            "predicted_makespan_p2p_s": sim_p2p.makespan_s}


def tp_worker(cfg):
    import torch
    import torch_monarch
    from torch_monarch import planner
    from torch_monarch.hybrid import parallelize
    from torch_monarch.tensor_parallel_modules import vocab_parallel_cross_entropy
    from tiny_gpt import GLOBAL_BATCH, HEADS, HIDDEN, SEQ, VOCAB, batch, make_model, make_optimizer

    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=120)
    mesh = torch_monarch.device_mesh(tp=world.size)
    layers, m = 4, 2
    pm = parallelize(make_model(layers=layers), mesh, micro_batches=m, sequence_parallel=cfg["sp"])
    opt = make_optimizer(pm.named_parameters())
    tp = mesh.group("tp")

    def step(k):
        x, y = batch(k, GLOBAL_BATCH)
        opt.zero_grad()
        pm.train_step(x, y, lambda logits, t: vocab_parallel_cross_entropy(logits, t, mesh))
        opt.step()

    step(0)
    tp.reset_counters()
    t0 = time.perf_counter()
    step(1)
    elapsed = time.perf_counter() - t0
    kinds = torch_monarch._runtime.CollectiveKind
    measured = {k: tp.bytes_sent(getattr(kinds, k)) for k in ("all_reduce", "reduce_scatter", "all_gather")}
    graph = planner.transformer(layers=layers, hidden=HIDDEN, heads=HEADS, seq=SEQ, vocab=VOCAB,
                                tied_embeddings=True, dtype="fp32")
    training = planner.training(GLOBAL_BATCH, activation_bytes=4.0, compute_dtype="fp32")
    predicted = planner.tp_bytes_per_step(graph, training, world.size, GLOBAL_BATCH // m, m, cfg["sp"])
    return {"measured_bytes": sum(measured.values()), "by_kind": measured, "predicted_bytes": predicted,
            "step_s": elapsed}


# ----------------------------------------------------------------------------- driver

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks, cfg, timeout=300):
    out = tempfile.mkdtemp(prefix="monarch-bench-")
    port = free_port()
    procs = []
    for r in range(ranks):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(ranks),
                   LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1", MONARCH_BENCH_OUT=out)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env))
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(timeout=max(1, deadline - time.monotonic()))
        if p.returncode != 0:
            raise RuntimeError(f"bench worker failed ({cfg}): exit {p.returncode}")
    results = []
    for r in range(ranks):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


def pipeline_rows():
    rows = []
    for p in (2, 4):
        for kind, v in SCHEDULES:
            ranks = launch(p, {"mode": "pipeline", "kind": kind, "v": v})
            bubbles = []
            for k in range(STEPS):
                # As the simulator counts it: each rank's time not computing within the step's
                # makespan (ranks start together after a barrier; the step ends with the last).
                makespan = max(r["steps"][k]["total_s"] for r in ranks)
                per_rank = [(makespan - r["steps"][k]["compute_s"]) / makespan for r in ranks]
                bubbles.append(sum(per_rank) / len(per_rank))
            step_s = statistics.median(max(r["steps"][k]["total_s"] for r in ranks) for k in range(STEPS))
            rows.append({"schedule": kind, "p": p, "v": v, "m": MICRO_BATCHES,
                         "measured_bubble": statistics.median(bubbles),
                         "predicted_bubble": ranks[0]["predicted_bubble"],
                         "predicted_bubble_with_p2p": ranks[0]["predicted_bubble_p2p"],
                         "p2p_latency_s": ranks[0]["p2p_s"],
                         "measured_step_s": step_s, "predicted_step_s": ranks[0]["predicted_makespan_s"],
                         "predicted_step_with_p2p_s": ranks[0]["predicted_makespan_p2p_s"]})
    return rows


def tp_rows():
    rows = []
    for tp, sp in ((2, False), (2, True), (4, False), (4, True)):
        r = launch(tp, {"mode": "tp", "sp": sp})[0]
        rows.append({"tp": tp, "sequence_parallel": sp, "measured_bytes": r["measured_bytes"],
                     "predicted_bytes": r["predicted_bytes"], "by_kind": r["by_kind"],
                     "ratio": r["measured_bytes"] / r["predicted_bytes"]})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "parallel.json"))
    args = ap.parse_args()
    if args.worker:
        cfg = json.loads(args.worker)
        result = pipeline_worker(cfg) if cfg["mode"] == "pipeline" else tp_worker(cfg)
        with open(os.path.join(os.environ["MONARCH_BENCH_OUT"], f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(result, f)
        return
    pipe = pipeline_rows()
    print(f"Pipeline bubble, m={MICRO_BATCHES}, per micro-batch and rank F={F_S * 1e3:.0f} ms, "
          f"Bi={BI_S * 1e3:.0f} ms, W={W_S * 1e3:.0f} ms (interleaved: each of v stages 1/v of it)")
    print("predicted: planner.simulate on the same action lists, without p2p cost and with the measured "
          "one-way loopback latency")
    print(f"{'schedule':<18}{'p':>3}{'v':>3}{'bubble':>9}{'pred':>8}{'pred+p2p':>10}{'step s':>9}{'pred s':>8}"
          f"{'pred+p2p':>10}{'p2p ms':>8}")
    for r in pipe:
        print(f"{r['schedule']:<18}{r['p']:>3}{r['v']:>3}{r['measured_bubble']:>9.3f}{r['predicted_bubble']:>8.3f}"
              f"{r['predicted_bubble_with_p2p']:>10.3f}{r['measured_step_s']:>9.3f}{r['predicted_step_s']:>8.3f}"
              f"{r['predicted_step_with_p2p_s']:>10.3f}{r['p2p_latency_s'] * 1e3:>8.2f}")
    tp = tp_rows()
    print("\nTensor-parallel bytes per step and rank (tiny GPT, 4 blocks, batch 8 in 2 micro-batches, fp32)")
    print(f"{'tp':>3}{'sp':>5}{'measured':>12}{'cost model':>12}{'ratio':>8}")
    for r in tp:
        print(f"{r['tp']:>3}{str(r['sequence_parallel']):>5}{r['measured_bytes']:>12.0f}{r['predicted_bytes']:>12.0f}"
              f"{r['ratio']:>8.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"pipeline": pipe, "tensor_parallel": tp,
                   "setup": {"micro_batches": MICRO_BATCHES, "forward_s": F_S, "backward_input_s": BI_S,
                             "backward_weight_s": W_S, "steps": STEPS, "backend": "gloo (loopback)"}}, f, indent=2)
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
