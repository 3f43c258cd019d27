"""Compiled blocks (``parallelize(..., compile=True)``, torch_monarch.compile) against the same
layouts eager, and against FSDP2 with its blocks compiled as torchtitan compiles them, on the
Llama-style decoder (4 layers, hidden 256), Inductor on CPU, 4 ranks with Gloo:

    dp4 compiled            vs dp4 eager                parallelize(model, mesh(dp=4), compile=True)
    ZeRO-3 compiled         vs ZeRO-3 eager             ... zero_stage=3
    TP-2 x dp2 compiled     vs TP-2 x dp2 eager         ... mesh(tp=2, dp=2)
    PP-2 x dp2 compiled     vs PP-2 x dp2 eager         ... mesh(pp=2, dp=2), 1F1B, 2 micro-batches
    ZeRO-3 compiled         vs FSDP2 compiled           fully_shard per block, each block's
                                                        ``.compile()`` first (torchtitan's
                                                        apply_compile, then apply_fsdp)
    FSDP2 compiled          vs FSDP2 eager              (the peer's own gain, for reference)

Run by bench/compile.py through peers.py's pair worker: engines interleaved round by round,
the first (warm-up) rounds compile; step time is the slowest rank's; parity of every engine
against one eager process on the same batches.
"""

PAIRS = (("dp4 compiled", "dp4 eager"), ("ZeRO-3 compiled", "ZeRO-3 eager"),
         ("TP-2 x dp2 compiled", "TP-2 x dp2 eager"), ("PP-2 x dp2 compiled", "PP-2 x dp2 eager"),
         ("ZeRO-3 compiled", "FSDP2 compiled"), ("FSDP2 compiled", "FSDP2 eager"))
MODEL = "llama_compile"
MICRO_BATCHES = 2


def build():
    import torch
    from models import LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(vocab=1024, hidden=256, heads=8, kv_heads=2, intermediate=688, layers=4)
    return model, list(model.model.layers)


def _axes(engine):
    layout = engine.rsplit(" ", 1)[0]
    if layout.startswith("TP-2"):
        return dict(tp=2, dp=2), {}
    if layout.startswith("PP-2"):
        return dict(pp=2, dp=2), dict(schedule="1f1b", micro_batches=MICRO_BATCHES)
    if layout == "ZeRO-3":
        return dict(dp=4), dict(zero_stage=3)
    return dict(dp=4), {}


class Engine:
    """One engine on this rank (peers_tp.Engine's interface)."""

    def __init__(self, engine, lr):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        self.engine = engine
        compiled = engine.endswith(" compiled")
        model, blocks = build()
        self.ours = not engine.startswith("FSDP2")
        if self.ours:
            import torch_monarch
            from torch_monarch.tensor_parallel_modules import vocab_parallel_cross_entropy
            axes, keywords = _axes(engine)
            self.mesh = torch_monarch.device_mesh(**axes)
            self.model = torch_monarch.parallelize(model, self.mesh, units=blocks, compile=compiled, **keywords)
            mesh = self.mesh
            tp = self.mesh.axis_size("tp")
            self.loss = (lambda logits, y: vocab_parallel_cross_entropy(logits, y, mesh)) if tp > 1 else \
                (lambda logits, y: F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))
            self.dp, self.dp_rank = self.mesh.axis_size("dp"), self.mesh.coordinate("dp")
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            n = dist.get_world_size()
            mesh = init_device_mesh("cpu", (n,))
            for block in blocks:
                if compiled:
                    block.compile()
                fully_shard(block, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
            self.loss = lambda logits, y: F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            self.dp, self.dp_rank = n, dist.get_rank()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    @property
    def counts_own_bytes(self):
        return self.ours

    def share(self, x, y, global_batch):
        local = global_batch // self.dp
        return x[self.dp_rank * local:(self.dp_rank + 1) * local], y[self.dp_rank * local:(self.dp_rank + 1) * local]

    def step(self, x, y):
        if self.ours:
            value = self.model.train_step(x, y, self.loss)
        else:
            loss = self.loss(self.model(x), y)
            loss.backward()
            value = loss.item()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return value

    def reset_bytes(self):
        if self.ours:
            for axis in ("pp", "tp", "dp"):
                self.mesh.group(axis).reset_counters()

    def bytes_sent(self):
        return sum(self.mesh.group(axis).total_bytes_sent() for axis in ("pp", "tp", "dp"))

    def full_parameters(self):
        state = self.model.state_dict()
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def functional_bytes():
    from peers_tp import functional_bytes as count
    return count()
