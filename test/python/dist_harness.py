"""Starts N local ranks of a worker script on loopback and collects exit codes, stderr and
result files.

Two ways, as users start jobs:
  * ``via="monarch-run"`` (the default): ``python3 -m torch_monarch.run`` (torchrun's agent,
    its store and its environment), exactly as the README launches training;
  * ``via="env"``: one process per rank with MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE set
    by hand (what a cluster scheduler's own launcher does). Fault tests use it: torchrun's
    agent stops every worker once one fails, which would hide what the survivors report.
"""

import glob
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    def __init__(self, out_dir, codes, errors, timed_out):
        self.out_dir = out_dir
        self.codes = codes
        self.errors = errors
        self.timed_out = timed_out

    @property
    def ok(self):
        return not self.timed_out and all(c == 0 for c in self.codes)

    def result_path(self, rank):
        return os.path.join(self.out_dir, f"rank{rank}.pt")

    def describe(self):
        parts = [f"timed_out={self.timed_out}"]
        for r, (c, e) in enumerate(zip(self.codes, self.errors)):
            parts.append(f"[rank {r} exit {c}] {e[-2000:]}")
        return "\n".join(parts)


def launch(world_size, scenario, timeout=120, env=None, worker="workers.py", via="monarch-run"):
    if via == "monarch-run":
        return launch_with_launcher(world_size, scenario, timeout, env, worker)
    if via != "env":
        raise ValueError(f"launch: via={via!r} is neither 'monarch-run' nor 'env'")
    out_dir = tempfile.mkdtemp(prefix="monarch-pytest-")
    port = free_port()
    procs = []
    for rank in range(world_size):
        e = dict(os.environ)
        e.update({
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1",
            "MONARCH_TEST_OUTPUT": out_dir,
        })
        e.update(env or {})
        err = open(os.path.join(out_dir, f"rank{rank}.stderr"), "w")
        procs.append((subprocess.Popen([sys.executable, os.path.join(HERE, worker), scenario],
                                       env=e, stdout=subprocess.DEVNULL, stderr=err), err))
    deadline = time.monotonic() + timeout
    timed_out = False
    for p, err in procs:
        remaining = max(0.1, deadline - time.monotonic())
        try:
            p.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            timed_out = True
            p.kill()
            p.wait()
        err.close()
    codes = [p.returncode for p, _ in procs]
    errors = []
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"rank{rank}.stderr")) as f:
            errors.append(f.read())
    result = Launch(out_dir, codes, errors, timed_out)
    if not timed_out and any(c < 0 for c in codes):  # no test sends signals through this path
        raise AssertionError(f"a rank died by a signal (exit codes {codes}):\n{result.describe()}")
    return result


def launch_with_launcher(world_size, scenario, timeout=120, env=None, worker="workers.py",
                         extra_args=()):
    """``python3 -m torch_monarch.run --nproc-per-node N worker.py scenario`` on a free port;
    each rank's stderr is read from the launcher's per-rank log files. The agent reports one
    exit status for the job, so every rank gets it in ``codes``."""
    out_dir = tempfile.mkdtemp(prefix="monarch-pytest-")
    log_dir = os.path.join(out_dir, "logs")
    e = dict(os.environ)
    e.update({"OMP_NUM_THREADS": "1", "MONARCH_TEST_OUTPUT": out_dir})
    e.update(env or {})
    cmd = [sys.executable, "-m", "torch_monarch.run", "--nproc-per-node", str(world_size),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--log-dir", log_dir,
           "--redirects", "3", *extra_args, os.path.join(HERE, worker), scenario]
    with open(os.path.join(out_dir, "launcher.log"), "w") as log:
        proc = subprocess.Popen(cmd, env=e, cwd=HERE, stdout=log, stderr=subprocess.STDOUT)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()
    with open(os.path.join(out_dir, "launcher.log")) as f:
        launcher_log = f.read()
    errors = []
    for rank in range(world_size):
        files = glob.glob(os.path.join(log_dir, "*", "attempt_*", str(rank), "stderr.log"))
        text = ""
        for path in sorted(files):
            with open(path) as f:
                text += f.read()
        errors.append(text + ("" if proc.returncode == 0 else "\n[launcher] " + launcher_log[-3000:]))
    result = Launch(out_dir, [proc.returncode] * world_size, errors, timed_out)
    # A worker killed by a crash signal (the agent's own SIGTERM to survivors is not one).
    crash = re.search(r"exitcode\s*:\s*-(4|6|7|8|11)\b", launcher_log)
    if crash and not timed_out:
        raise AssertionError(f"a rank died by signal {crash.group(1)}:\n{result.describe()}")
    return result


def vm(field):
    """A /proc/self/status memory field of this process in bytes (VmRSS, VmHWM, VmData)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def error_of(fn):
    """The message of what ``fn()`` raises (what a test checks), or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return str(e)
    return None


def run_worker(main, *args):
    """A worker script's entry: exits with main(*args), or on an exception prints its
    traceback and one line naming it ("worker error: ..."), the line tests read, and exits 1."""
    try:
        sys.exit(main(*args))
    except Exception as e:  # noqa: BLE001 - reported for the test to read
        import traceback
        traceback.print_exc()
        print(f"worker error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
