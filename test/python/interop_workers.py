"""One rank (WORLD_SIZE=1) with torch.distributed initialized: each torch_monarch wrapper given a
model that PyTorch's own wrappers already lay out (FSDP2, DTensor, DDP) must refuse it with a
ValueError naming the part; plain models still wrap. Prints one JSON line of what happened."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import torch_monarch  # noqa: E402
from models import GPT2LMHeadModel  # noqa: E402
from torch_monarch.tensor_parallel_modules import tensor_parallel  # noqa: E402


def gpt():
    torch.manual_seed(0)
    return GPT2LMHeadModel(vocab=32, hidden=16, heads=2, layers=2, max_positions=8)


def fsdp2_model():
    from torch.distributed.fsdp import fully_shard
    model = gpt()
    fully_shard(model.transformer.h[1])
    return model


def dtensor_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    model = gpt()
    parallelize_module(model, init_device_mesh("cpu", (1,)), {"transformer.h.0.mlp.c_fc": ColwiseParallel()})
    return model


def ddp_model():
    return nn.parallel.DistributedDataParallel(gpt())


def main():
    dist.init_process_group("gloo")
    mesh = torch_monarch.device_mesh()
    wrappers = {
        "parallelize": lambda m: torch_monarch.parallelize(m, mesh, zero_stage=0),
        "DataParallel": lambda m: torch_monarch.DataParallel(m, mesh),
        "fully_shard": lambda m: torch_monarch.fully_shard(m, mesh),
        "tensor_parallel": lambda m: tensor_parallel(m, mesh),
    }
    seen = {}
    for model_name, make in (("fsdp2", fsdp2_model), ("dtensor", dtensor_model), ("ddp", ddp_model),
                             ("plain", gpt)):
        for wrapper_name, wrap in wrappers.items():
            try:
                wrap(make())
                seen[f"{model_name} {wrapper_name}"] = "wrapped"
            except ValueError as e:
                seen[f"{model_name} {wrapper_name}"] = "ValueError: " + str(e)
    dist.destroy_process_group()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
