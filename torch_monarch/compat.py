"""The one place where differences between the supported torch versions (2.9 through 2.14)
live in the Python package, and the check that the installed torch is one of them."""

import re
import warnings

import torch

SUPPORTED = ((2, 9), (2, 14))


def torch_version(version=None):
    """(major, minor) of the installed torch (or of ``version``, a version string)."""
    match = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    return int(match.group(1)), int(match.group(2))


def check_supported(version=None):
    """Raises for a torch before 2.9 (its APIs are missing); warns for one newer than 2.14 (not
    tested). Returns the (major, minor) checked."""
    found = torch_version(version)
    low, high = SUPPORTED
    text = f"{low[0]}.{low[1]} through {high[0]}.{high[1]}"
    if found < low:
        raise RuntimeError(f"torch_monarch needs torch {text}; this is torch {version or torch.__version__}")
    if found > high:
        warnings.warn(f"torch_monarch is tested with torch {text}; this is torch {version or torch.__version__}",
                      stacklevel=2)
    return found


def meta_device():
    """A context under which modules are built on the meta device (no storage): a model of any
    size is built in no time and no memory (``torch_monarch.meta_init()``)."""
    return torch.device("meta")


# How long the exit guard lets other threads run before the interpreter finalizes.
_EXIT_GRACE_S = 0.1


def guard_gloo_exit():
    """Registers (once) an exit handler that gives c10d's Gloo worker threads a moment with the
    GIL before the interpreter finalizes.

    Why (torch 2.13 and earlier, pytorch/pytorch#190489): a Gloo worker thread destroys a
    finished collective's work object after waking its caller, and with it the last C++
    reference to the caller's tensors; releasing a tensor that has a Python object takes the
    GIL. When the main thread has meanwhile reached interpreter finalization, taking the GIL
    ends the worker thread inside a noexcept destructor, and the process dies of SIGABRT
    ("terminate called without an active exception") after the script finished, whether or
    not it called destroy_process_group(). On this machine a 4-rank script that trains a
    Linear and calls dist.all_reduce each step aborted at exit in 2 of 8 launches (6 of 8
    without destroy_process_group); with this pause, 0 of 12 (and 0 of 12). The handler runs
    at exit, before finalization, and sleeps: the waiting threads take the GIL and finish."""
    global _exit_guarded
    if _exit_guarded:
        return
    import atexit
    import time
    atexit.register(time.sleep, _EXIT_GRACE_S)
    _exit_guarded = True


_exit_guarded = False
