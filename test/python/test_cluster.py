"""cluster.probe on CPU ranks: the compute rates the ranks get while sharing the cores (all
busy, and each alone) replace detect()'s cores / ranks guess; cached per machine."""

import json
import os

import pytest

from dist_harness import launch
from torch_monarch import cluster as cl
from torch_monarch.cluster import effective_cores


def test_effective_cores_from_busy_and_alone_rates():
    # 4 ranks, a rank alone 2.1x faster than with all busy: 1.9 cores' worth.
    assert effective_cores(4, busy=1.0, alone=2.1, detected=2) == pytest.approx(4 / 2.1)
    # No contention (within 5%): the machine's cores stand, at least one per rank.
    assert effective_cores(2, busy=0.98, alone=1.0, detected=16) == 16
    assert effective_cores(4, busy=1.0, alone=1.0, detected=2) == 4
    # Never below one core.
    assert effective_cores(4, busy=0.1, alone=1.0, detected=2) == 1


def _ring(sizes, n, latency, bandwidth):
    return [2 * (n - 1) * latency + 2 * (n - 1) / n * s / bandwidth for s in sizes]


def test_link_measurement_is_checked_and_retried_before_it_is_kept(monkeypatch):
    sizes, n = cl._PROBE_SIZES_CPU, 4
    good = _ring(sizes, n, 1e-3, 1.5e9)
    # A point off the line by 30%: still a fit (this VM's medians scatter that much).
    noisy = [t * (1.3 if i == 0 else 1.0) for i, t in enumerate(good)]
    # Slow spells on all but the largest size: no positive slope. One size 6x the line: a
    # line through the rest is far from it, and a line through all is far from the rest.
    no_slope = [0.02, 0.02, 0.02, 0.02, 0.02, 0.001]
    off = [t * (6.0 if i == 2 else 1.0) for i, t in enumerate(good)]
    calls = []

    def timed(measurements):
        def fake(group, sizes_, rounds, device):
            calls.append(rounds)
            return measurements[len(calls) - 1]
        return fake

    monkeypatch.setattr(cl, "_time_all_reduces", timed([noisy]))
    latency, bandwidth, times, error = cl.measure_link(None, n, sizes, 12, "cpu")
    assert calls == [12] and 0.05 < error < 0.3 and bandwidth > 0
    # The first fails, the second (twice the rounds) is kept.
    calls.clear()
    monkeypatch.setattr(cl, "_time_all_reduces", timed([no_slope, good]))
    latency, bandwidth, times, error = cl.measure_link(None, n, sizes, 12, "cpu")
    assert calls == [12, 24] and latency == pytest.approx(1e-3) and bandwidth == pytest.approx(1.5e9)
    # Both fail: nothing is kept (the caller keeps the preset and says so).
    for second in (no_slope, off):
        calls.clear()
        monkeypatch.setattr(cl, "_time_all_reduces", timed([no_slope, second]))
        assert cl.measure_link(None, n, sizes, 12, "cpu")[:2] == (0.0, 0.0)
    assert cl.fit_error(sizes, good, n, 1e-3, 1.5e9) == pytest.approx(0.0, abs=1e-12)


def test_probe_measures_the_cores_four_ranks_share_and_caches_them():
    r = launch(4, "probe", worker="cluster_workers.py", timeout=240)
    assert r.ok, r.describe()
    with open(os.path.join(r.out_dir, "facts.json")) as f:
        facts = json.load(f)
    first, second, cached = facts["first"], facts["second"], facts["cached"]
    # The loopback link was measured (not the cpu preset's 50 us, 2 GB/s) the current way.
    assert cached, "no links cache: the probe's all-reduce times fit no line, twice (see its warning in the log)"
    assert cached["links_method"] == cl._LINKS_METHOD and cached["links_backend"] == "gloo"
    assert first["intra_node_latency_s"] == pytest.approx(cached["intra_latency_s"]) != 50e-6
    assert 1e-6 < first["intra_node_latency_s"] < 0.05 and 1e7 < first["intra_node_bytes_per_s"] < 1e12
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


def test_zero_overlap_follows_the_planners_rule_for_the_cores_ranks_share(monkeypatch):
    """fully_shard's default and parallelize laid out by hand use the planner's zero_overlap
    rule (planner.zero_overlap_pays): the collectives run behind computation only where the
    ranks leave a core free for them; otherwise each is waited for, holding a unit less."""
    from torch_monarch import planner
    monkeypatch.setattr(cl.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cl, "_cores", lambda: 8)
    for ranks, pays in ((4, True), (8, False), (16, False)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
        assert cl.zero_overlap_pays_here() is pays, ranks
        c = planner.cluster_preset("cpu", 1)
        c.overlap_contention = cl.cpu_overlap_contention(ranks, 8)
        assert planner.zero_overlap_pays(c) is pays, ranks
    assert planner.zero_overlap_pays(planner.cluster_preset("h100-80gb", 8))
