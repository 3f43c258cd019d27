"""The runtime fuzzer's ranks: seeded scenarios of valid and invalid calls on 2 ranks.

Each seed picks an engine (DataParallel or ZeRO-1/2/3) and one fault: none, the same local
error on every rank (the user retries the step), a local error on one rank only (it catches
it and trains on: a skipped step), an extra collective on one rank (logging on rank 0), a
state dict asked on one rank only, different bucket sizes, or a rank killed by SIGKILL. The
scenario is the same on both ranks (drawn from the seed). A rank that gets an error does
what an uncaught exception would: it gives up its process group (here: drops the mesh,
which closes its connections, so a peer still waiting learns it at once) and goes on to the
next seed. Every rank appends one JSON line per seed: outcome, error text, losses.

    python fuzz_workers.py FIRST_SEED LAST_SEED OUT_DIR STORE_PORT
"""

import gc
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import torch_monarch

FAULTS = ["none", "none", "none", "raise_all", "raise_all", "skip_step", "skip_step", "extra_collective",
          "state_dict_alone", "bucket_mismatch", "kill"]
ENGINES = ["dp", "zero1", "zero2", "zero3"]
BATCH, DIM, STEPS_MAX = 8, 16, 3


def scenario(seed):
    rng = random.Random(seed)
    return {"seed": seed, "engine": rng.choice(ENGINES), "fault": rng.choice(FAULTS), "rank": rng.randrange(2),
            "steps": rng.randint(2, STEPS_MAX), "at": rng.randrange(STEPS_MAX), "point": rng.choice(["data", "forward", "backward"])}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.inp = nn.Linear(DIM, 2 * DIM)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(2 * DIM, 2 * DIM), nn.Tanh()) for _ in range(2)])
        self.out = nn.Linear(2 * DIM, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randint(4, (BATCH,), generator=g)


def reference(steps):
    """One process, the whole batch: the losses every correct run reproduces."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class Injected(RuntimeError):
    pass


def _raise(message):
    raise Injected(message)


def run(sc, rank):
    mesh = torch_monarch.device_mesh()
    dp = mesh.group("dp")
    engine = sc["engine"]
    bucket = 1 / 1024 if not (sc["fault"] == "bucket_mismatch" and rank == sc["rank"]) else 4 / 1024
    net = Net()
    if engine == "dp":
        model = torch_monarch.DataParallel(net, mesh=mesh, bucket_cap_mb=bucket)
    else:
        model = torch_monarch.fully_shard(net, mesh=mesh, zero_stage=int(engine[-1]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    step, retried = 0, False
    while step < sc["steps"]:
        x, y = data(step)
        x, y = x[rank * BATCH // 2:(rank + 1) * BATCH // 2], y[rank * BATCH // 2:(rank + 1) * BATCH // 2]
        here = step == sc["at"]
        mine = here and rank == sc["rank"]
        if mine and sc["fault"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mine and sc["fault"] == "extra_collective":
            dp.all_reduce(torch.ones(3)).wait()  # a metric logged on one rank only
        if mine and sc["fault"] == "state_dict_alone":
            model.state_dict()  # the "save on one rank" pattern
        opt.zero_grad()
        try:
            if mine and sc["fault"] == "skip_step" and sc["point"] == "data":
                raise Injected("a data error on this rank only, before the model runs")
            hook = None
            if mine and sc["fault"] == "skip_step" and sc["point"] == "forward":
                hook = net.blocks[1].register_forward_pre_hook(lambda m, i: _raise("bad batch on this rank only"))
            try:
                out = model(x)
            finally:
                if hook is not None:
                    hook.remove()
            loss = nn.functional.cross_entropy(out, y)
            if here and not retried and sc["fault"] == "raise_all":
                if sc["point"] == "forward":
                    raise Injected("the same local error on every rank")
                out.register_hook(lambda g: (_ for _ in ()).throw(Injected("raised in backward on every rank")))
            if mine and sc["fault"] == "skip_step" and sc["point"] == "backward":
                out.register_hook(lambda g: (_ for _ in ()).throw(Injected("raised in backward on this rank")))
            loss.backward()
        except Injected:
            if sc["fault"] == "raise_all" and not retried:
                retried = True  # every rank failed alike: the user retries the step
                continue
            step += 1  # one rank gave up its step and trains on
            continue
        opt.step()
        t = torch.tensor([loss.item() * x.shape[0]], dtype=torch.float64)
        dp.all_reduce(t).wait()
        losses.append(t.item() / BATCH)
        step += 1
    state = model.state_dict()
    checksum = float(sum(v.double().sum() for v in state.values()))
    # The run's last collective, as users end one (a final metric): ranks that drifted apart
    # (one gave up a step) meet here at the latest.
    total = torch.tensor([checksum], dtype=torch.float64)
    dp.all_reduce(total).wait()
    if abs(total.item() - 2 * checksum) > 1e-9 * max(1.0, abs(checksum)):
        return {"outcome": "diverged", "losses": losses, "checksum": checksum}
    return {"outcome": "ok", "losses": losses, "checksum": checksum}


def main(first, last, out_dir, port):
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = torch_monarch.init(timeout=float(os.environ.get("MONARCH_TIMEOUT_S", "15")))
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    log = open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a")
    for seed in range(first, last):
        try:
            store.set(f"start/{seed}/{rank}", "1")
            store.wait([f"start/{seed}/{1 - rank}"], timedelta(seconds=30))
        except Exception:
            return 4  # the peer never came (died): the driver restarts both from here
        sc = scenario(seed)
        start = time.monotonic()
        try:
            result = run(sc, rank)
        except Exception as e:  # as if uncaught: this rank gives up its groups
            result = {"outcome": "error", "error": str(e), "type": type(e).__name__}
        gc.collect()  # drops the meshes and their connections (a waiting peer learns at once)
        result.update(sc, seconds=time.monotonic() - start)
        log.write(json.dumps(result) + "\n")
        log.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])))
