"""Hugging Face Transformers models (hf_models.py: 21 architectures built from small
configs) read, planned and trained by ``parallelize`` on 4 ranks, against the same model
trained by one process.

Tolerance: losses within 1e-5 relative and every parameter tensor within 1e-4 relative (in
norm) after 3 AdamW steps. Both sides compute in fp32 with dropout off; they differ in the
order of sums (over dp ranks, tp shards and micro-batches), which moves the low bits of the
gradients; Adam's first steps divide by sqrt(v) ~ |g|, so a relative change of 1e-7 in a
gradient becomes about that in its update, and the norms stay far below 1e-4.
"""

import pytest
import torch

from dist_harness import launch
from hf_models import ARCHITECTURES, batch, build

LOSS_REL, PARAM_REL = 1e-5, 1e-4


def run(scenario, timeout=900):
    r = launch(4, scenario, timeout=timeout, worker="hf_workers.py")
    assert r.ok, r.describe()
    return torch.load(r.result_path(0))


def assert_parity(key, result):
    assert "error" not in result, f"{key}: {result.get('error')}"
    assert result["missing"] == [], f"{key}: the parallel state dict lacks {result['missing']}"
    for step, (got, want) in enumerate(zip(result["losses"], result["reference_losses"])):
        assert got == pytest.approx(want, rel=LOSS_REL), f"{key} ({result['plan']}): loss of step {step}"
    assert result["max_param_rel_diff"] <= PARAM_REL, \
        f"{key} ({result['plan']}): {result['worst_param']} differs by {result['max_param_rel_diff']:.2e}"


def test_tensor_parallelism_a_model_cannot_take_is_refused_by_name():
    """Gemma with one key/value head: tp=2 cannot split it (HF's attention reads its head
    counts from the config); the planner says so, naming the layer, and never picks it."""
    from torch_monarch import api, planner
    model = build("gemma")
    with pytest.raises(ValueError, match=r"pins.tp: 2 does not divide kv_heads=1 \(layer 'model.layers.0'\)"):
        api.plan(model, batch("gemma", 2), 8, planner.cluster("cpu", 4), tp=2)


def test_encoder_decoder_pipelines_are_refused_by_name():
    """T5's encoder (weights, before the decoder's blocks) feeds every decoder block: the hook
    cut, which sends only the blocks' chain between stages, cannot cut it, and says so."""
    from torch_monarch import api, planner
    with pytest.raises(ValueError, match=r"pp=2 is pinned, but T5ForConditionalGeneration cannot be cut .* "
                                         r"'encoder' \(before the blocks, with weights\) feeds block "
                                         r"'decoder.block.1' directly"):
        api.plan(build("t5"), batch("t5", 2), 8, planner.cluster("cpu", 4), pp=2)


def test_hf_moe_models_are_read_with_their_experts_and_routers():
    """Mixtral (4 experts, top-2, MixtralTopKRouter) and Qwen2-MoE (4 experts, top-2, a shared
    expert of twice the experts' width): every block a MoE layer whose FLOPs count top_k of the
    experts (HF's experts loop skips every expert on meta; the reader counts the routing), its
    parameters all of them; ep divides the experts or is refused naming the layer."""
    from torch_monarch import api, planner
    for name, ffn, shared in (("mixtral", 128, 0), ("qwen2_moe", 32, 2)):
        model = build(name)
        info, graph = api.model_graph(model, batch(name, 2))
        assert graph.total_params() == sum(p.numel() for p in model.parameters()), name
        blocks = [layer for layer in graph.layers if layer.name.startswith("model.layers.")]
        for block in blocks:
            assert (block.moe.experts, block.moe.top_k) == (4, 2), name
            assert block.moe.expert_params == 4 * 3 * 64 * ffn, name
            assert block.moe.routed_flops_per_sample == 2 * 16 * 2 * 3 * 64 * ffn, name
            assert block.forward_flops_per_sample > block.moe.routed_flops_per_sample, name
            assert block.kv_elements_per_token == 2 * 2 * 16, name  # k and v, 2 kv heads of 16
        moe = graph.transformer.moe
        assert (moe.experts, moe.top_k, moe.expert_ffn, moe.shared_experts) == (4, 2, ffn, shared), name
    with pytest.raises(ValueError, match=r"pins.ep: 3 "):
        api.plan(build("mixtral"), batch("mixtral", 2), 8, planner.cluster("cpu", 4), ep=3)


def test_every_architecture_is_read_and_planned():
    """One process: each model is read (its forward runs on meta parameters with the real
    padded batch: HF's mask checks read the attention mask's values) and planned for 4 CPU
    ranks; blocks are found and every graph layer has its parameters."""
    from torch_monarch import api, planner
    cluster = planner.cluster("cpu", 4)
    for name in ARCHITECTURES:
        model = build(name)
        info, graph = api.model_graph(model, batch(name, 2))
        assert len(info.blocks) >= 2, f"{name}: blocks {info.blocks}"
        assert graph.total_params() == sum(p.numel() for p in model.parameters()), name
        plan = api.plan(model, batch(name, 2), 8, cluster)
        assert plan.mesh.world_size() == 4, name


