"""Workers for test_parallelize.py: a model from examples/models.py laid out by
torch_monarch.parallelize (planned on this machine, or with pins), trained for a few steps
through train_step; losses and the reassembled state dict go to MONARCH_TEST_OUTPUT.

    python3 -m torch_monarch.run --nproc-per-node 2 auto_workers.py gpt2:tp=2
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))

import models  # noqa: E402
import torch_monarch  # noqa: E402

STEPS = 4
GLOBAL_BATCH = 8
SEQ = 8
LR = 1e-2
# Adam divides by sqrt(v) + eps: with the default 1e-8 a gradient that is exactly zero in
# theory (a key bias: softmax ignores it) but rounding noise in practice takes lr-sized
# steps whose sign depends on summation order. eps=1e-3 keeps such noise from moving weights;
# real gradients here are far larger, so training is unchanged.
EPS = 1e-3
BIG = 4096


def build(name):
    """(model, example input, batch(step) -> (inputs, targets), is_language_model)."""
    torch.manual_seed(1234)
    if name == "gpt2":
        m = models.GPT2LMHeadModel(vocab=64, hidden=32, heads=4, layers=4, max_positions=SEQ)
        return m, _tokens(0, 64), lambda step: _lm_batch(0, 64), True  # one batch: the loss falls
    if name == "llama":
        m = models.LlamaForCausalLM(vocab=64, hidden=32, heads=4, kv_heads=2, intermediate=48, layers=4)
        return m, _tokens(0, 64), lambda step: _lm_batch(0, 64), True  # one batch: the loss falls
    if name == "bert":
        m = models.BertForSequenceClassification(vocab=64, hidden=32, heads=4, intermediate=64, layers=2,
                                                 max_positions=SEQ, num_labels=3)
        return m, _tokens(0, 64), lambda step: (_tokens(0, 64), _labels(0, 3)), False
    if name == "mlp":
        m = models.MLP(inputs=16, hidden=32, outputs=5, depth=4)
        return m, torch.randn(GLOBAL_BATCH, 16), lambda step: _learnable(torch.randn(
            GLOBAL_BATCH, 16, generator=_gen(0)), 5), False  # one batch: the loss visibly falls
    if name == "resnet18":
        m = models.resnet18(num_classes=4, batch_stats=False)
        return m, torch.randn(GLOBAL_BATCH, 3, 16, 16), lambda step: _learnable(torch.randn(
            GLOBAL_BATCH, 3, 16, 16, generator=_gen(0)), 4), False
    if name == "big":
        # Deferred initialization: built on meta, 8 blocks of 4096 x 4096 (512 MiB in fp32).
        with torch_monarch.meta_init():
            m = models.MLP(inputs=BIG, hidden=BIG, outputs=8, depth=8)
        return m, torch.randn(GLOBAL_BATCH, BIG), lambda step: _learnable(torch.randn(
            GLOBAL_BATCH, BIG, generator=_gen(0)), 8), False
    raise ValueError(f"unknown model {name}")


def _vm(field):
    """A /proc/self/status memory field in bytes (VmData: allocated; VmHWM: peak resident)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _learnable(x, classes):
    """(x, labels) with labels a fixed function of x, so a few steps visibly reduce the loss."""
    projection = torch.randn(x[0].numel(), classes, generator=torch.Generator().manual_seed(7))
    return x, (x.flatten(1) @ projection).argmax(1)


def _gen(step):
    return torch.Generator().manual_seed(100 + step)


def _tokens(step, vocab):
    return torch.randint(vocab, (GLOBAL_BATCH, SEQ), generator=_gen(step))


def _labels(step, n):
    return torch.randint(n, (GLOBAL_BATCH,), generator=_gen(1000 + step))


def _lm_batch(step, vocab):
    t = torch.randint(vocab, (GLOBAL_BATCH, SEQ + 1), generator=_gen(step))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def lr_of(name):
    return 1e-3 if name == "resnet18" else LR


