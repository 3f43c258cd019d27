"""The pipeline pairs of bench/peers.py: torch_monarch's pipeline schedules against
``torch.distributed.pipelining``'s, on an 8-layer Llama-style decoder cut into 4 stages (one
per rank) or 8 (two per rank: interleaved, or as a V), 8 micro-batches of 2 sequences:

    PP-4 1F1B            parallelize(model, mesh(pp=4), schedule="1f1b", micro_batches=8)
      vs pipelining 1F1B PipelineStage per rank + Schedule1F1B
    PP-4 interleaved     parallelize(..., schedule="interleaved_1f1b", virtual_stages=2)
      vs pipelining Interleaved1F1B   two PipelineStages per rank (stages r and r + 4)
    PP-4 ZB-H1           parallelize(..., schedule="zb_h1") (Qi et al. 2023: B and W split)
      vs pipelining ZeroBubble        ScheduleInterleavedZeroBubble over one stage per rank
    PP-4 ZBV             parallelize(..., schedule="zbv") (Qi et al. 2024: two stages per rank
                         as a V, rank r runs stages r and 7 - r)
      vs pipelining ZBVZeroBubble     ScheduleZBVZeroBubble over the same V of 8 stages

The peer's stages are cut by hand, as torchtitan's pipeline_llama does: the embedding on the
first stage, the final norm and the head on the last, layers split evenly. Both sides average
the micro-batches' mean losses (pipelining's scale_grads). Bytes per rank per step: ours from
the runtime's counters (pp group), the peer's from the tensors its stages hand to
batch_isend_irecv (their send ops, counted in one untimed step). Parity and timing as the
other pairs (peers.py).
"""


PAIRS = (("PP-4 1F1B", "pipelining 1F1B"), ("PP-4 interleaved", "pipelining Interleaved1F1B"),
         ("PP-4 ZB-H1", "pipelining ZeroBubble"), ("PP-4 ZBV", "pipelining ZBVZeroBubble"))
MODEL = "llama_pp"
MICRO_BATCHES = 8


def build():
    import torch
    from models import LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(vocab=1024, hidden=256, heads=8, kv_heads=2, intermediate=688, layers=8)
    return model, list(model.model.layers)


def stage_module(model, index, num_stages):
    """Stage ``index`` of ``num_stages`` as its own module (torchtitan cuts the same way)."""
    from torch import nn
    layers = list(model.model.layers)
    per = len(layers) // num_stages

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = model.model.embed_tokens if index == 0 else None
            self.layers = nn.ModuleList(layers[index * per:(index + 1) * per])
            last = index == num_stages - 1
            self.norm = model.model.norm if last else None
            self.head = model.lm_head if last else None

        def forward(self, x):
            if self.embed is not None:
                x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            if self.norm is not None:
                x = self.head(self.norm(x))
            return x

    return Stage()


class Engine:
    """One side of a pair on this rank (peers_tp.Engine's interface)."""

    def __init__(self, engine, lr):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        self.engine = engine
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        model, blocks = build()
        self.names = {id(p): n for n, p in model.named_parameters()}
        interleaved = "nterleaved" in engine
        v_shape = "ZBV" in engine
        zero_bubble = "ZB" in engine or "ZeroBubble" in engine
        self.ours = engine.startswith("PP")
        self._sent = 0.0
        if self.ours:
            import torch_monarch
            self.mesh = torch_monarch.device_mesh(pp=self.world)
            schedule = ("interleaved_1f1b" if interleaved else "zbv" if v_shape else "zb_h1" if zero_bubble
                        else "1f1b")
            self.model = torch_monarch.parallelize(
                model, self.mesh, schedule=schedule, micro_batches=MICRO_BATCHES,
                virtual_stages=2 if interleaved or v_shape else 1, units=blocks)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
            return
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B,
                                                  ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
        per_rank = 2 if interleaved or v_shape else 1
        num_stages = self.world * per_rank
        indices = ([self.rank, num_stages - 1 - self.rank] if v_shape
                   else [self.rank + k * self.world for k in range(per_rank)])
        self.stages = [stage_module(model, i, num_stages) for i in indices]
        self.first, self.last = 0 in indices, num_stages - 1 in indices
        pipe_stages = [PipelineStage(m, i, num_stages, torch.device("cpu")) for m, i in zip(self.stages, indices)]
        self._counting = False
        for st in pipe_stages:
            for what in ("get_fwd_send_ops", "get_bwd_send_ops"):
                original = getattr(st, what)

                def counted(*args, _original=original, **kwargs):
                    ops = _original(*args, **kwargs)
                    if self._counting:
                        self._sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
                    return ops
                setattr(st, what, counted)

        def loss_fn(logits, y):
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())
        if v_shape:
            self.schedule = ScheduleZBVZeroBubble(pipe_stages, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
        elif zero_bubble:
            self.schedule = ScheduleInterleavedZeroBubble(pipe_stages, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
        elif interleaved:
            self.schedule = ScheduleInterleaved1F1B(pipe_stages, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
        else:
            self.schedule = Schedule1F1B(pipe_stages[0], n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
        params = [p for m in self.stages for p in m.parameters()]
        self.opt = torch.optim.AdamW(params, lr=lr)

    counts_own_bytes = True  # ours from the runtime, the peer's from its stages' send ops

    def share(self, x, y, global_batch):
        return x, y  # one pipeline: every rank sees the whole batch (only the ends use it)

    def step(self, x, y):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        if self.ours:
            loss = self.model.train_step(x, y, lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()))
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return loss  # the global mean, on every rank
        losses = []
        if self.first and self.last:
            self.schedule.step(x, target=y, losses=losses)
        elif self.first:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        value = torch.tensor([torch.stack(losses).mean().item() if losses else 0.0], dtype=torch.float64)
        dist.all_reduce(value)  # from the last stage's rank to every rank
        return value.item()

    def reset_bytes(self):
        if self.ours:
            self.mesh.group("pp").reset_counters()
        self._sent = 0.0
        self._counting = True

    def bytes_sent(self):
        if self.ours:
            return self.mesh.group("pp").total_bytes_sent()
        self._counting = False
        return self._sent

    def full_parameters(self):
        import torch.distributed as dist
        if self.ours:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        mine = {self.names[id(p)]: p.detach().clone() for m in self.stages for p in m.parameters()}
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine)
        out = {}
        for part in everyone:
            out.update(part)
        return out
