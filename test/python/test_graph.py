"""The model reader (torch_monarch.graph) and the one-call planning API, on one process:
what it reads from models as users write them (on the meta device), and how a plan made for
another model or world is refused."""

import os
import re
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))

import models  # noqa: E402
import torch_monarch  # noqa: E402
from torch_monarch import planner  # noqa: E402
from torch_monarch.graph import read_model  # noqa: E402


def kinds(info):
    return [(layer.name, str(layer.kind).split(".")[-1]) for layer in info.graph.layers]


def test_gpt3_175b_on_meta_matches_the_published_shape_and_flops():
    with torch_monarch.meta_init():
        model = models.gpt3_175b()
    assert all(p.is_meta for p in model.parameters())  # never materialized
    start = time.perf_counter()
    info = read_model(model, torch.zeros(1, 2048, dtype=torch.long), dtype="bf16")
    seconds = time.perf_counter() - start
    assert seconds < 10, f"reading GPT-3 175B took {seconds:.1f} s"
    ref = planner.transformer(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, tied_embeddings=True)
    # Narayanan et al.'s F counts only the matmuls; ours counts the ops that ran. Per block
    # they agree exactly (biases add parameters, no matmul FLOPs).
    block, ref_block = info.graph.layers[2], ref.layers[1]
    assert block.name == "transformer.h.0" and str(block.kind).endswith("block")
    assert block.forward_flops_per_sample == pytest.approx(ref_block.forward_flops_per_sample, rel=1e-9)
    assert block.attention_flops_per_sample == pytest.approx(ref_block.attention_flops_per_sample, rel=1e-9)
    assert block.params - ref_block.params == 12288 * (3 + 1 + 4 + 1)  # the four linears' biases
    head = info.graph.layers[-1]
    assert head.forward_flops_per_sample == pytest.approx(ref.layers[-1].forward_flops_per_sample, rel=1e-9)
    assert head.activations.total() == pytest.approx(ref.layers[-1].activations.total(), rel=1e-9)
    # Tied embedding and head: one tensor, counted once.
    assert info.tied == [["transformer.wte.weight", "lm_head.weight"]]
    assert info.graph.tied_groups == [[0, len(info.graph.layers) - 1]]
    assert info.total_params == sum(p.numel() for p in model.parameters())
    assert (block.tp_dims.heads, block.tp_dims.kv_heads, block.tp_dims.ffn) == (96, 96, 4 * 12288)
    t = info.graph.transformer
    assert (t.layers, t.hidden, t.heads, t.seq, t.vocab, t.tied_embeddings) == (96, 12288, 96, 2048, 51200, True)


def test_llama_grouped_kv_heads_and_gated_mlp_are_read_from_the_modules():
    model = models.LlamaForCausalLM(vocab=256, hidden=64, heads=8, kv_heads=2, intermediate=96, layers=3)
    info = read_model(model, torch.zeros(2, 16, dtype=torch.long))
    assert kinds(info) == [("model.embed_tokens", "embedding"), ("model.layers.0", "block"),
                           ("model.layers.1", "block"), ("model.layers.2", "block"), ("model.norm", "norm"),
                           ("lm_head", "head")]
    block = info.graph.layers[1]
    assert (block.tp_dims.heads, block.tp_dims.kv_heads, block.tp_dims.ffn) == (8, 2, 96)
    assert str(block.tp).endswith("block")
    assert info.graph.transformer.gated_mlp and info.graph.transformer.kv_heads == 2
    # q, k, v (k and v at a quarter width), o, gate, up, down: 2 FLOPs per multiply-add.
    per_token = 2 * (64 * 64 + 2 * 64 * 16 + 64 * 64 + 3 * 64 * 96)
    attention = 4 * 16 * 64  # Q K^T and A V per token, over all heads
    assert block.forward_flops_per_sample == pytest.approx(16 * (per_token + attention))
    assert block.attention_flops_per_sample == pytest.approx(16 * attention)
    assert block.activations.attention_scores > 0 and block.activations.tp_sharded > 0
    assert not info.graph.tied_groups
    # The weight GEMMs, per sample (16 tokens), with the dimension tp cuts: q, k, v, gate, up
    # column-parallel (N), o and down row-parallel (K).
    split = lambda g: str(g.split).split(".")[-1]  # noqa: E731
    assert sorted((g.m_per_sample, g.n, g.k, split(g)) for g in block.gemms) == sorted(
        [(16, 64, 64, "n"), (16, 16, 64, "n"), (16, 16, 64, "n"), (16, 64, 64, "k"), (16, 96, 64, "n"),
         (16, 96, 64, "n"), (16, 64, 96, "k")])
    head = info.graph.layers[-1]
    assert [(g.m_per_sample, g.n, g.k, split(g)) for g in head.gemms] == [(16, 256, 64, "n")]
    assert info.graph.layers[0].gemms == []  # a lookup


