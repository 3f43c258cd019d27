"""Worker for test_netcluster.py, one per rank on a two-"node" cluster made by
scripts/netcluster.sh (torchrun's multi-node launch in each node's namespace): the tiny GPT
with tp 2 inside each node and dp 2 across the nodes, trained STEPS steps; then an
all-reduce timed on each axis, so the test sees the inter-node link's limit and the
intra-node loopback. Rank 0 writes losses, the whole model and the timings."""

import os
import socket
import sys
import time

import torch

import torch_monarch
from torch_monarch.tensor_parallel_modules import vocab_parallel_cross_entropy
from tiny_gpt import GLOBAL_BATCH, STEPS, batch, make_model, make_optimizer

PROBE_BYTES = 4 << 20


def timed_all_reduce(group, nbytes, repeats=3):
    buf = torch.ones(nbytes // 4)
    group.all_reduce(buf).wait()  # connect and warm up
    best = float("inf")
    for _ in range(repeats):
        group.barrier()
        t0 = time.perf_counter()
        group.all_reduce(buf).wait()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=120)
    mesh = torch_monarch.device_mesh(pp=1, dp=2, tp=2)
    model = torch_monarch.parallelize(make_model(), mesh)
    opt = make_optimizer(model.named_parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(step, GLOBAL_BATCH)
        opt.zero_grad()
        losses.append(float(model.train_step(*model.local_batch(x, y),
                                             lambda out, t: vocab_parallel_cross_entropy(out, t, mesh))))
        opt.step()
    state = model.state_dict()
    dp_s = timed_all_reduce(mesh.group("dp"), PROBE_BYTES)
    tp_s = timed_all_reduce(mesh.group("tp"), PROBE_BYTES)
    if world.rank == 0:
        torch.save({"losses": losses, "state": state, "dp_all_reduce_s": dp_s, "tp_all_reduce_s": tp_s,
                    "bytes": PROBE_BYTES, "node": int(os.environ["NODE_RANK"]), "host": socket.gethostname()},
                   os.path.join(os.environ["MONARCH_TEST_OUTPUT"], "result.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
