"""Living with torch.distributed 2.x: a model already laid out by FSDP2 (fully_shard), DTensor
tensor parallelism or DDP is refused by every torch_monarch wrapper with one ValueError naming
the part and the wrapper, instead of being sharded or reduced twice; plain models still wrap
in a job that initialized torch.distributed first. (Training over an initialized process group
is checked for parity in test_runtime.py: test_reuses_initialized_torch_distributed.)"""

import json
import os
import subprocess
import sys

from dist_harness import HERE, free_port


def test_models_laid_out_by_pytorch_wrappers_are_refused_by_name():
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, os.path.join(HERE, "interop_workers.py")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    expected = {
        "fsdp2": ("'transformer.h.1' is already laid out by FSDP2 (fully_shard)"),
        "dtensor": ("'transformer.h.0.mlp.c_fc.weight' is already laid out by DTensor"),
        "ddp": ("'the model itself' is already laid out by DistributedDataParallel"),
    }
    for model, text in expected.items():
        for wrapper in ("parallelize", "DataParallel", "fully_shard", "tensor_parallel"):
            got = seen[f"{model} {wrapper}"]
            assert got.startswith(f"ValueError: torch_monarch.{wrapper}: {text}"), (model, wrapper, got)
            assert "pass the plain module" in got
    for wrapper in ("parallelize", "DataParallel", "fully_shard", "tensor_parallel"):
        assert seen[f"plain {wrapper}"] == "wrapped", seen[f"plain {wrapper}"]


def test_the_supported_torch_range_is_checked():
    import warnings

    import pytest
    from torch_monarch import compat
    assert compat.check_supported("2.13.0+cpu") == (2, 13)
    assert compat.check_supported("2.9.1") == (2, 9)
    with pytest.raises(RuntimeError, match=r"needs torch 2.9 through 2.14; this is torch 1.13.1"):
        compat.check_supported("1.13.1")
    with pytest.raises(RuntimeError, match=r"this is torch 2.8.0"):
        compat.check_supported("2.8.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compat.check_supported("2.15.0") == (2, 15)
    assert any("tested with torch 2.9 through 2.14; this is torch 2.15.0" in str(w.message) for w in caught)
