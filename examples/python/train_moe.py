# Launch: .venv/bin/torchrun --nproc-per-node 4 examples/python/train_moe.py --dp 2 --cp 2 --ep 2
"""A Mixture-of-Experts decoder (examples/models.py's MoEForCausalLM: Qwen3-MoE / Mixtral
module names) trained with expert parallelism (its experts split over ep ranks, tokens moved
by all-to-all) and context parallelism (each sequence split over cp ranks, ring attention),
on a mesh given by hand. Prints the global loss and where this rank's experts are."""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
import torch_monarch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from models import MoEForCausalLM  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--dp", type=int, default=None, help="data parallel (default: what the world leaves)")
parser.add_argument("--cp", type=int, default=1, help="context parallel: ranks per sequence")
parser.add_argument("--ep", type=int, default=1, help="expert parallel: ranks the experts are split over")
parser.add_argument("--zero", type=int, default=0, help="0: replicas; 1-3: ZeRO (experts sharded over edp)")
parser.add_argument("--capacity-factor", type=float, default=0.0, help="0: dropless")
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

torch.manual_seed(0)  # every rank builds the same model
vocab, seq, batch = 128, 64, 8
model = MoEForCausalLM(vocab=vocab, hidden=64, heads=4, kv_heads=2, intermediate=64, layers=2, num_experts=8,
                       top_k=2, shared_intermediate=64, capacity_factor=args.capacity_factor)
tokens = torch.randint(vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
inputs, targets = tokens[:, :-1], tokens[:, 1:]

mesh = torch_monarch.device_mesh(dp=args.dp, cp=args.cp, ep=args.ep)
pm = torch_monarch.parallelize(model, mesh, zero_stage=args.zero)  # experts, then ring attention, then dp / ZeRO
opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)


def loss_fn(logits, y):  # each rank's tokens; the engine averages over dp x cp
    return F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1)) + 0.01 * model.aux_loss()


for step in range(args.steps):
    opt.zero_grad()
    loss = pm.train_step(*pm.local_batch(inputs, targets), loss_fn)  # cut along the sequence under cp
    opt.step()
    if mesh.rank == 0:
        print(f"step {step}: loss {loss:.4f}")
experts = [m for m in model.modules() if type(m).__name__ == "ExpertParallelExperts"]
print(f"rank {mesh.rank}: dp {mesh.coordinate('dp')} cp {mesh.coordinate('cp')}: "
      + (f"experts {experts[0].first_expert}-{experts[0].first_expert + experts[0].local_experts - 1} of 8"
         if experts else "all 8 experts"), flush=True)
