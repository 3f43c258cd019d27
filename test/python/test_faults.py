"""Misuse and faults a user can cause on 2 ranks: each ends, on every rank, in one clear
error naming what and where (never an abort by signal, a hang, or a silently wrong result)."""

import time

import pytest
import torch

from dist_harness import launch


def run(scenario, env=None, timeout=120):
    start = time.monotonic()
    r = launch(2, scenario, env=dict({"MONARCH_TIMEOUT_S": "60"}, **(env or {})), timeout=timeout,
               worker="fault_workers.py", via="env")
    r.seconds = time.monotonic() - start
    assert not r.timed_out, r.describe()
    assert all(c >= 0 for c in r.codes), f"a rank died by a signal: {r.describe()}"
    return r


def results(r):
    return [torch.load(r.result_path(rank)) for rank in range(2)]


def results_of(r, rank):
    return torch.load(r.result_path(rank))


def test_different_bucket_sizes_are_an_error_on_every_rank_naming_each_value():
    r = run("bucket_mismatch")
    assert r.codes == [1, 1], r.describe()
    for e in (x["error"] for x in results(r)):
        assert "monarch::DataParallel: the ranks of group 'dp' were given different options" in e, e
        assert "bucket_cap_mb: rank 0 0.015625, rank 1 0.0625" in e, e


def test_different_sharding_units_are_named_not_called_different_shapes():
    r = run("units_mismatch")
    assert r.codes == [1, 1], r.describe()
    for e in (x["error"] for x in results(r)):
        assert "number of sharding units (units=): rank 0 " in e, e
        assert "different shapes" not in e, e


def test_uneven_batches_under_tensor_parallelism_are_an_error_not_an_abort():
    r = run("tp_uneven_batch")
    assert r.codes == [1, 1], r.describe()
    for e in (x["error"] for x in results(r)):
        assert "the ranks of group 'tp' are not making the same collective call" in e, e
        assert "in a tensor-parallel layer" in e and "different batch sizes" in e, e


def test_state_dict_on_rank_0_only_fails_fast_saying_every_rank_must_call_it():
    r = run("rank0_state_dict", env={"MONARCH_ENTRY_TIMEOUT_S": "3", "MONARCH_TEST_SLEEP_S": "8"})
    assert r.codes == [0, 0], r.describe()
    got = results(r)[0]
    assert "rank 0 called state_dict()" in got["error"] and "rank 1 did not call it within 3 s" in got["error"]
    assert "every rank must call it" in got["error"], got["error"]
    assert got["seconds"] < 6, got


def test_state_dict_on_rank_0_while_the_others_train_fails_on_both():
    r = run("rank0_state_dict_then_train", env={"MONARCH_ENTRY_TIMEOUT_S": "3"})
    assert r.codes == [1, 1], r.describe()
    e0, e1 = (x["error"] for x in results(r))
    assert "every rank must call it" in e0, e0
    # Rank 1 waited in its next forward's all-gather until rank 0 gave up and exited.
    assert "rank 1: agreement check before all_gather" in e1 and "fully_shard forward" in e1, e1


@pytest.mark.parametrize("stage", [0, 3])
def test_a_rank_that_skips_a_step_is_named_at_its_next_collective(stage):
    r = run(f"skipped_step{stage}")
    assert r.codes == [1, 1], r.describe()
    for e in (x["error"] for x in results(r)):
        assert "are not making the same collective call" in e, e
        assert ", step 4 (collective" in e and ", step 3 (collective" in e, e
        assert "an exception caught on one rank only" in e, e


def test_tensor_parallelism_that_splits_nothing_is_an_error_listing_the_modules():
    r = run("tp_splits_nothing")
    assert r.codes == [1, 1], r.describe()
    for e in (x["error"] for x in results(r)):
        assert "tp=2 but the plan splits none of the linear layers in OddNames's blocks" in e, e
        assert "only ['to_vocab', 'tok'] would be split" in e, e
        assert "'layers.0.mix_in' (Linear 32->128)" in e and "'to_vocab' (Linear 32->64)" in e, e
    r = run("tp_splits_nothing_parallelize")
    assert r.codes == [1, 1], r.describe()
    for e in (x["error"] for x in results(r)):
        assert "pins.tp" in e and "splits none of the blocks" in e, e


def test_a_vocabulary_head_left_whole_next_to_a_split_embedding_is_an_error():
    r = run("tp_head_unsplit")
    assert r.codes == [1, 1], r.describe()
    for e in (x["error"] for x in results(r)):
        assert "'to_vocab' (Linear 32->64) produces the vocabulary (64, as the split embedding) but is not split" in e, e


def test_a_wrong_shape_loaded_into_a_tp_model_names_the_key_and_both_shapes():
    r = run("tp_load_wrong_shape")
    assert r.codes == [1, 1], r.describe()
    for e in (x["error"] for x in results(r)):
        assert "wte.weight has shape [65, 32], the model holds [64, 32] (split over tp=2 along dim 0: [32, 32] " \
               "per rank)" in e, e


def test_a_transposed_or_miscounted_weight_loaded_into_zero3_is_refused_by_name():
    """Plain torch refuses a transposed weight of the same element count; so must ZeRO-3
    (before, it loaded scrambled rows and said all keys matched)."""
    r = run("zero3_load_wrong_shapes")
    assert r.codes == [1, 1], r.describe()
    for e in (x["error"] for x in results(r)):
        assert "blocks.0.fc1.weight: the checkpoint holds [32, 128], the model [128, 32]" in e, e
        assert "blocks.1.proj.weight: the checkpoint holds [33, 32], the model [32, 32]" in e, e


def test_pipelined_steps_retried_after_a_dead_peer_repeat_the_first_error_at_once():
    r = run("pipeline_retry", env={"MONARCH_TIMEOUT_S": "10"})
    assert r.codes[1] == 3, r.describe()
    assert r.codes[0] == 0, r.describe()
    got = results_of(r, 0)
    first, *later = got["errors"]
    assert first is not None and "rank 0" in first and "group 'pp'" in first, first
    original = first[first.index("rank 0: "):].split(" failed: ")[0]  # "rank 0: recv of ... on group 'pp' ..."
    for message, seconds in zip(later, got["seconds"][1:]):
        assert message is not None and original in message, (first, message)
        assert seconds < 5, f"a retry waited {seconds:.1f} s instead of failing at once"
