"""Lightning: ``MonarchStrategy`` runs an unchanged ``LightningModule`` in the layout the planner
picks (or the pins / plan given), launched, logged and looped by Lightning itself.

    trainer = L.Trainer(strategy=MonarchStrategy(), accelerator="cpu", devices=4)
    trainer.fit(module, train_dataloaders=loader)

Lightning starts the processes and the process group (Gloo on CPU, as its DDP strategy does);
``torch_monarch.init`` joins that group's store. In ``setup`` the module goes through
``torch_monarch.parallelize``: read on its ``example_input_array`` (or ``example_input=``),
planned for ``global_batch`` (default: the example's batch on every rank), rewritten (tensor
parallelism splits its layers in place) and wrapped by our data-parallel engine, before Lightning
builds the optimizers from ``configure_optimizers``, so they step on this rank's parameters.
Lightning's loop then calls ``training_step`` through the wrapper, as with DDP.

Layouts: data parallelism, ZeRO-1/2/3, tensor parallelism and their mixes (``pp=1``: Lightning's
loop calls ``training_step`` once per batch, which a pipeline schedule would have to own; a plan
or pin with pp > 1 is refused). Lightning builds its optimizers from the module's own
parameters (``configure_optimizers``); under ZeRO each optimizer is then pointed at this rank's
shards of them, parameter by parameter (same groups and hyperparameters, state still empty), as
Lightning's FSDP strategy builds its optimizers over the sharded parameters. A split output head
gathers its logits, since ``training_step`` computes its loss on whole rows. Gradient clipping by
Lightning (``gradient_clip_val``) sees the module's parameters, whose gradients ZeRO keeps in
the shards: refused under ZeRO.

Checkpoints: the model and the optimizer are saved by ``torch_monarch.checkpoint`` (every rank
writes what it holds, in any layout) in a directory beside the Lightning checkpoint file, which
keeps the rest (loops, callbacks, hyperparameters) and the whole model's state dict (so
``LightningModule.load_from_checkpoint`` works without us). Resuming (``ckpt_path=``) loads both.
"""

import os

import torch
from lightning.pytorch.strategies import DDPStrategy


def _monarch_dir(filepath):
    return os.fspath(filepath) + ".monarch"