@pytest.fixture(scope="module")
def planned():
    return run("planned")


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_planned_layout_trains_like_one_process(planned, name):
    assert_parity(name, planned[name])


PINNED = {
    "llama@tp2": {"tp": 2},
    "llama@tp2_sp": {"tp": 2, "sequence_parallel": True},
    "qwen2@zero3": {"dp": 4, "zero_stage": 3},
    "mistral@tp2_zero3": {"tp": 2, "zero_stage": 3},
    "bert@tp2": {"tp": 2},
    "t5@zero3": {"dp": 4, "zero_stage": 3},
    "qwen3@tp2": {"tp": 2},
    "gpt2@tp2": {"tp": 2},
    # Pipelines: HF forwards do not trace under torch.fx; stages are cut by module hooks.
    "llama@pp2": {"pp": 2},
    "gpt2@pp2": {"pp": 2},  # the embedding tied to the head across the two stages
    "qwen2@pp2_tp2": {"pp": 2, "tp": 2},
    "bert@pp2_zero3": {"pp": 2, "zero_stage": 3},
    "mixtral@pp2": {"pp": 2},
    # Experts split over ep ranks (torch_monarch.experts swaps HF's MixtralExperts /
    # Qwen2MoeExperts; the router, the shared expert and HF's loss stay the model's).
    "mixtral@ep2": {"dp": 4, "ep": 2},
    "qwen2_moe@ep4_zero3": {"dp": 4, "ep": 4, "zero_stage": 3},
    "mixtral@ep2_tp2": {"tp": 2, "ep": 2},
    # Experts split over ep inside a pipeline: the state dict gathers the experts of the stage
    # this rank does not run too (their released weights keep the expert mark).
    "mixtral@pp2_ep2": {"pp": 2, "dp": 2, "ep": 2},
    # Blocks under torch.compile (torch_monarch.compile), inside tp, the hook-cut pipeline, ZeRO-3.
    "llama@tp2_compiled": {"tp": 2, "compile": True},
    "gpt2@pp2_compiled": {"pp": 2, "compile": True},
    "qwen2@zero3_compiled": {"dp": 4, "zero_stage": 3, "compile": True},
    # dp rank 1's rows carry no label (all -100): its loss is 0/0 in HF's own mean; it must add
    # nothing, not NaN, to the step.
    "llama@dp4_unlabelled_rank": {"dp": 4, "_unlabelled_rows": [2, 4]},
}
COMPILED = [k for k, pins in PINNED.items() if pins.get("compile")]
EXPERT_PARALLEL = [k for k, pins in PINNED.items() if pins.get("ep", 1) > 1]


@pytest.fixture(scope="module")
def pinned():
    import json
    return run("pinned:" + json.dumps(PINNED))


@pytest.mark.parametrize("key", list(PINNED))
def test_pinned_layout_trains_like_one_process(pinned, key):
    assert_parity(key, pinned[key])


@pytest.mark.parametrize("key", EXPERT_PARALLEL)
def test_hf_moe_models_run_their_experts_split_over_ep(pinned, key):
    """The pinned ep is the plan's: graph.py reads HF's experts modules and routers into the
    planner's MoE layers, and parallelize passes ep= to the planner."""
    r = pinned[key]
    assert "error" not in r, r.get("error")
    assert f" ep={PINNED[key]['ep']} " in r["plan"], f"{key}: planned {r['plan']}"


@pytest.mark.parametrize("key", COMPILED)
def test_compiled_hf_blocks_make_one_graph_without_breaks(pinned, key):
    """Hugging Face blocks compile whole inside the layout: no graph break during the steps,
    one graph for all blocks (their key/value cache is off: its per-layer state would make
    one graph per block)."""
    r = pinned[key]
    assert "error" not in r, r.get("error")
    assert r["graph_breaks"] == {}, f"{key}: graph breaks {r['graph_breaks']}"
    assert r["unique_graphs"] == 1, f"{key}: {r['unique_graphs']} graphs"
    assert r["compiled_blocks"] >= 2, f"{key}: {r['compiled_blocks']} blocks compiled"


@pytest.mark.parametrize("key", ["llama@pp2", "mixtral@pp2"])
def test_zero_bubble_pipelines_defer_weight_gradients(pinned, key):
    """Under the zero-bubble schedule the blocks' linears leave their weight gradients to the
    W pass (torch_monarch.zero_bubble): a B pass that computed them would make W empty."""
    r = pinned[key]
    assert " zb_h1 " in r["plan"], f"{key}: planned {r['plan']}"
    assert r["deferred_linears"] > 0, f"{key}: no linear defers its weight gradient"
