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
