"""Embedding tables of recommendation models: jagged sparse batches, an unsharded collection
(the reference, and what users write), and its sharded form run by the C++ engine
(``ShardedEmbeddingTables``: all-to-all input and output distribution, fused sparse
optimizer in backward).

    tables = [EmbeddingBagConfig("user", 1_000_000, 64, features=["user_id"]),
              EmbeddingBagConfig("item", 500_000, 64, features=["item_id", "clicked_ids"], pooling="mean")]
    ebc = EmbeddingBagCollection(tables)                     # one process: nn.EmbeddingBag per table
    sharded = shard_embeddings(ebc, batch_per_rank=256, optimizer="rowwise_adagrad", lr=0.05)
    pooled = sharded(JaggedBatch.from_lists({"user_id": [[3], [7]], "item_id": [[1, 2], []],
                                             "clicked_ids": [[5], [6, 8]]}))   # [2, 192]
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from . import planner as _planner


class JaggedBatch:
    """Sparse features of a batch in TorchRec's KeyedJaggedTensor layout: ``values`` (int64 ids),
    ``lengths`` (int64, features x batch, feature-major: the ids of feature k, sample i are the
    next ``lengths[k * B + i]`` values) and optional per-id ``weights``."""

    def __init__(self, keys: Sequence[str], values, lengths, weights=None):
        self.keys = list(keys)
        self.values = torch.as_tensor(values, dtype=torch.long).reshape(-1)
        self.lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
        self.weights = None if weights is None else torch.as_tensor(weights, dtype=torch.float32).reshape(-1)
        if not self.keys:
            raise ValueError("JaggedBatch: no feature keys")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"JaggedBatch: a feature is named twice in {self.keys}")
        if self.lengths.numel() % len(self.keys):
            raise ValueError(f"JaggedBatch: {self.lengths.numel()} lengths for {len(self.keys)} features: expected "
                             "features x batch size")
        if self.lengths.numel() and int(self.lengths.min()) < 0:
            raise ValueError("JaggedBatch: a length is negative")
        total = int(self.lengths.sum())
        if total != self.values.numel():
            raise ValueError(f"JaggedBatch: lengths sum to {total} but there are {self.values.numel()} values")
        if self.weights is not None and self.weights.numel() != self.values.numel():
            raise ValueError(f"JaggedBatch: {self.weights.numel()} weights for {self.values.numel()} values")

    @classmethod
    def from_lists(cls, features: Dict[str, Sequence[Sequence[int]]], weights: Optional[Dict[str, Sequence]] = None):
        """From {feature: [ids of sample 0, ids of sample 1, ...]} (every feature the same number
        of samples); ``weights`` likewise, for weighted pooling."""
        keys = list(features)
        sizes = {k: len(features[k]) for k in keys}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"JaggedBatch.from_lists: features have different batch sizes {sizes}")
        values, lengths, ws = [], [], []
        for k in keys:
            for i, ids in enumerate(features[k]):
                ids = list(ids)
                values.extend(int(v) for v in ids)
                lengths.append(len(ids))
                if weights is not None:
                    w = list(weights[k][i])
                    if len(w) != len(ids):
                        raise ValueError(f"JaggedBatch.from_lists: feature '{k}' sample {i}: {len(w)} weights for "
                                         f"{len(ids)} ids")
                    ws.extend(float(x) for x in w)
        return cls(keys, torch.tensor(values, dtype=torch.long), torch.tensor(lengths, dtype=torch.long),
                   None if weights is None else torch.tensor(ws, dtype=torch.float32))

    @property
    def batch_size(self) -> int:
        return self.lengths.numel() // len(self.keys)

    def _starts(self):
        per_key = self.lengths.view(len(self.keys), -1).sum(1)
        return torch.cat([per_key.new_zeros(1), per_key.cumsum(0)]).tolist()

    def feature(self, key):
        """(ids, lengths [B], weights or None) of one feature."""
        k = self.keys.index(key)
        starts = self._starts()
        ids = self.values[starts[k]:starts[k + 1]]
        w = None if self.weights is None else self.weights[starts[k]:starts[k + 1]]
        return ids, self.lengths.view(len(self.keys), -1)[k], w

    def samples(self, begin, end):
        """The batch of samples [begin, end) (a rank's share of a global batch)."""
        values, lengths, weights = [], [], []
        for key in self.keys:
            ids, lens, w = self.feature(key)
            offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
            values.append(ids[offsets[begin]:offsets[end]])
            lengths.append(lens[begin:end])
            if w is not None:
                weights.append(w[offsets[begin]:offsets[end]])
        return JaggedBatch(self.keys, torch.cat(values), torch.cat(lengths),
                           torch.cat(weights) if self.weights is not None else None)

    def __repr__(self):
        return f"JaggedBatch(keys={self.keys}, batch_size={self.batch_size}, ids={self.values.numel()})"


@dataclass
class EmbeddingBagConfig:
    """One table: ``rows`` x ``dim``, looked up by ``features`` (default: a feature named like
    the table); ``pooling`` sum or mean; ``pooling_factor``: mean ids per sample per feature
    (for the planner)."""
    name: str
    rows: int
    dim: int
    features: List[str] = field(default_factory=list)
    pooling: str = "sum"
    pooling_factor: float = 1.0

    _poolings = ("sum", "mean")

    def __post_init__(self):
        if not self.features:
            self.features = [self.name]
        if self.pooling not in self._poolings:
            raise ValueError(f"table '{self.name}': pooling must be one of {self._poolings}, got '{self.pooling}'")
        if self.rows <= 0 or self.dim <= 0:
            raise ValueError(f"table '{self.name}': rows and dim must be > 0 (got {self.rows} x {self.dim})")


@dataclass
class EmbeddingConfig(EmbeddingBagConfig):
    """A table of sequence features (``nn.Embedding``): every id gets its own row, no pooling;
    ``pooling_factor``: mean ids per sample per feature (the sequence length)."""
    pooling: str = "none"
    _poolings = ("none",)


def _check_unique(configs, what):
    names = [t.name for t in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"{what}: two tables share a name in {names}")
    features = [f for t in configs for f in t.features]
    if len(set(features)) != len(features):
        raise ValueError(f"{what}: a feature looks up two tables; each feature names one")


class EmbeddingBagCollection(nn.Module):
    """Tables as ``nn.EmbeddingBag`` modules on one process: the unsharded model (and the
    reference sharded runs are checked against). Output: [B, sum of each feature's dim], the
    features in table order, each table's features in its config's order."""

    def __init__(self, tables: Sequence[EmbeddingBagConfig], device=None):
        super().__init__()
        self.configs = list(tables)
        _check_unique(self.configs, "EmbeddingBagCollection")
        for t in self.configs:
            if t.pooling not in ("sum", "mean"):
                raise ValueError(f"EmbeddingBagCollection: table '{t.name}' has pooling '{t.pooling}'; sequence tables "
                                 "(EmbeddingConfig) go in an EmbeddingCollection")
        self.tables = nn.ModuleDict({t.name: nn.EmbeddingBag(t.rows, t.dim, mode=t.pooling, device=device)
                                     for t in self.configs})

    @property
    def output_keys(self):
        return [f for t in self.configs for f in t.features]

    def forward(self, batch: JaggedBatch):
        outs = []
        for t in self.configs:
            bag = self.tables[t.name]
            for f in t.features:
                if f not in batch.keys:
                    raise ValueError(f"JaggedBatch lacks feature '{f}'")
                ids, lens, w = batch.feature(f)
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t.rows):
                    bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                    raise ValueError(f"feature '{f}': id {bad} is out of range for table '{t.name}' ({t.rows} rows)")
                offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)[:-1]])
                outs.append(bag(ids, offsets, per_sample_weights=w))
        return torch.cat(outs, dim=1)

    def planner_tables(self, dtype="fp32"):
        return [_planner.embedding_table(t.name, t.rows, t.dim, features=t.features, pooling_factor=t.pooling_factor,
                                         pooling=t.pooling, dtype=dtype) for t in self.configs]


