"""Worker ranks for test_faults.py: each scenario is a misuse a user can make on 2 ranks.

Every rank writes what it saw (the error text, or its results) to its result file, so the
test can assert the error on every rank, not only that a process failed.
"""

import os
import sys
import time

import torch

import torch_monarch
from tiny_gpt import GLOBAL_BATCH, batch, loss_fn, make_model, make_optimizer


def out_path():
    return os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{os.environ['RANK']}.pt")


def local_batch(step, rank, size):
    inputs, targets = batch(step, GLOBAL_BATCH)
    n = GLOBAL_BATCH // size
    return inputs[rank * n:(rank + 1) * n], targets[rank * n:(rank + 1) * n]


def bucket_mismatch(mesh):
    """bucket_cap_mb differs between the ranks (a config read per host)."""
    dp = mesh.group("dp")
    model = torch_monarch.DataParallel(make_model(), mesh=mesh, bucket_cap_mb=(16 if dp.rank == 0 else 64) / 1024)
    x, y = local_batch(0, dp.rank, dp.size)
    loss_fn(model(x), y).backward()


class OddBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mix_in = torch.nn.Linear(32, 128)
        self.mix_out = torch.nn.Linear(128, 32)

    def forward(self, h):
        return h + self.mix_out(torch.relu(self.mix_in(h)))


class OddNames(torch.nn.Module):
    """Blocks whose layer names no tp plan recognises (an in-house model)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList([OddBlock(), OddBlock()])
        self.to_vocab = torch.nn.Linear(32, 64)

    def forward(self, x):
        h = self.tok(x)
        for layer in self.layers:
            h = layer(h)
        return self.to_vocab(h)


def tp_splits_nothing(mesh):
    torch_monarch.tensor_parallel(OddNames(), torch_monarch.device_mesh(tp=2))


def tp_splits_nothing_parallelize(mesh):
    torch_monarch.parallelize(OddNames(), example_input=batch(0, GLOBAL_BATCH)[0], global_batch=GLOBAL_BATCH, tp=2)


def tp_head_unsplit(mesh):
    from torch_monarch import Colwise, Rowwise, VocabEmbedding
    torch_monarch.tensor_parallel(OddNames(), torch_monarch.device_mesh(tp=2),
                                  plan={"tok": VocabEmbedding(), "layers.*.mix_in": Colwise(),
                                        "layers.*.mix_out": Rowwise()})


def tp_load_wrong_shape(mesh):
    """A checkpoint with a (65, 32) embedding loaded into a tp=2 model that holds (64, 32)."""
    pm = torch_monarch.parallelize(make_model(), example_input=batch(0, GLOBAL_BATCH)[0], global_batch=GLOBAL_BATCH,
                                   tp=2)
    state = make_model().state_dict()
    state["wte.weight"] = torch.zeros(65, 32)
    pm.load_state_dict(state)


def zero3_load_wrong_shapes(mesh):
    """A transposed weight (same element count) and one with a wrong count, into ZeRO-3."""
    model = torch_monarch.fully_shard(make_model(), mesh=mesh, zero_stage=3)
    state = make_model().state_dict()
    state["blocks.0.fc1.weight"] = state["blocks.0.fc1.weight"].t().contiguous()
    state["blocks.1.proj.weight"] = torch.zeros(33, 32)
    model.load_state_dict(state)


def pipeline_retry_after_dead_peer(mesh):
    """pp=2: the last stage dies after a good step; the first stage retries twice: every
    attempt fails at once with the first error (rank, collective, group)."""
    pm = torch_monarch.parallelize(make_model(), example_input=batch(0, GLOBAL_BATCH)[0], global_batch=GLOBAL_BATCH,
                                   pp=2, dp=1, tp=1, micro_batches=2, schedule="1f1b")
    x, y = batch(0, GLOBAL_BATCH)
    pm.train_step(x, y, loss_fn)
    if pm.mesh.coordinate("pp") == 1:
        os._exit(3)
    errors, seconds = [], []
    for _ in range(3):
        start = time.monotonic()
        try:
            pm.train_step(x, y, loss_fn)
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
        seconds.append(time.monotonic() - start)
    return {"errors": errors, "seconds": seconds}


def units_mismatch(mesh):
    """fully_shard with units= that differ between the ranks (same parameters)."""
    model = make_model()
    blocks = list(model.blocks)
    units = blocks if mesh.group("dp").rank == 0 else blocks[:1]  # rank 1: block 1 joins the root unit
    torch_monarch.fully_shard(model, mesh=mesh, units=units)


def tp_uneven_batch(mesh):
    """tp=2 fed 4 samples on one rank and 6 on the other."""
    pm = torch_monarch.parallelize(make_model(), example_input=batch(0, GLOBAL_BATCH)[0], global_batch=GLOBAL_BATCH,
                                   tp=2)
    inputs, targets = batch(0, 12)
    rows = slice(0, 4) if pm.mesh.coordinate("tp") == 0 else slice(4, 10)
    pm.train_step(inputs[rows], targets[rows], loss_fn)


def rank0_state_dict(mesh):
    """ZeRO-3, then the usual "save on rank 0" pattern: only rank 0 asks for the state dict
    while rank 1 waits elsewhere (here: sleeps, as in a torch.distributed barrier)."""
    dp = mesh.group("dp")
    model = torch_monarch.fully_shard(make_model(), mesh=mesh, zero_stage=3)
    opt = make_optimizer(model.named_parameters())
    x, y = local_batch(0, dp.rank, dp.size)
    loss_fn(model(x), y).backward()
    opt.step()
    if dp.rank == 0:
        start = time.monotonic()
        try:
            model.state_dict()
            return {"error": None}
        except RuntimeError as e:
            return {"error": str(e), "seconds": time.monotonic() - start}
    time.sleep(float(os.environ.get("MONARCH_TEST_SLEEP_S", "20")))
    return {"error": None}


def rank0_state_dict_then_train(mesh):
    """Only rank 0 asks for the state dict while rank 1 goes on training: both must fail."""
    dp = mesh.group("dp")
    model = torch_monarch.fully_shard(make_model(), mesh=mesh, zero_stage=3)
    x, y = local_batch(0, dp.rank, dp.size)
    loss_fn(model(x), y).backward()
    if dp.rank == 0:
        model.state_dict()
    loss_fn(model(x), y).backward()


def skipped_step(mesh, stage):
    """Rank 0 hits a local error in step 2's forward (before any collective), catches it and
    trains on: its step 3 would pair with rank 1's step 2 for the rest of the run."""
    dp = mesh.group("dp")
    plain = make_model()
    model = (torch_monarch.DataParallel(plain, mesh=mesh) if stage == 0
             else torch_monarch.fully_shard(plain, mesh=mesh, zero_stage=stage))
    opt = make_optimizer(model.named_parameters())
    caught = []
    for step in range(4):
        x, y = local_batch(step, dp.rank, dp.size)
        opt.zero_grad()
        try:
            if step == 2 and dp.rank == 0:
                out = model(torch.full_like(x, 10**6))  # a bad batch: raises inside the model
            else:
                out = model(x)
            loss_fn(out, y).backward()
        except (RuntimeError, IndexError, ValueError) as e:
            if "not making the same collective call" in str(e):
                raise
            caught.append(str(e).splitlines()[0])
            continue
        opt.step()
    return {"caught": caught}


