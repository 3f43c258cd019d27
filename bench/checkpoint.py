"""Checkpoint save and load throughput, and the memory a save takes, beside torch.save /
torch.load of the same state from one process, in one run.

A GPT (8 blocks, hidden 1024, vocabulary 8192: 109M parameters) with AdamW state after one
step, in a 4-rank ZeRO-1 layout (dp 4) launched through the launcher: each rank holds a
quarter of the fp32 parameters' optimizer state and of the master weights it steps on.
  * ours: torch_monarch.checkpoint.save / load, every rank at once (the slowest rank's wall
    time); bytes = the checkpoint's files;
  * baseline: one process builds the same state (the whole model's state_dict and the Adam
    state of every parameter, as `torch.save({"model": ..., "optimizer": ...})` would be
    used without a sharded checkpoint) and times torch.save / torch.load of it;
  * peak extra memory during the save: each rank's VmHWM growth over its RSS just before
    the save (glibc told to return freed memory at once), the largest over ranks, beside the
    rank's state size;
  * save_async: how long it blocks the caller (staging the rank's slices in host memory), a
    training step run while the files are written beside one run alone, when wait() has the
    checkpoint in place, and its peak extra memory (the staging copy);
  * PyTorch's own sharded checkpoint in the same launch: FSDP2 (fully_shard per block, 4
    ranks) with the same state after one step, saved and loaded with torch.distributed.
    checkpoint ({"model": get_model_state_dict, "optimizer": get_optimizer_state_dict}, as
    torchtitan saves) on the same filesystem; peak extra memory as ours;
  * a load into another layout: ours from the ZeRO-1 dp4 checkpoint into tp2 x dp2, DCP's
    from FSDP2's checkpoint into FSDP2 + DTensor TP on a (dp 2, tp 2) mesh (its resharding),
    and ours from FSDP2's DCP checkpoint into tp2 x dp2 (checkpoint.load_dcp, migrating).

    python3 bench/checkpoint.py [--out bench/results/checkpoint.json] [--dir DIR]
"""

import argparse
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from procmem import reset_peak, vm  # noqa: E402

ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 8192, 1024, 16, 8, 64


def make_model():
    import torch
    from models import GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(vocab=VOCAB, hidden=HIDDEN, heads=HEADS, layers=LAYERS, max_positions=SEQ, dropout=0.0)


