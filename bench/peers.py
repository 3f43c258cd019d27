"""torch_monarch against PyTorch's own distributed stack, side by side: the same model, the same
data, the same launch, in one run. Sharded data parallelism here; tensor parallelism against
DTensor, alone and 2-D with FSDP2, in peers_tp.py, and pipeline schedules against
torch.distributed.pipelining in peers_pp.py (same method, same table; their bytes are the
busiest rank's):

    ZeRO-3 (torch_monarch.fully_shard, zero_stage=3)  vs  FSDP2 fully_shard(reshard_after_forward=True)
    ZeRO-2 (torch_monarch.fully_shard, zero_stage=2)  vs  FSDP2 fully_shard(reshard_after_forward=False)

on a GPT-2 and a Llama-style decoder (grouped-query attention, SwiGLU) from examples/models.py,
AdamW, 4 ranks with Gloo, each block a sharding unit on both sides, in fp32 and in bf16 mixed
precision: ours as a bf16 plan runs it (fp32 shards, bf16 compute, gradients reduced in bf16:
the planner's grad_bytes = 2) against FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32), the policy torchtitan trains with.

    python3 bench/peers.py [--ranks 4] [--rounds 12] [--out bench/results/peers.json]

Step time: every engine is built in one launch and kept alive; rounds of one step each run the
engines one after another, each round starting at a different engine, so both sides meet the
same machine; a step's time is the slowest rank's (barrier before it, max over ranks after);
per engine the best and the median over the rounds. Bytes sent per rank per step: ours from the
runtime's counters, FSDP2's from its collectives (all-gather (n-1)/n of the output, reduce-scatter
(n-1)/n of the input, all-reduce 2(n-1)/n: the ring volumes the planner uses). Peak memory:
MEMORY_LAUNCHES launches per engine, each the high-water mark (VmHWM) growth over three steps
above the rank's memory after a warm-up step on a tiny model, worst rank; the median of the
launches is reported (one launch's VmHWM moves by 1-3 MiB between launches of the same engine:
glibc's heap, not the layout). Beside it, in the same launches, the allocated-bytes high-water
mark over the same span (bench/malloc_peak.c, preloaded: every thread's malloc'd bytes, what
torch.cuda.max_memory_allocated is on a GPU), which leaves out the heap's free holes; it needs
`make build` (build/bench/libmalloc_peak.so). Parity: every engine's losses (the global mean,
all rounds) and parameters after the last round against one process training the plain model on
the global batches; tolerances in TOLERANCE.
"""

import argparse
import inspect
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
from procmem import AllocatedPeak, malloc_peak_preload, vm, warm_up_torch, write_rank_result  # noqa: E402

SEQ, VOCAB, GLOBAL_BATCH, LR = 64, 1024, 16, 1e-3
MEMORY_STEPS = 3
MEMORY_LAUNCHES = 3
WARMUP_ROUNDS = 2
# fp32 on both sides; the sums of gradients over 4 ranks are added in another order than one
# process adds them (per rank, then across), so parameters differ in the last bits after each
# AdamW step, and AdamW's normalisation amplifies that for elements whose gradient is tiny.
TOLERANCE = {"loss": 1e-4, "parameters": 1e-3}
# bf16 rows against one process computing with bf16 copies of fp32 parameters (FSDP's and our
# MixedPrecision arithmetic, torch_monarch.mixed_precision.CastParameters), accumulating the
# ranks' shares of the batch one after another (each share's backward rounds in bf16 as a
# rank's does); their losses also against one process under torch.autocast(bfloat16)
# (autocast keeps norms and softmax in fp32: another arithmetic, reported, not asserted).
# Parameters: the whole model's relative difference in norm. Per tensor it means nothing in
# bf16: a gradient that is zero in exact arithmetic (GPT-2's attention key bias) is bf16
# rounding noise, which AdamW turns into full-size steps; the same one process run with and
# without splitting the batch into 4 accumulated parts differs by 0.41 on such a tensor.
TOLERANCE_BF16 = {"loss": 1e-3, "parameters": 1e-2}
PAIRS = (("ZeRO-3", "FSDP2 reshard"), ("ZeRO-2", "FSDP2 no reshard"),
         ("ZeRO-3 bf16", "FSDP2 reshard bf16"), ("ZeRO-2 bf16", "FSDP2 no reshard bf16"))


