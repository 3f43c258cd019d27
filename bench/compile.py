"""Compiled blocks against eager, and against FSDP2 + torch.compile (engines in peers_compile.py),
4 ranks, Gloo, Inductor on CPU; a table and bench/results/compile.json.

    python3 bench/compile.py [--ranks 4] [--rounds 10] [--out bench/results/compile.json]

Method as bench/peers.py's: one launch holds every engine, rounds of one step each run them
one after another (each round starting at another engine), the warm-up rounds (compilation
included) are not timed; step time is the slowest rank's, best and median over the rounds.
Peak memory: one launch per engine, the high-water mark's growth over three steps (compiled
engines compile inside them), worst rank. Parity: every engine's losses and parameters
against one eager process on the same global batches (peers.TOLERANCE).
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
            out = peers.launch(args.ranks, "--memory-worker-of", "compile", engine,
                               env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
            row["peak_bytes"] = max(peers.read_json(out, f"rank{r}.json")["peak_growth"] for r in range(args.ranks))
            shutil.rmtree(out)
    print(f"{args.ranks} ranks, Gloo, fp32, AdamW, Llama 4 x 256, global batch {peers.GLOBAL_BATCH} x {peers.SEQ} "
          f"tokens, {args.rounds} rounds (engines interleaved), torch {torch.__version__}, Inductor on CPU")
    print(f"{'engine':<22} {'vs':<20} {'best ms':>15} {'x':>5} {'median ms':>15} {'x':>5} {'peak MiB':>11} {'x':>5}"
          f"  parity loss / params (engine, vs)")
    pairs = []
    for a, b in peers_compile.PAIRS:
        ra, rb = rows[a], rows[b]
        pair = dict(engine=a, versus=b, best_ratio=ra["best_s"] / rb["best_s"],
                    median_ratio=ra["median_s"] / rb["median_s"])
        memory = ""
        if "peak_bytes" in ra:
            pair["memory_ratio"] = ra["peak_bytes"] / rb["peak_bytes"]
            memory = f"{ra['peak_bytes'] / 2**20:>5.0f}/{rb['peak_bytes'] / 2**20:<5.0f} {pair['memory_ratio']:>5.2f}"
        pairs.append(pair)
        print(f"{a:<22} {b:<20} {ra['best_s'] * 1e3:>7.1f}/{rb['best_s'] * 1e3:<7.1f} {pair['best_ratio']:>5.2f} "
              f"{ra['median_s'] * 1e3:>7.1f}/{rb['median_s'] * 1e3:<7.1f} {pair['median_ratio']:>5.2f} {memory:>17}  "
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
    main()
