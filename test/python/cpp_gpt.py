"""The GPT of examples/cpp/train_gpt written in Python: the same module names (embedding,
block<i>.{ln1,q,k,v,o,ln2,up,down}, final_norm, lm_head tied to the embedding), the same
arithmetic, data and AdamW groups. A checkpoint the C++ example saves loads into it in any
layout, and one it saves loads back into the C++ example (test_cpp_frontend.py).

As a worker (launched by torch_monarch.run):

    cpp_gpt.py LAYOUT STEPS --resume DIR [--save DIR2 --save-at N]

LAYOUT: comma-separated pp, dp, tp, zero (e.g. "pp=2,dp=2,zero=3"). Loads DIR, trains from its
step to STEPS, printing "step <k>  loss <value>" on rank 0 as train_gpt does.
"""

import argparse
import math
from collections import OrderedDict

import torch
from torch import nn
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, GLOBAL_BATCH, LR = 64, 32, 4, 4, 16, 16, 1e-2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = HEADS
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        d = HIDDEN // HEADS
        y = self.ln1(x)

        def split(t):
            return t.view(b, s, -1, d).transpose(1, 2)

        q, k, v = split(self.q(y)), split(self.k(y)), split(self.v(y))
        # monarch::attention_core's arithmetic: scores scaled, the upper triangle filled with
        # the dtype's lowest value, softmax, weighted values.
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        above = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(above, torch.finfo(scores.dtype).min).softmax(-1)
        attended = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
        x1 = x + self.o(attended)
        return x1 + self.down(F.gelu(self.up(self.ln2(x1))))


def make_gpt():
    embedding = nn.Embedding(VOCAB, HIDDEN)
    layers = [("embedding", embedding)] + [(f"block{i}", Block()) for i in range(LAYERS)]
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    head.weight = embedding.weight
    layers += [("final_norm", nn.LayerNorm(HIDDEN)), ("lm_head", head)]
    return nn.Sequential(OrderedDict(layers))


def batch(step):
    """train_gpt's batch(): one of two fixed batches of random tokens, targets the next token."""
    g = torch.Generator().manual_seed(1000 + step % 2)
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(named_parameters):
    """train_gpt's make_optimizer: weight decay 0.05 on matrices, none on 1-D tensors and biases."""
    decay, flat = [], []
    for name, p in named_parameters:
        (flat if p.dim() < 2 or "bias" in name else decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": 0.05}, {"params": flat, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=LR, eps=1e-6)


def main():
    import torch_monarch
    from torch_monarch import checkpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("layout")
    ap.add_argument("steps", type=int)
    ap.add_argument("--resume", required=True)
    ap.add_argument("--save")
    ap.add_argument("--save-at", type=int)
    args = ap.parse_args()
    cfg = {"pp": 1, "dp": 1, "tp": 1, "zero": 0}
    for item in args.layout.split(","):
        k, v = item.split("=")
        cfg[k] = int(v)
    torch_monarch.init(timeout=120)
    mesh = torch_monarch.device_mesh(pp=cfg["pp"], dp=cfg["dp"], tp=cfg["tp"])
    pm = torch_monarch.parallelize(make_gpt(), mesh, schedule="1f1b" if cfg["pp"] > 1 else None,
                                   zero_stage=cfg["zero"])
    opt = make_optimizer(pm.named_parameters())
    info = checkpoint.load(pm, opt, args.resume)
    lead = torch_monarch.init().rank == 0
    if lead:
        print(f"resumed from {info['path']} at step {info['step']} (saved by {info['world_size']} ranks)", flush=True)
    for step in range(info["step"], args.steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = pm.train_step(*pm.local_batch(x, y), lm_loss)
        opt.step()
        if lead:
            print(f"step {step}  loss {float(loss):.6f}", flush=True)
        if args.save and step + 1 == args.save_at:
            checkpoint.save(pm, opt, args.save, step=step + 1)
            if lead:
                print(f"saved {args.save} at step {step + 1}", flush=True)


if __name__ == "__main__":
    main()