def one_step(model, opt, step_fn):
    import torch
    tokens = torch.randint(VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(1))
    opt.zero_grad()
    step_fn(tokens[:, :-1], tokens[:, 1:])
    opt.step()


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def worker(out_dir, ckpt_dir):
    import torch
    import torch.nn.functional as F
    import torch_monarch
    from torch_monarch import checkpoint
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # (DCP's collectives; ours joins its store)
    world = torch_monarch.init(timeout=600)
    mesh = torch_monarch.device_mesh(pp=1, dp=world.size, tp=1)
    pm = torch_monarch.parallelize(make_model(), mesh, zero_stage=1)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def loss(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    one_step(pm, opt, lambda x, y: pm.train_step(*pm.local_batch(x, y), loss))
    state_bytes = sum(p.numel() * p.element_size() for p in pm.parameters()) + sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    group = torch_monarch._runtime.DeviceMesh(world, pp=1, dp=world.size, tp=1).group("dp")

    def all_max(x):
        t = torch.tensor([float(x)], dtype=torch.float64)
        group.all_reduce_max(t).wait()
        return t.item()

    gc.collect()
    group.barrier()
    base = vm("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    checkpoint.save(pm, opt, ckpt_dir, step=1)
    save_s = all_max(time.perf_counter() - t0)
    extra = all_max(vm("VmHWM") - base)
    group.barrier()
    t0 = time.perf_counter()
    checkpoint.load(pm, opt, ckpt_dir)
    load_s = all_max(time.perf_counter() - t0)
    step = lambda: one_step(pm, opt, lambda x, y: pm.train_step(*pm.local_batch(x, y), loss))  # noqa: E731
    # A training step alone, then save_async: how long it blocks (staging), a step while the
    # files are written, and when wait() has the checkpoint in place.
    group.barrier()
    t0 = time.perf_counter()
    step()
    step_s = all_max(time.perf_counter() - t0)
    gc.collect()
    group.barrier()
    base = vm("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    pending = checkpoint.save_async(pm, opt, ckpt_dir + ".async", step=2)
    block_s = all_max(time.perf_counter() - t0)
    t1 = time.perf_counter()
    step()
    step_during_s = all_max(time.perf_counter() - t1)
    pending.wait()
    async_total_s = all_max(time.perf_counter() - t0)
    async_extra = all_max(vm("VmHWM") - base)
    ours_bytes = dir_bytes(ckpt_dir)
    # Into another layout: tp 2 x dp 2 (ZeRO-1).
    del pending
    gc.collect()
    mesh2 = torch_monarch.device_mesh(pp=1, dp=world.size // 2, tp=2)
    pm2 = torch_monarch.parallelize(make_model(), mesh2, zero_stage=1)
    opt2 = torch.optim.AdamW(pm2.parameters(), lr=1e-4)
    one_step(pm2, opt2, lambda x, y: pm2.train_step(*pm2.local_batch(x, y), tp_loss(mesh2)))  # (creates its state)
    group.barrier()
    t0 = time.perf_counter()
    checkpoint.load(pm2, opt2, ckpt_dir)
    reshard_s = all_max(time.perf_counter() - t0)
    dcp_row = dcp_side(ckpt_dir + ".dcp", all_max, group)
    group.barrier()
    t0 = time.perf_counter()
    checkpoint.load_dcp(pm2, opt2, ckpt_dir + ".dcp")
    migrate_s = all_max(time.perf_counter() - t0)
    if world.rank == 0:
        with open(os.path.join(out_dir, "ours.json"), "w") as f:
            json.dump({"save_s": save_s, "load_s": load_s, "bytes": ours_bytes, "peak_extra_bytes": extra,
                       "rank_state_bytes": state_bytes, "ranks": world.size, "load_into_tp2_dp2_s": reshard_s,
                       "load_dcp_into_tp2_dp2_s": migrate_s, "dcp": dcp_row,
                       "async": {"blocked_s": block_s, "total_s": async_total_s, "step_s": step_s,
                                 "step_during_write_s": step_during_s, "peak_extra_bytes": async_extra}}, f)


def tp_loss(mesh):
    import torch_monarch

    def loss(out, y):
        return torch_monarch.vocab_parallel_cross_entropy(out, y, mesh)
    return loss


def dcp_side(path, all_max, group):
    """FSDP2 with the same state, saved and loaded with DCP; then loaded into FSDP2 + DTensor
    TP on a (dp 2, tp 2) mesh (DCP's resharding)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    n = dist.get_world_size()
    model = make_model()
    mesh = init_device_mesh("cpu", (n,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rank = dist.get_rank()

    def step(x, y):
        share = slice(rank * x.shape[0] // n, (rank + 1) * x.shape[0] // n)
        F.cross_entropy(model(x[share]).reshape(-1, VOCAB), y[share].reshape(-1)).backward()
    one_step(model, opt, step)
    gc.collect()
    group.barrier()
    base = vm("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
    save_s = all_max(time.perf_counter() - t0)
    extra = all_max(vm("VmHWM") - base)
    del model_sd, optim_sd

    def timed_load(model, opt):
        """DCP's load as torchtitan does it (into the model's own state dict, then set), timed."""
        group.barrier()
        t0 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return all_max(time.perf_counter() - t0)
    load_s = timed_load(model, opt)
    del model, opt
    gc.collect()
    # Into FSDP2 + DTensor TP (dp 2 x tp 2): the GPT's attention and MLP split as Megatron does.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh2 = init_device_mesh("cpu", (n // 2, 2), mesh_dim_names=("dp", "tp"))
    model = make_model()
    for block in model.transformer.h:
        parallelize_module(block, mesh2["tp"], {"mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
        fully_shard(block, mesh=mesh2["dp"])
    fully_shard(model, mesh=mesh2["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    share2 = slice(0, 2)

    def step2(x, y):
        F.cross_entropy(model(x[share2]).reshape(-1, VOCAB), y[share2].reshape(-1)).backward()
    one_step(model, opt, step2)
    reshard_s = timed_load(model, opt)
    return {"save_s": save_s, "load_s": load_s, "bytes": dir_bytes(path), "peak_extra_bytes": extra,
            "load_into_tp2_dp2_s": reshard_s}


def baseline(path):
    """torch.save / torch.load of the same state from one process."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    one_step(model, opt, lambda x, y: F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward())
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    gc.collect()
    t0 = time.perf_counter()
    torch.save(state, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())  # as ours: on disk, not in the page cache only
    save_s = time.perf_counter() - t0
    del state
    gc.collect()
    t0 = time.perf_counter()
    torch.load(path)
    load_s = time.perf_counter() - t0
    return {"save_s": save_s, "load_s": load_s, "bytes": os.path.getsize(path)}


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=2)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "checkpoint.json"))
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    work = tempfile.mkdtemp(prefix="monarch-ckpt-bench-", dir=args.dir)
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
        subprocess.run([sys.executable, "-m", "torch_monarch.run", "--nproc-per-node", str(args.ranks),
                        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), __file__,
                        "--worker", work, os.path.join(work, "ckpt")], check=True, timeout=1800, env=env)
        with open(os.path.join(work, "ours.json")) as f:
            ours = json.load(f)
        shutil.rmtree(os.path.join(work, "ckpt"), ignore_errors=True)
        shutil.rmtree(os.path.join(work, "ckpt.async"), ignore_errors=True)
        base = baseline(os.path.join(work, "state.pt"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = 1e9
    rows = [("torch_monarch.checkpoint, %d ranks" % ours["ranks"], ours),
            ("DCP (FSDP2), %d ranks" % ours["ranks"], ours["dcp"]),
            ("torch.save / torch.load, 1 process", base)]
    print(f"GPT {LAYERS} blocks, hidden {HIDDEN}, vocab {VOCAB}; fp32 weights + AdamW state; ZeRO-1 over "
          f"{ours['ranks']} ranks on this machine")
    print(f"{'':<38}{'bytes':>12}{'save s':>9}{'save GB/s':>11}{'load s':>9}{'load GB/s':>11}")
    for name, r in rows:
        print(f"{name:<38}{r['bytes']:>12}{r['save_s']:>9.2f}{r['bytes'] / r['save_s'] / gb:>11.2f}"
              f"{r['load_s']:>9.2f}{r['bytes'] / r['load_s'] / gb:>11.2f}")
    print(f"peak extra memory during the save (largest rank): ours {ours['peak_extra_bytes'] / 2**20:.1f} MiB, DCP "
          f"{ours['dcp']['peak_extra_bytes'] / 2**20:.1f} MiB; the rank's state: {ours['rank_state_bytes'] / 2**20:.1f} MiB")
    print(f"load into another layout (tp 2 x dp 2): ours {ours['load_into_tp2_dp2_s']:.2f} s, DCP into FSDP2 + "
          f"DTensor TP {ours['dcp']['load_into_tp2_dp2_s']:.2f} s; FSDP2's DCP checkpoint into ours (load_dcp) "
          f"{ours['load_dcp_into_tp2_dp2_s']:.2f} s")
    a = ours["async"]
    print(f"save_async: blocks {a['blocked_s']:.2f} s (staging; the blocking save took {ours['save_s']:.2f} s), "
          f"a training step while the files are written {a['step_during_write_s']:.2f} s (alone {a['step_s']:.2f} s), "
          f"in place after {a['total_s']:.2f} s; peak extra memory {a['peak_extra_bytes'] / 2**20:.1f} MiB "
          "(the staging copy)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"ours": ours, "torch_save": base}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
