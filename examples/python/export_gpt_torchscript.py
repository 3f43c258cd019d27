"""Writes a small GPT as a TorchScript nn.Sequential, for the C++ example to train:

    python3 examples/python/export_gpt_torchscript.py gpt.pt
    torchrun --no-python --nproc-per-node 4 build/bin/train_gpt --torchscript gpt.pt

The C++ frontend cuts a scripted Sequential between its children like a torch::nn one. The
layers have the shapes the planner's transformer builder counts (untied head: weights tied
in Python come back from a TorchScript file as two tensors). The blocks also export
forward_cached, the method through which the C++ frontend generates with a KV cache
(ParallelModule::generate; `train_gpt --torchscript gpt.pt --generate 32`).
"""

import argparse
import math
from typing import Tuple

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.ln2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        y = self.ln1(x)
        q = self.q(y).view(b, s, self.heads, d).transpose(1, 2)
        k = self.k(y).view(b, s, self.heads, d).transpose(1, 2)
        v = self.v(y).view(b, s, self.heads, d).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        attn = torch.matmul(scores.masked_fill(causal, -1e9).softmax(-1), v).transpose(1, 2).reshape(b, s, h)
        x = x + self.o(attn)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))

    @torch.jit.export
    def forward_cached(self, x: torch.Tensor, past_keys: torch.Tensor, past_values: torch.Tensor,
                       allowed: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same block over a KV cache (monarch::chain_of(jit::Module) in C++): x holds the tokens
        fed now, past_keys / past_values what the cache holds for this block (0 elements at the
        prompt), allowed [batch, 1, queries, keys] where a query may attend (causal, not the left
        padding). Returns the output and this call's keys and values, which the cache appends.
        No position embedding here, so positions is unused."""
        b, s, h = x.shape
        d = h // self.heads
        y = self.ln1(x)
        q = self.q(y).view(b, s, self.heads, d).transpose(1, 2)
        k = self.k(y).view(b, s, self.heads, d).transpose(1, 2)
        v = self.v(y).view(b, s, self.heads, d).transpose(1, 2)
        keys = k if past_keys.numel() == 0 else torch.cat([past_keys, k], 2)
        values = v if past_values.numel() == 0 else torch.cat([past_values, v], 2)
        scores = torch.matmul(q, keys.transpose(-2, -1)) / math.sqrt(d)
        attn = torch.matmul(scores.masked_fill(~allowed, -1e9).softmax(-1), values).transpose(1, 2).reshape(b, s, h)
        x = x + self.o(attn)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x)))), k, v


def gpt(vocab=64, hidden=32, heads=4, layers=4):
    torch.manual_seed(0)
    embedding = nn.Embedding(vocab, hidden)
    nn.init.normal_(embedding.weight, std=0.02)
    head = nn.Linear(hidden, vocab, bias=False)
    nn.init.normal_(head.weight, std=0.02)
    return nn.Sequential(embedding, *[Block(hidden, heads) for _ in range(layers)], nn.LayerNorm(hidden), head)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.jit.script(gpt(layers=args.layers)).save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
