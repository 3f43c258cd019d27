"""This process's memory from /proc (Linux): what the memory benches measure."""


def vm(field):
    """A /proc/self/status field in bytes (VmRSS: resident now, VmHWM: the high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


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
