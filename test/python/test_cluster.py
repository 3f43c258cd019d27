"""cluster.probe on CPU ranks: the compute rates the ranks get while sharing the cores (all
busy, and each alone) replace detect()'s cores / ranks guess; cached per machine."""

import json
import os

import pytest

from dist_harness import launch
from torch_monarch.cluster import effective_cores


def test_effective_cores_from_busy_and_alone_rates():
    # 4 ranks, a rank alone 2.1x faster than with all busy: 1.9 cores' worth.
    assert effective_cores(4, busy=1.0, alone=2.1, detected=2) == pytest.approx(4 / 2.1)
    # No contention (within 5%): the machine's cores stand, at least one per rank.
    assert effective_cores(2, busy=0.98, alone=1.0, detected=16) == 16
    assert effective_cores(4, busy=1.0, alone=1.0, detected=2) == 4
    # Never below one core.
    assert effective_cores(4, busy=0.1, alone=1.0, detected=2) == 1


def test_probe_measures_the_cores_four_ranks_share_and_caches_them():
    r = launch(4, "probe", worker="cluster_workers.py", timeout=240)
    assert r.ok, r.describe()
    with open(os.path.join(r.out_dir, "facts.json")) as f:
        facts = json.load(f)
    first, second, cached = facts["first"], facts["second"], facts["cached"]
    # The probe's rates are the ones it cached; the second probe reads them back.
    assert first["peak_flops_fp32"] == pytest.approx(cached["cpu_flops_busy"])
    assert first["hbm_bytes_per_s"] == pytest.approx(cached["cpu_hbm_bytes_per_s"])
    assert second == pytest.approx(first)
    assert 0.2e9 < first["peak_flops_fp32"] < 1e13 and 0.1e9 < first["hbm_bytes_per_s"] < 1e13
    assert first["matmul_efficiency"] == 1.0
    busy, alone = cached["cpu_flops_busy"], cached["cpu_flops_alone"]
    assert first["cores_per_node"] == pytest.approx(effective_cores(4, busy, alone, facts["detected"]["cores_per_node"]))
    if facts["affinity"] < 4:
        # Fewer cores than ranks: a rank alone must run faster than with all four busy, and
        # the ranks contend, so a collective hides behind no computation.
        assert busy < 0.95 * alone, (busy, alone)
        assert 1.0 <= first["cores_per_node"] < 4.0
        assert first["overlap_contention"] == 1.0
