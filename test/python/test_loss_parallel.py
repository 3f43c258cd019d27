"""What a tensor-parallel model returns (``parallelize(loss_parallel=)``): logits split along
the vocabulary by default and with ``loss_parallel=True``, for ``vocab_parallel_cross_entropy``
(a plain cross-entropy on them is one clear error from ``train_step``, not a wrong loss);
gathered with ``loss_parallel=False``, where a plain cross-entropy trains as on one process and
``vocab_parallel_cross_entropy`` takes them too. The planner chooses tp=2 by itself here (fast
links, one sequence per step) or it is pinned. 2 ranks, tiny_gpt (vocabulary 64, the head tied
to the embedding), 3 AdamW steps against one process: losses within 1e-5 relative, every
parameter tensor within 1e-4 relative in norm (sums over tp shards in another order)."""

import pytest
import torch

from dist_harness import launch
from tiny_gpt import VOCAB

# case: logits width on each rank
EXPECTED = {"planned_vocab": VOCAB // 2, "planned_gather": VOCAB, "pinned_tp2": VOCAB // 2,
            "pinned_gather": VOCAB, "declared_split": VOCAB // 2}


@pytest.fixture(scope="module")
def results():
    r = launch(2, "", timeout=300, worker="loss_parallel_workers.py")
    assert r.ok, r.describe()
    return [torch.load(r.result_path(rank)) for rank in range(2)]


@pytest.mark.parametrize("case", list(EXPECTED))
def test_logits_are_split_unless_gathered_and_every_loop_trains_like_one_process(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert "error" not in r, f"{case} rank {rank}: {r['error']}"
        assert r["tp"] == 2, f"{case}: the plan {r['plan']} did not split over tp=2"
        assert r["logits_width"] == [EXPECTED[case]], f"{case} rank {rank}: logits of width {r['logits_width']}"
        assert r["losses"] == results[0][case]["losses"]
    r = results[0][case]
    for step, (got, want) in enumerate(zip(r["losses"], r["reference_losses"])):
        assert got == pytest.approx(want, rel=1e-5), f"{case}: loss of step {step}"
    assert r["max_param_rel_diff"] <= 1e-4, f"{case}: parameters differ by {r['max_param_rel_diff']:.2e}"


def test_a_plain_loss_on_split_logits_is_one_clear_error_on_every_rank(results):
    for rank, res in enumerate(results):
        error = res["planned_plain"].get("error", "")
        assert error.startswith("ValueError: parallelize: the model's output head splits the vocabulary over tp=2 "
                                "(each rank's logits hold 32 of the columns)"), f"rank {rank}: {error!r}"
        assert "vocab_parallel_cross_entropy" in error and "loss_parallel=False" in error, error
        assert "IndexError: Target" in error, error  # what the plain loss raised, named
