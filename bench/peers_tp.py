"""The tensor-parallel pairs of bench/peers.py: torch_monarch's tensor parallelism against
DTensor's ``parallelize_module`` with torchtitan's Llama plan, alone and under sharded data
parallelism, on the Llama-style decoder (4 K/V heads here, so tp = 4 divides them):

    TP-4 SP              parallelize(model, mesh(tp=4), sequence_parallel=True)
      vs DTensor TP-4 SP parallelize_module(model, tp_mesh, torchtitan's plan)
    TP-2 x ZeRO-3        parallelize(model, mesh(dp=2, tp=2), zero_stage=3, sequence_parallel=True)
      vs FSDP2 + TP-2    the same DTensor plan on mesh["tp"], then fully_shard per block on mesh["dp"]

torchtitan's plan (torchtitan/models/llama3/infra/parallelize.py, apply_tp, read for this):
the embedding row-wise with a sequence-sharded output, norms SequenceParallel, attention and
MLP inputs gathered (PrepareModuleInput Shard(1) -> Replicate), q/k/v and gate/up
column-wise, o/down row-wise back to sequence shards, the output head column-wise with
vocabulary-sharded logits under ``loss_parallel``. Ours: the same cut, found by reading the
model (tensor_parallel_modules.py), with its vocabulary-parallel cross entropy. Both sides
run plain forward/backward/AdamW steps; step time, peak memory and parity are measured as
for the other pairs (peers.py). Bytes per rank per step: ours from the runtime's counters
(tp and dp groups), the peer's from its collectives (torch.distributed's and the functional
ones DTensor issues), counted in one untimed step.
"""

import os

PAIRS = (("TP-4 SP", "DTensor TP-4 SP"), ("TP-2 x ZeRO-3", "FSDP2 + DTensor TP-2"))
MODEL = "llama_tp"


def build():
    import torch
    from models import LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(vocab=1024, hidden=256, heads=8, kv_heads=4, intermediate=688, layers=4)
    return model, list(model.model.layers)


def dp_of(engine):
    return 2 if "2" in engine.split()[0] or engine.startswith("FSDP2") else 1


def torchtitan_plan(model, tp_mesh):
    """torchtitan's Llama tensor/sequence-parallel plan, on examples/models.py's names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    tp = tp_mesh.size()
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                            use_local_output=True),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                      use_local_output=True),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
        # The attention views its projections with its own head counts: the local ones now
        # (torchtitan adjusts its attention the same way).
        layer.self_attn.num_heads //= tp
        layer.self_attn.num_key_value_heads //= tp


class Engine:
    """One side of a pair, built on this rank: ``step(x, y)`` runs forward, backward and the
    optimizer on this rank's share of the batch and returns the local loss; ``bytes_sent()``
    what this rank sent since ``reset_bytes()``; ``full_parameters()`` the whole model."""

    def __init__(self, engine, lr):
        import torch
        import torch.distributed as dist
        self.engine = engine
        self.world = dist.get_world_size()
        model, blocks = build()
        self.ours = not engine.startswith(("DTensor", "FSDP2"))
        dp = dp_of(engine)
        tp = self.world // dp
        self.dp, self.tp = dp, tp
        if self.ours:
            import torch_monarch
            from torch_monarch.tensor_parallel_modules import vocab_parallel_cross_entropy
            self.mesh = torch_monarch.device_mesh(dp=dp, tp=tp)
            self.model = torch_monarch.parallelize(model, self.mesh, sequence_parallel=True,
                                                   zero_stage=3 if dp > 1 else 0, units=blocks)
            mesh = self.mesh
            self.loss = lambda logits, y: vocab_parallel_cross_entropy(logits, y, mesh)
            self.dp_rank = self.mesh.coordinate("dp")
        else:
            import torch.nn.functional as F
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import loss_parallel
            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            torchtitan_plan(model, mesh["tp"])
            if dp > 1:
                from torch.distributed.fsdp import fully_shard
                for block in blocks:
                    fully_shard(block, mesh=mesh["dp"])
                fully_shard(model, mesh=mesh["dp"])
            self.model = model
            self.dp_rank = mesh.get_local_rank("dp")
            self._loss_parallel = loss_parallel

            def loss(logits, y):
                return F.cross_entropy(logits.flatten(0, 1), y.flatten())
            self.loss = loss
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self._counted = 0.0

    @property
    def counts_own_bytes(self):
        return self.ours  # the peer's are counted around its step (time_worker)

    def share(self, x, y, global_batch):
        local = global_batch // self.dp
        return x[self.dp_rank * local:(self.dp_rank + 1) * local], y[self.dp_rank * local:(self.dp_rank + 1) * local]

    def step(self, x, y):
        if self.ours:
            loss = self.loss(self.model(x), y)
            loss.backward()
            value = loss.item()
        else:
            with self._loss_parallel():
                loss = self.loss(self.model(x), y)
                loss.backward()
            value = loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return value

    def reset_bytes(self):
        if self.ours:
            for axis in ("tp", "dp"):
                self.mesh.group(axis).reset_counters()

    def bytes_sent(self):
        return sum(self.mesh.group(axis).total_bytes_sent() for axis in ("tp", "dp"))

    def full_parameters(self):
        state = self.model.state_dict()
        out = {}
        for k, v in state.items():
            out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        return out


def functional_bytes():
    """A dispatch mode counting the bytes this rank sends in the functional collectives
    DTensor issues (ring volumes, as CollectiveBytes in peers.py counts torch.distributed's)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.name() if hasattr(func, "name") else str(func)
            if name.startswith("_c10d_functional::"):
                op = name.split("::")[1].split(".")[0]
                t = args[0]
                size = sum(x.numel() * x.element_size() for x in t) if isinstance(t, (list, tuple)) \
                    else t.numel() * t.element_size()
                ring = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather_into_tensor": lambda n: n - 1,
                        "reduce_scatter_tensor": lambda n: (n - 1) / n, "all_to_all_single": lambda n: (n - 1) / n}
                base = op.replace("_coalesced", "").replace("_out", "")
                if base in ring:  # (wait_tensor moves nothing)
                    self.bytes += ring[base](_group_size(args, kwargs)) * size
            return func(*args, **kwargs)

    return Count()


