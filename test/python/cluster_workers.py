"""Worker for test_cluster.py: detect() and probe() on CPU ranks launched as users launch them,
twice (the second from the cache), with the cache in the test's output directory."""

import json
import os
import sys
import time

import torch

import torch_monarch
from torch_monarch import cluster as cl


def facts(c):
    return {k: getattr(c, k) for k in ("peak_flops_fp32", "hbm_bytes_per_s", "cores_per_node", "overlap_contention",
                                       "matmul_efficiency", "intra_node_bytes_per_s", "intra_node_latency_s")}


def main():
    torch.set_num_threads(1)
    out = os.environ["MONARCH_TEST_OUTPUT"]
    os.environ["MONARCH_CACHE_DIR"] = os.path.join(out, "cache")
    world = torch_monarch.init(timeout=120)
    detected = cl.detect(world_size=world.size)
    t0 = time.perf_counter()
    first = cl.probe(detected, world)
    t1 = time.perf_counter()
    second = cl.probe(detected, world)
    t2 = time.perf_counter()
    if world.rank == 0:
        cache = [f for f in os.listdir(os.path.join(out, "cache")) if f.startswith("links-")]
        # No links cache: the link's times fit no line twice (the probe warned) and nothing
        # was kept; the test names that instead of failing on a missing file.
        cached = {}
        if cache:
            with open(os.path.join(out, "cache", cache[0])) as f:
                cached = json.load(f)
        with open(os.path.join(out, "facts.json"), "w") as f:
            json.dump({"detected": facts(detected), "first": facts(first), "second": facts(second),
                       "cached": cached, "first_s": t1 - t0, "second_s": t2 - t1,
                       "affinity": len(os.sched_getaffinity(0))}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
