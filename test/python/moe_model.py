"""A small MoE decoder (examples/models.py's MoEForCausalLM: 8 experts, top-2, a shared expert)
and its deterministic data and training loop, shared by the one-process reference and the
expert-parallel workers."""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import models  # noqa: E402

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, EXPERTS, TOP_K, SHARED = 64, 32, 4, 2, 16, 2, 8, 2, 16
SEQ, GLOBAL_BATCH, STEPS, AUX = 8, 8, 3, 0.01
LR = 1e-3


def make_model(capacity_factor=0.0):
    torch.manual_seed(0)
    return models.MoEForCausalLM(vocab=VOCAB, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, intermediate=FFN,
                                 layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, shared_intermediate=SHARED,
                                 capacity_factor=capacity_factor)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


def aux_loss(model):
    """The blocks' load-balancing losses (each a module that may have been swapped)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, models.MoEBlock)]
    return torch.stack(losses).sum()


def reference(capacity_factor=0.0, micro_batches=1, dp=1):
    """One process, the whole global batch: losses per step, the final parameters, the slots
    the capacity dropped per step and the step-0 gradients. With micro-batches, as a layout of
    dp ranks runs them: micro-batch i is every rank's i-th slice of its rows (the load-balancing
    loss and the capacity are per micro-batch), the loss the mean over micro-batches."""
    model = make_model(capacity_factor)
    opt = make_optimizer(model)
    losses, dropped = [], []
    counts = []

    def count(module, args, _out):
        counts.append(int((~module.kept(args[1])).sum()))

    for m in model.modules():
        if isinstance(m, models.MoEExperts):
            m.register_forward_hook(count)
    per_rank = GLOBAL_BATCH // dp
    per_mb = per_rank // micro_batches
    for step in range(STEPS):
        inputs, targets = batch(step)
        opt.zero_grad()
        total = 0.0
        for mb in range(micro_batches):
            rows = torch.cat([torch.arange(r * per_rank + mb * per_mb, r * per_rank + (mb + 1) * per_mb)
                              for r in range(dp)])
            logits = model(inputs[rows])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[rows].reshape(-1)) + AUX * aux_loss(model)
            (loss / micro_batches).backward()
            total += loss.item() / micro_batches
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(total)
        dropped.append(sum(counts))
        counts.clear()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, dropped, grads
