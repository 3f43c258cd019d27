"""The planner's peak memory per rank beside the measured high-water mark, in fp32 and in bf16
mixed precision (fp32 master weights), for the layouts parallelize builds: plain replicas,
ZeRO-1/2/3, tensor parallelism and a pipeline, each with dp over the rest of 4 ranks.

The model: zero_memory.py's (8 blocks of two 2048 x 2048 linears with a tanh between, a
2048 x 2048 head; 285 MB of fp32 parameters), so that model state, not the process, dominates.
AdamW; 3 steps of 8 x 2048 per dp rank. Each (layout, dtype) runs in its own job under the
launcher; each rank reports VmHWM minus its VmRSS before the model was built (torch warmed up,
groups joined), worst rank. Predicted: planner.evaluate on the graph read from the model with
the TrainingConfig parallelize plans with (api.runtime_training: the runtime's own
accounting, e.g. fp32 master gradients under bf16), the same layout pinned.

Activations (the second table): a Llama-style model whose activations dwarf its weights
(make_llama: 4 blocks, hidden 256, 8 query / 4 key-value heads, SwiGLU 704, RMSNorm, rotary,
sequence 512, vocabulary 1024; 3.4 M parameters, 14 MB in fp32), in layouts that change what
a rank keeps: replicas with and without gradient accumulation, ZeRO-3, tp 2 and 4, 1F1B,
GPipe, interleaved, ZB-H1 and ZB-V pipelines, full recomputation, and materialized ("eager") attention with
and without selective recomputation; fp32 and bf16. Each layout runs the plan the prediction
is for (planner.evaluate, the same pins, laid out by parallelize(plan=...)).
  * measured activation peak, per rank: the high-water mark of resident memory during
    train_step (forward and backward of every micro-batch, the gradient reduction) minus the
    resident memory just before it (VmHWM reset to VmRSS by clear_refs), in steps 2 and 3
    (the larger): weights, gradients (zeroed, not freed: zero_grad(set_to_none=False)),
    optimizer state and the engines' buffers already exist then, so what grows is what the
    step allocates and frees: the tensors kept for backward, the backward's transient
    gradients, what pipeline stages send, and, small here (weights are 14 MB), ZeRO-3's
    gathered units and Gloo's receive buffers. In bf16 below ZeRO-3 the step also casts the
    weights (torch_monarch.mixed_precision): one bf16 copy of the rank's weights, which the
    planner counts as parameters, is subtracted (2 bytes x the rank's parameters, exact);
    the copies further micro-batches in flight keep stay in. glibc serves every allocation of
    128 KiB or more by its own mapping (MALLOC_MMAP_THRESHOLD_), so freed tensors leave at once.
  * predicted: the plan's per-rank `memory.activations`: the walk of the rank's action list
    (each stage's kept tensors per micro-batch in flight, the backward's workspace, what the
    stages send, the weight copies further micro-batches keep; docs/cost_model.md, "Memory").
    Both the layout's worst rank and every pipeline rank are compared (ratio = predicted /
    measured; the bar: within 10%).

    python3 bench/memory_prediction.py [--only totals|activations] [--out bench/results/memory_prediction.json]
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from procmem import (reset_peak, run_workers, vm, warm_up_torch, worst_peak_growth,  # noqa: E402
                     write_peak_growth, write_rank_result)
from zero_memory import BATCH, STEPS, WIDTH, make_model  # noqa: E402

RANKS = 4
# name: (pp, dp, tp, zero, micro-batches)
LAYOUTS = {
    "dp4": (1, 4, 1, 0, 1),
    "zero1 dp4": (1, 4, 1, 1, 1),
    "zero2 dp4": (1, 4, 1, 2, 1),
    "zero3 dp4": (1, 4, 1, 3, 1),
    "tp2 dp2": (1, 2, 2, 0, 1),
    "pp2 dp2 1f1b": (2, 2, 1, 0, 2),
}
DTYPES = ("fp32", "bf16")
WITHIN = 0.15  # the bar: predicted within 15% of measured


def tp_plan():
    """Each block's first linear split by columns, its second by rows (Megatron's MLP)."""
    import torch_monarch
    return {"blocks.*.a": torch_monarch.Colwise(), "blocks.*.b": torch_monarch.Rowwise()}


def predicted(layout, dtype):
    import torch
    from torch_monarch import planner
    from torch_monarch.api import model_graph, runtime_training
    pp, dp, tp, zero, m = LAYOUTS[layout]
    model = make_model()
    info, graph = model_graph(model, torch.randn(1, WIDTH), dtype=dtype, tp_plan=tp_plan() if tp > 1 else None)
    training = runtime_training(info, BATCH * dp, dtype, {"tp": tp, "pp": pp}, param_dtype=torch.float32)
    # This machine's cores shared by RANKS ranks, as cluster.detect() says (the overlap
    # contention decides the plan's zero_overlap, which the runtime then runs).
    from torch_monarch.cluster import _cores, cpu_overlap_contention
    cluster = planner.cluster("cpu", RANKS, overlap_contention=cpu_overlap_contention(RANKS, float(_cores())))
    plan = planner.evaluate(graph, cluster, training, tp=tp, pp=pp, dp=dp, zero=zero,
                            micro_batch=BATCH // m, schedule="1f1b" if pp > 1 else "none", recompute="none",
                            allow_over_memory=True)
    mem = plan.prediction.memory
    return {"total": plan.prediction.memory_bytes_per_device, "params": mem.params, "grads": mem.grads,
            "optimizer": mem.optimizer, "activations": mem.activations, "buffers": mem.buffers}


def worker(layout, dtype, out_dir):
    import torch
    import torch_monarch
    torch.set_num_threads(1)
    pp, dp, tp, zero, m = LAYOUTS[layout]
    torch_monarch.init()
    mesh = torch_monarch.device_mesh(pp=pp, dp=dp, tp=tp)
    warm_up_torch()
    baseline = vm("VmRSS")
    torch.manual_seed(0)
    # (Rebinding, as users write it: the unwrapped model's other pipeline stages are freed.)
    pm = torch_monarch.parallelize(make_model(), mesh, zero_stage=zero, micro_batches=m, tp_plan=tp_plan() if tp > 1 else None,
                                   schedule="1f1b" if pp > 1 else None,
                                   dtype=torch.bfloat16 if dtype == "bf16" else None)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(mesh.coordinate("dp"))

    def loss_fn(out, _target):
        return out.float().square().mean()

    for _ in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=g)
        opt.zero_grad(set_to_none=True)
        pm.train_step(x, torch.zeros(BATCH), loss_fn)
        opt.step()
    write_peak_growth(out_dir, baseline)


def measure(layout, dtype):
    return worst_peak_growth(__file__, RANKS, layout, dtype)


# ---- Activations ----------------------------------------------------------------------

A_LAYERS, A_HIDDEN, A_HEADS, A_KV_HEADS, A_FFN, A_SEQ, A_VOCAB = 4, 256, 8, 4, 704, 512, 1024
A_BATCH = 8       # samples per dp rank per step
A_STEPS = 3       # the first warms up (optimizer state, buckets); the others are measured
A_MMAP = 128 << 10
A_WITHIN = 0.10   # the bar for activations
# name: (pp, dp, tp, zero, micro-batches, schedule, virtual stages, recompute, attention)
ACT_LAYOUTS = {
    "dp4": (1, 4, 1, 0, 1, "none", 1, "none", "sdpa"),
    "dp4 m2": (1, 4, 1, 0, 2, "none", 1, "none", "sdpa"),
    "zero3 dp4": (1, 4, 1, 3, 1, "none", 1, "none", "sdpa"),
    "tp2 dp2": (1, 2, 2, 0, 1, "none", 1, "none", "sdpa"),
    "tp4": (1, 1, 4, 0, 1, "none", 1, "none", "sdpa"),
    "pp2 dp2 1f1b m4": (2, 2, 1, 0, 4, "1f1b", 1, "none", "sdpa"),
    "pp4 1f1b m8": (4, 1, 1, 0, 8, "1f1b", 1, "none", "sdpa"),
    "pp4 gpipe m4": (4, 1, 1, 0, 4, "gpipe", 1, "none", "sdpa"),
    "pp2 dp2 interleaved v2 m4": (2, 2, 1, 0, 4, "interleaved_1f1b", 2, "none", "sdpa"),
    "pp2 dp2 zb_h1 m4": (2, 2, 1, 0, 4, "zb_h1", 1, "none", "sdpa"),
    "pp2 dp2 zbv m4": (2, 2, 1, 0, 4, "zbv", 2, "none", "sdpa"),
    "dp4 full recompute": (1, 4, 1, 0, 1, "none", 1, "full", "sdpa"),
    "dp4 eager": (1, 4, 1, 0, 1, "none", 1, "none", "eager"),
    "dp4 eager selective": (1, 4, 1, 0, 1, "none", 1, "selective", "eager"),
}


def make_llama(attention="sdpa"):
    """Hugging Face's Llama as examples/models.py writes it (names, RMSNorm without the fp32
    upcast, rotary, SwiGLU), small; attention by F.scaled_dot_product_attention with grouped
    key-value heads (on CPU the flash kernel: keeps q, k, v, the output and the log-sum-exp)
    or materialized ("eager": keys and values repeated to every head, the softmax kept)."""
    import math
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(A_HIDDEN))

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def rotate_half(x):
        a, b = x.chunk(2, dim=-1)
        return torch.cat((-b, a), dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads, self.num_key_value_heads = A_HEADS, A_KV_HEADS
            self.head_dim = A_HIDDEN // A_HEADS
            self.q_proj = nn.Linear(A_HIDDEN, A_HIDDEN, bias=False)
            self.k_proj = nn.Linear(A_HIDDEN, A_KV_HEADS * self.head_dim, bias=False)
            self.v_proj = nn.Linear(A_HIDDEN, A_KV_HEADS * self.head_dim, bias=False)
            self.o_proj = nn.Linear(A_HIDDEN, A_HIDDEN, bias=False)
            d = self.head_dim
            freqs = torch.outer(torch.arange(A_SEQ).float(), 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)

        def forward(self, x):
            b, n, _ = x.shape
            h, kv, d = self.num_heads, self.num_key_value_heads, self.head_dim
            q = self.q_proj(x).view(b, n, h, d).transpose(1, 2)
            k = self.k_proj(x).view(b, n, kv, d).transpose(1, 2)
            v = self.v_proj(x).view(b, n, kv, d).transpose(1, 2)
            cos, sin = self.cos[:n].to(q.dtype), self.sin[:n].to(q.dtype)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if attention == "sdpa":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                k = k[:, :, None].expand(b, kv, h // kv, n, d).reshape(b, h, n, d)
                v = v[:, :, None].expand(b, kv, h // kv, n, d).reshape(b, h, n, d)
                scores = q @ k.transpose(2, 3) / math.sqrt(d)
                causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
                out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
            return self.o_proj(out.transpose(1, 2).reshape(b, n, h * d))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(A_HIDDEN, A_FFN, bias=False)
            self.up_proj = nn.Linear(A_HIDDEN, A_FFN, bias=False)
            self.down_proj = nn.Linear(A_FFN, A_HIDDEN, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.self_attn = RMSNorm(), Attention()
            self.post_attention_layernorm, self.mlp = RMSNorm(), MLP()

        def forward(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(A_VOCAB, A_HIDDEN)
            self.layers = nn.ModuleList(Block() for _ in range(A_LAYERS))
            self.norm = RMSNorm()
            self.lm_head = nn.Linear(A_HIDDEN, A_VOCAB, bias=False)

        def forward(self, tokens):
            x = self.embed_tokens(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x))

    torch.manual_seed(0)
    return Llama()


def act_plan(layout, dtype):
    """The plan for ``layout``: the model read at the layout's micro-batch (per-forward tensors
    such as the rotary tables then count once, not once per sample), the runtime's
    TrainingConfig, the layout pinned."""
    import torch
    from torch_monarch import planner
    from torch_monarch.api import model_graph, runtime_training
    from torch_monarch.cluster import _cores, cpu_overlap_contention
    pp, dp, tp, zero, m, schedule, v, recompute, attention = ACT_LAYOUTS[layout]
    micro = A_BATCH // m
    info, graph = model_graph(make_llama(attention), torch.zeros(micro, A_SEQ, dtype=torch.long), dtype=dtype)
    training = runtime_training(info, A_BATCH * dp, dtype, {"tp": tp, "pp": pp}, param_dtype=torch.float32)
    cluster = planner.cluster("cpu", RANKS, overlap_contention=cpu_overlap_contention(RANKS, float(_cores())))
    return planner.evaluate(graph, cluster, training, tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=micro,
                            schedule=schedule, virtual_stages=v, recompute=recompute, sequence_parallel=False,
                            allow_over_memory=True)


def act_predicted(layout, dtype):
    plan = act_plan(layout, dtype)
    ranks = [r.memory.activations for r in plan.prediction.ranks]
    return {"activations": max(ranks), "per_pp_rank": ranks, "total": plan.prediction.memory_bytes_per_device}


def act_worker(layout, dtype, out_dir):
    import torch
    import torch.nn.functional as F
    import torch_monarch
    from torch_monarch import planner
    from torch_monarch.tensor_parallel_modules import vocab_parallel_cross_entropy
    torch.set_num_threads(1)
    torch_monarch.init()
    plan = planner.loads(planner.dumps(act_plan(layout, dtype)))
    warm_up_torch()
    baseline = vm("VmRSS")
    pm = torch_monarch.parallelize(make_llama(ACT_LAYOUTS[layout][-1]), plan=plan)
    mesh = pm.mesh
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(mesh.coordinate("dp"))
    tp = mesh.axis_size("tp")

    def loss_fn(logits, targets):
        if tp > 1:  # the head's output is split along the vocabulary
            return vocab_parallel_cross_entropy(logits, targets, mesh)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    # Below ZeRO-3 a bf16 step computes with bf16 copies of this rank's weights, made in the
    # step (torch_monarch.mixed_precision): one copy is what the planner counts as parameters
    # (param_bytes 2), not activations; the copies each further micro-batch in flight keeps are.
    zero = ACT_LAYOUTS[layout][3]
    weight_copy = 2 * sum(p.numel() for p in pm.parameters()) if dtype == "bf16" and zero < 3 else 0
    steps, whole = [], 0
    for _ in range(A_STEPS):
        tokens = torch.randint(A_VOCAB, (A_BATCH, A_SEQ + 1), generator=g)
        opt.zero_grad(set_to_none=False)
        whole = max(whole, vm("VmHWM") - baseline)
        before = vm("VmRSS")
        reset_peak()
        pm.train_step(tokens[:, :-1], tokens[:, 1:], loss_fn)
        steps.append(vm("VmHWM") - before)
        opt.step()
    whole = max(whole, vm("VmHWM") - baseline)
    write_rank_result(out_dir, {"pp": mesh.coordinate("pp"), "steps": steps, "peak_growth": whole,
                                "weight_copy": weight_copy})


def act_measure(layout, dtype):
    """Per pipeline rank, the largest activation peak of its dp x tp ranks (steps 2 and 3)."""
    pp = ACT_LAYOUTS[layout][0]
    ranks = run_workers(__file__, RANKS, "activations", layout, dtype, mmap_threshold=A_MMAP)
    per_pp = [max(max(r["steps"][1:]) - r["weight_copy"] for r in ranks if r["pp"] == s) for s in range(pp)]
    return {"activations": max(per_pp), "per_pp_rank": per_pp, "peak_growth": max(r["peak_growth"] for r in ranks),
            "steps": [r["steps"] for r in ranks], "weight_copy": [r["weight_copy"] for r in ranks]}


def main_activations(layouts):
    rows = []
    print(f"\nActivations: {RANKS} ranks, Llama-style {A_LAYERS} blocks h {A_HIDDEN} s {A_SEQ}, {A_BATCH} samples "
          "per dp rank; MiB per rank (worst rank; per pipeline rank after '|')")
    print(f"{'layout':<27} {'dtype':<5} {'measured':>9} {'predicted':>10} {'pred/meas':>10}")
    for layout in layouts:
        for dtype in DTYPES:
            got = act_measure(layout, dtype)
            want = act_predicted(layout, dtype)
            ratio = want["activations"] / got["activations"]
            per = [w / g for w, g in zip(want["per_pp_rank"], got["per_pp_rank"])]
            rows.append(dict(layout=layout, dtype=dtype, measured=got, predicted=want, ratio=ratio,
                             per_pp_rank_ratio=per))
            detail = "" if len(per) == 1 else "  | " + " ".join(
                f"{g / 2**20:.0f}/{w / 2**20:.0f}" for g, w in zip(got["per_pp_rank"], want["per_pp_rank"]))
            print(f"{layout:<27} {dtype:<5} {got['activations'] / 2**20:>9.1f} {want['activations'] / 2**20:>10.1f} "
                  f"{ratio:>10.3f}{detail}", flush=True)
    inside = sum(abs(r["ratio"] - 1) <= A_WITHIN for r in rows)
    print(f"activations within {A_WITHIN:.0%} of measured: {inside} of {len(rows)}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--act-layouts", nargs="+", default=list(ACT_LAYOUTS))
    parser.add_argument("--only", choices=("totals", "activations"))
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    if args.only != "activations":
        rows = main_totals(args.layouts)
    act_rows = main_activations(args.act_layouts) if args.only != "totals" else []
    if args.out:
        import time
        with open(args.out, "w") as f:
            json.dump(dict(ranks=RANKS, batch=BATCH, width=WIDTH, steps=STEPS, within=WITHIN, rows=rows,
                           activations=dict(layers=A_LAYERS, hidden=A_HIDDEN, heads=A_HEADS, kv_heads=A_KV_HEADS,
                                            ffn=A_FFN, seq=A_SEQ, vocab=A_VOCAB, batch=A_BATCH, steps=A_STEPS,
                                            mmap_threshold=A_MMAP, within=A_WITHIN, rows=act_rows),
                           when=time.strftime("%Y-%m-%d %H:%M"), load_average=os.getloadavg()), f, indent=2)


def main_totals(layouts):
    rows = []
    print(f"{RANKS} ranks, AdamW, {BATCH} x {WIDTH} per dp rank, {STEPS} steps; MiB per rank (worst rank)")
    print(f"{'layout':<14} {'dtype':<5} {'measured':>9} {'predicted':>10} {'pred/meas':>10}  "
          "predicted: params / grads / optimizer / activations / buffers")
    for layout in layouts:
        for dtype in DTYPES:
            got = measure(layout, dtype)
            want = predicted(layout, dtype)
            ratio = want["total"] / got
            rows.append(dict(layout=layout, dtype=dtype, measured=got, predicted=want, ratio=ratio))
            parts = " / ".join(f"{want[k] / 2**20:.0f}" for k in ("params", "grads", "optimizer", "activations",
                                                                  "buffers"))
            print(f"{layout:<14} {dtype:<5} {got / 2**20:>9.0f} {want['total'] / 2**20:>10.0f} {ratio:>10.2f}  {parts}",
                  flush=True)
    inside = sum(abs(r["ratio"] - 1) <= WITHIN for r in rows)
    print(f"within {WITHIN:.0%} of measured: {inside} of {len(rows)}")
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker" and sys.argv[2] == "activations":
        act_worker(sys.argv[3], sys.argv[4], sys.argv[5])
    elif len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
