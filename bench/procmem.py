"""This process's memory from /proc (Linux): what the memory benches measure."""


def vm(field):
    """A /proc/self/status field in bytes (VmRSS: resident now, VmHWM: the high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def malloc_peak_preload():
    """The environment that makes a launched process count its allocated bytes
    (bench/malloc_peak.c, built by `make build` into build/bench/): LD_PRELOAD of the library,
    or MONARCH_MALLOC_PEAK's path when set."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("MONARCH_MALLOC_PEAK") or os.path.join(root, "build", "bench", "libmalloc_peak.so")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: `make build` builds it (bench/malloc_peak.c), "
                                "or point MONARCH_MALLOC_PEAK at it")
    return {"LD_PRELOAD": path}


class AllocatedPeak:
    """The allocated-bytes high-water mark of this process (the CPU side of
    torch.cuda.max_memory_allocated), in a process started with malloc_peak_preload()'s
    environment: ``growth()`` is the most held at once since ``reset()`` above what was held at
    that reset. Unlike VmHWM it leaves out the heap's free holes, whose layout moves by 1-3 MiB
    from launch to launch."""

    def __init__(self):
        import ctypes
        lib = ctypes.CDLL(None)
        if not hasattr(lib, "malloc_peak_bytes"):
            raise RuntimeError("bench/malloc_peak.c is not loaded: launch with procmem.malloc_peak_preload()")
        lib.malloc_peak_bytes.restype = ctypes.c_long
        lib.malloc_peak_held.restype = ctypes.c_long
        self._lib = lib
        self.reset()

    def reset(self):
        self._lib.malloc_peak_reset()
        self._base = self._lib.malloc_peak_held()

    def growth(self):
        return self._lib.malloc_peak_bytes() - self._base


def reset_peak():
    """VmHWM := the current RSS (writing "5" to clear_refs, Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def warm_up_torch():
    """One training step of a tiny model, so that what torch loads on its first backward and
    first optimizer step (torch 2.x imports modules worth tens of MiB of resident memory there)
    is loaded before a memory bench takes its baseline: a one-time cost of the process, the same
    for every layout, not the layout's memory."""
    import torch
    tiny = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-4)
    tiny(torch.randn(2, 4)).square().mean().backward()
    opt.step()


def write_peak_growth(out_dir, baseline):
    """A memory worker's result: its VmHWM growth over ``baseline``, as rank<RANK>.json."""
    import json
    import os
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"peak_growth": vm("VmHWM") - baseline}, f)


def write_rank_result(out_dir, result):
    """A memory worker's result (a JSON-able dict), as rank<RANK>.json."""
    import json
    import os
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(result, f)


def run_workers(script, ranks, *args, mmap_threshold=1 << 20):
    """Runs ``script --worker *args OUT`` on ``ranks`` ranks through the launcher, glibc told
    to serve every allocation of ``mmap_threshold`` bytes or more by its own mapping (a fixed
    MALLOC_MMAP_THRESHOLD_ also turns off glibc's raising of it), so that such tensors leave
    the process as soon as they are freed; returns the dicts its ranks wrote, by rank."""
    import json
    import os
    import shutil
    import socket
    import subprocess
    import sys
    import tempfile
    out = tempfile.mkdtemp(prefix="monarch-memory-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(mmap_threshold))
    cmd = [sys.executable, "-m", "torch_monarch.run", "--nproc-per-node", str(ranks), "--master-port", str(port),
           script, "--worker", *args, out]
    try:
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        results = []
        for r in range(ranks):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                results.append(json.load(f))
        return results
    finally:
        shutil.rmtree(out, ignore_errors=True)


def worst_peak_growth(script, ranks, *args):
    """Runs ``script --worker *args OUT`` on ``ranks`` ranks through the launcher (glibc told to
    return freed memory at once) and returns the largest peak growth its ranks wrote."""
    return max(r["peak_growth"] for r in run_workers(script, ranks, *args))
