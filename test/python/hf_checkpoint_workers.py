"""Worker ranks for test_hf_checkpoint.py (4 ranks): a Hugging Face Llama built on meta, laid
out tp=2 x pp=2 by parallelize, filled from the directory Hugging Face's own save_pretrained
wrote (torch_monarch.hf_checkpoint.load_pretrained), trained 2 steps, and written back in
Hugging Face's format from the parallel layout (save_pretrained). Each rank saves its losses
and its resident-memory peak while the model was laid out and loaded."""

import json
import os
import sys

import torch

from dist_harness import run_worker, vm


def main(arg):
    import transformers
    import torch_monarch
    from torch_monarch import hf_checkpoint
    source, target, batches_file, pins = arg.split(",", 3)
    pins = json.loads(pins)
    torch.set_num_threads(1)
    torch_monarch.init(timeout=180)
    rank = int(os.environ["RANK"])
    batches = torch.load(batches_file)
    config = transformers.AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    example = {k: v[:2] for k, v in batches[0].items()}
    # The peak from here on (the kernel resets VmHWM to the current RSS): laying the model out
    # and loading it. The cluster is given, so no matmul or link probe allocates meanwhile.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    hwm_before = vm("VmHWM")
    pm = torch_monarch.parallelize(model, example_input=example, global_batch=batches[0]["input_ids"].shape[0],
                                   cluster=torch_monarch.planner.cluster("cpu", 4), **pins)
    laid_out = vm("VmHWM") - hwm_before
    # What this rank's shards of split weights were initialized to (before the load): tp ranks
    # must draw different values, not copies of one another.
    split = sorted((n, float(p.detach().double().sum())) for n, p in pm.named_parameters() if pm.tp_spec(n))
    hf_checkpoint.load_pretrained(pm, source)
    memory = {"model_bytes": model_bytes, "peak_growth": vm("VmHWM") - hwm_before, "laid_out_growth": laid_out,
              "held": sum(p.numel() * p.element_size() for p in pm.parameters())}
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    dp, r = pm.dp, pm.mesh.coordinate("dp")
    losses = []
    for b in batches:
        local = b["input_ids"].shape[0] // dp
        opt.zero_grad()
        losses.append(pm.train_step({k: v[r * local:(r + 1) * local] for k, v in b.items()}))
        opt.step()
    hf_checkpoint.save_pretrained(pm, target)
    with open(os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "memory": memory, "plan": pm.plan.summary(), "init_sums": split,
                   "coords": [pm.mesh.coordinate(a) for a in ("pp", "dp", "tp")]}, f)
    return 0


if __name__ == "__main__":
    run_worker(main, sys.argv[1])
