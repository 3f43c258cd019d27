"""Ranks of the sharded-embedding tests (started through the launcher by test_embeddings.py).

    embedding_workers.py parity:<optimizer>:<layout>[,<layout>...]
    embedding_workers.py sequence:<optimizer>:<layout>[,...]   sequence tables (nn.Embedding)
    embedding_workers.py meta        a 512 MiB table built on meta, row-wise, trained
    embedding_workers.py errors      bad input on every rank: the messages
    embedding_workers.py reshard     whole-table state dict from one sharding into another
    embedding_workers.py dlrm        the example DLRM, planned and sharded, SGD
    embedding_workers.py dlrm_parallelize   the same through torch_monarch.parallelize
    embedding_workers.py sequence:<optimizer>:<layout>[,...]   sequence tables (nn.Embedding)
    embedding_workers.py meta        a 512 MiB table built on meta, row-wise, trained
    embedding_workers.py errors      bad input on every rank: the messages
    embedding_workers.py reshard     whole-table state dict from one sharding into another
    embedding_workers.py dlrm        the example DLRM, planned and sharded, SGD
    embedding_workers.py dlrm_parallelize   the same through torch_monarch.parallelize

layout: one sharding for every table (data_parallel, table_wise, row_wise, column_wise,
table_row_wise) or "mix" (two tables pinned, the third the planner's choice). Each layout
trains the model of embedding_model.py for STEPS steps; rank 0 writes losses, final tables
and each table's sharding."""

import os
import sys
import time

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


def sequence(optimizer, layout, world, mesh):
    """Sequence tables (nn.Embedding) in one sharding: losses and final tables."""
    from embedding_model import SEQUENCE_TABLES, make_sequence_collection, sequence_batch, sequence_loss
    dp = mesh.group("dp")
    local = GLOBAL_BATCH // world.size
    sharded = shard_embeddings(make_sequence_collection(), batch_per_rank=local, optimizer=optimizer, lr=LR,
                               cluster=planner.cluster("a100-80gb", world.size),
                               pins={t.name: layout for t in SEQUENCE_TABLES}, world=world)
    losses = []
    for step in range(STEPS):
        x = sequence_batch(step).samples(world.rank * local, (world.rank + 1) * local)
        rows = sharded(x)
        assert sorted(rows) == ["h1", "h2", "t"], sorted(rows)
        loss = sequence_loss(rows, local)
        loss.backward()
        losses.append(global_mean(dp, loss.item()))
    return {"losses": losses, "tables": {t.name: sharded.full_table(t.name) for t in SEQUENCE_TABLES}}


def vm(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def meta(world):
    """2M x 64 fp32 = 512 MiB: built on meta, sharded row-wise, trained; every rank's peak
    resident memory grows by far less than the table."""
    from torch_monarch.embeddings import EmbeddingBagCollection, EmbeddingBagConfig, JaggedBatch
    import resource
    rows, dim = 2_000_000, 64
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = vm("VmRSS")
    # This rank may allocate 320 MiB more than it has now: less than the 488 MiB table.
    limit = vm("VmData") + 320 * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    try:
        torch.empty(rows, dim)  # the whole table does not fit under the limit
        whole_fits = True
    except RuntimeError:
        whole_fits = False
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("huge", rows, dim, features=["id"], pooling_factor=4)],
                                 device="meta")
    sharded = shard_embeddings(ebc, batch_per_rank=16, optimizer="rowwise_adagrad", lr=0.1,
                               cluster=planner.cluster("a100-80gb", world.size), pins={"huge": "row_wise"}, world=world)
    g = torch.Generator().manual_seed(world.rank)
    losses = []
    for step in range(3):
        ids = torch.randint(0, rows, (16 * 4,), generator=g)
        x = JaggedBatch(["id"], ids, torch.full((16,), 4, dtype=torch.long))
        loss = sharded(x).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    shards = sharded.local_shards()
    return {"losses": losses, "peak_growth": vm("VmHWM") - base, "table_bytes": rows * dim * 4, "whole_fits": whole_fits,
            "local_rows": sum(v.shape[0] for v in shards.values()), "local_bytes": sharded.local_bytes}


