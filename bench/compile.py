"""Compiled blocks against eager, and against FSDP2 + torch.compile (engines in peers_compile.py),
4 ranks, Gloo, Inductor on CPU; a table and bench/results/compile.json.

    python3 bench/compile.py [--ranks 4] [--rounds 10] [--out bench/results/compile.json]

Method as bench/peers.py's: one launch holds every engine, rounds of one step each run them
one after another (each round starting at another engine), the warm-up rounds (compilation
included) are not timed; step time is the slowest rank's, best and median over the rounds.
Peak memory, worst rank, one launch per engine and column: "peak" is the high-water mark's
growth over three steps from before the engine is built (peers.py's measure: compiled engines
compile inside it, so it holds Inductor's compilation too); "step peak" is the high-water
mark's growth during two steps over the resident memory after a first step (compilation
done, weights and optimizer state in place): what a training step needs on top of them.
Parity: every engine's losses and parameters against one eager process on the same global
batches (peers.TOLERANCE).
"""

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peers  # noqa: E402
import peers_compile  # noqa: E402
from procmem import reset_peak, vm, warm_up_torch, worst_peak_growth, write_peak_growth  # noqa: E402


def step_memory_worker(engine, out_dir):
    """The step peak of ``engine`` on this rank (module docstring)."""
    import torch
    import torch.distributed as dist
    import torch_monarch
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if not engine.startswith("FSDP2"):
        torch_monarch.init()
    warm_up_torch()
    side = peers_compile.Engine(engine, peers.LR)
    x, y = peers.batch(0)
    side.step(*side.share(x, y, peers.GLOBAL_BATCH))  # compiles
    dist.barrier()
    reset_peak()
    baseline = vm("VmRSS")
    for step in (1, 2):
        x, y = peers.batch(step)
        side.step(*side.share(x, y, peers.GLOBAL_BATCH))
    write_peak_growth(out_dir, baseline)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-engine memory launches")
    args = parser.parse_args()
    import torch
    started = time.time()
    out = peers.launch(args.ranks, "--time-worker-of", "compile", str(args.rounds))
    rows = {r["engine"]: r for r in peers.read_json(out, f"{peers_compile.MODEL}_time.json")}
    shutil.rmtree(out)
    if not args.no_memory:
        for engine, row in rows.items():
            # peers.py's memory worker, one launch: the resident and the allocated-bytes
            # high-water marks (peak_bytes, allocated_bytes).
            memory = peers.peak_memory(args.ranks, "--memory-worker-of", "compile", engine, launches=1)
            row["peak_bytes"], row["allocated_bytes"] = memory["peak_bytes"], memory["allocated_bytes"]
            row["step_peak_bytes"] = worst_peak_growth(os.path.abspath(__file__), args.ranks, engine)
    print(f"{args.ranks} ranks, Gloo, fp32, AdamW, Llama 4 x 256, global batch {peers.GLOBAL_BATCH} x {peers.SEQ} "
          f"tokens, {args.rounds} rounds (engines interleaved), torch {torch.__version__}, Inductor on CPU")
    print(f"{'engine':<22} {'vs':<20} {'best ms':>15} {'x':>5} {'median ms':>15} {'x':>5} {'peak MiB':>11} {'x':>5}"
          f" {'step peak MiB':>13} {'x':>5}  parity loss / params (engine, vs)")
    pairs = []
    for a, b in peers_compile.PAIRS:
        ra, rb = rows[a], rows[b]
        pair = dict(engine=a, versus=b, best_ratio=ra["best_s"] / rb["best_s"],
                    median_ratio=ra["median_s"] / rb["median_s"])
        memory = ""
        if "peak_bytes" in ra:
            pair["memory_ratio"] = ra["peak_bytes"] / rb["peak_bytes"]
            pair["step_memory_ratio"] = ra["step_peak_bytes"] / rb["step_peak_bytes"]
            memory = (f"{ra['peak_bytes'] / 2**20:>5.0f}/{rb['peak_bytes'] / 2**20:<5.0f} {pair['memory_ratio']:>5.2f} "
                      f"{ra['step_peak_bytes'] / 2**20:>6.1f}/{rb['step_peak_bytes'] / 2**20:<6.1f} "
                      f"{pair['step_memory_ratio']:>5.2f}")
        pairs.append(pair)
        print(f"{a:<22} {b:<20} {ra['best_s'] * 1e3:>7.1f}/{rb['best_s'] * 1e3:<7.1f} {pair['best_ratio']:>5.2f} "
              f"{ra['median_s'] * 1e3:>7.1f}/{rb['median_s'] * 1e3:<7.1f} {pair['median_ratio']:>5.2f} {memory:>37}  "
              f"{ra['loss_rel_diff']:.1e}/{ra['parameter_rel_diff']:.1e}, "
              f"{rb['loss_rel_diff']:.1e}/{rb['parameter_rel_diff']:.1e}")
    worst = max(max(r["loss_rel_diff"] / peers.TOLERANCE["loss"], r["parameter_rel_diff"] / peers.TOLERANCE["parameters"])
                for r in rows.values())
    print(f"parity with one eager process: {'OK' if worst <= 1 else 'FAILED'} (relative tolerances: losses "
          f"{peers.TOLERANCE['loss']}, parameters {peers.TOLERANCE['parameters']} per tensor)")
    result = dict(ranks=args.ranks, rounds=args.rounds, torch=torch.__version__, global_batch=peers.GLOBAL_BATCH,
                  seq=peers.SEQ, rows=rows, pairs=pairs, tolerance=peers.TOLERANCE, parity_ok=worst <= 1,
                  seconds=time.time() - started)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        step_memory_worker(sys.argv[2], sys.argv[3])
    else:
        main()
