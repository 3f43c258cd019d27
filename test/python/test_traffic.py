"""Bytes on the wire per step equal the planner's prediction (planner.bytes_per_step) within
5% on every rank and axis, for DP, ZeRO-1/2/3, TP (with and without sequence parallelism) and
PP, with gradient accumulation: bench/traffic.py's run, launched through the launcher on 4
ranks (its table is in bench/results/traffic.json)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))

import traffic  # noqa: E402


def test_bytes_per_step_match_the_planner():
    table = traffic.run(4)
    assert [r["layout"] for r in table] == [name for name, _ in traffic.LAYOUTS]
    for r in table:
        assert r["micro_batches"] >= 2, r["layout"]  # accumulation (or a pipeline) everywhere
        assert sum(r["measured"].values()) > 0, r["layout"]
        assert r["worst_deviation"] <= 0.05, (r["layout"], r["measured"], r["predicted"])
