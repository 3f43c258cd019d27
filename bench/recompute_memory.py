"""Activation memory of a 4-block GPT-2 (dropout on) with recompute none, selective and full: measured
(resident memory the forward leaves behind for backward, in this process) beside the
planner's prediction for the same model, batch and layout; and the gradients of both modes,
which must agree (full recompute re-runs the blocks, selective their attention cores, with
their RNG state).

    python3 bench/recompute_memory.py [--out results.json]

Measured: VmRSS after the forward (loss held) minus before it, with glibc's mmap threshold
fixed low (MALLOC_MMAP_THRESHOLD_, set by re-executing) so freed tensors leave the process at
once. Predicted: the planner's activation bytes for one micro-batch of 8 sequences (pp = dp =
tp = 1), from the model as torch_monarch's reader sees it, fp32.
"""

import argparse
import json
import os
import subprocess
import sys

MODES = ("none", "selective", "full")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from procmem import reset_peak, vm
ROOT = os.path.dirname(HERE)
BATCH, SEQ = 8, 256


def build():
    import torch
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from models import GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(vocab=512, hidden=256, heads=4, layers=4, max_positions=SEQ, dropout=0.1)


def measure(mode):
    import gc
    import torch
    import torch_monarch.recompute as recompute
    from torch_monarch.sharded import _default_units
    model = build()
    recompute.apply(_default_units(model), mode)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(512, (BATCH, SEQ + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    torch.manual_seed(2)  # dropout masks
    # Warm up outside the measurement with one small training step: the allocator, the kernels'
    # workspaces, and what torch imports on first use (torch 2.x's checkpoint loads modules worth
    # ~70 MiB of resident memory on its first call with gradients, which a no_grad warm-up skips).
    model(x[:1]).sum().backward()
    for p in model.parameters():  # gradients exist before the step, as after the first one
        p.grad = torch.zeros_like(p)
    gc.collect()
    before = vm("VmRSS")
    reset_peak()
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), y.reshape(-1))
    del logits
    gc.collect()
    held = vm("VmRSS") - before
    loss.backward()
    peak = vm("VmHWM") - before
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return held, peak, loss.item(), grads


def predicted(mode):
    import torch
    import torch_monarch
    from torch_monarch import planner
    from torch_monarch.api import model_graph, runtime_training
    model = build()
    with torch_monarch.meta_init():
        meta = build()
    info, graph = model_graph(meta, torch.zeros(1, SEQ, dtype=torch.long), dtype="fp32")
    t = runtime_training(info, BATCH, dtype="fp32")
    pins = planner.Pins()
    pins.tp = pins.pp = pins.dp = 1
    pins.zero_stage = 0
    pins.micro_batch_size = BATCH
    pins.schedule = planner.ScheduleKind.none
    pins.recompute = getattr(planner.Recompute, mode)
    del model
    plan = planner.evaluate_layout(graph, planner.cluster("cpu", 1), t, pins, True)
    return plan.prediction.memory.activations


def child(mode):
    import torch
    torch.set_num_threads(1)
    held, peak, loss, grads = measure(mode)
    out = os.environ["MONARCH_RECOMPUTE_OUT"]
    torch.save({"held": held, "peak": peak, "loss": loss, "grads": grads, "predicted": predicted(mode)}, out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    import tempfile
    import torch
    rows = {}
    for mode in MODES:
        path = tempfile.mktemp(suffix=".pt")
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MONARCH_RECOMPUTE_OUT=path, OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, __file__, "--child", mode], env=env, check=True)
        rows[mode] = torch.load(path)
        os.unlink(path)
    worst = max(((rows[mode]["grads"][n] - g).norm() / max(g.norm().item(), 1e-6)).item()
                for mode in MODES[1:] for n, g in rows["none"]["grads"].items())
    result = {"batch": BATCH, "seq": SEQ, "grad_max_rel_diff": worst}
    print(f"{'recompute':<10} {'held after fwd MiB':>19} {'peak MiB':>9} {'predicted MiB':>14} {'loss':>9}")
    for mode, r in rows.items():
        print(f"{mode:<10} {r['held'] / 2**20:>19.1f} {r['peak'] / 2**20:>9.1f} {r['predicted'] / 2**20:>14.1f} "
              f"{r['loss']:>9.5f}")
        result[mode] = {"held_bytes": r["held"], "peak_bytes": r["peak"], "predicted_bytes": r["predicted"],
                        "loss": r["loss"]}
    for mode in MODES[1:]:
        m = rows[mode]["peak"] / rows["none"]["peak"]
        p = rows[mode]["predicted"] / rows["none"]["predicted"]
        result[mode].update(measured_factor=m, predicted_factor=p)
        print(f"{mode} / none: measured {m:.3f}, predicted {p:.3f} ({(m / p - 1) * 100:+.1f}%)")
    print(f"gradients agree with recompute none to {worst:.1e} (relative, worst tensor)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
