"""A Lightning training job for test_lightning.py, started the way users start one:
``python lightning_job.py --strategy ddp|monarch ...``; Lightning itself launches the other
ranks (``--devices``, 4 by default, on CPU). Rank 0 writes ``--out``/result.json: every rank's per-step losses and
the final model's state dict (``--out``/state.pt).

    --strategy ddp | monarch        Lightning's DDPStrategy, or MonarchStrategy (with --tp)
    --steps N --save-every K        train N steps, checkpoint every K
    --resume CKPT                   continue from a checkpoint file
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

import lightning as L

VOCAB, HIDDEN, HEADS, SEQ, BATCH = 64, 32, 4, 16, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = HEADS
        # No q/k/v bias: the key bias gets an exactly-zero gradient (softmax ignores a shift
        # shared by all keys), and Adam would turn its rounding noise into steps.
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LanguageModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.example_input_array = torch.zeros(BATCH, SEQ, dtype=torch.long)
        self.losses = []

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, _index):
        ids, targets = batch
        loss = F.cross_entropy(self(ids).reshape(-1, VOCAB), targets.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        # eps 1e-6: the key bias's exact gradient is zero (softmax ignores a shift shared by all
        # keys); with 1e-8 Adam would turn its rounding noise into steps of lr size.
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6)


def dataset(n=64):
    g = torch.Generator().manual_seed(1)
    start = torch.randint(VOCAB, (n, 1), generator=g)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB  # a learnable stream
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=["ddp", "monarch"], required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--zero", type=int, help="MonarchStrategy's zero_stage pin (default: the planner's)")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--resume")
    ap.add_argument("--samples", type=int, default=64, help="dataset size (an epoch: samples / (batch x replicas) steps)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy
        strategy = DDPStrategy(process_group_backend="gloo")
    else:
        from torch_monarch.lightning import MonarchStrategy
        strategy = MonarchStrategy(tp=args.tp, **({"zero_stage": args.zero} if args.zero is not None else {}))
    callbacks = []
    if args.save_every:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=args.out, every_n_train_steps=args.save_every,
                                                             save_top_k=-1, filename="{step}"))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps, callbacks=callbacks,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(args.save_every), use_distributed_sampler=True)
    module = LanguageModel()
    loader = torch.utils.data.DataLoader(dataset(args.samples), batch_size=BATCH, shuffle=False)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=args.resume)
    state = trainer.strategy.lightning_module_state_dict()  # the whole model (collective)
    losses = [None] * trainer.world_size
    torch.distributed.all_gather_object(losses, module.losses)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in state.items()}, os.path.join(args.out, "state.pt"))
        pm = getattr(trainer.strategy, "parallel_model", None)
        plan = pm.plan.summary() if pm is not None and pm.plan is not None else None
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"losses": losses, "global_step": trainer.global_step, "plan": plan}, f)
    # Lightning leaves its Gloo process group to interpreter exit, where tearing it down has
    # aborted a DDPStrategy job once in CI ("terminate called without an active exception"
    # after fit had ended): shut it down here, on every rank.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
