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
        self.heads = HEADS  # tensor parallelism divides it (local heads)
        self.ln1 = nn.LayerNorm(HIDDEN)
        # No qkv bias: the key bias has an exactly-zero gradient, so its float gradient is
        # rounding noise that Adam turns into run-dependent updates.
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        # Shapes come from the projections' outputs, not from x: under tensor parallelism
        # they hold this rank's heads, under sequence parallelism x holds part of the sequence.
        qkv = self.qkv(self.ln1(x))
        b, s, _ = qkv.shape
        d = HIDDEN // HEADS
        q, k, v = qkv.view(b, s, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        attended = (scores.masked_fill(causal, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(attended)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers=LAYERS):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList([Block() for _ in range(layers)])
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied output head

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_model(seed=1234, layers=LAYERS):
    torch.manual_seed(seed)
    return TinyGPT(layers)


def batch(step, global_batch):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (global_batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(named_parameters):
    """AdamW with parameter groups by name and shape, as GPT training scripts make them: the
    embeddings at half the learning rate, no weight decay on 1-D tensors (biases, norms).
    Takes (name, tensor) pairs: what every wrapper's named_parameters() gives, shards too."""
    decay, flat, embeddings = [], [], []
    for name, p in named_parameters:
        (embeddings if "wte" in name or "wpe" in name else flat if p.dim() < 2 else decay).append(p)
    groups = [{"params": decay}, {"params": flat, "weight_decay": 0.0},
              {"params": embeddings, "lr": 1.5e-3, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=3e-3, weight_decay=0.01)


STEPS, GLOBAL_BATCH = 10, 8


def train_reference(steps=STEPS, global_batch=GLOBAL_BATCH, with_grads=False, layers=LAYERS):
    """Losses per step and the final state dict; with_grads adds the gradients of step 0."""
    torch.set_num_threads(1)
    model = make_model(layers=layers)
    opt = make_optimizer(model.named_parameters())
    losses, grads = [], {}
    for step in range(steps):
        inputs, targets = batch(step, global_batch)
        opt.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            grads["head.weight"] = grads["wte.weight"]  # tied: one tensor, two names
        opt.step()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return (losses, state, grads) if with_grads else (losses, state)