def test_bert_encoder_mlp_names_are_split_the_right_way():
    model = models.BertForSequenceClassification(vocab=128, hidden=32, heads=4, intermediate=64, layers=2,
                                                 max_positions=16)
    info = read_model(model, torch.zeros(2, 16, dtype=torch.long))
    assert info.blocks == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    from torch_monarch.tensor_parallel_modules import Colwise, Rowwise
    assert isinstance(info.tp_plan["bert.encoder.layer.0.intermediate.dense"], Colwise)
    assert isinstance(info.tp_plan["bert.encoder.layer.0.output.dense"], Rowwise)
    block = info.graph.layers[[n for n, _ in kinds(info)].index("bert.encoder.layer.0")]
    assert (block.tp_dims.heads, block.tp_dims.ffn) == (4, 64)


def test_models_without_blocks_or_tp_structure_plan_as_data_parallel():
    model = models.resnet18(num_classes=4)
    info = read_model(model, torch.zeros(2, 3, 32, 32))
    assert info.blocks == [] and info.seq == 0
    assert all(str(layer.tp).endswith("replicated") for layer in info.graph.layers)
    # ResNet-18 forward: 2 x 1.82 GMAC at 224 x 224 (He et al. 2016, Table 1); at 32 x 32 the
    # spatial work is (32/224)^2 of it, plus the 4-class head.
    flops = sum(layer.forward_flops_per_sample for layer in info.graph.layers)
    assert flops == pytest.approx(2 * 1.82e9 * (32 / 224) ** 2, rel=0.03)
    p = torch_monarch.plan(model, torch.zeros(2, 3, 32, 32), 64, planner.cluster("a100-80gb", 8))
    assert (p.mesh.pp, p.mesh.tp) == (1, 1)


def test_plan_save_edit_load_round_trip_and_refusals_list_every_difference(tmp_path):
    model = models.GPT2LMHeadModel(vocab=64, hidden=32, heads=4, layers=4, max_positions=8)
    x = torch.zeros(2, 8, dtype=torch.long)
    p = torch_monarch.plan(model, x, 8, planner.cluster("a100-80gb", 8), pp=2, tp=2)
    path = tmp_path / "plan.json"
    p.save(path)
    text = path.read_text()
    edited = text.replace('"zero_stage": ' + str(p.zero_stage), '"zero_stage": 1')
    q = planner.loads(edited)
    assert q.zero_stage == 1 and planner.loads(text) == p
    torch_monarch.check_plan(q, model, x, world_size=8)  # the edit is legal
    # Another model: every difference in one error.
    other = models.GPT2LMHeadModel(vocab=64, hidden=48, heads=6, layers=3, max_positions=8)
    with pytest.raises(ValueError) as e:
        torch_monarch.check_plan(p, other, x, world_size=4)
    msg = str(e.value)
    assert "world size: the plan is for 8 ranks" in msg and "the job has 4" in msg
    assert "layers in the plan the model does not have: transformer.h.3" in msg
    assert "layer transformer.h.0:" in msg and "parameters in the plan" in msg
    assert "tp=2 does not divide" not in msg
    # A stage cut the runtime cannot make (the head alone on the last stage).
    bad = planner.loads(text)
    layers = list(bad.layers)
    layers[-1].stage = 1
    for layer in layers[:-1]:
        layer.stage = 0
    bad.layers = layers
    with pytest.raises(ValueError, match="lm_head runs after the last block, so it must share its stage 0"):
        torch_monarch.check_plan(bad, model, x, world_size=8)


