"""Workers for test_checkpoint.py: train the tiny GPT in one layout, save, and resume in
another. argv[1]:

  save LAYOUT DIR K       train K steps, save to DIR, train K more: the uninterrupted run
  async LAYOUT DIR K      the same with save_async, waited for after the K more steps
  resume LAYOUT K DIR...  for each DIR: load it into a fresh model in LAYOUT, train K steps
  elastic LAYOUT ROOT N KILL   train N steps, saving to ROOT/step_<s> after every step; in the
                          first attempt rank 1 dies (SIGKILL) right after step KILL's save;
                          every attempt starts from checkpoint.latest(ROOT)

LAYOUT: "plain" (one process, the unwrapped model) or comma-separated pp, dp, tp, zero, m.
Rank 0 writes what it saw (losses, the whole model after the run) to MONARCH_TEST_OUTPUT.
"""

import os
import sys

import torch

import torch_monarch
from torch_monarch import checkpoint
from torch_monarch.tensor_parallel_modules import vocab_parallel_cross_entropy
from tiny_gpt import batch, loss_fn, make_model, make_optimizer

# Divisible by every layout's dp x micro-batches (dp 3 included).
BATCH = 12


def build(layout, seed):
    model = make_model(seed=seed)
    if layout == "plain":
        return model, make_optimizer(model.named_parameters()), lambda x, y: _plain_step(model, x, y)
    cfg = {"pp": 1, "dp": 1, "tp": 1, "zero": 0, "m": 1}
    for item in layout.split(","):
        k, v = item.split("=")
        cfg[k] = int(v)
    torch_monarch.init(timeout=120)
    mesh = torch_monarch.device_mesh(pp=cfg["pp"], dp=cfg["dp"], tp=cfg["tp"])
    pm = torch_monarch.parallelize(model, mesh, schedule="1f1b" if cfg["pp"] > 1 else None,
                                   micro_batches=cfg["m"], zero_stage=cfg["zero"])
    opt = make_optimizer(pm.named_parameters())
    loss = (lambda out, y: vocab_parallel_cross_entropy(out, y, mesh)) if cfg["tp"] > 1 else loss_fn
    return pm, opt, lambda x, y: pm.train_step(*pm.local_batch(x, y), loss)


def _plain_step(model, x, y):
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.item()


def train(opt, step_fn, first, count):
    losses = []
    for step in range(first, first + count):
        x, y = batch(step, BATCH)
        opt.zero_grad()
        losses.append(float(step_fn(x, y)))
        opt.step()
    return losses


def rank():
    return int(os.environ.get("RANK", "0"))


def write(name, value):
    if rank() == 0:
        torch.save(value, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], name))


def main(argv):
    torch.set_num_threads(1)
    mode = argv[0]
    if mode in ("save", "async"):
        layout, directory, k = argv[1], argv[2], int(argv[3])
        model, opt, step_fn = build(layout, 1234)
        first = train(opt, step_fn, 0, k)
        # A schedule changed the learning rates: the checkpoint must carry them (the resumed
        # runs start from make_optimizer's).
        for g in opt.param_groups:
            g["lr"] *= 0.5
        if mode == "save":
            checkpoint.save(model, opt, directory, step=k, extra={"layout": layout})
            rest = train(opt, step_fn, k, k)
        else:  # training goes on while the files are written; the checkpoint holds step K
            pending = checkpoint.save_async(model, opt, directory, step=k, extra={"layout": layout})
            rest = train(opt, step_fn, k, k)
            pending.wait()
        write("uninterrupted.pt", {"losses": first + rest, "state": model.state_dict()})
    elif mode == "elastic":
        import signal
        layout, root, n, kill = argv[1], argv[2], int(argv[3]), int(argv[4])
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        model, opt, step_fn = build(layout, 1234)
        start, losses = 0, []
        last = checkpoint.latest(root)
        if last is not None:
            info = checkpoint.load(model, opt, last)
            start, losses = info["step"], info["extra"]["losses"]
        for step in range(start, n):
            if step == n // 2:  # as "save" does after its first half
                for g in opt.param_groups:
                    g["lr"] *= 0.5
            losses += train(opt, step_fn, step, 1)
            checkpoint.save(model, opt, os.path.join(root, f"step_{step + 1:04d}"), step=step + 1,
                            extra={"losses": losses, "layout": layout})
            if attempt == 0 and step + 1 == kill and rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        write("elastic.pt", {"losses": losses, "state": model.state_dict(), "attempt": attempt, "start": start})
    elif mode == "resume":
        layout, k, dirs = argv[1], int(argv[2]), argv[3:]
        out = {}
        for d in dirs:
            model, opt, step_fn = build(layout, 99)  # other weights: all of them must come from the checkpoint
            info = checkpoint.load(model, opt, d)
            assert info["step"] == k and info["extra"]["layout"], info
            out[d] = {"losses": train(opt, step_fn, k, k), "state": model.state_dict()}
        write("resumed.pt", out)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args[0].split() if len(args) == 1 else args))