def is_bf16(engine):
    return engine.endswith(" bf16")


def tolerance_of(engine):
    return TOLERANCE_BF16 if is_bf16(engine) else TOLERANCE


def build(model_name):
    import torch
    from models import GPT2LMHeadModel, LlamaForCausalLM
    torch.manual_seed(0)
    if model_name == "gpt2":
        model = GPT2LMHeadModel(vocab=VOCAB, hidden=256, heads=8, layers=4, max_positions=SEQ, dropout=0.0)
        return model, list(model.transformer.h)
    model = LlamaForCausalLM(vocab=VOCAB, hidden=256, heads=8, kv_heads=2, intermediate=688, layers=4)
    return model, list(model.model.layers)


def batch(step):
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, x, y):
    import torch.nn.functional as F
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def wrap(engine, model, blocks, mesh):
    """The engine's sharded model (engine: 'ZeRO-3', 'ZeRO-2', 'FSDP2 reshard', 'FSDP2 no reshard',
    each also with ' bf16')."""
    import torch
    bf16 = is_bf16(engine)
    engine = engine.replace(" bf16", "")
    if engine.startswith("ZeRO"):
        import torch_monarch
        return torch_monarch.fully_shard(model, mesh=mesh, units=blocks, zero_stage=int(engine[-1]),
                                         mixed_precision=torch.bfloat16 if bf16 else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    reshard = engine == "FSDP2 reshard"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)


# Bytes one rank sends in a ring collective over n ranks, per byte of the tensor given to it
# (all-gather: its input; reduce-scatter: its input; all-reduce: the buffer): the volumes the
# planner uses (docs/cost_model.md).
RING_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather_into_tensor": lambda n: n - 1,
                "reduce_scatter_tensor": lambda n: (n - 1) / n, "all_to_all_single": lambda n: (n - 1) / n}


class CollectiveBytes:
    """Counts what torch.distributed's collectives send from this rank (ring volumes), by
    wrapping the functions FSDP2 calls (their names differ between torch versions)."""

    def __init__(self):
        import torch.distributed as dist
        self.bytes = 0.0

        def size(t):
            return t.numel() * t.element_size()

        # (function, which argument's bytes, ring factor for a group of n ranks)
        volumes = {"all_gather_single": (1, RING_FACTORS["all_gather_into_tensor"]),
                   "all_gather_into_tensor": (1, RING_FACTORS["all_gather_into_tensor"]),
                   "reduce_scatter_single": (1, RING_FACTORS["reduce_scatter_tensor"]),
                   "reduce_scatter_tensor": (1, RING_FACTORS["reduce_scatter_tensor"]),
                   "all_reduce": (0, RING_FACTORS["all_reduce"])}
        for name, (position, factor) in volumes.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            signature = inspect.signature(original)

            def counted(*args, _original=original, _signature=signature, _position=position, _factor=factor,
                        **kwargs):
                bound = _signature.bind(*args, **kwargs)
                tensor = list(bound.arguments.values())[_position]
                group = bound.arguments.get("group")  # the group's size, not the world's (2-D meshes)
                self.bytes += _factor(dist.get_world_size(group)) * size(tensor)
                return _original(*args, **kwargs)

            setattr(dist, name, counted)


def engines():
    return [(m, e) for m in ("gpt2", "llama") for pair in PAIRS for e in pair]


def full_parameters(engine, wrapped):
    """{name: whole tensor} after training (FSDP2's parameters are DTensors)."""
    state = wrapped.state_dict()
    if engine.startswith("FSDP2"):
        state = {k: v.full_tensor() for k, v in state.items()}
    return {k: v.detach().clone() for k, v in state.items()}


