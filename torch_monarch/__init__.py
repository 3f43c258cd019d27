"""torch_monarch: plan, then run, hybrid-parallel training of PyTorch models.

The planner (``torch_monarch.planner``) is pure C++ behind pybind11 and does not need
torch: ``import torch_monarch`` never imports torch. The runtime (``init``,
``device_mesh``, ``DataParallel``, ``fully_shard``, ``tensor_parallel``, ``parallelize``,
``plan``, ``read_model``, ``meta_init``, ``cluster``) loads torch on first use.
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
    "Colwise": "tensor_parallel_modules",
    "Rowwise": "tensor_parallel_modules",
    "VocabEmbedding": "tensor_parallel_modules",
    "VocabHead": "tensor_parallel_modules",
    "Replicate": "tensor_parallel_modules",
    "Heads": "tensor_parallel_modules",
    "parallelize": "hybrid",
    "ParallelModel": "hybrid",
    "plan": "api",
    "check_plan": "api",
    "model_graph": "api",
    "read_model": "graph",
    "meta_init": "compat",
    "JaggedBatch": "embeddings",
    "EmbeddingBagConfig": "embeddings",
    "EmbeddingBagCollection": "embeddings",
    "EmbeddingConfig": "embeddings",
    "EmbeddingCollection": "embeddings",
    "shard_embeddings": "embeddings",
    "expert_parallel": "experts",
    "cluster": None,
    "graph": None,
    "embeddings": None,
    "experts": None,
    "profile": None,
    "checkpoint": None,
    "hf_checkpoint": None,
    "mixed_precision": None,
}


def __getattr__(name):
    if name in _RUNTIME:
        import importlib
        from . import compat
        compat.check_supported()  # once torch is loaded: a torch outside 2.9-2.14 is named here
        if _RUNTIME[name] is None:  # a submodule
            return importlib.import_module(f".{name}", __name__)
        module = importlib.import_module(f".{_RUNTIME[name]}", __name__)
        return getattr(module, "meta_device" if name == "meta_init" else name)
    raise AttributeError(f"module 'torch_monarch' has no attribute {name!r}")


__all__ = ["__version__", "planner", *_RUNTIME]