def errors(world):
    """Each bad input on every rank (so no rank waits for another): the message."""
    from torch_monarch.embeddings import JaggedBatch
    ebc = make_collection()
    sharded = shard_embeddings(ebc, batch_per_rank=2, optimizer="sgd", lr=LR, world=world,
                               cluster=planner.cluster("a100-80gb", world.size), pins={"small": "row_wise"})
    out = {}
    good = {"a": [[1], [2]], "b": [[3], []], "c": [[4], [5]], "d": [[6], [7]]}
    for name, features in (("id", dict(good, d=[[6], [97]])), ("negative", dict(good, a=[[-1], [2]])),
                           ("missing", {k: v for k, v in good.items() if k != "c"}),
                           ("unknown", dict(good, z=[[1], [1]]))):
        try:
            sharded(JaggedBatch.from_lists(features))
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the message is what is tested
            out[name] = str(e)
    x = JaggedBatch.from_lists(good)
    try:
        JaggedBatch(x.keys, x.values[:-1], x.lengths)
        out["lengths"] = None
    except ValueError as e:
        out["lengths"] = str(e)
    # Only rank 1's batch is bad: every rank fails the same lookup, at once, and the next
    # lookup works on every rank.
    bad_on_one = dict(good, d=[[6], [97]]) if world.rank == 1 else good
    t0 = time.monotonic()
    try:
        sharded(JaggedBatch.from_lists(bad_on_one))
        out["one_rank"] = None
    except Exception as e:  # noqa: BLE001
        out["one_rank"] = str(e)
    out["one_rank_seconds"] = time.monotonic() - t0
    out["after"] = sharded(x).shape[0]
    # Two lookups before one backward: refused (the fused update runs once per lookup).
    y = sharded(x)
    try:
        sharded(x)
        out["twice"] = None
    except Exception as e:  # noqa: BLE001
        out["twice"] = str(e)
    y.sum().backward()
    # Only rank 0 keeps an output without its backward (rank 1 drops its own): both ranks fail
    # the next lookup together, and once rank 0 drops it too the group works again.
    kept = sharded(x)
    if world.rank == 1:
        del kept
        kept = None
    try:
        sharded(x)
        out["kept_on_one"] = None
    except Exception as e:  # noqa: BLE001
        out["kept_on_one"] = str(e)
    del kept
    sharded(x).sum().backward()
    with torch.no_grad():  # evaluation lookups keep nothing and need no backward
        sharded(x)
        sharded(x)
    sharded(x).sum().backward()
    out["after_backward"] = True
    return out


def reshard(world):
    """Train two steps row-wise, save the whole-table state dict, load it into a table-wise and a
    column-wise copy: all three give the same pooled output."""
    state = None
    outputs = {}
    local = GLOBAL_BATCH // world.size
    for layout in ("row_wise", "table_wise", "column_wise"):
        ebc = make_collection(seed=7 if state is not None else 0)
        sharded = shard_embeddings(ebc, batch_per_rank=local, optimizer="sgd", lr=LR,
                                   cluster=planner.cluster("a100-80gb", world.size),
                                   pins={t.name: layout for t in TABLES}, world=world)
        holder = torch.nn.Module()  # the tables inside a model: its state dict holds them
        holder.emb = sharded
        if state is None:
            for step in range(2):
                x, _ = batch(step)
                sharded(x.samples(world.rank * local, (world.rank + 1) * local)).sum().backward()
            state = holder.state_dict()
        else:
            holder.load_state_dict(state)
        x, _ = batch(5)
        outputs[layout] = sharded(x.samples(world.rank * local, (world.rank + 1) * local)).detach()
    return {"outputs": outputs, "state": state}


