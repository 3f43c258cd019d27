"""torch_monarch.plan(model, ..., mode="inference"): the planner's inference objective on a
model read from an nn.Module (api.py passes it to planner.plan_inference; the cost model is
tested in test/cpp/planner/test_inference_*.cpp and test_planner.py)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import models  # noqa: E402
import torch_monarch  # noqa: E402
from torch_monarch import planner  # noqa: E402


def test_llama3_8b_module_on_meta_plans_for_latency_and_throughput():
    with torch.device("meta"):
        model = models.llama3_8b()
    x = torch.zeros(1, 1280, dtype=torch.long, device="meta")
    cluster = planner.cluster("h100-80gb", 8)
    fast = torch_monarch.plan(model, x, cluster=cluster, mode="inference", batch=1, prompt_len=1024,
                              max_new_tokens=256, dtype="bf16")
    many = torch_monarch.plan(model, x, cluster=cluster, mode="inference", batch=1, prompt_len=1024,
                              max_new_tokens=256, latency_target=0.05, dtype="bf16")
    assert fast.inference.config.objective == "latency" and many.inference.config.objective == "throughput"
    assert fast.mesh.tp > many.mesh.tp and many.mesh.dp > 1
    assert "weights read per token" in fast.choices[0] and "tokens/s" in many.choices[0]
    # The KV cache read from the module's k/v projections: 128 KiB per token for Llama-3-8B in
    # bf16, 160 MiB for 1280 tokens, split over tp by kv heads; in the parameters' fp32, twice.
    assert fast.inference.prediction.kv_cache_bytes == 160 * 2**20 / fast.mesh.tp
    fp32 = torch_monarch.plan(model, x, cluster=cluster, mode="inference", batch=1, prompt_len=1024,
                              max_new_tokens=256, tp=8)
    assert fp32.inference.prediction.kv_cache_bytes == 2 * 160 * 2**20 / 8
    with pytest.raises(ValueError, match="not an inference pin"):
        torch_monarch.plan(model, x, cluster=cluster, mode="inference", batch=1, prompt_len=8,
                           max_new_tokens=8, zero=1)
    with pytest.raises(ValueError, match="mode must be"):
        torch_monarch.plan(model, x, 8, cluster, mode="serving")


@pytest.mark.parametrize("kwargs,message", [
    (dict(mode="serving"), r"mode must be 'training' or 'inference', got 'serving'"),
    (dict(batch=4, prompt_len=8, max_new_tokens=8), r"\['batch', 'max_new_tokens', 'prompt_len'\] plan generation: "
                                                    r"pass mode='inference'"),
    (dict(mode="inference", batch=4, prompt_len=8, max_new_tokens=8), r"mode='inference' plans generation: it needs "
                                                                      r"example_input="),
    (dict(mode="inference", example_input=torch.zeros(1, 8, dtype=torch.long), batch=4),
     r"needs batch=, prompt_len= and max_new_tokens="),
    (dict(mode="inference", example_input=torch.zeros(1, 8, dtype=torch.long), batch=4, prompt_len=8,
          max_new_tokens=8, zero_stage=3), r"\['zero_stage'\] are training choices; mode='inference' pins tp and pp"),
    (dict(inference_options={"host_seconds_per_op": 3e-6}), r"inference_options are planner.plan_inference's keywords "
                                                            r"for mode='inference'"),
    (dict(mode="inference", inference_options={"hbm": 0.5}), r"got \['hbm'\] with mode='inference'"),
])
def test_parallelize_inference_mode_refuses_what_it_cannot_honour(kwargs, message):
    """Each before any process group exists (one process, no launch)."""
    model = models.LlamaForCausalLM(vocab=64, hidden=32, heads=4, kv_heads=2, intermediate=64, layers=2)
    with pytest.raises(ValueError, match=message):
        torch_monarch.parallelize(model, **kwargs)
