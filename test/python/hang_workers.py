"""Worker ranks for test_hangs.py, started through the launcher (torchrun's protocol):

  state_dict:<T>   2 ranks, job timeout T s, ZeRO-3: rank 0 asks for the state dict (the "save
                   on rank 0" mistake) while rank 1 trains on.
  skip:<k>         4 ranks: six all-reduces on the dp group; rank 2 skips call #k (a larger
                   one), so its next call pairs with the others' call #k.
  stuck            4 ranks, job timeout 8 s: rank 2 skips the last all-reduce and then hangs
                   elsewhere (sleeps); the others time out, the launcher stops rank 2.
Each rank writes {"error", "seconds", "seconds_in_state_dict"} to MONARCH_TEST_OUTPUT/rank<R>.pt
when it gets to; "seconds_in_state_dict" (rank 0 of state_dict:<T> only) runs from the mistaken
call to its error, without the start-up (imports, sharding, two steps) that a loaded machine
slows down."""

import os
import sys
import time

import torch

import torch_monarch
from tiny_gpt import batch, loss_fn, make_model, make_optimizer

SIZES = [16, 16, 16, 64, 16, 16]
STATE_DICT_CALLED = []  # time.monotonic() when rank 0 made the mistaken call


def state_dict(mesh):
    dp = mesh.group("dp")
    model = torch_monarch.fully_shard(make_model(), mesh=mesh, zero_stage=3)
    opt = make_optimizer(model.named_parameters())
    x, y = batch(0, 4)
    x, y = x[dp.rank * 2:(dp.rank + 1) * 2], y[dp.rank * 2:(dp.rank + 1) * 2]
    for _ in range(2):
        loss_fn(model(x), y).backward()
        opt.step()
    if dp.rank == 0:
        STATE_DICT_CALLED.append(time.monotonic())
        model.state_dict()  # the mistake: only rank 0
    loss_fn(model(x), y).backward()


def skip(mesh, k):
    dp = mesh.group("dp")
    for i, n in enumerate(SIZES):
        if dp.rank == 2 and i == k:
            continue
        dp.all_reduce(torch.ones(n)).wait()


def stuck(mesh):
    dp = mesh.group("dp")
    for i, n in enumerate(SIZES):
        if dp.rank == 2 and i == len(SIZES) - 1:
            time.sleep(120)  # hung somewhere else (a deadlock of its own, a slow filesystem ...)
        dp.all_reduce(torch.ones(n)).wait()


def main(scenario):
    torch.set_num_threads(1)
    name, _, arg = scenario.partition(":")
    timeout = float(arg) if name == "state_dict" else 8.0 if name == "stuck" else 60.0
    torch_monarch.init(timeout=timeout)
    mesh = torch_monarch.device_mesh()
    start = time.monotonic()
    rank = int(os.environ["RANK"])
    try:
        if name == "state_dict":
            state_dict(mesh)
        elif name == "skip":
            skip(mesh, int(arg))
        else:
            stuck(mesh)
        result = {"error": None}
    except (RuntimeError, ValueError) as e:
        result = {"error": str(e)}
    result["seconds"] = time.monotonic() - start
    if STATE_DICT_CALLED:
        result["seconds_in_state_dict"] = time.monotonic() - STATE_DICT_CALLED[0]
    torch.save(result, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{rank}.pt"))
    if result["error"]:
        print(f"worker error: {result['error']}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
