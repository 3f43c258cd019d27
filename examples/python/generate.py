# Launch: .venv/bin/torchrun --nproc-per-node 4 examples/python/generate.py --tp 2 --pp 2
"""Train, then serve, the same parallel model: examples/models.py's Llama (8 query heads over 4
key/value heads) laid out on a mesh given by hand (tensor parallelism inside each pipeline
stage, data parallelism over what is left), a few training steps, then token-by-token greedy
generation from left-padded prompts of different lengths, each rank's KV cache holding its kv
heads of its stage's layers. The output is checked against one process holding the trained
weights (a loop without a cache, each prompt alone)."""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
import torch_monarch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from models import LlamaForCausalLM  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--tp", type=int, default=1, help="tensor parallel: ranks per layer")
parser.add_argument("--pp", type=int, default=1, help="pipeline stages (micro-batched decode round them)")
parser.add_argument("--steps", type=int, default=3, help="training steps before generating")
parser.add_argument("--new-tokens", type=int, default=32)
args = parser.parse_args()

torch.manual_seed(0)  # every rank builds the same model
vocab = 128
model = LlamaForCausalLM(vocab=vocab, hidden=64, heads=8, kv_heads=4, intermediate=128, layers=4)
with torch.no_grad():  # a tiny random model at its default init emits one token over and over
    for p in model.parameters():
        if p.dim() >= 2:
            p.normal_(0.0, 0.3)
mesh = torch_monarch.device_mesh(pp=args.pp, tp=args.tp)
pm = torch_monarch.parallelize(model, mesh)
opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
tokens = torch.randint(vocab, (8, 33), generator=torch.Generator().manual_seed(1))
if args.tp > 1:  # the head is split by vocabulary: each tp rank holds vocab / tp of the logits
    loss_fn = lambda logits, y: torch_monarch.vocab_parallel_cross_entropy(logits, y, mesh)  # noqa: E731
else:
    loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731
for step in range(args.steps):
    opt.zero_grad()
    loss = pm.train_step(*pm.local_batch(tokens[:, :-1], tokens[:, 1:]), loss_fn)
    opt.step()
    if mesh.rank == 0:
        print(f"step {step}: loss {loss:.4f}")

# This dp replica's prompts: 4 of different lengths, left-padded (attention_mask 0 on the padding).
g = torch.Generator().manual_seed(100 + mesh.coordinate("dp"))
rows = [torch.randint(1, vocab, (n,), generator=g) for n in (5, 11, 3, 8)]
ids = torch.zeros(4, 11, dtype=torch.long)
mask = torch.zeros(4, 11, dtype=torch.long)
for i, r in enumerate(rows):
    ids[i, 11 - len(r):], mask[i, 11 - len(r):] = r, 1
out = pm.generate(ids, max_new_tokens=args.new_tokens, attention_mask=mask,
                  micro_batches=2 if args.pp > 1 else None)  # 2 groups of rows round the pipeline

# One process with the trained weights: each prompt alone, the whole forward each step.
state = pm.state_dict()  # collective: every rank gets the whole model
reference = LlamaForCausalLM(vocab=vocab, hidden=64, heads=8, kv_heads=4, intermediate=128, layers=4).eval()
reference.load_state_dict(state)
with torch.no_grad():
    for i, r in enumerate(rows):
        t = r[None]
        for _ in range(args.new_tokens):
            t = torch.cat([t, reference(t)[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(out[i, 11:], t[0, len(r):]), f"rank {mesh.rank}: prompt {i} differs from one process"
if mesh.coordinate("tp") == 0 and mesh.coordinate("pp") == 0:
    print(f"dp {mesh.coordinate('dp')}: prompt 0 -> {out[0, 11:19].tolist()} ...", flush=True)
torch.distributed.barrier() if torch.distributed.is_initialized() else None
if mesh.rank == 0:
    print(f"generation ({args.new_tokens} tokens, tp={args.tp} pp={args.pp}) equals one process: OK")
