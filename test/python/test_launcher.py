"""The launcher (python3 -m torch_monarch.run) starts jobs the way torchrun does: both flag
spellings, the agent's store joined by every rank (TORCHELASTIC_USE_AGENT_STORE), restarts
under a fresh key prefix, C++ binaries with --no-python; and a plain env launch still works."""

import os
import subprocess
import sys
import tempfile

import pytest

from dist_harness import HERE, free_port, launch

ROOT = os.path.dirname(os.path.dirname(HERE))


def run_launcher(args, env=None, timeout=120):
    out = tempfile.mkdtemp(prefix="monarch-launch-")
    e = dict(os.environ, OMP_NUM_THREADS="1", MONARCH_TEST_OUTPUT=out, **(env or {}))
    p = subprocess.run([sys.executable, "-m", "torch_monarch.run", *args], env=e, cwd=HERE, timeout=timeout,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p, out


def results(out, n):
    rows = []
    for r in range(n):
        with open(os.path.join(out, f"rank{r}.txt")) as f:
            rows.append(f.read().split())
    return rows


@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nproc_per_node"])
def test_both_flag_spellings_start_a_job_on_the_agents_store(flag):
    p, out = run_launcher([flag, "2", "--master-port", str(free_port()), "launch_worker.py"])
    assert p.returncode == 0, p.stdout[-3000:]
    for rank, (r, size, total, attempt, agent_store) in enumerate(results(out, 2)):
        assert (int(r), int(size), float(total), attempt) == (rank, 2, 3.0, "0")
        # torchrun's agent serves the store: the ranks joined it instead of opening their own.
        assert agent_store == "True"


def test_a_restarted_worker_group_rendezvous_again_under_the_next_attempt():
    p, out = run_launcher(["--nproc-per-node", "2", "--max-restarts", "1", "--master-port", str(free_port()),
                           "launch_worker.py", "fail_first_attempt"])
    assert p.returncode == 0, p.stdout[-3000:]
    for rank, (r, size, total, attempt, _) in enumerate(results(out, 2)):
        assert (int(r), float(total), attempt) == (rank, 3.0, "1")


def test_a_failing_job_reports_the_failure_and_a_nonzero_status():
    p, out = run_launcher(["--nproc-per-node", "2", "--master-port", str(free_port()), "launch_worker.py",
                           "fail_first_attempt"])
    assert p.returncode != 0
    assert "launch_worker.py FAILED" in p.stdout or "exitcode" in p.stdout, p.stdout[-3000:]


def test_a_cpp_binary_trains_through_the_launcher_with_no_python():
    binary = os.path.join(ROOT, "build", "bin", "test_runtime")
    assert os.path.exists(binary), f"{binary} is not built: run `make build` (make test does)"
    p, out = run_launcher(["--nproc-per-node", "2", "--master-port", str(free_port()), "--no-python", binary],
                          env={"MONARCH_TEST_SCENARIO": "dp"})
    assert p.returncode == 0, p.stdout[-3000:]
    assert all(os.path.getsize(os.path.join(out, f"rank{r}.pt")) > 0 for r in range(2))


def test_env_launch_without_the_agent_still_works():
    r = launch(2, "launch", worker="launch_worker.py", via="env")
    assert r.ok, r.describe()
    with open(os.path.join(r.out_dir, "rank1.txt")) as f:
        rank, size, total, _, agent_store = f.read().split()
    assert (rank, size, float(total), agent_store) == ("1", "2", 3.0, "None")