class EmbeddingCollection(nn.Module):
    """Sequence features on one process: one ``nn.Embedding`` per table (the unsharded model
    and the reference). Output: {feature: [its ids in the batch, dim]} in table order."""

    def __init__(self, tables: Sequence[EmbeddingConfig], device=None):
        super().__init__()
        self.configs = list(tables)
        _check_unique(self.configs, "EmbeddingCollection")
        for t in self.configs:
            if t.pooling != "none":
                raise ValueError(f"EmbeddingCollection: table '{t.name}' pools ({t.pooling}); use EmbeddingConfig")
        self.tables = nn.ModuleDict({t.name: nn.Embedding(t.rows, t.dim, device=device) for t in self.configs})

    @property
    def output_keys(self):
        return [f for t in self.configs for f in t.features]

    def forward(self, batch: JaggedBatch):
        out = {}
        for t in self.configs:
            for f in t.features:
                if f not in batch.keys:
                    raise ValueError(f"JaggedBatch lacks feature '{f}'")
                ids, _, w = batch.feature(f)
                if w is not None:
                    raise ValueError(f"feature '{f}' has weights but table '{t.name}' is a sequence table")
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t.rows):
                    bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                    raise ValueError(f"feature '{f}': id {bad} is out of range for table '{t.name}' ({t.rows} rows)")
                out[f] = self.tables[t.name](ids)
        return out

    def planner_tables(self, dtype="fp32"):
        return [_planner.embedding_table(t.name, t.rows, t.dim, features=t.features, pooling_factor=t.pooling_factor,
                                         pooling="none", dtype=dtype) for t in self.configs]


