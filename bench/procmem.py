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
