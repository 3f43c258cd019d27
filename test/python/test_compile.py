"""``parallelize(..., compile=True)`` (torch_monarch.compile): every block compiled by
torch.compile (Inductor, CPU) inside the layout's wrappers, on 4 ranks, one launch for all
layouts (compile_workers.py); each layout is also run eagerly in the same launch.

What is checked, per layout: no graph break at all during the steps (Dynamo's counters:
the runtime's hooks stay outside the blocks, tensor parallelism's collectives trace as an
operator), one graph for all the blocks (identical blocks share it), and parity.

Tolerances: fp32 layouts within 1e-5 (losses) and 1e-4 (parameters, relative in norm) of one
eager process and of the same layout run eagerly; measured 5e-8 and 2e-6 (Inductor fuses and
reorders fp32 sums). The bf16 layout (bf16 compute over fp32 masters) against the same layout
eager: 1e-3 and 0.03; measured 2.5e-4 and 9e-3. Inductor computes a chain of bf16 pointwise
ops in fp32 and rounds once where eager rounds after every op, so the two differ by bf16
roundings (2^-8 relative) carried through 4 AdamW steps.
"""

import functools

import pytest
import torch

from dist_harness import launch
from tiny_gpt import train_reference

LOSS_REL, PARAM_REL = 1e-5, 1e-4
BF16_LOSS_REL, BF16_PARAM_REL = 1e-3, 0.03
STEPS = 4
LAYOUTS = {  # name: blocks in the model
    "dp4": 2, "zero3_dp4": 2, "tp2_dp2": 2, "tp2_sp_zero3_dp2": 2, "pp2_dp2": 4, "pp2_tp2_recompute_bf16": 4,
}


@functools.lru_cache(maxsize=None)
def results():
    r = launch(4, "all", timeout=600, worker="compile_workers.py")
    assert r.ok, r.describe()
    return [torch.load(r.result_path(k)) for k in range(4)]


@functools.lru_cache(maxsize=None)
def reference(layers):
    return train_reference(steps=STEPS, layers=layers)


def _param_rel(got, want):
    assert set(got) == set(want)
    return max(((got[k].float() - want[k].float()).norm() / want[k].float().norm()).item() for k in want)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_blocks_make_one_graph_without_breaks(name):
    for rank, res in enumerate(results()):
        r = res[name]
        who = f"{name} rank {rank}"
        assert r["graph_breaks"] == {}, f"{who}: graph breaks {r['graph_breaks']}"
        assert r["unique_graphs"] == 1, f"{who}: {r['unique_graphs']} graphs for identical blocks"
        assert r["compiled_blocks"] == LAYOUTS[name], f"{who}: {r['compiled_blocks']} blocks compiled"
        assert r["eager"]["compiled_blocks"] == 0 and r["eager"]["unique_graphs"] == 0, f"{who}: eager run compiled"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_the_same_layout_eager(name):
    r = results()[0][name]
    bf16 = name.endswith("bf16")
    loss_rel, param_rel = (BF16_LOSS_REL, BF16_PARAM_REL) if bf16 else (LOSS_REL, PARAM_REL)
    for step, (got, want) in enumerate(zip(r["losses"], r["eager"]["losses"])):
        assert got == pytest.approx(want, rel=loss_rel), f"{name}: loss of step {step}"
    assert _param_rel(r["full"], r["eager"]["full"]) <= param_rel


@pytest.mark.parametrize("name", [n for n in LAYOUTS if not n.endswith("bf16")])
def test_compiled_layout_matches_one_eager_process(name):
    want_losses, want_state = reference(LAYOUTS[name])
    r = results()[0][name]
    for step, (got, want) in enumerate(zip(r["losses"], want_losses)):
        assert got == pytest.approx(want, rel=LOSS_REL), f"{name}: loss of step {step}"
    assert _param_rel(r["full"], want_state) <= PARAM_REL


def test_what_cannot_run_in_a_compiled_block_is_refused_by_name():
    from torch_monarch import compile as monarch_compile
    with pytest.raises(ValueError, match="schedule zero_bubble_h1: the zero-bubble schedule's linears defer"):
        monarch_compile.check({}, "zero_bubble_h1", "none")
    with pytest.raises(ValueError, match="schedule zero_bubble_v: the zero-bubble schedule's linears defer"):
        monarch_compile.check({}, "zero_bubble_v", "none")
    with pytest.raises(ValueError, match="recompute='selective': selective recomputation finds"):
        monarch_compile.check({}, None, "selective")
    monarch_compile.check(None, "zero_bubble_v", "selective")  # eager: anything goes
    with pytest.raises(ValueError, match=r"compile= keywords \['fullgrahp'\] are not torch.compile's"):
        monarch_compile.compile_options({"fullgrahp": True})
    assert monarch_compile.compile_options(True) == {}
    assert monarch_compile.compile_options(False) is None


def test_the_planner_leaves_out_what_compiled_blocks_cannot_run():
    """Llama (HF) cut in 2 stages: eagerly the planner picks the zero-bubble schedule; for
    compiled blocks it may not, nor selective recomputation."""
    from hf_models import batch, build
    from torch_monarch import api, planner
    model = build("llama")
    cluster = planner.cluster("cpu", 4)
    eager = api.plan(model, batch("llama", 2), 8, cluster, pp=2)
    assert eager.schedule == planner.ScheduleKind.zero_bubble_h1, eager.summary()
    compiled = api.plan(model, batch("llama", 2), 8, cluster, pp=2, compile=True)
    assert compiled.schedule != planner.ScheduleKind.zero_bubble_h1, compiled.summary()
    for alt in compiled.alternatives:  # summaries: "... zb_h1 recompute=selective ..."
        assert " zb_h1 " not in alt.summary and "recompute=selective" not in alt.summary, alt.summary