SCENARIOS = {
    "bucket_mismatch": bucket_mismatch,
    "tp_uneven_batch": tp_uneven_batch,
    "units_mismatch": units_mismatch,
    "pipeline_retry": pipeline_retry_after_dead_peer,
    "zero3_load_wrong_shapes": zero3_load_wrong_shapes,
    "tp_load_wrong_shape": tp_load_wrong_shape,
    "tp_splits_nothing": tp_splits_nothing,
    "tp_splits_nothing_parallelize": tp_splits_nothing_parallelize,
    "tp_head_unsplit": tp_head_unsplit,
    "rank0_state_dict": rank0_state_dict,
    "rank0_state_dict_then_train": rank0_state_dict_then_train,
    "skipped_step0": lambda mesh: skipped_step(mesh, 0),
    "skipped_step3": lambda mesh: skipped_step(mesh, 3),
}


def main(scenario):
    torch.set_num_threads(1)
    torch_monarch.init(timeout=float(os.environ.get("MONARCH_TIMEOUT_S", "60")))
    # Scenarios that make their own mesh (parallelize, tensor_parallel) get none.
    mesh = torch_monarch.device_mesh() if not scenario.startswith(("tp_", "pipeline_")) else None
    try:
        result = SCENARIOS[scenario](mesh) or {}
    except (RuntimeError, ValueError) as e:
        result = {"error": str(e)}
        torch.save(result, out_path())
        print(f"worker error: {e}", file=sys.stderr, flush=True)
        return 1
    torch.save(result, out_path())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
