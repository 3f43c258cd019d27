"""The runtime fuzzer, long seed set: 200 seeded scenarios of valid and invalid calls on 2
ranks (DataParallel and ZeRO-1/2/3; faults: none, the same error on every rank then a retry,
a local error on one rank at the data / forward / backward point, an extra collective on one
rank, a state dict on one rank, different bucket sizes, SIGKILL of a rank). Prints the
outcome counts and every crash, hang, unclear error or wrong result, and writes JSON.

    .venv/bin/python bench/fuzz.py [--seeds 200] [--out bench/results/fuzz.json]
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "test", "python"))

import fuzz  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--first", type=int, default=1000)
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "fuzz.json"))
    args = ap.parse_args()
    report = fuzz.run(args.first, args.first + args.seeds, timeout_s=1800)
    print(f"{report['seeds']} seeds (from {args.first}) on 2 ranks in {report['seconds']:.0f} s, "
          f"{report['launches']} launches")
    print(f"{'fault/expected':<28}{'seeds':>6}")
    for k, n in sorted(report["outcomes"].items()):
        print(f"{k:<28}{n:>6}")
    for k in ("crashes", "hangs", "unclear", "wrong"):
        print(f"{k}: {len(report[k])}")
        for item in report[k][:5]:
            print("   ", json.dumps(item)[:400])
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({k: v for k, v in report.items() if k != "out_dir"}, f, indent=2)
    print(f"wrote {args.out}")
    return 1 if any(report[k] for k in ("crashes", "hangs", "unclear", "wrong")) else 0


if __name__ == "__main__":
    sys.exit(main())
