"""Worker ranks for test_context_parallel.py (started by dist_harness on 4 ranks), and the
models, batches and one-process reference the test compares them with.

One launch runs every scenario one after another, each on its own mesh (the ranks build a
mesh per scenario): the ring attention itself (cp=4: values and gradients against plain
attention, bytes sent against the formula, bad inputs), then training parity runs of a
Llama-style model (rotary, grouped-query heads) on cp=4, dp=2 x cp=2 and cp=2 x tp=2 and of
a GPT-2-style model (learned positions, tied head) on dp=2 x cp=2. Each rank saves one dict.
"""

import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))

import models  # noqa: E402
from dist_harness import error_of  # noqa: E402

STEPS = 6
BATCH, SEQ = 4, 16   # SEQ divides by 2*cp for cp = 2 and 4
VOCAB = 64

TRAIN_LAYOUTS = {
    # name: (model, dp, cp, tp)
    "llama_cp4": ("llama", 1, 4, 1),
    "llama_dp2_cp2": ("llama", 2, 2, 1),
    "llama_cp2_tp2": ("llama", 1, 2, 2),
    "gpt2_dp2_cp2": ("gpt2", 2, 2, 1),
}


def make_model(kind):
    torch.manual_seed(0)
    if kind == "llama":  # 4 query heads sharing 2 key/value heads
        return models.LlamaForCausalLM(vocab=VOCAB, hidden=32, heads=4, kv_heads=2, intermediate=64, layers=2)
    return models.GPT2LMHeadModel(vocab=VOCAB, hidden=32, heads=4, layers=2, max_positions=SEQ)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step % 2)  # two batches in turn: the model can fit them
    data = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train_reference(kind):
    """One process, whole batch, whole sequence: losses, step-0 gradients, final parameters."""
    model = make_model(kind)
    opt = make_optimizer(model)
    losses, grads = [], None
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_attention(q, k, v, causal):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = q.shape[2]
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


# ---------------------------------------------------------------------------------------
# Worker side



