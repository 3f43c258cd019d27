"""A small transformer built from PyTorch's own blocks: nn.MultiheadAttention (fused q|k|v
in_proj_weight) and an nn.Sequential MLP, with a causal mask and padded keys; shared by the
single-process reference and mha_workers.py."""

import torch
from torch import nn
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, SEQ, LAYERS, GLOBAL_BATCH, STEPS = 64, 32, 4, 12, 2, 8, 4


class Block(nn.Module):
    def __init__(self, need_weights=False, add_bias_kv=False):
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True, add_bias_kv=add_bias_kv)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))
        self.need_weights = need_weights
        self.weights = None  # the averaged attention weights of the last forward (need_weights)

    def forward(self, x, pad):
        s = x.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        h = self.ln1(x)
        a, w = self.attn(h, h, h, attn_mask=causal, key_padding_mask=pad, need_weights=self.need_weights)
        self.weights = None if w is None else w.detach()
        x = x + a
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self, **block):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([Block(**block) for _ in range(LAYERS)])
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens, pad):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x, pad)
        return self.head(x)


def make_model(seed=7, **block):
    torch.manual_seed(seed)
    return Model(**block)


def batch(step):
    g = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    pad = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.bool)
    pad[::2, -3:] = True  # the last keys of every other row are padding
    return tokens[:, :-1], tokens[:, 1:], pad


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