def dlrm(world, via_parallelize=False):
    """The example DLRM, tables planned by the planner (no pins) and sharded, dense part
    data-parallel, SGD everywhere: losses and final tables and dense weights."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python"))
    import dlrm as example
    configs = example.tables(scale=0.002)
    torch.manual_seed(0)
    model = example.DLRM(configs)
    local = DLRM_BATCH // world.size
    if via_parallelize:  # what users call
        dp = torch_monarch.parallelize(model, global_batch=DLRM_BATCH, cluster=planner.cluster("a100-80gb", world.size),
                                       embeddings=dict(optimizer="sgd", lr=LR))
        assert dp.plan.world_size == world.size
    else:
        model.embeddings = shard_embeddings(model.embeddings, batch_per_rank=local, optimizer="sgd", lr=LR,
                                            world=world, cluster=planner.cluster("a100-80gb", world.size))
        dp = torch_monarch.DataParallel(model)
    opt = torch.optim.SGD(dp.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        dense, sparse, clicks = example.make_batch(step, DLRM_BATCH, configs)
        b = world.rank * local
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            dp(dense[b:b + local], sparse.samples(b, b + local)), clicks[b:b + local])
        loss.backward()
        opt.step()
        losses.append(global_mean(dp.group, loss.item()))
    return {"losses": losses, "tables": model.embeddings.state_dict(),
            "dense": {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith("embeddings")},
            "shardings": {p.table: str(p.sharding) for p in model.embeddings.plan.placements}}


DLRM_BATCH = 16


class Recommender(torch.nn.Module):
    """The tables and the head in one model: what a checkpoint saves and loads."""

    def __init__(self, emb, head):
        super().__init__()
        self.emb, self.head = emb, head

    def forward(self, x):
        return self.head(self.emb(x))


def checkpointed(world, mesh, optimizer, save_layout, load_layout, directory):
    """Train 2 steps with the tables sharded as save_layout, checkpoint (tables, their fused
    optimizer state, the head and its optimizer), train 2 more: the uninterrupted run. Then a
    model with other weights, sharded as load_layout, loads the checkpoint and trains the same
    2 steps."""
    from torch_monarch import checkpoint
    local = GLOBAL_BATCH // world.size
    cluster = planner.cluster("a100-80gb", world.size)

    def build(layout, seed):
        sharded = shard_embeddings(make_collection(seed=seed), batch_per_rank=local, optimizer=optimizer, lr=LR,
                                   cluster=cluster, pins={t.name: layout for t in TABLES}, world=world)
        model = torch_monarch.DataParallel(Recommender(sharded, make_head(seed=seed + 1)), mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=LR)

    def train(model, opt, first, count):
        losses = []
        for step in range(first, first + count):
            x, y = batch(step)
            begin = world.rank * local
            opt.zero_grad()
            loss = loss_fn(model(x.samples(begin, begin + local)), y[begin:begin + local])
            loss.backward()
            opt.step()
            losses.append(global_mean(mesh.group("dp"), loss.item()))
        return losses

    model, opt = build(save_layout, 0)
    first = train(model, opt, 0, 2)
    checkpoint.save(model, opt, directory, step=2)
    rest = train(model, opt, 2, 2)
    tables = {t.name: model.module.emb.full_table(t.name) for t in TABLES}
    fresh, fresh_opt = build(load_layout, 5)
    info = checkpoint.load(fresh, fresh_opt, directory)
    assert info["step"] == 2
    resumed = train(fresh, fresh_opt, 2, 2)
    return {"uninterrupted": first + rest, "resumed": resumed, "tables": tables,
            "resumed_tables": {t.name: fresh.module.emb.full_table(t.name) for t in TABLES}}


def main():
    parts = sys.argv[1].split(":")
    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=120)
    mesh = torch_monarch.device_mesh(dp=world.size, world=world)
    if parts[0] == "parity":
        optimizer, layouts = parts[1], parts[2].split(",")
        results = {layout: run(optimizer, layout, world, mesh) for layout in layouts}
    elif parts[0] == "meta":
        results = meta(world)
    elif parts[0] == "errors":
        results = errors(world)
    elif parts[0] == "reshard":
        results = reshard(world)
    elif parts[0] == "sequence":
        optimizer, layouts = parts[1], parts[2].split(",")
        results = {layout: sequence(optimizer, layout, world, mesh) for layout in layouts}
    elif parts[0] == "dlrm":
        results = dlrm(world)
    elif parts[0] == "dlrm_parallelize":
        results = dlrm(world, via_parallelize=True)
    elif parts[0] == "checkpoint":
        results = checkpointed(world, mesh, parts[1], parts[2], parts[3], parts[4])
    elif parts[0] == "checkpoint_without_mesh":
        # Sharded tables inside a model that has no mesh: refused on every rank, nothing written.
        from torch_monarch import checkpoint
        sharded = shard_embeddings(make_collection(), batch_per_rank=GLOBAL_BATCH // world.size, optimizer="sgd", lr=LR,
                                   cluster=planner.cluster("a100-80gb", world.size), world=world)
        try:
            checkpoint.save(Recommender(sharded, make_head()), None, parts[1])
            results = {"error": None}
        except checkpoint.CheckpointError as e:
            results = {"error": str(e)}
    else:
        raise SystemExit(f"unknown scenario {sys.argv[1]}")
    torch.save(results, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{world.rank}.pt"))


if __name__ == "__main__":
    main()
