"""torch_monarch: plan, then run, hybrid-parallel training of PyTorch models.

The planner (``torch_monarch.planner``) is pure C++ behind pybind11 and does not need
torch: ``import torch_monarch`` never imports torch. The runtime (``init``,
``device_mesh``, ``DataParallel``, ``fully_shard``, ``tensor_parallel``, ``parallelize``)
loads torch on first use.
"""

__version__ = "0.1.0"

from . import planner  # noqa: E402  (after __version__ so a failed build still shows it)

_RUNTIME = {
    "init": "distributed",
    "device_mesh": "distributed",
    "mesh_from_plan": "distributed",
    "DataParallel": "data_parallel",
    "fully_shard": "sharded",
    "FullyShardedModule": "sharded",
    "tensor_parallel": "tensor_parallel_modules",
    "vocab_parallel_cross_entropy": "tensor_parallel_modules",
    "parallelize": "hybrid",
    "ParallelModel": "hybrid",
}


def __getattr__(name):
    if name in _RUNTIME:
        import importlib
        module = importlib.import_module(f".{_RUNTIME[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'torch_monarch' has no attribute {name!r}")


__all__ = ["__version__", "planner", *_RUNTIME]
