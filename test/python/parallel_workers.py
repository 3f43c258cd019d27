"""Worker ranks for the tensor / pipeline / hybrid parity tests (started by dist_harness).

argv[1] is a layout: comma-separated key=value with pp, dp, tp, schedule, m (micro-batches
per dp rank), v (virtual stages), sp (sequence parallel 0/1), zero (0 = DDP-style, 1-3),
layers (blocks of the tiny GPT). Each rank saves its losses, its step-0 gradients, its
final parameters (whole along dp, split along tp as their spec says) and its executed trace.
"""

import os
import sys

import torch

import torch_monarch
from dist_harness import error_of, run_worker

from torch_monarch.tensor_parallel_modules import vocab_parallel_cross_entropy
from tiny_gpt import GLOBAL_BATCH, STEPS, batch, loss_fn, make_model, make_optimizer


def parse(layout):
    cfg = {"pp": 1, "dp": 1, "tp": 1, "schedule": "1f1b", "m": 1, "v": 1, "sp": 0, "zero": 0, "layers": 2,
           "direct": 0, "perturb": 0, "uneven": 0}
    for item in layout.split(","):
        key, value = item.split("=")
        cfg[key] = value if key == "schedule" else int(value)
    return cfg


def save(result):
    torch.save(result, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{os.environ['RANK']}.pt"))




def bad_schedule(world):
    """An action list with a receive removed on one rank, then ranks holding different
    schedules: both must be refused on every rank before anything runs."""
    from torch_monarch import planner
    mesh = torch_monarch.device_mesh(pp=world.size)
    broken = planner.make_schedule(planner.ScheduleKind.one_f_one_b, world.size, 4, 1)
    programs = broken.per_rank
    programs[1] = [a for a in programs[1] if not (a.type == planner.ActionType.recv_activation and a.micro_batch == 2)]
    broken.per_rank = programs
    errors = {"broken": error_of(lambda: torch_monarch._runtime.PipelineExecutor(broken, mesh))}
    kind = planner.ScheduleKind.gpipe if world.rank == 1 else planner.ScheduleKind.one_f_one_b
    mine = planner.make_schedule(kind, world.size, 4, 1)
    errors["different"] = error_of(lambda: torch_monarch._runtime.PipelineExecutor(mine, mesh))
    save(errors)


def bad_tensor_parallel(world):
    """tp=3 against a model whose heads (4), vocabulary (64) or hidden width do not divide."""
    from torch import nn
    from torch_monarch.tensor_parallel_modules import Colwise, tensor_parallel
    mesh = torch_monarch.device_mesh(tp=world.size)
    errors = {
        "heads": error_of(lambda: tensor_parallel(make_model(), mesh)),
        "vocab": error_of(lambda: tensor_parallel(nn.ModuleDict({"wte": nn.Embedding(64, 12)}), mesh)),
        "hidden": error_of(lambda: tensor_parallel(nn.ModuleDict({"fc1": nn.Linear(12, 10)}), mesh,
                                                   plan={"fc1": Colwise()})),
    }
    save(errors)


def predict(world):
    """Forward-only through a 2-stage pipeline: the last stage's logits equal the model's."""
    mesh = torch_monarch.device_mesh(pp=world.size)
    pm = torch_monarch.parallelize(make_model(layers=4), mesh, schedule="1f1b", micro_batches=4)
    inputs, _ = batch(0, GLOBAL_BATCH)
    out = pm.predict(inputs)
    want = make_model(layers=4)(inputs)
    save({"diff": None if out is None else (out - want).abs().max().item(),
          "trace": pm.last_stats["trace"], "is_last": mesh.coordinate("pp") == world.size - 1})


def zbv_predict_and_meta(world):
    """ZB-V on 2 ranks: forward-only through the V (its turn on rank 1 hands the activations
    over inside the rank; the logits come out of stage 3, on rank 0), and a model on meta whose
    weights are tied between the first and the last stage refused on every rank."""
    mesh = torch_monarch.device_mesh(pp=world.size)
    pm = torch_monarch.parallelize(make_model(layers=4), mesh, schedule="zbv", micro_batches=2)
    inputs, _ = batch(0, GLOBAL_BATCH)
    out = pm.predict(inputs)
    want = make_model(layers=4)(inputs)
    with torch.device("meta"):
        meta = make_model(layers=4)
    try:
        torch_monarch.parallelize(meta, mesh, schedule="zbv", micro_batches=2)
        refused = None
    except ValueError as e:
        refused = str(e)
    save({"diff": None if out is None else (out - want).abs().max().item(), "local_stages": pm.local_stages,
          "trace": pm.last_stats["trace"], "refused": refused})


def vocab_loss(world):
    """The vocabulary-parallel loss of a head alone, with every tensor any operation
    produces (forward and backward) watched for a full-vocabulary dimension."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch_monarch.tensor_parallel_modules import VocabHead, tensor_parallel, vocab_parallel_cross_entropy
    from torch import nn
    vocab, hidden, tokens = 96, 8, 24
    mesh = torch_monarch.device_mesh(tp=world.size)
    torch.manual_seed(5)
    head = nn.ModuleDict({"head": nn.Linear(hidden, vocab, bias=False)})
    x = torch.randn(tokens, hidden, requires_grad=True)
    targets = torch.randint(vocab, (tokens,))
    targets[3] = -100  # ignored
    tensor_parallel(head, mesh, plan={"head": VocabHead()})

    widths = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    widths.append(max(t.shape, default=0))
            return out

    with Watch():
        loss = vocab_parallel_cross_entropy(head["head"](x), targets, mesh)
        loss.backward()
    # padding_idx: its row gets no gradient (token 5 lives on tp rank 0).
    from torch_monarch.tensor_parallel_modules import VocabEmbedding
    emb = nn.ModuleDict({"wte": nn.Embedding(vocab, hidden, padding_idx=5)})
    tensor_parallel(emb, mesh, plan={"wte": VocabEmbedding()})
    emb["wte"](torch.tensor([[5, 6, 60, 5]])).sum().backward()
    save({"loss": loss.item(), "x_grad": x.grad, "weight_grad": head["head"].weight.grad,
          "widest": max(widths), "ops": len(widths), "tp_rank": mesh.coordinate("tp"),
          "emb_grad": emb["wte"].weight.grad})


def from_plan(world):
    """The layout comes from the planner: a pinned plan for the tiny GPT (pp=2, tp=2, 1F1B,
    4 micro-batches, sequence parallel), through JSON and back, then parallelize(plan=...)."""
    from torch_monarch import planner
    from tiny_gpt import HEADS, HIDDEN, SEQ, VOCAB
    graph = planner.transformer(layers=4, hidden=HIDDEN, heads=HEADS, seq=SEQ, vocab=VOCAB,
                                tied_embeddings=True, dtype="fp32", name="tiny-gpt")
    plan = planner.evaluate(graph, planner.cluster("cpu", world.size), planner.training(GLOBAL_BATCH, compute_dtype="fp32"),
                            tp=2, pp=2, dp=1, zero=0, micro_batch=2, schedule="1f1b", recompute="none",
                            sequence_parallel=True, allow_over_memory=True)
    plan = planner.loads(planner.dumps(plan))
    wrong = error_of(lambda: torch_monarch.parallelize(make_model(layers=2), plan=plan))
    model = make_model(layers=4)
    pm = torch_monarch.parallelize(model, plan=plan)
    mesh = pm.mesh
    opt = make_optimizer(pm.named_parameters())
    losses = []
    for step in range(STEPS):
        inputs, targets = batch(step, GLOBAL_BATCH)
        opt.zero_grad()
        losses.append(pm.train_step(inputs, targets, lambda lg, y: vocab_parallel_cross_entropy(lg, y, mesh)))
        opt.step()
    save({"losses": losses, "state": pm.local_state_dict(), "specs": {n: pm.tp_spec(n) for n in pm.local_state_dict()},
          "tp_rank": mesh.coordinate("tp"), "tp": mesh.axis_size("tp"), "micro_batches": pm.micro_batches,
          "summary": plan.summary(), "wrong_model": wrong, "sequence_parallel": plan.sequence_parallel})


def tp_dropout(world):
    """Dropout masks under tp: attention-probability dropouts (and, under sequence
    parallelism, every dropout in the blocks) differ across tp ranks; the others match."""
    from torch import nn
    from torch_monarch.tensor_parallel_modules import Colwise, seed_tensor_parallel_rng, tensor_parallel
    mesh = torch_monarch.device_mesh(tp=world.size)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = 2
            self.qkv = nn.Linear(8, 24)
            self.attn_dropout = nn.Dropout(0.5)
            self.resid_dropout = nn.Dropout(0.5)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb_dropout = nn.Dropout(0.5)
            self.blocks = nn.ModuleList([Attention()])

    out = {}
    for sp in (False, True):
        rng = seed_tensor_parallel_rng(mesh, 1234)
        m = tensor_parallel(Model(), mesh, plan={"blocks.0.qkv": Colwise(fused_parts=3)}, sequence_parallel=sp,
                            rng=rng)
        m.train()
        ones = torch.ones(256)
        out[sp] = {"attn": m.blocks[0].attn_dropout(ones), "resid": m.blocks[0].resid_dropout(ones),
                   "emb": m.emb_dropout(ones), "after": torch.rand(8), "forked": m._monarch_forked_dropouts}
    save(out)


def main(layout):
    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=float(os.environ.get("MONARCH_TIMEOUT_S", "120")))
    special = {"bad_schedule": bad_schedule, "bad_tensor_parallel": bad_tensor_parallel, "predict": predict,
               "vocab_loss": vocab_loss, "from_plan": from_plan, "zbv_predict_and_meta": zbv_predict_and_meta,
               "tp_dropout": tp_dropout}
    if layout in special:
        special[layout](world)
        return 0
    cfg = parse(layout)
    mesh = torch_monarch.device_mesh(pp=cfg["pp"], dp=cfg["dp"], tp=cfg["tp"])
    model = make_model(layers=cfg["layers"])
    if cfg["perturb"]:
        # Copies that parallelize must make equal start different: everything tp does not
        # split on tp ranks > 0, and the output head's tied copy on later pipeline ranks.
        with torch.no_grad():
            if mesh.coordinate("tp") > 0:
                for name, p in model.named_parameters():
                    if "ln" in name or "wpe" in name or name.endswith("proj.bias") or name.endswith("fc2.bias"):
                        p.add_(0.5)
            if mesh.coordinate("pp") > 0 and cfg["tp"] == 1:
                model.wte.weight.add_(0.5)
    pm = torch_monarch.parallelize(model, mesh, schedule=cfg["schedule"] if cfg["pp"] > 1 else None,
                     micro_batches=cfg["m"], virtual_stages=cfg["v"], sequence_parallel=bool(cfg["sp"]),
                     zero_stage=cfg["zero"])
    opt = make_optimizer(pm.named_parameters())
    tp = mesh.axis_size("tp")

    def loss(logits, targets):
        if tp == 1:
            return loss_fn(logits, targets)
        return vocab_parallel_cross_entropy(logits, targets, mesh)

    dp_rank, dp = mesh.coordinate("dp"), mesh.axis_size("dp")
    # uneven=1 (dp=2): a global batch of 10 held as 4 + 6, like an epoch's last batch.
    sizes = [4, 6] if cfg["uneven"] else [GLOBAL_BATCH // dp] * dp
    begin, local = sum(sizes[:dp_rank]), sizes[dp_rank]
    losses, grads, widest = [], {}, 0
    for step in range(STEPS):
        inputs, targets = batch(step, sum(sizes))
        x, y = inputs[begin:begin + local], targets[begin:begin + local]
        opt.zero_grad()
        if cfg["direct"]:
            # Without a pipeline the wrapped model is an ordinary module.
            step_loss = loss(pm(x), y)
            step_loss.backward()
            t = torch.tensor([step_loss.item()], dtype=torch.float64)
            mesh.group("dp").all_reduce(t, average=True).wait()
            losses.append(t.item())
        else:
            losses.append(pm.train_step(x, y, loss))
        if step == 0 and cfg["zero"] == 0:
            grads = {n: p.grad.detach().clone() for n, p, _ in pm.named_local_parameters() if p.grad is not None}
        opt.step()
    full = pm.state_dict()  # the whole model, like the unwrapped model's
    fresh = make_model(seed=99, layers=cfg["layers"])
    fresh.load_state_dict(full)  # strict: every name, every shape of the unwrapped model
    # Round trip: load a different whole model, then the trained one back.
    before = {k: v.clone() for k, v in pm.local_state_dict().items()}
    pm.load_state_dict(make_model(seed=99, layers=cfg["layers"]).state_dict())
    changed = any(not torch.equal(before[k], v) for k, v in pm.local_state_dict().items())
    pm.load_state_dict(full)
    reload_diff = max((before[k] - v).abs().max().item() for k, v in pm.local_state_dict().items())
    assert changed, "loading another model changed nothing"
    trace = pm.last_stats["trace"] if pm.last_stats else []
    program = pm.executor.program() if pm.executor else []
    result = {
        "losses": losses, "grads": grads, "state": pm.local_state_dict(),
        "specs": {n: pm.tp_spec(n) for n in pm.local_state_dict()},
        "tp_rank": mesh.coordinate("tp"), "tp": tp, "pp_rank": mesh.coordinate("pp"),
        "trace": trace, "program": program, "local_stages": pm.local_stages,
        "full": full if int(os.environ["RANK"]) == 0 else None, "reload_diff": reload_diff,
    }
    save(result)
    return 0


if __name__ == "__main__":
    run_worker(main, sys.argv[1])
