"""Worker for test_report.py: a 4-rank pipelined run of a small GPT (pp=4, 1F1B, 8
micro-batches) planned by parallelize, three training steps, then the measured trace of
every rank (model.trace) and the plan, for the report to draw side by side."""

import os
import sys

import torch

import torch_monarch
from tiny_gpt import batch, loss_fn, make_model, make_optimizer


def main():
    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=120)
    out = os.environ["MONARCH_TEST_OUTPUT"]
    x, y = batch(0, 16)
    model = torch_monarch.parallelize(make_model(layers=4), example_input=x[:1], global_batch=16, pp=4, dp=1, tp=1,
                                      schedule="1f1b", micro_batch=2)
    opt = make_optimizer(model.named_parameters())
    for step in range(3):
        inputs, targets = batch(step, 16)
        opt.zero_grad()
        model.train_step(*model.local_batch(inputs, targets), loss_fn)
        opt.step()
    model.trace(os.path.join(out, "trace.json"))
    if world.rank == 0:
        model.plan.save(os.path.join(out, "plan.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