def rowwise_adagrad_(weight, grad, state, lr, eps=1e-8):
    """FBGEMM's row-wise Adagrad on whole tensors (the reference for the fused sparse path):
    one accumulator per row, the mean squared gradient; rows with no gradient do not move."""
    with torch.no_grad():
        state.add_(grad.pow(2).mean(1))
        weight.add_(-lr * grad / (state.sqrt() + eps).unsqueeze(1))


class ShardedEmbeddingCollection(nn.Module):
    """An EmbeddingBagCollection sharded as an EmbeddingPlan says, run by the C++ engine. Its
    tables are not ``nn.Parameter``s: the optimizer (``sgd``, ``rowwise_adagrad``, ``adam``) runs
    fused inside backward, once per lookup, on the rows the batch touched, so pass only the
    dense model's parameters to ``torch.optim``, and run backward after each lookup (no
    gradient accumulation over several lookups). ``state_dict()`` holds whole tables under the
    unsharded collection's keys, also inside a parent model's state dict (collective: every
    rank calls it)."""

    def __init__(self, configs, plan, group, optimizer, lr, **optimizer_options):
        super().__init__()
        from . import _runtime
        self.configs = list(configs)
        self.plan = plan
        self._engine = _runtime.ShardedEmbeddingTables(plan, group, optimizer, lr, **optimizer_options)

    @property
    def output_keys(self):
        return list(self._engine.output_keys)

    def forward(self, batch: JaggedBatch):
        """Pooled tables: [B, width]. Sequence tables: {feature: [ids, dim]}. Both: the pair."""
        pooled, sequences = self._engine.forward_all(batch.keys, batch.values, batch.lengths, batch.weights)
        sequence_keys = list(self._engine.sequence_keys)  # the engine's order, which labels its output
        if not sequence_keys:
            return pooled
        named = dict(zip(sequence_keys, sequences))
        return named if len(sequence_keys) == len(self.output_keys) else (pooled, named)

    def full_table(self, name):
        return self._engine.full_table(name)

    def local_shards(self):
        return dict(self._engine.local_shards())

    @property
    def local_bytes(self):
        return self._engine.local_bytes

    # Whole tables under the unsharded collection's keys ("tables.<name>.weight"), through
    # nn.Module's own state_dict machinery so a model holding this module saves and loads
    # them too. Collective: every rank calls state_dict() / load_state_dict().
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for t in self.configs:
            destination[f"{prefix}tables.{t.name}.weight"] = self._engine.full_table(t.name)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for t in self.configs:
            key = f"{prefix}tables.{t.name}.weight"
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            if tuple(value.shape) != (t.rows, t.dim):
                error_msgs.append(f"{key}: table '{t.name}' is {t.rows} x {t.dim}, the state dict holds "
                                  f"{tuple(value.shape)}")
                continue
            self._engine.load_table(t.name, value.detach().to(torch.float32))
        if strict:
            ours = {f"{prefix}tables.{t.name}.weight" for t in self.configs}
            for key in state_dict:
                if key.startswith(prefix + "tables.") and key not in ours:
                    unexpected_keys.append(key)