def _group_size(args, kwargs):
    """The size of the group a functional collective runs over (named by its last str argument)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    name = [a for a in list(args) + list(kwargs.values()) if isinstance(a, str)][-1]  # (a reduce op is one too)
    return _resolve_process_group(name).size()


def time_worker(rounds, warmup, out_dir, kind=None):
    """All four engines of ``kind`` (this module, or peers_pp) in one launch, interleaved round
    by round as peers.time_worker does; rank 0 writes <MODEL>_time.json with the same fields."""
    import sys
    kind = kind or sys.modules[__name__]
    import json
    import statistics
    import time
    import torch
    import torch.distributed as dist
    import torch_monarch
    import peers
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    counter = peers.CollectiveBytes()
    torch_monarch.init()
    rank, n = dist.get_rank(), dist.get_world_size()
    jobs = [dict(engine=e, side=kind.Engine(e, peers.LR), times=[], losses=[]) for pair in kind.PAIRS for e in pair]
    total = warmup + rounds
    for step in range(total):
        x, y = peers.batch(step)
        order = jobs[step % len(jobs):] + jobs[:step % len(jobs)]
        for job in order:
            side = job["side"]
            xs, ys = side.share(x, y, peers.GLOBAL_BATCH)
            dist.barrier()
            start = time.perf_counter()
            loss = side.step(xs, ys)
            elapsed = torch.tensor([time.perf_counter() - start, loss / n])
            slowest = elapsed[:1].clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            mean_loss = elapsed[1:].clone()
            dist.all_reduce(mean_loss)  # tp ranks hold the same loss: the mean over all is the dp mean
            job["losses"].append(mean_loss.item())
            if step >= warmup:
                job["times"].append(slowest.item())
    # Bytes: one more step per engine, untimed (the peer's functional collectives are counted
    # through a dispatch mode, which would slow a timed step).
    x, y = peers.batch(total)
    for job in jobs:
        side = job["side"]
        xs, ys = side.share(x, y, peers.GLOBAL_BATCH)
        side.reset_bytes()
        before = counter.bytes
        if side.counts_own_bytes:
            side.step(xs, ys)
            job["bytes"] = side.bytes_sent()
        else:
            with functional_bytes() as mode:
                side.step(xs, ys)
            job["bytes"] = counter.bytes - before + mode.bytes
    for job in jobs:  # the busiest rank's (a pipeline's middle stages send both ways)
        busiest = torch.tensor([float(job["bytes"])], dtype=torch.float64)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        job["bytes"] = busiest.item()
    params = {job["engine"]: job["side"].full_parameters() for job in jobs}
    if rank == 0:
        model, _ = kind.build()
        opt = torch.optim.AdamW(model.parameters(), lr=peers.LR)
        ref_losses = []
        for step in range(total + 1):
            loss = peers.loss_of(model, *peers.batch(step))
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


def memory_worker(engine, out_dir, kind=None):
    import json
    import torch
    import torch.distributed as dist
    import torch_monarch
    import peers
    from procmem import vm, warm_up_torch
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import sys
    kind = kind or sys.modules[__name__]
    rank = dist.get_rank()
    if not engine.startswith(("DTensor", "FSDP2", "pipelining")):
        torch_monarch.init()  # (the peer's launch runs nothing of ours)
    warm_up_torch()
    dist.barrier()
    baseline = vm("VmRSS")
    side = kind.Engine(engine, peers.LR)
    for step in range(peers.MEMORY_STEPS):
        x, y = peers.batch(step)
        side.step(*side.share(x, y, peers.GLOBAL_BATCH))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peak_growth": vm("VmHWM") - baseline}, f)
    dist.barrier()
    dist.destroy_process_group()
