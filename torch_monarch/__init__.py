"""torch_monarch: plan, then run, hybrid-parallel training of PyTorch models.

The planner (``torch_monarch.planner``) is pure C++ behind pybind11 and does not need
torch: ``import torch_monarch`` never imports torch.
"""

__version__ = "0.1.0"

from . import planner  # noqa: E402  (after __version__ so a failed build still shows it)

__all__ = ["__version__", "planner"]