class MonarchStrategy(DDPStrategy):
    strategy_name = "monarch"

    def __init__(self, *, global_batch=None, example_input=None, plan=None, process_group_backend="gloo", **pins):
        """``pins``: ``parallelize``'s (``tp``, ``dp``, ``micro_batch``, ``sequence_parallel``,
        ``recompute``, ...); ``plan``: a saved plan to run instead of planning."""
        super().__init__(process_group_backend=process_group_backend)
        if pins.get("pp") not in (None, 1):
            raise ValueError(f"MonarchStrategy: pp={pins['pp']}: Lightning's loop calls training_step once per "
                             "batch, which a pipeline schedule would have to own; only pp=1 runs")
        pins.setdefault("pp", 1)
        self._pins, self._global_batch, self._example, self._plan = pins, global_batch, example_input, plan
        self.parallel_model = None

    def _setup_model(self, model):
        import torch_monarch
        torch_monarch.init()  # joins the process group Lightning made
        if self._plan is not None:
            if self._plan.mesh.pp != 1:
                raise ValueError(f"MonarchStrategy: the plan has pp={self._plan.mesh.pp}; Lightning's loop runs "
                                 "pp=1 only")
            self.parallel_model = torch_monarch.parallelize(model, plan=self._plan)
            return self.parallel_model
        example = self._example if self._example is not None else getattr(model, "example_input_array", None)
        if example is None:
            raise ValueError("MonarchStrategy: the planner reads the model on an example batch: set "
                             "`example_input_array` on the LightningModule, or pass example_input= or plan=")
        global_batch = self._global_batch or _batch_size(example) * self.world_size
        pins = dict(self._pins)
        trainer = getattr(model, "_trainer", None)
        if "zero_stage" not in pins and trainer is not None and trainer.gradient_clip_val:
            pins["zero_stage"] = 0  # Lightning clips the module's own gradients: no ZeRO
        if "tp_plan" not in pins:
            pins["tp_plan"] = _whole_logits_plan(model)
        self.parallel_model = torch_monarch.parallelize(model, example_input=example, global_batch=global_batch,
                                                        **pins)
        return self.parallel_model

    def setup_optimizers(self, trainer):
        super().setup_optimizers(trainer)
        pm = self.parallel_model
        if pm is None or pm.dp == 1 or pm.zero_stage == 0:
            return
        if trainer.gradient_clip_val:
            raise ValueError("MonarchStrategy: gradient_clip_val with ZeRO (zero_stage="
                             f"{pm.zero_stage}): Lightning clips the module's parameters' gradients, which ZeRO "
                             "keeps in this rank's shards; clip in the module (on_before_optimizer_step) or use "
                             "zero_stage=0")
        # configure_optimizers stepped on the module's own parameters; ZeRO steps on this
        # rank's shards of them (the same names).
        shards = dict(pm.named_parameters())
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                params = []
                for p in group["params"]:
                    name = names.get(id(p))
                    if name is None or name not in shards:
                        raise ValueError(f"MonarchStrategy: an optimizer steps on a tensor that is not one of "
                                         f"the module's parameters ({name or tuple(p.shape)}): under ZeRO each "
                                         "optimizer must step on the module's parameters")
                    params.append(shards[name])
                group["params"] = params

    @property
    def distributed_sampler_kwargs(self):
        # One slice of the data per data-parallel replica: the tp ranks of a replica read the
        # same batch (Lightning's default would give every rank its own).
        if self.parallel_model is None:
            return super().distributed_sampler_kwargs
        mesh = self.parallel_model.mesh
        return {"num_replicas": self.parallel_model.dp, "rank": mesh.coordinate("dp")}

    def _register_ddp_hooks(self):
        pass  # no DDP communication hooks: the engine reduces

    def lightning_module_state_dict(self):
        # The whole model (collective: every rank gathers its part), as the unwrapped module
        # would give it: Lightning's own loaders read it.
        if self.parallel_model is None:
            return super().lightning_module_state_dict()
        return self.parallel_model.state_dict()

    def optimizer_state(self, optimizer):
        # Saved by torch_monarch.checkpoint beside the file (each rank's part), not in it.
        return {} if self.parallel_model is not None else super().optimizer_state(optimizer)

    def _optimizer(self):
        if len(self.optimizers) > 1:
            raise ValueError(f"MonarchStrategy: the module configures {len(self.optimizers)} optimizers; "
                             "torch_monarch.checkpoint saves and loads one with the model")
        return self.optimizers[0] if self.optimizers else None

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        from . import checkpoint as monarch_checkpoint
        if self.parallel_model is not None:
            monarch_checkpoint.save(self.parallel_model, self._optimizer(), _monarch_dir(filepath),
                                    step=int(checkpoint.get("global_step", 0)))
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_optimizer_state_dict(self, checkpoint):
        # After setup (Lightning restores the model's weights into the unwrapped module first,
        # which parallelize then lays out): model and optimizer from this rank's parts.
        from . import checkpoint as monarch_checkpoint
        path = getattr(self, "_resume_path", None)
        if self.parallel_model is None or path is None or not os.path.isdir(_monarch_dir(path)):
            return super().load_optimizer_state_dict(checkpoint)
        monarch_checkpoint.load(self.parallel_model, self._optimizer(), _monarch_dir(path))

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        self._resume_path = os.fspath(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=False)

    def remove_checkpoint(self, filepath):
        super().remove_checkpoint(filepath)
        if self.is_global_zero and os.path.isdir(_monarch_dir(filepath)):
            import shutil
            shutil.rmtree(_monarch_dir(filepath))


def _whole_logits_plan(model):
    """The default tensor-parallel plan, with a split output head gathering its logits: an
    unchanged ``training_step`` computes its loss on whole rows (``F.cross_entropy``), not with
    ``vocab_parallel_cross_entropy``."""
    from .tensor_parallel_modules import VocabHead, default_plan
    return {name: VocabHead(gather_output=True) if isinstance(style, VocabHead) else style
            for name, style in default_plan(model).items()}


def _batch_size(example):
    if isinstance(example, torch.Tensor):
        return example.shape[0]
    if isinstance(example, dict):
        example = list(example.values())
    for value in example:
        if isinstance(value, torch.Tensor):
            return value.shape[0]
    raise ValueError("MonarchStrategy: the example input holds no tensor to read the batch size from")
