"""Worker for test_logging.py: joins the world, parallelizes a small GPT (detect, probe, plan),
trains one step and saves a checkpoint: everything that prints progress."""

import os
import sys

import torch

import torch_monarch
from torch_monarch import checkpoint
from tiny_gpt import batch, loss_fn, make_model, make_optimizer


def main():
    torch.set_num_threads(1)
    torch_monarch.init(timeout=120)
    x, y = batch(0, 8)
    model = torch_monarch.parallelize(make_model(), example_input=x[:1], global_batch=8, pp=2)
    opt = make_optimizer(model.named_parameters())
    model.train_step(*model.local_batch(x, y), loss_fn)
    opt.step()
    checkpoint.save(model, opt, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], "ckpt"), step=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
