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
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
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


def test_a_table_larger_than_a_rank_is_built_on_meta_and_trains_row_wise():
    r = launch(4, "meta", worker="embedding_workers.py", timeout=300)
    assert r.ok, r.describe()
    for rank in range(4):
        got = torch.load(r.result_path(rank))
        assert not got["whole_fits"]  # under the rank's allocation limit the whole table does not fit
        assert got["local_rows"] == 500_000  # a quarter of the rows, never the whole table
        # Peak resident growth: the shard (128 MiB) and its state, nowhere near the 512 MiB table.
        assert got["peak_growth"] < 0.5 * got["table_bytes"], got
        assert all(l == l and l > 0 for l in got["losses"])


def test_bad_input_is_refused_with_the_feature_and_id():
    r = launch(2, "errors", worker="embedding_workers.py", timeout=200)
    assert r.ok, r.describe()
    got = torch.load(r.result_path(0))
    assert "feature 'd': id 97 is out of range for table 'odd' (97 rows)" in got["id"]
    assert "feature 'a': id -1 is out of range for table 'small' (50 rows)" in got["negative"]
    assert "lacks feature 'c'" in got["missing"]
    assert "feature 'z' is not looked up by any table" in got["unknown"]
    assert "lengths sum to" in got["lengths"]
    # Only rank 1's batch was bad: rank 1 names the id, rank 0 names rank 1, both at once.
    assert "id 97 is out of range" in torch.load(r.result_path(1))["one_rank"]
    assert "rank 1 refused its batch" in got["one_rank"]
    assert got["one_rank_seconds"] < 10
    assert got["after"] == 2 and got["after_backward"]
    assert "gradient accumulation over several lookups is not supported" in got["twice"]
    # Rank 0 alone kept an output: it names why, rank 1 names rank 0; nobody hangs.
    assert "gradient accumulation over several lookups is not supported" in got["kept_on_one"]
    assert "rank 0 refused its batch or this lookup" in torch.load(r.result_path(1))["kept_on_one"]


def test_pinning_a_table_to_a_sharding_it_cannot_take_names_it():
    tables = [planner.embedding_table("big", 400_000_000, 64)]
    with pytest.raises(planner.ValidationError, match="embeddings.tables.big.sharding") as info:
        planner.plan_embeddings(tables, planner.cluster("a100-80gb", 4), world_size=4, batch_per_rank=8,
                                pins={"big": "table_wise"})
    assert "table_wise needs the whole table" in str(info.value)


def test_whole_table_state_dict_loads_into_another_sharding():
    r = launch(2, "reshard", worker="embedding_workers.py", timeout=200)
    assert r.ok, r.describe()
    for rank in range(2):
        got = torch.load(r.result_path(rank))
        ref = got["outputs"]["row_wise"]
        for layout in ("table_wise", "column_wise"):
            # Row-wise adds partial sums in another order: equal up to float rounding.
            torch.testing.assert_close(got["outputs"][layout], ref, rtol=1e-6, atol=1e-6)
    # The parent model's state dict holds whole tables under the unsharded collection's keys.
    assert sorted(got["state"]) == sorted(f"emb.tables.{t.name}.weight" for t in TABLES)
    ebc = EmbeddingBagCollection(TABLES)
    ebc.load_state_dict({k[len("emb."):]: v for k, v in got["state"].items()})


@pytest.mark.parametrize("ranks,scenario", [(2, "dlrm"), (4, "dlrm"), (2, "dlrm_parallelize")])
def test_dlrm_planned_and_sharded_trains_like_one_process(ranks, scenario):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python"))
    import dlrm as example
    from embedding_model import LR, STEPS
    from embedding_workers import DLRM_BATCH
    configs = example.tables(scale=0.002)
    torch.manual_seed(0)
    model = example.DLRM(configs)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        dense, sparse, clicks = example.make_batch(step, DLRM_BATCH, configs)
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), clicks)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    r = launch(ranks, scenario, worker="embedding_workers.py", timeout=300)
    assert r.ok, r.describe()
    got = torch.load(r.result_path(0))
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    for name, value in model.state_dict().items():
        if name.startswith("embeddings."):
            torch.testing.assert_close(got["tables"][name[len("embeddings."):]], value, rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(got["dense"][name], value, rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_sequence_tables_train_like_one_process(optimizer):
    from embedding_model import sequence_reference
    ref_losses, ref_tables = sequence_reference(optimizer)
    layouts = ["data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise"]
    r = launch(2, f"sequence:{optimizer}:{','.join(layouts)}", worker="embedding_workers.py", timeout=300)
    assert r.ok, r.describe()
    results = torch.load(r.result_path(0))
    for layout in layouts:
        got = results[layout]
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), layout
        for name, table in ref_tables.items():
            torch.testing.assert_close(got["tables"][name], table, rtol=1e-5, atol=1e-6, msg=f"{layout}: {name}")



def test_a_plan_for_other_tables_is_refused_before_sharding():
    from torch_monarch.embeddings import EmbeddingConfig, EmbeddingCollection, _check_plan_tables
    ec = EmbeddingCollection([EmbeddingConfig("a", 10, 4), EmbeddingConfig("b", 20, 4)])
    swapped = EmbeddingCollection([EmbeddingConfig("b", 20, 4), EmbeddingConfig("a", 10, 4)])
    plan = planner.plan_embeddings(swapped.planner_tables(), planner.cluster("a100-80gb", 2), world_size=2,
                                   batch_per_rank=4)
    with pytest.raises(ValueError, match="table 0: the plan has \\('b'"):
        _check_plan_tables(plan, ec)
    _check_plan_tables(plan, swapped)
    with pytest.raises(ValueError, match="sequence tables"):
        EmbeddingBagCollection([EmbeddingConfig("a", 10, 4)])
