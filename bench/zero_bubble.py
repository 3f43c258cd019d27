"""ZB-H1's split backward, measured: the input-gradient pass (Bi) plus the weight-gradient
pass (W) of one pipeline stage against a plain backward of the same stage, in one process,
through the executor's own stage work (AutogradStageWork). Three ways, interleaved:

* plain: backward of the stage (what 1F1B runs);
* split: Bi then W with the model's linears deferred (torch_monarch.zero_bubble: W computes
  the weight GEMMs Bi skipped, Qi et al. 2023);
* replay: what W used to be, for reference: Bi = gradients to the stage input only, W = the
  stage's backward again restricted to the parameters.

Prints medians and (Bi + W) / plain, checks that the split's gradients equal the plain
ones, and writes JSON.

    .venv/bin/python bench/zero_bubble.py [--reps 15] [--out bench/results/zero_bubble.json]
"""

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time

import torch
from torch import nn
import torch.nn.functional as F

HIDDEN, HEADS, SEQ, BATCH, BLOCKS = 256, 8, 128, 8, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, h // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1) / math.sqrt(h // HEADS)).softmax(-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "zero_bubble.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from torch_monarch import _runtime
    from torch_monarch.zero_bubble import defer_weight_gradients

    torch.manual_seed(0)
    plain_model = nn.Sequential(*[Block() for _ in range(BLOCKS)])
    split_model = copy.deepcopy(plain_model)
    deferred = defer_weight_gradients(split_model)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    dy = torch.randn(BATCH, SEQ, HIDDEN)

    def work_for(model):
        # Stage 0 of 2: its output goes to the next stage, its gradient comes back as dy.
        return _runtime.AutogradStageWork(2, 1, lambda stage, mb, inputs: [model(inputs[0])], None, 1.0,
                                          lambda stage: list(model.parameters()))

    times = {"plain": [], "split_bi": [], "split_w": [], "replay_bi": [], "replay_w": []}
    for rep in range(args.reps + 2):
        for model in (plain_model, split_model):
            model.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_()
        w = work_for(plain_model)
        w.forward(0, 0, [inp])
        t = timed(lambda: w.backward(0, 0, [dy]))
        plain_grads = [p.grad.clone() for p in plain_model.parameters()]
        inp2 = x.clone().requires_grad_()
        w2 = work_for(split_model)
        w2.forward(0, 0, [inp2])
        t_bi = timed(lambda: w2.backward_input(0, 0, [dy]))
        t_w = timed(lambda: w2.backward_weight(0, 0))
        diff = max((p.grad - g).abs().max().item() / max(g.abs().max().item(), 1e-12)
                   for p, g in zip(split_model.parameters(), plain_grads))
        # The replay W (the executor before deferral), by hand on the plain model.
        plain_model.zero_grad(set_to_none=True)
        inp3 = x.clone().requires_grad_()
        out = plain_model(inp3)
        params = list(plain_model.parameters())
        r_bi = timed(lambda: torch.autograd.grad([out], [inp3], [dy], retain_graph=True))
        r_w = timed(lambda: torch.autograd.backward([out], [dy], inputs=params))
        if rep >= 2:  # warm-up
            for k, v in zip(times, (t, t_bi, t_w, r_bi, r_w)):
                times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    split = med["split_bi"] + med["split_w"]
    replay = med["replay_bi"] + med["replay_w"]
    print(f"one stage of {BLOCKS} blocks (hidden {HIDDEN}, seq {SEQ}, batch {BATCH}), fp32, 1 thread; "
          f"{deferred} linears deferred; median of {args.reps}")
    print(f"{'backward':<22}{'Bi ms':>9}{'W ms':>9}{'total ms':>10}{'vs plain':>10}")
    print(f"{'plain (1F1B)':<22}{'':>9}{'':>9}{1e3 * med['plain']:>10.1f}{1.0:>10.3f}")
    print(f"{'split (ZB-H1 now)':<22}{1e3 * med['split_bi']:>9.1f}{1e3 * med['split_w']:>9.1f}{1e3 * split:>10.1f}"
          f"{split / med['plain']:>10.3f}")
    print(f"{'replay (ZB-H1 before)':<22}{1e3 * med['replay_bi']:>9.1f}{1e3 * med['replay_w']:>9.1f}"
          f"{1e3 * replay:>10.1f}{replay / med['plain']:>10.3f}")
    print(f"split gradients vs plain: max relative difference {diff:.2e}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {"hidden": HIDDEN, "heads": HEADS, "seq": SEQ, "batch": BATCH, "blocks": BLOCKS,
                              "reps": args.reps, "deferred_linears": deferred},
                   "median_s": med, "split_over_plain": split / med["plain"], "replay_over_plain": replay / med["plain"],
                   "max_relative_grad_difference": diff}, f, indent=2)
    print(f"wrote {args.out}")
    return 0 if diff < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
