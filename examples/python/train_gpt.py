"""Trains a small GPT-2 with the layout the planner picks for this job, and checks it against
one process. Launch (from the repository's root):

    torchrun --nproc-per-node 4 examples/python/train_gpt.py

Every rank reads the model, the machine is detected and its links probed, rank 0 plans and
broadcasts the plan, the model is laid out and trained. Rank 0 then trains the same model
on one process and prints whether the two runs match ("parity") with the worst relative
difference of the losses and of the final parameters.
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import models  # noqa: E402
import torch_monarch  # noqa: E402

STEPS = 8
GLOBAL_BATCH = 16
SEQ = 16
VOCAB = 128
# Parity tolerance: fp32, only the order of sums differs between the layouts.
TOLERANCE = 1e-4


def make_model():
    torch.manual_seed(0)
    return models.GPT2LMHeadModel(vocab=VOCAB, hidden=64, heads=4, layers=4, max_positions=SEQ)


def data(step):
    g = torch.Generator().manual_seed(step % 2)  # two batches, alternating: the loss falls visibly
    t = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, eps=1e-6)


def reference():
    model = make_model()
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def main():
    torch.set_num_threads(1)
    world = torch_monarch.init()
    model = torch_monarch.parallelize(make_model(), example_input=data(0)[0], global_batch=GLOBAL_BATCH)
    if world.rank == 0:
        print(f"plan picked for this machine: {model.plan.summary()}", flush=True)
    if model.tp > 1:
        loss_fn = lambda logits, y: torch_monarch.vocab_parallel_cross_entropy(logits, y, model.mesh)  # noqa: E731
    else:
        loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731
    opt = optimizer(model.parameters())
    dp_rank, local = model.mesh.coordinate("dp"), GLOBAL_BATCH // model.dp
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        x, y = x[dp_rank * local:(dp_rank + 1) * local], y[dp_rank * local:(dp_rank + 1) * local]
        opt.zero_grad()
        losses.append(model.train_step(x, y, loss_fn))
        opt.step()
        if world.rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    state = model.state_dict()  # the whole model, on every rank
    if world.rank != 0:
        return 0
    ref_losses, ref_state = reference()
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_diff = max(((state[k] - v).norm() / max(v.norm(), 1e-12)).item() for k, v in ref_state.items())
    worst = max(loss_diff, param_diff)
    verdict = "OK" if worst <= TOLERANCE else "FAILED"
    print(f"parity with 1 process: {verdict} (worst relative difference {worst:.2e}: losses {loss_diff:.2e}, "
          f"parameters {param_diff:.2e}; tolerance {TOLERANCE:g})", flush=True)
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
