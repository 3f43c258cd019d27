"""DLRM (Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and
Recommendation Systems") on synthetic click data, its embedding tables planned and sharded by
torch_monarch, its dense part data-parallel.

    torchrun --nproc-per-node 4 examples/python/dlrm.py --steps 20
    python3 examples/python/dlrm.py --steps 20              # one process, unsharded

Model: a bottom MLP over 13 dense features to the embedding width, 8 embedding tables of
different sizes and pooling factors (sum-pooled bags of power-law ids: a few ids are very
frequent, as in click logs), pairwise dot products of the bottom output and every pooled
feature (the interaction), a top MLP to one click logit.
"""

import argparse
import os
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from torch_monarch.embeddings import EmbeddingBagCollection, EmbeddingBagConfig, JaggedBatch  # noqa: E402

DENSE_FEATURES = 13


def tables(scale=1.0, dim=16):
    """8 tables: rows from 100k down to 100 (times `scale`), pooling factors 1 to 10."""
    spec = [("user", 100_000, 1), ("item", 50_000, 2), ("history", 20_000, 8), ("category", 10_000, 3),
            ("query", 5_000, 4), ("site", 1_000, 1), ("ad_group", 500, 10), ("device", 100, 1)]
    return [EmbeddingBagConfig(name, max(8, int(rows * scale)), dim, pooling_factor=pf) for name, rows, pf in spec]


def mlp(sizes):
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DLRM(nn.Module):
    def __init__(self, table_configs, bottom=(64, 32), top=(64, 32)):
        super().__init__()
        dims = {t.dim for t in table_configs}
        if len(dims) != 1:
            raise ValueError(f"DLRM: every table needs the same dim for the dot interaction, got {sorted(dims)}")
        self.dim = dims.pop()
        self.num_features = sum(len(t.features) for t in table_configs)
        self.bottom = mlp([DENSE_FEATURES, *bottom, self.dim])
        self.embeddings = EmbeddingBagCollection(table_configs)
        n = self.num_features + 1
        self.top = mlp([n * (n - 1) // 2 + self.dim, *top, 1])

    def forward(self, dense, sparse: JaggedBatch):
        x = self.bottom(dense)                                  # [B, D]
        e = self.embeddings(sparse).view(x.shape[0], self.num_features, self.dim)
        t = torch.cat([x.unsqueeze(1), e], dim=1)               # [B, F + 1, D]
        z = torch.bmm(t, t.transpose(1, 2))                     # every pair's dot product
        i, j = torch.triu_indices(t.shape[1], t.shape[1], offset=1)
        return self.top(torch.cat([x, z[:, i, j]], dim=1))     # [B, 1] click logit


def make_batch(step, size, table_configs, alpha=3.0):
    """Dense features ~ N(0, 1); per feature 0 to 2 x pooling_factor ids drawn as
    floor(rows * u^alpha) (power law: low ids dominate); clicks from a fixed logistic rule."""
    g = torch.Generator().manual_seed(10_000 + step)
    dense = torch.randn(size, DENSE_FEATURES, generator=g)
    features = {}
    for t in table_configs:
        for f in t.features:
            bags = []
            top = int(2 * t.pooling_factor) + 1
            for _ in range(size):
                n = int(torch.randint(0, top, (1,), generator=g))
                u = torch.rand(n, generator=g)
                bags.append((u.pow(alpha) * t.rows).long().clamp_(max=t.rows - 1).tolist())
            features[f] = bags
    clicks = (dense[:, :3].sum(1, keepdim=True) + 0.5 * torch.randn(size, 1, generator=g) > 0).float()
    return dense, JaggedBatch.from_lists(features), clicks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=256, help="global batch")
    ap.add_argument("--scale", type=float, default=1.0, help="table rows x this")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--optimizer", default="rowwise_adagrad", help="tables: sgd, rowwise_adagrad, adam")
    args = ap.parse_args()
    torch.manual_seed(0)
    configs = tables(args.scale)
    model = DLRM(configs)
    loss_fn = nn.BCEWithLogitsLoss()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world_size > 1:
        import torch_monarch
        world = torch_monarch.init()
        rank = world.rank
        local = args.batch // world_size
        # Tables planned and sharded over every rank, the rest data-parallel.
        model = torch_monarch.parallelize(model, global_batch=args.batch,
                                          embeddings=dict(optimizer=args.optimizer, lr=args.lr))
        if rank == 0:
            from torch_monarch import planner
            print(planner.format_embedding_report(model.plan))
    else:
        local = args.batch
    dense_opt = torch.optim.Adagrad([p for p in model.parameters()], lr=args.lr)
    for step in range(args.steps):
        dense, sparse, clicks = make_batch(step, args.batch, configs)
        begin = rank * local
        dense, sparse, clicks = dense[begin:begin + local], sparse.samples(begin, begin + local), clicks[begin:begin + local]
        dense_opt.zero_grad()
        loss = loss_fn(model(dense, sparse), clicks)
        loss.backward()
        dense_opt.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f} (rank 0's share)")


if __name__ == "__main__":
    main()
