"""Worker ranks for test_checkpoint_dcp.py (4 ranks, one launch): the tiny GPT trained with
FSDP2 for 3 steps and saved with torch.distributed.checkpoint the way torchtitan saves
({"model": get_model_state_dict, "optimizer": get_optimizer_state_dict}), FSDP2's own run
continued for 3 more steps; then each torch_monarch layout, built from a differently seeded
model, loads that checkpoint (torch_monarch.checkpoint.load_dcp) and trains the same 3
steps. Rank 0 saves every run's losses and the checkpoint's keys."""

import os

import torch
import torch.distributed as dist

import torch_monarch
from dist_harness import run_worker
from torch_monarch.tensor_parallel_modules import vocab_parallel_cross_entropy
from tiny_gpt import GLOBAL_BATCH, batch, loss_fn, make_model, make_optimizer

BEFORE, AFTER = 3, 3
# name: (mesh axes, parallelize keywords, layers)
LAYOUTS = {
    "zero3_dp4": (dict(dp=4), dict(zero_stage=3), 4),
    "tp2_dp2": (dict(tp=2, dp=2), dict(), 4),
    "pp2_dp2": (dict(pp=2, dp=2), dict(schedule="1f1b", micro_batches=2), 4),
    # The positional checkpoint (state keyed by the optimizer's parameter positions).
    "tp2_dp2_positional": (dict(tp=2, dp=2), dict(), 4),
}
LAYERS = 4


def global_mean(value, group=None):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def fsdp2_run(directory):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    model = make_model(layers=LAYERS)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(model.named_parameters())
    local = GLOBAL_BATCH // n
    losses = []
    for step in range(BEFORE + AFTER):
        if step == BEFORE:
            dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=directory)
            # The DCP tutorial's plain form: optimizer state keyed by parameter position.
            dcp.save({"app": {"model": model.state_dict(), "optim": opt.state_dict()}},
                     checkpoint_id=directory + "_positional")
        x, y = batch(step, GLOBAL_BATCH)
        opt.zero_grad()
        loss = loss_fn(model(x[rank * local:(rank + 1) * local]), y[rank * local:(rank + 1) * local])
        loss.backward()
        opt.step()
        losses.append(global_mean(loss.item()))
    return losses


def ours(name, directory):
    axes, keywords, layers = LAYOUTS[name]
    mesh = torch_monarch.device_mesh(**axes)
    pm = torch_monarch.parallelize(make_model(seed=99, layers=layers), mesh, **keywords)
    opt = make_optimizer(pm.named_parameters())
    for group in opt.param_groups:
        group["lr"] = 1.0  # the checkpoint's learning rates must replace these
    info = torch_monarch.checkpoint.load_dcp(pm, opt, directory + ("_positional" if "positional" in name else ""))
    tp, dp, dp_rank = mesh.axis_size("tp"), mesh.axis_size("dp"), mesh.coordinate("dp")

    def loss(logits, targets):
        return loss_fn(logits, targets) if tp == 1 else vocab_parallel_cross_entropy(logits, targets, mesh)

    local = GLOBAL_BATCH // dp
    losses = []
    for step in range(BEFORE, BEFORE + AFTER):
        x, y = batch(step, GLOBAL_BATCH)
        opt.zero_grad()
        losses.append(pm.train_step(x[dp_rank * local:(dp_rank + 1) * local], y[dp_rank * local:(dp_rank + 1) * local],
                                    loss))
        opt.step()
    lrs = sorted({g["lr"] for g in opt.param_groups})
    return {"losses": losses, "prefix": info["extra"]["prefix"], "lrs": lrs}


def errors(directory):
    """What a checkpoint of another model and a directory that is no DCP checkpoint say."""
    out = {}
    mesh = torch_monarch.device_mesh(dp=dist.get_world_size())
    bigger = torch_monarch.parallelize(make_model(layers=LAYERS + 2), mesh, zero_stage=3)
    before = {k: v.clone() for k, v in bigger.state_dict().items()}
    # A pipeline stage cannot map positions to names: refused, not guessed.
    staged = torch_monarch.parallelize(make_model(layers=LAYERS), torch_monarch.device_mesh(pp=2, dp=2), micro_batches=2)
    staged_opt = make_optimizer(staged.named_parameters())
    for what, model, opt, path in (("other_model", bigger, None, directory),
                                   ("not_dcp", bigger, None, os.path.dirname(directory)),
                                   ("positional_on_pipeline", staged, staged_opt, directory + "_positional")):
        try:
            torch_monarch.checkpoint.load_dcp(model, opt, path)
            out[what] = None
        except Exception as e:  # the message is what the test checks
            out[what] = f"{type(e).__name__}: {e}"
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in bigger.state_dict().items())
    return out


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch_monarch.init()
    directory = os.path.join(os.environ["MONARCH_TEST_OUTPUT"], "fsdp2_step3")
    results = {"fsdp2": fsdp2_run(directory)}
    for name in LAYOUTS:
        results[name] = ours(name, directory)
    results["errors"] = errors(directory)
    if dist.get_rank() == 0:
        from torch.distributed.checkpoint import FileSystemReader
        results["keys"] = sorted(FileSystemReader(directory).read_metadata().state_dict_metadata)
        torch.save(results, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], "rank0.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_worker(main)
