"""Starts N local ranks of a worker script on loopback with a free port (the Python twin of
test/cpp/runtime/harness.h) and collects exit codes, stderr and result files."""

import os
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


def launch(world_size, scenario, timeout=120, env=None, worker="workers.py"):
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
    return Launch(out_dir, codes, errors, timed_out)