def _broadcast_text(group, text, rank):
    """`text` from rank 0 of `group` to every rank (a plan planned once, so every rank lays the
    tables out alike even where their detected machines differ)."""
    data = torch.tensor(bytearray(text.encode()) if rank == 0 else bytearray(), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    group.broadcast(size, 0).wait()
    buffer = data if rank == 0 else torch.empty(int(size), dtype=torch.uint8)
    group.broadcast(buffer, 0).wait()
    return bytes(buffer.tolist()).decode()


def _check_plan_tables(plan, collection):
    """The plan's tables are the collection's, in its order: name, rows, dim, features, pooling
    (a plan for another model is refused, listing every difference)."""
    want = [(t.name, t.rows, t.dim, list(t.features), t.pooling) for t in collection.configs]
    got = [(t.name, t.rows, t.dim, list(t.features), str(t.pooling)) for t in plan.tables]
    if want != got:
        problems = [f"table {i}: the plan has {g}, the model {w}" for i, (g, w) in enumerate(zip(got, want)) if g != w]
        if len(got) != len(want):
            problems.append(f"the plan has {len(got)} tables, the model {len(want)}")
        raise ValueError("embeddings: the plan does not match the model's tables (name, rows, dim, features, "
                         "pooling):\n  " + "\n  ".join(problems))


def shard_embeddings(collection, *, batch_per_rank: int, optimizer: str = "sgd",
                     lr: float = 0.01, plan=None, cluster=None, pins=None, memory_budget_bytes=0.0,
                     world=None, init_bound: Optional[float] = None, seed: int = 0, **optimizer_options):
    """Plans (unless ``plan``, an EmbeddingPlan, is given: rank 0 plans and sends the plan to every
    rank) and shards `collection` over every rank of the job. Tables with real weights start
    from rank 0's values, each rank keeping its shards; tables on the meta device
    are never built whole: each rank fills only its shards, U(-b, b) with b = ``init_bound`` or
    1/sqrt(rows) of each table (values then depend on the sharding). Collective: every rank calls it."""
    from . import distributed
    world = world or distributed.init()
    mesh = distributed.device_mesh(dp=world.size, world=world)
    group = mesh.group("dp")
    if plan is None:
        # Rank 0 plans, every rank gets its plan (an error there is every rank's error).
        text = ""
        if world.rank == 0:
            try:
                if cluster is None:
                    from .cluster import detect
                    cluster = detect(world.size)
                text = _planner.plan_embeddings(collection.planner_tables(), cluster, world_size=world.size,
                                                batch_per_rank=batch_per_rank, optimizer=optimizer, pins=pins,
                                                memory_budget_bytes=memory_budget_bytes).to_json()
            except Exception as e:  # noqa: BLE001 - sent to the other ranks, then raised here
                text = "error:" + type(e).__name__ + ":" + str(e)
                _broadcast_text(group, text, world.rank)
                raise
        text = _broadcast_text(group, text, world.rank)
        if text.startswith("error:"):
            _, kind, message = text.split(":", 2)
            raise ValueError(f"planning the embedding tables failed on rank 0: {kind}: {message}")
        plan = _planner.EmbeddingPlan.from_json(text)
    if plan.world_size != world.size:
        raise ValueError(f"embeddings.world_size: the plan is for {plan.world_size} ranks, the job has {world.size}")
    _check_plan_tables(plan, collection)
    sharded = ShardedEmbeddingCollection(collection.configs, plan, mesh.group("dp"), optimizer, lr,
                                         **optimizer_options)
    sharded._mesh = mesh  # keeps the group alive
    meta = any(p.is_meta for p in collection.parameters())
    if meta:
        sharded._engine.init_uniform(init_bound if init_bound is not None else 0.0, seed)
    else:
        # Every table starts from rank 0's values, as replicas do (data-parallel copies would
        # otherwise differ forever: only their gradients are averaged).
        for t in collection.configs:
            full = collection.tables[t.name].weight.detach().to(torch.float32).contiguous().clone()
            group.broadcast(full, 0).wait()
            sharded._engine.load_table(t.name, full)
    return sharded


def _set_submodule(model, name, module):
    parent = model
    parts = name.split(".")
    for part in parts[:-1]:
        parent = getattr(parent, part)
    setattr(parent, parts[-1], module)


def parallelize_recommendation(model: nn.Module, *, global_batch: int, cluster=None, plan=None, optimizer="sgd",
                               lr=0.01, pins=None, memory_budget_bytes=0.0, world=None, bucket_cap_mb=25.0,
                               **optimizer_options):
    """``parallelize`` for a model holding an EmbeddingBagCollection (what TorchRec's
    DistributedModelParallel does): the tables planned and sharded over every rank
    (``shard_embeddings``), the rest of the model data-parallel (``DataParallel``) over the
    same ranks. A dense part built on meta is materialized here (``reset_parameters``).
    Returns the DataParallel-wrapped model; ``.plan`` is the tables' EmbeddingPlan."""
    from . import distributed
    from .data_parallel import DataParallel
    world = world or distributed.init()
    if global_batch is None or global_batch % world.size:
        raise ValueError(f"parallelize: global_batch={global_batch} must be a multiple of the {world.size} ranks "
                         "(each rank brings global_batch / ranks samples)")
    collections = [(n, m) for n, m in model.named_modules()
                   if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]
    if len(collections) != 1:
        raise ValueError(f"parallelize: found {len(collections)} embedding collections "
                         f"({[n for n, _ in collections]}); one per model is supported (put every table in it)")
    name, ebc = collections[0]
    sharded = shard_embeddings(ebc, batch_per_rank=global_batch // world.size, optimizer=optimizer, lr=lr, plan=plan,
                               cluster=cluster, pins=pins, memory_budget_bytes=memory_budget_bytes, world=world,
                               **optimizer_options)
    if name:
        _set_submodule(model, name, sharded)
    else:
        raise ValueError("parallelize: the model is itself an embedding collection: use shard_embeddings()")
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device="cpu")
        for m in model.modules():
            if m is not sharded and hasattr(m, "reset_parameters"):
                m.reset_parameters()
    wrapped = DataParallel(model, mesh=distributed.device_mesh(dp=world.size, world=world),
                           bucket_cap_mb=bucket_cap_mb)
    wrapped.plan = sharded.plan
    return wrapped
