"""The small recommendation model of the embedding tests: three tables (shared features, mean
pooling, an odd row count), a linear head, synthetic click data. Shared by the one-process
reference (test_embeddings.py) and the ranks (embedding_workers.py)."""

import torch
from torch import nn

from torch_monarch.embeddings import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig,
                                      JaggedBatch, rowwise_adagrad_)

GLOBAL_BATCH, STEPS, LR = 8, 4, 0.05
TABLES = [
    EmbeddingBagConfig("small", 50, 8, features=["a", "b"], pooling_factor=2),
    EmbeddingBagConfig("mean", 40, 8, features=["c"], pooling="mean", pooling_factor=3),
    EmbeddingBagConfig("odd", 97, 16, features=["d"], pooling_factor=2),
]
WIDTH = sum(t.dim * len(t.features) for t in TABLES)


def make_collection(seed=0, device=None):
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(TABLES, device=device)
    return ebc


def make_head(seed=1):
    torch.manual_seed(seed)
    return nn.Linear(WIDTH, 1)


def batch(step, size=GLOBAL_BATCH):
    """Power-law ids (low ids far more frequent, so rows repeat inside a batch), 0-4 ids per
    sample and feature (empty bags included), and click labels."""
    g = torch.Generator().manual_seed(1000 + step)
    features = {}
    for t in TABLES:
        for f in t.features:
            bags = []
            for _ in range(size):
                n = int(torch.randint(0, 5, (1,), generator=g))
                u = torch.rand(n, generator=g)
                bags.append([min(t.rows - 1, int(t.rows * x ** 3)) for x in u.tolist()])
            features[f] = bags
    labels = torch.randint(0, 2, (size, 1), generator=g).float()
    return JaggedBatch.from_lists(features), labels


def loss_fn(logits, labels):
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def reference(optimizer, steps=STEPS):
    """One process, the global batch: losses and final tables."""
    ebc, head = make_collection(), make_head()
    dense = torch.optim.SGD(head.parameters(), lr=LR)
    tables = torch.optim.SGD(ebc.parameters(), lr=LR) if optimizer == "sgd" else None
    state = {t.name: torch.zeros(t.rows) for t in TABLES}
    moments = {t.name: (torch.zeros(t.rows, t.dim), torch.zeros(t.rows, t.dim)) for t in TABLES}
    losses = []
    for step in range(steps):
        x, y = batch(step)
        dense.zero_grad()
        ebc.zero_grad()
        loss = loss_fn(head(ebc(x)), y)
        loss.backward()
        dense.step()
        if tables is not None:
            tables.step()
        elif optimizer == "rowwise_adagrad":
            for t in TABLES:
                w = ebc.tables[t.name].weight
                rowwise_adagrad_(w, w.grad, state[t.name], LR)
        else:  # lazy Adam: only the rows the batch looked up move; bias correction by step
            for t in TABLES:
                w = ebc.tables[t.name].weight
                rows = torch.unique(torch.cat([x.feature(f)[0] for f in t.features]))
                m, v = moments[t.name]
                g = w.grad[rows]
                m[rows] = 0.9 * m[rows] + 0.1 * g
                v[rows] = 0.999 * v[rows] + 0.001 * g * g
                c1, c2 = 1 - 0.9 ** (step + 1), 1 - 0.999 ** (step + 1)
                with torch.no_grad():
                    w[rows] -= LR * (m[rows] / c1) / ((v[rows] / c2).sqrt() + 1e-8)
        losses.append(loss.item())
    return losses, {t.name: ebc.tables[t.name].weight.detach().clone() for t in TABLES}, head


# Sequence features (nn.Embedding): every id its own row.
SEQUENCE_TABLES = [
    EmbeddingConfig("history", 60, 8, features=["h1", "h2"], pooling_factor=3),
    EmbeddingConfig("tags", 37, 8, features=["t"], pooling_factor=2),
]


def make_sequence_collection(seed=3):
    torch.manual_seed(seed)
    return EmbeddingCollection(SEQUENCE_TABLES)


def sequence_batch(step, size=GLOBAL_BATCH):
    g = torch.Generator().manual_seed(2000 + step)
    features = {}
    for t in SEQUENCE_TABLES:
        for f in t.features:
            bags = []
            for _ in range(size):
                n = int(torch.randint(0, 5, (1,), generator=g))
                bags.append([min(t.rows - 1, int(t.rows * x ** 2)) for x in torch.rand(n, generator=g).tolist()])
            features[f] = bags
    return JaggedBatch.from_lists(features)


def sequence_loss(rows, batch_size):
    """A nonlinear function of every looked-up row, summed, over the batch size: the same
    total split over ranks (each rank's loss over its own batch size, averaged)."""
    return sum((torch.tanh(r) * r).sum() for r in rows.values()) / batch_size


def sequence_reference(optimizer, steps=STEPS):
    ec = make_sequence_collection()
    state = {t.name: torch.zeros(t.rows) for t in SEQUENCE_TABLES}
    opt = torch.optim.SGD(ec.parameters(), lr=LR) if optimizer == "sgd" else None
    losses = []
    for step in range(steps):
        x = sequence_batch(step)
        ec.zero_grad()
        loss = sequence_loss(ec(x), GLOBAL_BATCH)
        loss.backward()
        if opt is not None:
            opt.step()
        else:
            for t in SEQUENCE_TABLES:
                w = ec.tables[t.name].weight
                rowwise_adagrad_(w, w.grad, state[t.name], LR)
        losses.append(loss.item())
    return losses, {t.name: ec.tables[t.name].weight.detach().clone() for t in SEQUENCE_TABLES}
