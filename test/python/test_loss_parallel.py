"""What a tensor-parallel model returns (``parallelize(loss_parallel=)``): where the planner
chose tp by itself the vocabulary-split head gathers its logits, so the caller's plain
cross-entropy trains as on one process; where the caller asked for tp (a pin) or
``loss_parallel=True``, the logits stay split for ``vocab_parallel_cross_entropy``, which also
takes whole logits, so one loop serves every layout. 2 ranks, tiny_gpt (vocabulary 64, the head
tied to the embedding), 3 AdamW steps against one process: losses within 1e-5 relative, every
parameter tensor within 1e-4 relative in norm (sums over tp shards in another order)."""

import pytest
import torch

from dist_harness import launch
from tiny_gpt import VOCAB

# case: (logits width on each rank, what the planner must have chosen)
EXPECTED = {"planned_plain": VOCAB, "planned_vocab": VOCAB, "planned_split": VOCAB // 2,
            "pinned_tp2": VOCAB // 2, "pinned_plain": VOCAB}


@pytest.fixture(scope="module")
def results():
    r = launch(2, "", timeout=300, worker="loss_parallel_workers.py")
    assert r.ok, r.describe()
    return [torch.load(r.result_path(rank)) for rank in range(2)]


@pytest.mark.parametrize("case", list(EXPECTED))
def test_logits_are_split_only_where_asked_and_every_loop_trains_like_one_process(results, case):
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
