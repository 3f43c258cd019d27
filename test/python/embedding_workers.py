"""Ranks of the sharded-embedding tests (started through the launcher by test_embeddings.py).

    embedding_workers.py parity:<optimizer>:<layout>[,<layout>...]

layout: one sharding for every table (data_parallel, table_wise, row_wise, column_wise,
table_row_wise) or "mix" (two tables pinned, the third the planner's choice). Each layout
trains the model of embedding_model.py for STEPS steps; rank 0 writes losses, final tables
and each table's sharding."""

import os
import sys

import torch

import torch_monarch
from torch_monarch import planner
from torch_monarch.embeddings import shard_embeddings

from embedding_model import GLOBAL_BATCH, LR, STEPS, TABLES, batch, loss_fn, make_collection, make_head


def global_mean(group, value):
    t = torch.tensor([value], dtype=torch.float64)
    group.all_reduce(t, average=True).wait()
    return t.item()


def run(optimizer, layout, world, mesh):
    dp = mesh.group("dp")
    cluster = planner.cluster("a100-80gb", world.size)
    if layout == "mix":
        pins = {"small": "table_wise", "mean": "row_wise"}
    else:
        pins = {t.name: layout for t in TABLES}
    ebc = make_collection()
    local = GLOBAL_BATCH // world.size
    sharded = shard_embeddings(ebc, batch_per_rank=local, optimizer=optimizer, lr=LR, cluster=cluster, pins=pins,
                               world=world)
    head = torch_monarch.DataParallel(make_head(), mesh=mesh)
    dense = torch.optim.SGD(head.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        begin = world.rank * local
        x, y = x.samples(begin, begin + local), y[begin:begin + local]
        dense.zero_grad()
        loss = loss_fn(head(sharded(x)), y)
        loss.backward()
        dense.step()
        losses.append(global_mean(dp, loss.item()))
    tables = {t.name: sharded.full_table(t.name) for t in TABLES}
    shardings = {p.table: str(p.sharding) for p in sharded.plan.placements}
    # No rank holds a table it was not given a shard of.
    held = {key.split("/")[0] for key in sharded.local_shards()}
    owners = {p.table for p in sharded.plan.placements if any(s.rank == world.rank for s in p.shards)}
    assert held == owners, (held, owners)
    return {"losses": losses, "tables": tables, "shardings": shardings,
            "head": {k: v.detach().clone() for k, v in head.module.state_dict().items()} if hasattr(head, "module")
            else {k: v.detach().clone() for k, v in head.state_dict().items()}}


def main():
    scenario, optimizer, layouts = sys.argv[1].split(":")
    layouts = layouts.split(",")
    assert scenario == "parity", scenario
    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=120)
    mesh = torch_monarch.device_mesh(dp=world.size, world=world)
    results = {layout: run(optimizer, layout, world, mesh) for layout in layouts}
    if world.rank == 0:
        torch.save(results, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], "rank0.pt"))


if __name__ == "__main__":
    main()
