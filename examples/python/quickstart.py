# Launch: .venv/bin/torchrun --nproc-per-node 4 examples/python/quickstart.py
import os
import sys

import torch
import torch_monarch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from models import GPT2LMHeadModel  # any nn.Module  # noqa: E402

torch.manual_seed(0)  # every rank builds the same model
model = GPT2LMHeadModel(vocab=128, hidden=64, heads=4, layers=4, max_positions=16)
tokens = torch.randint(128, (16, 17), generator=torch.Generator().manual_seed(1))
inputs, targets = tokens[:, :-1], tokens[:, 1:]                # 16 sequences of 16 tokens

model = torch_monarch.parallelize(model, example_input=inputs, global_batch=16)  # read, probe, plan, lay out
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)          # any torch.optim optimizer
loss_fn = lambda logits, y: torch_monarch.vocab_parallel_cross_entropy(logits, y, model.mesh)  # noqa: E731
for step in range(5):
    opt.zero_grad()
    loss = model.train_step(*model.local_batch(inputs, targets), loss_fn)  # this dp rank's share
    opt.step()
    if model.mesh.rank == 0:
        print(f"step {step}: loss {loss:.4f}  ({model.plan.summary()})")
state = model.state_dict()                                     # the whole model, loads into GPT2LMHeadModel