def ring_checks(world):
    """cp=4 over the 4 ranks: ring attention against plain attention (fp64: the difference is
    the summation order only), bf16, gather_sequence, bytes sent, and bad inputs."""
    import torch_monarch
    from torch_monarch import _runtime
    from torch_monarch.context_parallel import gather_sequence, ring_attention, shard_sequence
    mesh = torch_monarch.device_mesh(cp=world.size)
    group = mesh.group("cp")
    out = {"cp": group.size, "cp_rank": group.rank}
    for causal, rows in ((True, 0), (False, 0), (True, 5)):  # 5: blocks cut into tiles of 5 query rows
        torch.manual_seed(7)  # the same whole tensors on every rank
        q = torch.randn(2, 4, 32, 8, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 2, 32, 8, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 2, 32, 6, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(2, 4, 32, 6, dtype=torch.float64)
        want = reference_attention(q, k, v, causal)
        want.backward(dout)
        mine = [shard_sequence(t.detach(), mesh, dim=2).requires_grad_() for t in (q, k, v)]
        got = ring_attention(*mine, mesh, causal=causal, block_rows=rows)
        got.backward(shard_sequence(dout, mesh, dim=2))
        whole = gather_sequence(got.detach(), mesh, dim=2)

        def rel(a, b):
            return ((a - b).abs().max() / b.abs().max()).item()
        out[f"causal={causal},rows={rows}"] = {
            "out": rel(got, shard_sequence(want.detach(), mesh, dim=2)),
            "gathered": rel(whole, want.detach()),
            "dq": rel(mine[0].grad, shard_sequence(q.grad, mesh, dim=2)),
            "dk": rel(mine[1].grad, shard_sequence(k.grad, mesh, dim=2)),
            "dv": rel(mine[2].grad, shard_sequence(v.grad, mesh, dim=2)),
        }
    # bf16 in, float32 accumulation: against float32 plain attention on the same bf16 values.
    torch.manual_seed(8)
    qb, kb, vb = (torch.randn(1, 4, 64, 16).to(torch.bfloat16) for _ in range(3))
    want = reference_attention(qb.float(), kb.float(), vb.float(), True)
    got = ring_attention(*(shard_sequence(t, mesh, dim=2) for t in (qb, kb, vb)), mesh)
    out["bf16"] = {"dtype": str(got.dtype),
                   "rel": ((got.float() - shard_sequence(want, mesh, dim=2)).abs().max() / want.abs().max()).item()}
    # Bytes this rank sends on the cp group for one forward and one backward (float32).
    b, heads, kv_heads, local, d = 2, 8, 4, 64, 16
    q, k, v = (torch.randn(b, h, local, d, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    group.reset_counters()
    y = ring_attention(q, k, v, mesh)
    forward_sent = group.bytes_sent(_runtime.CollectiveKind.send)
    y.sum().backward()
    out["bytes"] = {"forward": forward_sent, "backward": group.bytes_sent(_runtime.CollectiveKind.send) - forward_sent,
                    "predicted": _runtime.cp_ring_attention_bytes(b, local, kv_heads, d, d, group.size, "float32")}
    # Bad inputs: each is one error on every rank, and the group stays usable.
    z = torch.zeros
    out["errors"] = {
        "indivisible": error_of(lambda: shard_sequence(z(2, 12, 4), mesh)),
        "shapes": error_of(lambda: ring_attention(z(1, 4, 8, 8), z(1, 2, 6, 8), z(1, 2, 6, 8), mesh)),
        "heads": error_of(lambda: ring_attention(z(1, 4, 8, 8), z(1, 3, 8, 8), z(1, 3, 8, 8), mesh)),
        "odd": error_of(lambda: ring_attention(z(1, 4, 7, 8), z(1, 2, 7, 8), z(1, 2, 7, 8), mesh)),
        # rank 0 holds a longer chunk than the others: caught before any key or value moves
        "ranks_differ": error_of(lambda: ring_attention(*(z(1, 2, 8 if group.rank == 0 else 4, 8) for _ in range(3)),
                                                        mesh)),
    }
    from torch import nn
    from torch_monarch.context_parallel import context_parallel
    out["errors"]["no_attention"] = error_of(lambda: context_parallel(nn.Sequential(nn.Linear(4, 4)), mesh))
    out["errors"]["multihead"] = error_of(lambda: context_parallel(
        nn.ModuleDict({"mha": nn.MultiheadAttention(8, 2), "llama": models.LlamaAttention(8, 2, 1)}), mesh))
    gpt2 = context_parallel(make_model("gpt2"), mesh)
    out["errors"]["positions"] = error_of(lambda: gpt2.transformer.wpe(torch.tensor([3, 4])))
    out["errors"]["twice"] = error_of(lambda: context_parallel(gpt2, mesh))
    again = ring_attention(*(torch.ones(1, 2, 4, 8) for _ in range(3)), mesh)
    out["usable_after_errors"] = bool(torch.allclose(again, torch.ones_like(again)))
    return out


def train(world, name):
    import torch_monarch
    from torch_monarch.context_parallel import (context_parallel, converted_modules, global_mean,
                                                shard_sequence)
    from torch_monarch.tensor_parallel_modules import (ColumnParallelLinear, RowParallelLinear,
                                                       VocabParallelEmbedding, tensor_parallel,
                                                       vocab_parallel_cross_entropy)
    kind, dp, cp, tp = TRAIN_LAYOUTS[name]
    mesh = torch_monarch.device_mesh(dp=dp, cp=cp, tp=tp)
    model = make_model(kind)
    if tp > 1:
        tensor_parallel(model, mesh)
    context_parallel(model, mesh)
    wrapped = torch_monarch.DataParallel(model, mesh)
    opt = make_optimizer(model)
    rows = BATCH // dp
    first = mesh.coordinate("dp") * rows
    losses, grads = [], None
    for step in range(STEPS):
        tokens, targets = batch(step)
        x = shard_sequence(tokens[first:first + rows], mesh)
        y = shard_sequence(targets[first:first + rows], mesh)
        logits = wrapped(x)
        if tp > 1:
            loss = vocab_parallel_cross_entropy(logits, y, mesh)
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        losses.append(global_mean(loss, mesh))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    # How each tensor-parallel parameter is split (dim), to compare with the reference's slice.
    specs = {}
    for mname, m in model.named_modules():
        dim = (0 if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding))
               else 1 if isinstance(m, RowParallelLinear) else None)
        for pname, _ in m.named_parameters(recurse=False):
            specs[f"{mname}.{pname}" if mname else pname] = dim
    return {"losses": losses, "grads": grads, "state": {n: p.detach().clone() for n, p in model.named_parameters()},
            "specs": specs, "tp": tp, "tp_rank": mesh.coordinate("tp"), "converted": converted_modules(model),
            "local_tokens": int(x.numel())}


def main():
    import torch_monarch
    world = torch_monarch.init()
    result = {"ring": ring_checks(world)}
    for name in TRAIN_LAYOUTS:
        result[name] = train(world, name)
    torch.save(result, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{os.environ['RANK']}.pt"))
    return 0


if __name__ == "__main__":
    from dist_harness import run_worker
    run_worker(main)
