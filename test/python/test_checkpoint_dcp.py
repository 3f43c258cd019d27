"""Migrating from FSDP2 + DCP: a checkpoint FSDP2 wrote with torch.distributed.checkpoint
(torchtitan's form: {"model": get_model_state_dict, "optimizer": get_optimizer_state_dict})
loads into torch_monarch layouts through torch_monarch.checkpoint.load_dcp, optimizer state
and learning rates included, and training continues as FSDP2's own run continues.

Tolerance: 1e-5 relative on each of the 3 continued losses (fp32; the layouts add partial
sums in other orders than FSDP2 does: measured up to 3e-8)."""

import functools

import pytest
import torch

from dist_harness import launch

LOSS_REL = 1e-5
LAYOUTS = ["zero3_dp4", "tp2_dp2", "pp2_dp2", "tp2_dp2_positional"]


@functools.lru_cache(maxsize=None)
def results():
    r = launch(4, "all", timeout=400, worker="dcp_workers.py")
    assert r.ok, r.describe()
    return torch.load(r.result_path(0))


@pytest.mark.parametrize("name", LAYOUTS)
def test_fsdp2_dcp_checkpoint_resumes_in_our_layout(name):
    res = results()
    fsdp2 = res["fsdp2"]
    assert fsdp2[-1] < fsdp2[0] - 1.0, f"FSDP2's run does not train: {fsdp2}"
    ours = res[name]
    assert ours["prefix"] == ("app.model." if "positional" in name else "model.")
    continued = fsdp2[len(fsdp2) - len(ours["losses"]):]
    for step, (got, want) in enumerate(zip(ours["losses"], continued)):
        assert got == pytest.approx(want, rel=LOSS_REL), f"{name}: continued step {step}"
    # The checkpoint's learning rates replaced the ones the optimizer was built with.
    assert ours["lrs"] == [0.0015, 0.003]


def test_the_checkpoint_is_torchs_own_format():
    keys = results()["keys"]
    assert "model.wte.weight" in keys and "model.blocks.0.qkv.weight" in keys
    assert any(k.startswith("optimizer.state.") and k.endswith(".exp_avg") for k in keys)


def test_bad_dcp_checkpoints_are_refused_naming_what_and_where():
    errors = results()["errors"]
    assert errors["other_model"] is not None and "CheckpointError" in errors["other_model"]
    assert "has no entry for" in errors["other_model"] and "blocks.4" in errors["other_model"]
    assert errors["not_dcp"] is not None and "is not a readable torch.distributed.checkpoint directory" in \
        errors["not_dcp"]
    assert errors["unchanged"], "a refused load changed the model"
    assert errors["positional_on_pipeline"] is not None and \
        "keys its optimizer state by position" in errors["positional_on_pipeline"]
