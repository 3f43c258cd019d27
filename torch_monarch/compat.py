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