def time_worker(rounds, out_dir):
    import torch
    import torch.distributed as dist
    import torch_monarch
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    counter = CollectiveBytes()  # before anything is wrapped
    torch_monarch.init()  # joins torch.distributed's store
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = torch_monarch.device_mesh()
    from torch.distributed.device_mesh import init_device_mesh
    torch_mesh = init_device_mesh("cpu", (n,))
    local = GLOBAL_BATCH // n
    jobs = []
    for model_name, engine in engines():
        model, blocks = build(model_name)
        wrapped = wrap(engine, model, blocks, mesh if engine.startswith("ZeRO") else torch_mesh)
        jobs.append(dict(model=model_name, engine=engine, wrapped=wrapped,
                         opt=torch.optim.AdamW(wrapped.parameters(), lr=LR), times=[], bytes=[], losses=[]))
    total = WARMUP_ROUNDS + rounds
    for step in range(total):
        x, y = batch(step)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        order = jobs[step % len(jobs):] + jobs[:step % len(jobs)]
        for job in order:
            ours = job["engine"].startswith("ZeRO")
            if ours:
                mesh.group("dp").reset_counters()
            before = counter.bytes
            dist.barrier()
            start = time.perf_counter()
            loss = loss_of(job["wrapped"], x, y)
            loss.backward()
            job["opt"].step()
            job["opt"].zero_grad(set_to_none=True)
            elapsed = torch.tensor([time.perf_counter() - start, loss.item() / n])
            sent = mesh.group("dp").total_bytes_sent() if ours else counter.bytes - before
            # after the timed step: the slowest rank's time and the global mean loss
            slowest = elapsed[:1].clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            mean_loss = elapsed[1:].clone()
            dist.all_reduce(mean_loss)
            job["losses"].append(mean_loss.item())
            if step >= WARMUP_ROUNDS:
                job["times"].append(slowest.item())
                job["bytes"].append(sent)
    params = {(j["model"], j["engine"]): full_parameters(j["engine"], j["wrapped"]) for j in jobs}
    if rank == 0:
        reference = {}
        for model_name in ("gpt2", "llama"):
            for bf16 in (False, True):
                model, _ = build(model_name)
                if bf16:
                    from torch_monarch.mixed_precision import CastParameters
                    CastParameters(model, torch.bfloat16)
                opt = torch.optim.AdamW(model.parameters(), lr=LR)
                losses = []
                for step in range(total):
                    if bf16:  # the ranks' shares one after another
                        x, y = batch(step)
                        loss = sum(loss_of(model, xs, ys).detach() / n for xs, ys in zip(x.chunk(n), y.chunk(n)))
                        for xs, ys in zip(x.chunk(n), y.chunk(n)):
                            (loss_of(model, xs, ys) / n).backward()
                    else:
                        loss = loss_of(model, *batch(step))
                        loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    losses.append(loss.item())
                reference[(model_name, bf16)] = (losses, {k: v.detach() for k, v in model.state_dict().items()})
            model, _ = build(model_name)
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            autocast_losses = []
            for step in range(total):
                with torch.autocast("cpu", torch.bfloat16):
                    loss = loss_of(model, *batch(step))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                autocast_losses.append(loss.item())
            reference[(model_name, "autocast")] = autocast_losses
        rows = []
        for j in jobs:
            ref_losses, ref_params = reference[(j["model"], is_bf16(j["engine"]))]
            got = params[(j["model"], j["engine"])]
            loss_diff = max(abs(a - b) / abs(b) for a, b in zip(j["losses"], ref_losses))
            autocast_diff = max(abs(a - b) / abs(b) for a, b in zip(j["losses"], reference[(j["model"], "autocast")]))
            per_tensor = {k: ((got[k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in ref_params.items()}
            model_diff = (sum(((got[k] - v).double() ** 2).sum() for k, v in ref_params.items()).sqrt()
                          / sum((v.double() ** 2).sum() for v in ref_params.values()).sqrt()).item()
            # fp32: the worst tensor; bf16: the whole model (TOLERANCE_BF16's note)
            param_diff = model_diff if is_bf16(j["engine"]) else max(per_tensor.values())
            rows.append(dict(model=j["model"], engine=j["engine"], best_s=min(j["times"]),
                             median_s=statistics.median(j["times"]), times_s=j["times"],
                             bytes_per_step=statistics.median(j["bytes"]), losses=j["losses"],
                             reference_losses=ref_losses, loss_rel_diff=loss_diff,
                             loss_rel_diff_to_autocast=autocast_diff, model_parameter_rel_diff=model_diff,
                             worst_tensor=max(per_tensor, key=per_tensor.get),
                             worst_tensor_rel_diff=max(per_tensor.values()), parameter_rel_diff=param_diff))
        with open(os.path.join(out_dir, "time.json"), "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def memory_worker(model_name, engine, out_dir):
    import torch
    import torch.distributed as dist
    import torch_monarch
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    if engine.startswith("ZeRO"):
        torch_monarch.init()
        mesh = torch_monarch.device_mesh()
    else:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (n,))
    warm_up_torch()
    dist.barrier()
    allocated = AllocatedPeak()
    baseline = vm("VmRSS")
    model, blocks = build(model_name)
    wrapped = wrap(engine, model, blocks, mesh)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    local = GLOBAL_BATCH // n
    for step in range(MEMORY_STEPS):
        x, y = batch(step)
        loss_of(wrapped, x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    write_rank_result(out_dir, {"peak_growth": vm("VmHWM") - baseline, "allocated_growth": allocated.growth()})
    dist.barrier()
    dist.destroy_process_group()


def pairs_time_worker(kind, rounds, out_dir):
    """Every engine of ``kind`` (peers_tp or peers_pp: build, Engine, PAIRS, MODEL) in one
    launch, interleaved round by round as time_worker does; rank 0 writes <MODEL>_time.json
    with time_worker's fields."""
    import json
    import statistics
    import time
    import torch
    import torch.distributed as dist
    import torch_monarch
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    counter = CollectiveBytes()
    torch_monarch.init()
    rank, n = dist.get_rank(), dist.get_world_size()
    jobs = [dict(engine=e, side=kind.Engine(e, LR), times=[], losses=[]) for pair in kind.PAIRS for e in pair]
    total = WARMUP_ROUNDS + rounds
    for step in range(total):
        x, y = batch(step)
        order = jobs[step % len(jobs):] + jobs[:step % len(jobs)]
        for job in order:
            side = job["side"]
            xs, ys = side.share(x, y, GLOBAL_BATCH)
            dist.barrier()
            start = time.perf_counter()
            loss = side.step(xs, ys)
            elapsed = torch.tensor([time.perf_counter() - start, loss / n])
            slowest = elapsed[:1].clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            mean_loss = elapsed[1:].clone()
            dist.all_reduce(mean_loss)  # tp ranks hold the same loss: the mean over all is the dp mean
            job["losses"].append(mean_loss.item())
            if step >= WARMUP_ROUNDS:
                job["times"].append(slowest.item())
    # Bytes: one more step per engine, untimed (the peer's functional collectives are counted
    # through a dispatch mode, which would slow a timed step).
    x, y = batch(total)
    for job in jobs:
        side = job["side"]
        xs, ys = side.share(x, y, GLOBAL_BATCH)
        side.reset_bytes()
        before = counter.bytes
        if side.counts_own_bytes:
            side.step(xs, ys)
            job["bytes"] = side.bytes_sent()
        else:
            with kind.functional_bytes() as mode:
                side.step(xs, ys)
            job["bytes"] = counter.bytes - before + mode.bytes
    for job in jobs:  # the busiest rank's (a pipeline's middle stages send both ways)
        busiest = torch.tensor([float(job["bytes"])], dtype=torch.float64)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        job["bytes"] = busiest.item()
    params = {job["engine"]: job["side"].full_parameters() for job in jobs}
    if rank == 0:
        model, _ = kind.build()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        ref_losses = []
        for step in range(total + 1):
            loss = loss_of(model, *batch(step))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ref_losses.append(loss.item())
        ref_losses = ref_losses[:total]
        ref_params = {k: v.detach() for k, v in model.state_dict().items()}
        rows = []
        for job in jobs:
            got = params[job["engine"]]
            per_tensor = {k: ((got[k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in ref_params.items()}
            rows.append(dict(model=kind.MODEL, engine=job["engine"], best_s=min(job["times"]),
                             median_s=statistics.median(job["times"]), times_s=job["times"],
                             bytes_per_step=job["bytes"], losses=job["losses"], reference_losses=ref_losses,
                             loss_rel_diff=max(abs(a - b) / abs(b) for a, b in zip(job["losses"], ref_losses)),
                             parameter_rel_diff=max(per_tensor.values()),
                             worst_tensor=max(per_tensor, key=per_tensor.get)))
        with open(os.path.join(out_dir, f"{kind.MODEL}_time.json"), "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def pairs_memory_worker(kind, engine, out_dir):
    import torch
    import torch.distributed as dist
    import torch_monarch
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if not engine.startswith(("DTensor", "FSDP2", "pipelining")):
        torch_monarch.init()  # (the peer's launch runs nothing of ours)
    warm_up_torch()
    dist.barrier()
    allocated = AllocatedPeak()
    baseline = vm("VmRSS")
    side = kind.Engine(engine, LR)
    for step in range(MEMORY_STEPS):
        x, y = batch(step)
        side.step(*side.share(x, y, GLOBAL_BATCH))
    write_rank_result(out_dir, {"peak_growth": vm("VmHWM") - baseline, "allocated_growth": allocated.growth()})
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks, *args, env=None):
    """Runs a worker on `ranks` ranks; its output folder. A launch that fails is run once more
    (the peer's processes have no guard against torch's Gloo abort at interpreter exit,
    pytorch/pytorch#190489, which kills a finished worker with SIGABRT now and then); a
    second failure raises."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    for attempt in (1, 2):
        out = tempfile.mkdtemp(prefix="monarch-peers-")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
               str(free_port()), __file__, *args, out]
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL)
        if done.returncode == 0:
            return out
        shutil.rmtree(out, ignore_errors=True)
        if attempt == 2:
            raise subprocess.CalledProcessError(done.returncode, cmd)
        print(f"peers: {' '.join(args[:3])} exited with {done.returncode}; launching it again", file=sys.stderr)


def read_json(folder, name):
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def peak_memory(ranks, *args, launches=MEMORY_LAUNCHES):
    """``launches`` launches of a memory worker: {"peak_bytes": median, "peak_bytes_launches":
    every launch's} of the worst rank's VmHWM growth, and the same of its allocated-bytes
    growth ("allocated_bytes", "allocated_bytes_launches")."""
    resident, allocated = [], []
    for _ in range(launches):
        out = launch(ranks, *args, env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20), **malloc_peak_preload()})
        ranks_json = [read_json(out, f"rank{r}.json") for r in range(ranks)]
        resident.append(max(r["peak_growth"] for r in ranks_json))
        allocated.append(max(r["allocated_growth"] for r in ranks_json))
        shutil.rmtree(out)
    return dict(peak_bytes=statistics.median(resident), peak_bytes_launches=resident,
                allocated_bytes=statistics.median(allocated), allocated_bytes_launches=allocated)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out")
    args = parser.parse_args()
    import torch
    started = time.time()
    out = launch(args.ranks, "--time-worker", str(args.rounds))
    rows = {(r["model"], r["engine"]): r for r in read_json(out, "time.json")}
    shutil.rmtree(out)
    for (model_name, engine), row in rows.items():
        row.update(peak_memory(args.ranks, "--memory-worker", model_name, engine))
    # Tensor parallelism, alone and with ZeRO-3 (peers_tp.py), and pipelines (peers_pp.py):
    # each its own launch, same method.
    import peers_pp
    import peers_tp
    for kind in (peers_tp, peers_pp):
        name = kind.__name__.split("_")[1]
        out = launch(args.ranks, "--time-worker-of", name, str(args.rounds))
        more = {(r["model"], r["engine"]): r for r in read_json(out, f"{kind.MODEL}_time.json")}
        shutil.rmtree(out)
        for (model_name, engine), row in more.items():
            row.update(peak_memory(args.ranks, "--memory-worker-of", name, engine))
        rows.update(more)
    print(f"{args.ranks} ranks, Gloo, fp32 and bf16, AdamW, global batch {GLOBAL_BATCH} x {SEQ} tokens, "
          f"{args.rounds} rounds (engines interleaved), torch {torch.__version__}")
    print(f"{'model':<8} {'ours':<14} {'peer':<22} {'best ms':>15} {'x':>5} {'median ms':>15} {'x':>5} "
          f"{'peak MiB':>11} {'x':>5} {'alloc MiB':>11} {'x':>5} {'MB sent/step':>13} {'x':>5}  "
          f"parity loss / params (ours, peer)")
    pairs = []
    for model_name, ours_name, peer_name in [(m, o, p) for m in ("gpt2", "llama") for o, p in PAIRS] + \
            [(kind.MODEL, o, p) for kind in (peers_tp, peers_pp) for o, p in kind.PAIRS]:
        ours, peer = rows[(model_name, ours_name)], rows[(model_name, peer_name)]
        pair = dict(model=model_name, ours=ours, peer=peer,
                    best_ratio=ours["best_s"] / peer["best_s"], median_ratio=ours["median_s"] / peer["median_s"],
                    memory_ratio=ours["peak_bytes"] / peer["peak_bytes"],
                    allocated_ratio=ours["allocated_bytes"] / peer["allocated_bytes"],
                    bytes_ratio=ours["bytes_per_step"] / peer["bytes_per_step"])
        pairs.append(pair)
        print(f"{model_name:<8} {ours_name:<14} {peer_name:<22} "
              f"{ours['best_s'] * 1e3:>7.1f}/{peer['best_s'] * 1e3:<7.1f} {pair['best_ratio']:>5.2f} "
              f"{ours['median_s'] * 1e3:>7.1f}/{peer['median_s'] * 1e3:<7.1f} {pair['median_ratio']:>5.2f} "
              f"{ours['peak_bytes'] / 2**20:>5.0f}/{peer['peak_bytes'] / 2**20:<5.0f} {pair['memory_ratio']:>5.2f} "
              f"{ours['allocated_bytes'] / 2**20:>5.1f}/{peer['allocated_bytes'] / 2**20:<5.1f} "
              f"{pair['allocated_ratio']:>5.2f} "
              f"{ours['bytes_per_step'] / 1e6:>6.2f}/{peer['bytes_per_step'] / 1e6:<6.2f} {pair['bytes_ratio']:>5.2f}  "
              f"{ours['loss_rel_diff']:.1e}/{ours['parameter_rel_diff']:.1e}, "
              f"{peer['loss_rel_diff']:.1e}/{peer['parameter_rel_diff']:.1e}")
    worst = max(max(r["loss_rel_diff"] / tolerance_of(r["engine"])["loss"],
                    r["parameter_rel_diff"] / tolerance_of(r["engine"])["parameters"]) for r in rows.values())
    print(f"parity with one process: {'OK' if worst <= 1 else 'FAILED'} (tolerances, relative: fp32 losses "
          f"{TOLERANCE['loss']}, parameters {TOLERANCE['parameters']} against fp32; bf16 losses "
          f"{TOLERANCE_BF16['loss']}, parameters {TOLERANCE_BF16['parameters']} against bf16 copies of fp32 "
          f"parameters; bf16 losses against autocast(bf16), not asserted: ours up to "
          f"{max(r['loss_rel_diff_to_autocast'] for r in rows.values() if is_bf16(r['engine'])):.1e}, FSDP2's up to "
          f"{max(r['loss_rel_diff_to_autocast'] for r in rows.values() if is_bf16(r['engine']) and 'FSDP2' in r['engine']):.1e})")
    result = dict(ranks=args.ranks, rounds=args.rounds, memory_launches=MEMORY_LAUNCHES, torch=torch.__version__,
                  global_batch=GLOBAL_BATCH, seq=SEQ,
                  dtypes=["fp32", "bf16"], tolerance=TOLERANCE, tolerance_bf16=TOLERANCE_BF16, pairs=pairs,
                  seconds=time.time() - started)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--time-worker":
        time_worker(int(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) == 5 and sys.argv[1] == "--time-worker-of":  # tp or pp
        import importlib
        pairs_time_worker(importlib.import_module(f"peers_{sys.argv[2]}"), int(sys.argv[3]), sys.argv[4])
    elif len(sys.argv) == 5 and sys.argv[1] == "--memory-worker-of":
        import importlib
        pairs_memory_worker(importlib.import_module(f"peers_{sys.argv[2]}"), sys.argv[3], sys.argv[4])
    elif len(sys.argv) == 5 and sys.argv[1] == "--memory-worker":
        memory_worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
