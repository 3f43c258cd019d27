"""Worker ranks for test_multihead_attention.py (4 ranks, tp=2 x dp=2): the nn.MultiheadAttention
model (mha_model.py) split by heads, in its variants, one after another in one launch."""

import os

import torch

import torch_monarch
from dist_harness import run_worker
from mha_model import GLOBAL_BATCH, STEPS, batch, make_model
from torch_monarch.tensor_parallel_modules import ParallelMultiheadAttention, vocab_parallel_cross_entropy

VARIANTS = {"plain": {}, "weights": {"need_weights": True}, "bias_kv": {"add_bias_kv": True}}


def run(variant):
    model = make_model(**VARIANTS[variant])
    mesh = torch_monarch.device_mesh(tp=2, dp=2)
    pm = torch_monarch.parallelize(model, mesh)
    split = [type(b.attn).__name__ for b in model.blocks]
    heads = [b.attn.num_heads for b in model.blocks if isinstance(b.attn, ParallelMultiheadAttention)]
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3, eps=1e-6)
    dp, r = 2, mesh.coordinate("dp")
    local = GLOBAL_BATCH // dp
    losses, weights = [], None

    def loss(logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, mesh)

    for step in range(STEPS):
        x, y, pad = batch(step)
        sl = slice(r * local, (r + 1) * local)
        opt.zero_grad()
        losses.append(pm.train_step((x[sl], pad[sl]), y[sl], loss))
        opt.step()
        if step == 0 and model.blocks[0].weights is not None:
            weights = model.blocks[0].weights.clone()
    return {"losses": losses, "split": split, "local_heads": heads, "weights": weights, "full": pm.state_dict()}


def main():
    torch.set_num_threads(1)
    torch_monarch.init(timeout=120)
    results = {v: run(v) for v in VARIANTS}
    torch.save(results, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{os.environ['RANK']}.pt"))
    return 0


if __name__ == "__main__":
    run_worker(main)
