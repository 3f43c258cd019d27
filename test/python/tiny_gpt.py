"""A small GPT (2 blocks, embedding tied to the output head) and its deterministic data,
shared by the single-process reference and the distributed workers."""

import math

import torch
from torch import nn
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, SEQ, LAYERS = 64, 32, 4, 16, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        # No qkv bias: the key bias has an exactly-zero gradient, so its float gradient is
        # rounding noise that Adam turns into run-dependent updates.
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, h = x.shape
        d = h // HEADS
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, d).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        attended = (scores.masked_fill(causal, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(attended)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(HIDDEN)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()  # tied output head


def make_model(seed=1234):
    torch.manual_seed(seed)
    return TinyGPT()


def batch(step, global_batch):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (global_batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


STEPS, GLOBAL_BATCH = 10, 8


def train_reference(steps=STEPS, global_batch=GLOBAL_BATCH):
    torch.set_num_threads(1)
    model = make_model()
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        inputs, targets = batch(step, global_batch)
        opt.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
