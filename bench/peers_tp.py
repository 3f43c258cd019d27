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
    from torch.utils._python_dispatch import TorchDispatchMode
    from peers import RING_FACTORS

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
                base = op.replace("_coalesced", "").replace("_out", "")
                if base in RING_FACTORS:  # (wait_tensor moves nothing)
                    self.bytes += RING_FACTORS[base](_group_size(args, kwargs)) * size
            return func(*args, **kwargs)

    return Count()


def _group_size(args, kwargs):
    """The size of the group a functional collective runs over (named by its last str argument)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    name = [a for a in list(args) + list(kwargs.values()) if isinstance(a, str)][-1]  # (a reduce op is one too)
    return _resolve_process_group(name).size()