def loss_fn_for(model, lm):
    if lm and getattr(model, "tp", 1) > 1:
        return lambda logits, y: torch_monarch.vocab_parallel_cross_entropy(logits, y, model.mesh)
    if lm:
        return lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())
    return lambda logits, y: F.cross_entropy(logits, y)


def make_optimizer(name, named_parameters):
    """AdamW with parameter groups by name and shape, as training scripts make them: the
    embeddings (any name with "emb", "wte", "wpe") at half the learning rate and no weight
    decay, no weight decay on 1-D tensors (biases, norms), 0.05 on the rest. Parity with
    these groups shows each parameter (ZeRO shards and tp shards too) lands in the same group
    under parallelize as in the plain model."""
    decay, flat, embeddings = [], [], []
    for n, p in named_parameters:
        (embeddings if any(k in n for k in ("emb", "wte", "wpe")) else flat if p.dim() < 2 else decay).append(p)
    lr = lr_of(name)
    groups = [{"params": decay, "weight_decay": 0.05}, {"params": flat, "weight_decay": 0.0},
              {"params": embeddings, "lr": lr / 2, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, eps=EPS)


def train_reference(name):
    model, _, batch, lm = build(name)
    opt = make_optimizer(name, model.named_parameters())
    loss_fn = loss_fn_for(model, lm)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(name, pins):
    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=120)
    model, example, batch, lm = build(name)
    pins = dict(kv.split("=") for kv in pins.split(",") if kv) if pins else {}
    typed = {k: (v if k in ("schedule", "recompute") else bool(int(v)) if k == "sequence_parallel" else int(v))
             for k, v in pins.items()}
    limit = None
    if name == "big":
        # What this rank may allocate while the model is laid out: 60% of the whole model
        # above what the process holds now (RLIMIT_DATA counts malloc'd and mmap'd memory).
        import resource
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        before = _vm("VmData")
        limit = before + int(float(os.environ.get("MONARCH_TEST_LIMIT", "0.6")) * model_bytes)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))
        hwm_before = _vm("VmHWM")
    pm = torch_monarch.parallelize(model, example_input=example, global_batch=GLOBAL_BATCH, **typed)
    if limit is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        memory = {"model_bytes": model_bytes, "limit_over_baseline": limit - before,
                  "peak_growth": _vm("VmHWM") - hwm_before,
                  "held": sum(p.numel() * p.element_size() for p in pm.parameters())}
    opt = make_optimizer(name, pm.named_parameters())
    loss_fn = loss_fn_for(pm, lm)
    dp, dp_rank = pm.dp, pm.mesh.coordinate("dp")
    local = GLOBAL_BATCH // dp
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[dp_rank * local:(dp_rank + 1) * local], y[dp_rank * local:(dp_rank + 1) * local]
        opt.zero_grad()
        losses.append(pm.train_step(x, y, loss_fn))
        opt.step()
    state = pm.state_dict() if name != "big" else None
    out = os.environ["MONARCH_TEST_OUTPUT"]
    if world.rank == 0:
        with open(os.path.join(out, "plan.json"), "w") as f:
            f.write(pm.plan.to_json())
    if name == "big":
        torch.save({"losses": losses, "memory": memory, "mesh": (pm.pp, pm.dp, pm.tp), "zero": pm.zero_stage},
                   os.path.join(out, f"rank{world.rank}.pt"))
        return 0
    from torch_monarch.sharded import _default_units
    from torch_monarch import selective
    recomputed = [getattr(u, "_monarch_recompute", None) or "none" for u in _default_units(model)]
    torch.save({"losses": losses, "state": state if world.rank == 0 else None,
                "mesh": (pm.pp, pm.dp, pm.tp), "zero": pm.zero_stage, "recomputed": recomputed,
                "selective": dict(selective.STATS)},
               os.path.join(out, f"rank{world.rank}.pt"))
    return 0


if __name__ == "__main__":
    name, _, pins = sys.argv[1].partition(":")  # "gpt2" or "gpt2:tp=2,schedule=1f1b"
    sys.exit(main(name, pins))
