# Launch: .venv/bin/torchrun --nproc-per-node 4 examples/python/from_fsdp2.py
# A run trained with FSDP2 in bf16 and checkpointed with DCP, the way torchtitan does it,
# continues in torch_monarch: the wrapping and the loss change, the optimizer does not, and
# the DCP checkpoint (weights, AdamW state, learning rates) loads into the planned layout.
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import torch_monarch
from torch_monarch import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from models import LlamaForCausalLM  # noqa: E402


def build():
    torch.manual_seed(0)  # every rank builds the same model
    return LlamaForCausalLM(vocab=128, hidden=64, heads=4, kv_heads=2, intermediate=172, layers=4)


tokens = torch.randint(128, (16, 17), generator=torch.Generator().manual_seed(1))
inputs, targets = tokens[:, :-1], tokens[:, 1:]                # 16 sequences of 16 tokens
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
shared = [tempfile.mkdtemp(prefix="from_fsdp2-") if rank == 0 else None]
dist.broadcast_object_list(shared)
ckpt = os.path.join(shared[0], "step-3")

# -- what the user runs today: FSDP2 with torchtitan's mixed precision, a DCP checkpoint at step 3
model = build()
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for block in model.model.layers:
    fully_shard(block, mp_policy=policy)
fully_shard(model, mp_policy=policy)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
share = slice(rank * 16 // world, (rank + 1) * 16 // world)
for step in range(3):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(inputs[share]).float().flatten(0, 1), targets[share].flatten())
    loss.backward()
    opt.step()
dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)

# -- the same run continued in torch_monarch
model = build()
model = torch_monarch.parallelize(model, example_input=inputs, global_batch=16, dtype="bf16")  # or plan=
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)         # unchanged
checkpoint.load_dcp(model, opt, ckpt)                        # FSDP2's dcp.save({"model": ..., "optimizer": ...})
loss_fn = lambda logits, y: torch_monarch.vocab_parallel_cross_entropy(logits, y, model.mesh)  # noqa: E731
for step in range(3, 6):
    opt.zero_grad()
    loss = model.train_step(*model.local_batch(inputs, targets), loss_fn)  # this dp rank's share
    opt.step()
    if rank == 0:
        print(f"step {step}: loss {loss:.4f}  ({model.plan.summary()})")
checkpoint.save(model, opt, os.path.join(shared[0], "step-6"), step=6)  # torch_monarch's own, any layout
dist.barrier()
if rank == 0:
    import shutil
    shutil.rmtree(shared[0])
dist.destroy_process_group()
