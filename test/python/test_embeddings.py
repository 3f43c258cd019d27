"""Sharded embedding tables (issue 11): jagged batches, the unsharded collection, and parity of
every sharding with one process, through the launcher."""

import pytest
import torch

from dist_harness import launch
from embedding_model import GLOBAL_BATCH, STEPS, TABLES, batch, make_collection, reference
from torch_monarch import planner
from torch_monarch.embeddings import EmbeddingBagCollection, EmbeddingBagConfig, JaggedBatch

LAYOUTS = ["data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "mix"]


def test_jagged_batch_from_lists_and_slices():
    b = JaggedBatch.from_lists({"a": [[1, 2], [], [3]], "b": [[4], [5, 6], []]})
    assert b.batch_size == 3
    assert b.values.tolist() == [1, 2, 3, 4, 5, 6]
    assert b.lengths.tolist() == [2, 0, 1, 1, 2, 0]
    ids, lens, w = b.feature("b")
    assert ids.tolist() == [4, 5, 6] and lens.tolist() == [1, 2, 0] and w is None
    tail = b.samples(1, 3)
    assert tail.batch_size == 2 and tail.values.tolist() == [3, 5, 6] and tail.lengths.tolist() == [0, 1, 2, 0]


def test_jagged_batch_refuses_inconsistent_input():
    with pytest.raises(ValueError, match="lengths sum to 3 but there are 2 values"):
        JaggedBatch(["a"], [1, 2], [1, 2])
    with pytest.raises(ValueError, match="different batch sizes"):
        JaggedBatch.from_lists({"a": [[1]], "b": [[1], [2]]})
    with pytest.raises(ValueError, match="negative"):
        JaggedBatch(["a"], [], [1, -1])


def test_collection_matches_embedding_bags_and_names_bad_ids():
    ebc = make_collection()
    x, _ = batch(0)
    out = ebc(x)
    assert out.shape == (GLOBAL_BATCH, sum(t.dim * len(t.features) for t in TABLES))
    ids, lens, _ = x.feature("c")
    offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)[:-1]])
    mean = torch.nn.functional.embedding_bag(ids, ebc.tables["mean"].weight, offsets, mode="mean")
    assert torch.equal(out[:, 16:24], mean)
    bad = JaggedBatch.from_lists({"a": [[0]], "b": [[0]], "c": [[40]], "d": [[0]]})
    with pytest.raises(ValueError, match="feature 'c': id 40 is out of range for table 'mean' \\(40 rows\\)"):
        ebc(bad)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_every_sharding_trains_like_one_process(ranks, optimizer):
    ref_losses, ref_tables, ref_head = reference(optimizer)
    init = make_collection()
    r = launch(ranks, f"parity:{optimizer}:{','.join(LAYOUTS)}", worker="embedding_workers.py", timeout=300)
    assert r.ok, r.describe()
    results = torch.load(r.result_path(0))
    for layout in LAYOUTS:
        got = results[layout]
        if layout != "mix":
            assert set(got["shardings"].values()) == {layout}, got["shardings"]
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), layout
        for name, table in ref_tables.items():
            torch.testing.assert_close(got["tables"][name], table, rtol=1e-5, atol=1e-6, msg=f"{layout}: {name}")
            # The updates themselves (SGD moves rows by ~1e-3): a wrong gradient scale shows here.
            start = init.tables[name].weight.detach()
            torch.testing.assert_close(got["tables"][name] - start, table - start, rtol=1e-3, atol=1e-7,
                                       msg=f"{layout}: update of {name}")
    assert {"table_wise", "row_wise"} <= set(results["mix"]["shardings"].values())
