"""When a job hangs or fails, every rank says what the others were doing (flight_recorder.h,
torch_monarch/hangs.py), launched as users launch jobs (torchrun's protocol: when one rank
fails the agent stops the others with SIGTERM).

* The "save on rank 0" mistake under ZeRO-3 with job timeouts of 10, 20 and 120 s: rank 0's
  entry check gives up at half the job's timeout naming the rule; rank 1, whose collective
  breaks when rank 0 leaves (or which the launcher terminates), names rank 0's state_dict()
  call. The check ends within the job's timeout, the whole launch within it plus 30 s.
* A rank that skips one all-reduce: the flight recorder dumps of every rank, merged by
  ``python -m torch_monarch hangs``, name the group, the call number and the rank.
* A rank hung elsewhere: the others time out and dump; the launcher's SIGTERM makes the hung
  rank dump too, and the merge says it never made the call.
"""

import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from dist_harness import launch

TIMEOUTS = (10, 20, 120)


def _launch(ranks, scenario, directory, timeout):
    start = time.monotonic()
    r = launch(ranks, scenario, timeout=timeout, worker="hang_workers.py",
               env={"MONARCH_FLIGHT_RECORDER_DIR": directory})
    r.seconds = time.monotonic() - start
    return r


@pytest.fixture(scope="module")
def state_dict_runs():
    """The three job timeouts launched side by side (they mostly wait)."""
    out = {}

    def run(t):
        directory = tempfile.mkdtemp(prefix="monarch-flight-")
        out[t] = (_launch(2, f"state_dict:{t}", directory, timeout=t + 90), directory)

    threads = [threading.Thread(target=run, args=(t,)) for t in TIMEOUTS]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def _result(r, rank):
    path = r.result_path(rank)
    return torch.load(path) if os.path.exists(path) else None


@pytest.mark.parametrize("job_timeout", TIMEOUTS)
def test_save_on_rank_0_only_is_named_on_every_rank_within_the_job_timeout(state_dict_runs, job_timeout):
    r, _ = state_dict_runs[job_timeout]
    assert not r.timed_out, r.describe()
    zero = _result(r, 0)
    assert zero is not None and zero["error"], r.describe()
    assert "rank 0 called state_dict()" in zero["error"] and "every rank must call it" in zero["error"], zero
    assert f"within {job_timeout / 2:g} s (half the job's timeout" in zero["error"], zero["error"]
    # The entry check waits its deadline (half the job's timeout) and no longer; the start-up
    # before the call is not the check's to bound (the whole job is bounded below).
    assert job_timeout / 2 <= zero["seconds_in_state_dict"] < job_timeout, zero
    # Rank 1: its own error (its collective broke when rank 0 left) or, if the launcher stopped it
    # first, its termination report; either names rank 0's call and the rule.
    one = _result(r, 1)
    text = (one or {}).get("error") or r.errors[1]
    assert "rank 0 is in state_dict() (call #0 on group 'dp'" in text, r.describe()
    assert "every rank must make that call" in text, text
    assert r.seconds < job_timeout + 30, r.seconds


def test_a_skipped_all_reduce_is_named_by_the_merged_flight_recorder():
    directory = tempfile.mkdtemp(prefix="monarch-flight-")
    r = _launch(4, "skip:3", directory, timeout=120)
    assert r.codes[0] != 0, r.describe()
    dumps = sorted(os.listdir(directory))
    assert dumps == [f"rank{k}.json" for k in range(4)], dumps
    report = subprocess.run([sys.executable, "-m", "torch_monarch", "hangs", directory], capture_output=True,
                            text=True, check=True).stdout
    assert "group 'dp' (ranks 0 1 2 3) diverged at call #3:" in report, report
    assert "ranks 0, 1, 3: all_reduce (sum) of 64 Float" in report, report
    assert "rank 2: all_reduce (sum) of 16 Float" in report, report


def test_a_rank_hung_elsewhere_dumps_on_the_launchers_sigterm():
    directory = tempfile.mkdtemp(prefix="monarch-flight-")
    r = _launch(4, "stuck", directory, timeout=120)
    assert r.seconds < 60, r.seconds  # the job's 8 s timeout, not rank 2's 120 s sleep
    assert "rank 2 was terminated (SIGTERM" in r.errors[2], r.errors[2][-3000:]
    dumps = sorted(os.listdir(directory))
    assert "rank2.json" in dumps, dumps
    from torch_monarch import hangs
    report = hangs.report(directory)
    assert "diverged at call #5:" in report, report
    assert "rank 2: made no call #5 (its last: call #4" in report, report
