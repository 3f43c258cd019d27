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
from torch_monarch.parallelize import parallelize
from torch_monarch.tensor_parallel import vocab_parallel_cross_entropy
from tiny_gpt import GLOBAL_BATCH, STEPS, batch, loss_fn, make_model, make_optimizer


def parse(layout):
    cfg = {"pp": 1, "dp": 1, "tp": 1, "schedule": "1f1b", "m": 1, "v": 1, "sp": 0, "zero": 0, "layers": 2}
    for item in layout.split(","):
        key, value = item.split("=")
        cfg[key] = value if key == "schedule" else int(value)
    return cfg


def main(layout):
    torch.set_num_threads(1)
    cfg = parse(layout)
    torch_monarch.init(timeout=float(os.environ.get("MONARCH_TIMEOUT_S", "120")))
    mesh = torch_monarch.device_mesh(pp=cfg["pp"], dp=cfg["dp"], tp=cfg["tp"])
    model = make_model(layers=cfg["layers"])
    pm = parallelize(model, mesh, schedule=cfg["schedule"] if cfg["pp"] > 1 else None,
                     micro_batches=cfg["m"], virtual_stages=cfg["v"], sequence_parallel=bool(cfg["sp"]),
                     zero_stage=cfg["zero"])
    opt = make_optimizer(pm.parameters())
    tp = mesh.axis_size("tp")

    def loss(logits, targets):
        if tp == 1:
            return loss_fn(logits, targets)
        return vocab_parallel_cross_entropy(logits, targets, mesh)

    dp_rank, dp = mesh.coordinate("dp"), mesh.axis_size("dp")
    local = GLOBAL_BATCH // dp
    losses, grads, widest = [], {}, 0
    for step in range(STEPS):
        inputs, targets = batch(step, GLOBAL_BATCH)
        x, y = inputs[dp_rank * local:(dp_rank + 1) * local], targets[dp_rank * local:(dp_rank + 1) * local]
        opt.zero_grad()
        losses.append(pm.train_step(x, y, loss))
        if step == 0 and cfg["zero"] == 0:
            grads = {n: p.grad.detach().clone() for n, p, _ in pm.named_local_parameters() if p.grad is not None}
        opt.step()
    trace = pm.last_stats["trace"] if pm.last_stats else []
    program = pm.executor.program() if pm.executor else []
    result = {
        "losses": losses, "grads": grads, "state": pm.local_state_dict(),
        "specs": {n: pm.tp_spec(n) for n in pm.local_state_dict()},
        "tp_rank": mesh.coordinate("tp"), "tp": tp, "pp_rank": mesh.coordinate("pp"),
        "trace": trace, "program": program, "local_stages": pm.local_stages,
    }
    torch.save(result, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{os.environ['RANK']}.pt"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1]))
    except Exception as e:  # one line naming the rank, for the test to read
        import traceback
        traceback.print_exc()
        print(f"worker error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
