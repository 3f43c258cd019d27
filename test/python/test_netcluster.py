"""A two-node cluster on this machine (scripts/netcluster.sh: a network namespace per node,
veth links through a switch namespace limited by tc tbf): 2 nodes x 2 ranks launched the
way multi-node jobs are (torchrun's --nnodes / --node-rank in each node), tensor
parallelism inside the nodes and data parallelism across them, trained like one process.
The timed all-reduces show the inter-node limit holds and intra-node traffic stays on
loopback. Needs root, as network namespaces do (CI runs as root)."""

import os
import subprocess
import sys
import tempfile

import pytest
import torch

from dist_harness import HERE, free_port
from tiny_gpt import train_reference

ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(ROOT, "scripts", "netcluster.sh")
RATE_BITS = 200e6  # --rate 200mbit
LOSS_REL = 1e-5
PARAM_NORM_REL = 1e-5


def _namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_two_nodes_train_like_one_process_over_a_limited_link():
    assert os.geteuid() == 0, "network namespaces need root (scripts/netcluster.sh)"
    out = tempfile.mkdtemp(prefix="monarch-netcluster-")
    before = _namespaces()
    launcher = [sys.executable, "-m", "torch_monarch.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--master-port", str(free_port())]
    # Each node's launcher: its node rank and node 0's address come from the script.
    node_cmd = ("exec " + " ".join(launcher) + " --node-rank \"$NODE_RANK\" --master-addr \"$MASTER_ADDR\" "
                + os.path.join(HERE, "netcluster_workers.py"))
    env = dict(os.environ, OMP_NUM_THREADS="1", MONARCH_TEST_OUTPUT=out, PYTHONPATH=HERE)
    p = subprocess.run(["bash", SCRIPT, "run", "2", "--rate", "200mbit", "--", "bash", "-c", node_cmd],
                       cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert _namespaces() == before, "the script left namespaces behind"
    got = torch.load(os.path.join(out, "result.pt"))
    assert got["node"] == 0
    ref_losses, ref_state = train_reference()
    assert got["losses"] == pytest.approx(ref_losses, rel=LOSS_REL)
    for k, v in ref_state.items():
        rel = ((got["state"][k] - v).norm() / max(v.norm().item(), 1e-12)).item()
        assert rel <= PARAM_NORM_REL, f"{k} differs by {rel} in norm"
    # A 2-rank all-reduce sends the buffer's size each way: at 200 Mbit/s at least this long.
    floor = got["bytes"] * 8 / RATE_BITS
    assert got["dp_all_reduce_s"] >= 0.8 * floor, (got["dp_all_reduce_s"], floor)
    assert got["tp_all_reduce_s"] < 0.5 * got["dp_all_reduce_s"], (got["tp_all_reduce_s"], got["dp_all_reduce_s"])


def test_the_script_tears_down_after_a_failing_command_and_refuses_bad_input():
    before = _namespaces()
    p = subprocess.run(["bash", SCRIPT, "run", "2", "--", "bash", "-c", "[ \"$NODE_RANK\" = 1 ] && exit 7; exit 0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 7, p.stderr
    assert _namespaces() == before
    p = subprocess.run(["bash", SCRIPT, "run", "two", "--", "true"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "NODES must be a number" in p.stderr
    p = subprocess.run(["bash", SCRIPT, "run", "2", "--bogus", "1", "--", "true"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and "unknown option '--bogus'" in p.stderr
    assert _namespaces() == before


def test_an_interrupted_cluster_stops_its_commands_and_removes_its_namespaces():
    import signal
    import time
    before = _namespaces()
    marker = "sleep 611"  # a duration no other process uses
    p = subprocess.Popen(["bash", SCRIPT, "run", "2", "--", "bash", "-c", marker], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while _namespaces() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    assert _namespaces() != before, "the cluster did not come up"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 143, p.stderr.read()
    assert _namespaces() == before
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert not left, f"node commands still running: {left}"
