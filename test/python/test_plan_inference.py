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


def test_host_dispatch_adds_to_compute_on_cpu_ranks_and_overlaps_on_gpus():
    # The same job on CPU ranks (the cluster's devices share its cores, as cluster.detect
    # says) and on a GPU cluster: the host's dispatch time adds to a CPU rank's compute,
    # where a GPU runs behind its host (max of the two).
    graph = planner.transformer(32, 4096, 32, 64, 128256, kv_heads=8, ffn=14336, gated_mlp=True)
    gpu = planner.cluster("h100-80gb", 1)
    cpu = planner.cluster("h100-80gb", 1)
    cpu.cores_per_node = 2.0
    args = dict(batch=1, prompt_len=32, max_new_tokens=32, tp=1, host_seconds_per_op=10e-6)
    on_gpu = planner.plan_inference(graph, gpu, **args)
    on_cpu = planner.plan_inference(graph, cpu, **args)
    assert on_gpu.inference.config.host_overlaps_device and not on_cpu.inference.config.host_overlaps_device
    p_gpu, p_cpu = on_gpu.inference.prediction, on_cpu.inference.prediction
    assert p_cpu.decode_host_s == pytest.approx(32 * 71 * 10e-6)  # 32 blocks x 71 operators x 10 us
    # the device's part: the same on both (the clusters differ only in cores_per_node)
    device = p_cpu.per_token_s - p_cpu.decode_host_s
    assert device > 0
    assert p_gpu.per_token_s == pytest.approx(max(device, p_cpu.decode_host_s), rel=1e-6)
    # said explicitly, the CPU cluster overlaps too
    told = planner.plan_inference(graph, cpu, host_overlaps_device=True, **args)
    assert told.inference.prediction.per_token_s == pytest.approx(p_gpu.per_token_s, rel=1e-6)
    # The decode loop's own host time per step adds once per token on top of the blocks', and
    # travels with the plan's JSON.
    loop = planner.plan_inference(graph, cpu, host_seconds_per_step=1.5e-3, **args)
    assert loop.inference.prediction.decode_host_s == pytest.approx(p_cpu.decode_host_s + 1.5e-3)
    assert loop.inference.prediction.per_token_s == pytest.approx(p_cpu.per_token_s + 1.5e-3)
    assert planner.Plan.from_json(loop.to_json()).inference.config.host_seconds_per_step == 1.5e-3