def test_pins_are_checked_by_name_and_type():
    model = models.MLP()
    with pytest.raises(TypeError, match="unknown pin"):
        torch_monarch.plan(model, torch.zeros(4, 32), 8, planner.cluster("cpu", 2), tpp=2)
    with pytest.raises(TypeError, match="pin tp='2' must be an int"):
        torch_monarch.plan(model, torch.zeros(4, 32), 8, planner.cluster("cpu", 2), tp="2")
    with pytest.raises(TypeError, match="pin ep='2' must be an int"):
        torch_monarch.plan(model, torch.zeros(4, 32), 8, planner.cluster("cpu", 2), ep="2")
    # ep and cp are pins like the others: a model without experts or attention cannot take them.
    with pytest.raises(ValueError, match="pins.ep: 2 needs a model with MoE layers"):
        torch_monarch.plan(model, torch.zeros(4, 32), 8, planner.cluster("cpu", 2), ep=2)
    with pytest.raises(ValueError, match="pins.cp: 2"):
        torch_monarch.plan(model, torch.zeros(4, 32), 8, planner.cluster("cpu", 2), cp=2)
    with pytest.raises(ValueError, match="ep / cp / micro_batch pins need example_input="):
        torch_monarch.parallelize(model, ep=2)


def test_custom_modules_say_how_they_split():
    from torch import nn

    class Expand(nn.Linear):
        monarch_tp_style = torch_monarch.Colwise()

    class Contract(nn.Linear):
        monarch_tp_style = torch_monarch.Rowwise()

    class Mixer(nn.Module):  # names no default plan knows
        def __init__(self):
            super().__init__()
            self.num_heads = 4
            self.inp = Expand(32, 32)
            self.out = Contract(32, 32)
            self.grow = Expand(32, 96)
            self.shrink = Contract(96, 32)

        def forward(self, x):
            return self.shrink(torch.relu(self.grow(self.out(torch.relu(self.inp(x))))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Mixer() for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return x

    info = read_model(Net(), torch.zeros(2, 8, 32))
    block = info.graph.layers[0]
    assert str(block.tp).endswith("block") and (block.tp_dims.heads, block.tp_dims.ffn) == (4, 96)
    bad = Net()
    bad.blocks[0].inp.monarch_tp_style = "colwise"
    with pytest.raises(ValueError, match="monarch_tp_style is 'colwise', not one of"):
        read_model(bad, torch.zeros(2, 8, 32))


def test_plans_with_every_recompute_mode_are_carried_out():
    model = models.GPT2LMHeadModel(vocab=64, hidden=32, heads=4, layers=2, max_positions=8)
    x = torch.zeros(2, 8, dtype=torch.long)
    # Whole blocks (full) and the attention core alone (selective) are both recomputed by the
    # runtime: such plans are accepted.
    for mode in ("selective", "full"):
        p = torch_monarch.plan(model, x, 8, planner.cluster("a100-80gb", 2), recompute=mode)
        assert str(p.recompute).endswith(mode)
        torch_monarch.check_plan(p, model, x, world_size=2)


def test_link_fit_recovers_latency_and_bandwidth():
    from torch_monarch.cluster import fit_alpha_beta
    n, alpha, bandwidth = 4, 20e-6, 3e9
    sizes = [1 << 12, 1 << 16, 1 << 20, 1 << 22]
    # Ring all-reduce: 2(n-1) alpha + 2(n-1)/n S / B.
    seconds = [2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bandwidth for s in sizes]
    got_alpha, got_bw = fit_alpha_beta(sizes, seconds, n)
    assert got_alpha == pytest.approx(alpha, rel=1e-9) and got_bw == pytest.approx(bandwidth, rel=1e-9)


def test_the_plans_compute_dtype_is_carried_out_or_refused():
    model = models.GPT2LMHeadModel(vocab=64, hidden=32, heads=4, layers=2, max_positions=8)  # fp32
    x = torch.zeros(2, 8, dtype=torch.long)
    cluster = planner.cluster("a100-80gb", 4)
    from torch_monarch.api import mixed_precision_of
    # bf16 over fp32 parameters is mixed precision in every layout: ZeRO, plain replicas,
    # tensor and pipeline parallelism (test_mixed_precision.py runs them).
    for pins in (dict(tp=1, pp=1, dp=2, zero_stage=3), dict(tp=1, pp=1, dp=2, zero_stage=0),
                 dict(tp=2, pp=1, dp=2, zero_stage=0), dict(tp=1, pp=2, dp=2, zero_stage=0)):
        world = pins["tp"] * pins["pp"] * pins["dp"]
        p = torch_monarch.plan(model, x, 8, planner.cluster("a100-80gb", world), dtype="bf16", **pins)
        torch_monarch.check_plan(p, model, x, world_size=world)
        assert mixed_precision_of(p, model) == torch.bfloat16, pins
    # The model's own dtype needs nothing.
    p = torch_monarch.plan(model, x, 8, planner.cluster("a100-80gb", 2), dtype="fp32", tp=1, pp=1, dp=2, zero_stage=0)
    torch_monarch.check_plan(p, model, x, world_size=2)
    assert mixed_precision_of(p, model) is None
    # A dtype the runtime does not compute in is refused, naming the field.
    p.training.compute_dtype = planner.DType.fp8
    with pytest.raises(ValueError, match=r"training.compute_dtype: fp8 is not a dtype the runtime computes in"):
        torch_monarch.check_plan(p, model, x, world_size=2)


def test_plans_count_the_runtimes_fp32_zero_gradients():
    # The runtime's ZeRO engine accumulates and reduces gradients in fp32 whatever the compute
    # dtype (fully_shard.cpp): its plans say so, and a bf16 ZeRO-2 plan's gradient shards are
    # predicted at 4 bytes per parameter, not bf16's 2.
    from torch_monarch.api import runtime_training
    model = models.GPT2LMHeadModel(vocab=512, hidden=64, heads=4, layers=2, max_positions=32, dropout=0.0)
    info = read_model(model, torch.zeros(1, 32, dtype=torch.long))
    for dtype in ("bf16", "fp32"):
        t = runtime_training(info, 8, dtype=dtype)
        assert t.zero_grad_bytes == 4, dtype
    t = runtime_training(info, 8, dtype="bf16")
    p = planner.evaluate(info.graph, planner.cluster("a100-80gb", 4), t, tp=1, pp=1, dp=4, zero=2, micro_batch=2,
                         schedule="none", recompute="none", allow_over_memory=True)
    params = info.graph.total_params()  # a tied weight once
    assert p.prediction.memory.grads == pytest.approx(4 * params / 4)
    assert planner.loads(planner.dumps(p)).training.zero_grad_bytes == 4


class _PlainAttention(torch.nn.Module):
    """What users write: grouped K/V heads by repeat_interleave, a causal mask from
    torch.ones and positions from torch.arange, no device named anywhere."""

    def __init__(self, hidden=64, heads=8, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = torch.nn.Linear(hidden, hidden)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim)
        self.o_proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t, h = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = (p(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
                .repeat_interleave(self.heads // self.kv_heads, dim=1) for p in (self.k_proj, self.v_proj))
        causal = torch.ones(t, t).tril().bool()
        scores = (q @ k.transpose(-1, -2) / self.head_dim ** 0.5).masked_fill(~causal, float("-inf"))
        return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h))


class _PlainBlock(torch.nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.attn = _PlainAttention(hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _PlainLM(torch.nn.Module):
    def __init__(self, vocab=100, hidden=64, layers=2, max_seq=32):
        super().__init__()
        self.max_seq = max_seq
        self.tokens, self.positions = torch.nn.Embedding(vocab, hidden), torch.nn.Embedding(max_seq, hidden)
        self.blocks = torch.nn.ModuleList(_PlainBlock(hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids):
        assert ids.shape[1] <= self.max_seq, "sequence longer than the position table"
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_tensors_made_in_forward_without_a_device_are_read_and_planned():
    """The pattern that failed ("found at least two devices, meta and cpu", then
    "cannot repeat_interleave a meta tensor without output_size"): read on meta, the blocks'
    attention (grouped K/V) and their Sequential MLP recognised for tp; planned with tp=2. Its
    shape assert stops torch.fx (the reason names the line); the stages are then cut by module
    hooks, so pp=2 plans too."""
    model = _PlainLM()
    ids = torch.randint(0, 100, (4, 16))
    info = read_model(model, ids)
    blocks = [layer for layer in info.graph.layers if layer.name in info.blocks]
    assert len(blocks) == 2 and all(str(b.tp).endswith("block") for b in blocks)
    assert (blocks[0].tp_dims.heads, blocks[0].tp_dims.kv_heads, blocks[0].tp_dims.ffn) == (8, 2, 256)
    assert blocks[0].forward_flops_per_sample > 0
    cluster = planner.cluster("cpu", 4)
    plan = torch_monarch.plan(model, ids, 8, cluster, tp=2)
    assert plan.mesh.tp == 2 and plan.mesh.pp == 1
    from torch_monarch.pipeline import trace_problem
    assert re.search(r"torch.fx could not trace _PlainLM.forward: TraceError: .* at .*test_graph.py:\d+ "
                     r"\(assert ids.shape\[1\] <= self.max_seq", trace_problem(model))
    assert torch_monarch.plan(model, ids, 8, cluster, pp=2).mesh.pp == 2


def test_a_batchnorm_model_is_read_and_planned_from_one_sample_without_touching_its_statistics():
    """A ResNet-style model (BasicBlocks of conv + BatchNorm2d, a BatchNorm1d after the
    classifier) read from a one-sample example: training-mode batch norm would refuse one value
    per channel, and reading needs no batch statistics. The model's running statistics and
    num_batches_tracked stay as they were."""
    from torch import nn
    from torch_monarch import api, planner

    class BasicBlock(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
            self.layers = nn.ModuleList([BasicBlock(16) for _ in range(4)])
            self.fc, self.bn = nn.Linear(16, 10), nn.BatchNorm1d(10)

        def forward(self, x):
            x = self.stem(x)
            for layer in self.layers:
                x = layer(x)
            return self.bn(self.fc(x.mean((2, 3))))

    model = Net()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    info, graph = api.model_graph(model, torch.randn(1, 3, 32, 32))
    assert len(info.blocks) == 4
    assert graph.total_params() == sum(p.numel() for p in model.parameters())
    plan = api.plan(model, torch.randn(1, 3, 32, 32), 64, planner.cluster("cpu", 4))
    assert plan.mesh.world_size() == 4
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), f"reading changed {k}"


def test_a_sequential_model_s_run_of_blocks_is_its_units_and_a_resnet_s_stages_are_not():
    """A model that is itself an nn.Sequential (embedding, block0..blockN, norm, head: how the C++
    frontend's GPT is written) has the longest run of same-type children with parameters as its
    blocks; Sequentials inside another model (a ResNet's stages, above) are not read."""
    from torch_monarch.sharded import _default_units

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return x + self.fc(x)

    blocks = [Block() for _ in range(3)]
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), *blocks, torch.nn.ReLU(), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 10))
    assert _default_units(model) == blocks
    # A run broken by a parameter-free child: two runs of one, no blocks (a ReLU between
    # two Linears is an MLP, not a stack of blocks).
    assert _default_units(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))) == []
    info = read_model(model, torch.zeros(2, 5, dtype=torch.long))
    assert info.blocks == ["1", "2", "3"]


def test_moe_decoder_is_read_with_its_experts_routed_flops_and_kv_widths():
    """examples/models.py's MoE decoder on meta: every block a MoE layer (8 experts, top-2,
    a shared expert, capacity 1.25 from the experts module), FLOPs of the active experts only
    (on meta the routing is unknown and the experts' loop sends every token everywhere; the
    reader counts top_k of them), parameters of all, keys and values per token for cp, and
    each number equal to the planner's own MoE transformer of the same shape."""
    with torch_monarch.meta_init():
        model = models.MoEForCausalLM(vocab=128, hidden=64, heads=4, kv_heads=2, intermediate=32, layers=2,
                                      num_experts=8, top_k=2, shared_intermediate=32, capacity_factor=1.25)
    info = read_model(model, torch.zeros(2, 16, dtype=torch.long))
    g = info.graph
    assert g.total_params() == sum(p.numel() for p in model.parameters())
    ref = planner.transformer(layers=2, hidden=64, heads=4, kv_heads=2, ffn=32, seq=16, vocab=128, gated_mlp=True,
                              dtype="fp32", attention="materialized",
                              moe=dict(experts=8, top_k=2, shared_experts=1, capacity_factor=1.25))
    for name in ("model.layers.0", "model.layers.1"):
        block = next(layer for layer in g.layers if layer.name == name)
        ref_block = ref.layers[1]
        m = block.moe
        assert (m.experts, m.top_k, m.capacity_factor) == (8, 2, 1.25)
        assert m.expert_params == ref_block.moe.expert_params == 8 * 3 * 64 * 32
        assert m.routed_flops_per_sample == ref_block.moe.routed_flops_per_sample == 2 * 16 * 2 * 3 * 64 * 32
        assert m.dispatch_bytes_per_sample == ref_block.moe.dispatch_bytes_per_sample
        # Attention, router, shared expert and top-2 of 8 experts: the builder's count exactly.
        assert block.forward_flops_per_sample == ref_block.forward_flops_per_sample == 1064960
        assert block.kv_elements_per_token == ref_block.kv_elements_per_token == 2 * 2 * 16
        grouped = [(gm.m_per_sample, gm.n, gm.k, gm.experts) for gm in block.gemms if gm.experts]
        assert grouped == [(32.0, 64, 64, 8), (32.0, 64, 32, 8)]
    t = g.transformer
    assert (t.moe.experts, t.moe.top_k, t.moe.expert_ffn, t.moe.shared_experts, t.moe.every) == (8, 2, 32, 1, 1)
    # A dense Llama's blocks carry their keys and values too (cp's ring bytes): 2 x kv_heads x head_dim.
    llama = read_model(models.LlamaForCausalLM(vocab=128, hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2),
                       torch.zeros(2, 16, dtype=torch.long))
    assert [layer.kv_elements_per_token for layer in llama.graph.layers if layer.name.startswith("model.layers.")] \
        == [64.0, 64.0]


def test_the_planner_splits_experts_over_ep_when_their_state_does_not_fit():
    """A 3.7B-parameter MoE decoder (on meta, 99% of it experts) replicated over 8 A100-40GB
    (zero=0, dp=8 pinned): with every expert on every rank its state (16 bytes a parameter,
    58 GB) does not fit, so the planner splits the experts over ep ranks and says why; ep=1 pinned is
    infeasible. A plan whose ep does not divide the experts is refused, naming the layers."""
    with torch_monarch.meta_init():
        model = models.MoEForCausalLM(vocab=1024, hidden=1024, heads=8, kv_heads=8, intermediate=12288, layers=6,
                                      num_experts=16, top_k=2)
    x = torch.zeros(1, 256, dtype=torch.long)
    cluster = planner.cluster("a100-40gb", 8)
    pins = dict(dtype="bf16", tp=1, pp=1, dp=8, zero_stage=0)
    p = torch_monarch.plan(model, x, 64, cluster, **pins)
    assert p.mesh.ep > 1, p.summary()
    assert any(c.startswith(f"ep={p.mesh.ep} ") for c in p.choices), list(p.choices)
    with pytest.raises(ValueError, match="no layout fits"):
        torch_monarch.plan(model, x, 64, cluster, ep=1, **pins)
    bad = planner.loads(planner.dumps(p))
    bad.mesh.ep = 3
    with pytest.raises(ValueError, match=r"layer model.layers.0: ep=3 does not divide its 16 experts "
                                         r"\(model.layers.0.mlp.experts\)"):
        torch_monarch.check_plan(bad, model)


def test_what_the_reader_says_a_layer_keeps_is_what_autograd_keeps():
    """Each storage once (q, k and v projections read one input: three views, one tensor), and
    F.scaled_dot_product_attention as the fused kernel the device runs (on meta torch would pick
    its math fallback, which keeps the s x s scores and repeats grouped heads): q, k and v (k, v
    at the 2 key-value heads' width), the output and one fp32 log-sum-exp per head and row; the
    head keeps the loss's fp32 softmax, not the logits. bench/memory_prediction.py measures these
    against the runtime's resident memory."""
    import torch.nn.functional as F
    from torch import nn
    from torch_monarch.api import runtime_training

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads, self.num_key_value_heads, self.head_dim = 4, 2, 16
            self.q_proj, self.o_proj = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)
            self.k_proj, self.v_proj = nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q = self.q_proj(x).view(b, s, 4, 16).transpose(1, 2)
            k = self.k_proj(x).view(b, s, 2, 16).transpose(1, 2)
            v = self.v_proj(x).view(b, s, 2, 16).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return x + self.o_proj(out.transpose(1, 2).reshape(b, s, 64))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 64)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.lm_head = nn.Linear(64, 100, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.lm_head(x)

    info = read_model(Model(), torch.zeros(2, 16, dtype=torch.long))
    block = next(layer for layer in info.graph.layers if layer.name == "blocks.0")
    a = block.activations
    # Per sample, fp32: x (once, not once per projection), q, k, v, the attention output (also
    # o_proj's input: the fused kernel lays it out so that the transpose back is a view) and
    # the log-sum-exp (4 heads x 16 rows).
    assert a.attention_scores == 0
    assert a.total() == 16 * (64 + 64 + 32 + 32 + 64) * 4 + 4 * 16 * 4
    assert str(info.graph.transformer.attention).endswith("flash")
    assert not info.graph.transformer.fused_kernels and not info.graph.transformer.dropout
    head = info.graph.layers[-1].activations
    assert head.replicated == 16 * 64 * 4                        # its input
    assert head.tp_sharded == 4 * 16 * 100                       # the loss's fp32 softmax
    assert head.read_once == 4 * 16 * 100                        # the (fp32) logits, read once
    assert head.backward_transient == 2 * 4 * 16 * 100           # eager cross entropy's two fp32 gradients
    # What the runtime holds beyond that: its pipeline's sends until the step ends, and under bf16
    # mixed precision a copy of the weights per micro-batch in flight.
    t = runtime_training(info, 8, "bf16", param_dtype=torch.float32)
    assert t.pipeline_sends_kept and t.weights_cast_per_forward
    assert not runtime_training(info, 8, "fp32", param_dtype=torch.float32).weights_cast_per_forward
