"""torch_monarch.parallelize: one model, any combination of pipeline (pp), data / fully
sharded (dp) and tensor (tp) parallelism on one mesh, read from a Plan or given by hand.

    model = parallelize(model, plan=plan)            # mesh, stages, schedule, ZeRO, SP from the plan
    opt = torch.optim.AdamW(model.parameters())      # this rank's parameters (or shards)
    for inputs, targets in data:                     # this dp rank's batch
        opt.zero_grad()
        loss = model.train_step(inputs, targets, loss_fn)   # same value on every rank
        opt.step()

Without a pipeline the result is also an ordinary module: ``loss_fn(model(x), y).backward()``.
Under tensor parallelism the model returns logits split along the vocabulary: use
``torch_monarch.vocab_parallel_cross_entropy`` as the loss.
"""

import contextlib

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from . import _runtime, deferred
from . import planner as _planner
from .data_parallel import DataParallel
from .distributed import device_mesh
from .sharded import _default_units, fully_shard
from .pipeline import split_model
from .tensor_parallel_modules import shard_spec, tensor_parallel


def _plan_block_stages(plan, num_units):
    blocks = [layer for layer in plan.layers if str(layer.kind).endswith("block")]
    if len(blocks) != num_units:
        raise ValueError(f"parallelize: the plan has {len(blocks)} transformer blocks, the model has {num_units}; "
                         "the plan was made for another model")
    return [int(layer.stage) for layer in blocks]


def _schedule_kind(name):
    return _planner._enum(_planner.ScheduleKind, name, "schedule") if isinstance(name, str) else name


class ParallelModel(nn.Module):
    """What ``parallelize`` returns. ``parameters()``: what this rank's optimizer steps on.
    ``train_step``: one forward + backward over the local batch (micro-batched through the
    pipeline schedule when pp > 1), gradients synchronised, loss returned on every rank."""

    def __init__(self, model, mesh, *, schedule, micro_batches, virtual_stages, unit_stage, units, tp_plan,
                 sequence_parallel, zero_stage, bucket_cap_mb, sequence_dim, init_fn=None):
        super().__init__()
        self.mesh = mesh
        self.pp, self.dp, self.tp = (mesh.axis_size(a) for a in ("pp", "dp", "tp"))
        self.micro_batches = micro_batches
        self.zero_stage = zero_stage
        self.last_stats = None  # the executor's statistics of the last pipelined step
        units = list(_default_units(model) if units is None else units)
        self.deferred = deferred.is_deferred(model)
        # ZeRO-3 materializes the blocks one at a time inside the engine (each rank keeps its
        # slice); every other layout materializes this rank's stages whole, after the cut.
        per_unit = self.deferred and self.dp > 1 and zero_stage == 3
        if self.deferred and self.tp > 1:
            raise ValueError("parallelize: deferred initialization (a model on meta) with tp > 1 is not supported "
                             "yet: plan with tp=1 (parallelize does so for a meta model), or build the model "
                             "on a device")
        if self.tp > 1:
            tensor_parallel(model, mesh, tp_plan, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                            units=units)
        # Every name a parameter has (a tied weight has two), with how tp cut it.
        self._tp_specs = {f"{mname}.{pname}" if mname else pname: shard_spec(p)
                          for mname, mod in model.named_modules() for pname, p in mod._parameters.items()
                          if p is not None and shard_spec(p)}
        self._executor = None
        if self.pp > 1:
            kind = _schedule_kind(schedule or "1f1b")
            sched = _planner.make_schedule(kind, self.pp, micro_batches, virtual_stages)
            self._executor = _runtime.PipelineExecutor(sched, mesh)
            stages = split_model(model, self.pp * virtual_stages, units, unit_stage)
            self.num_stages = len(stages)
            self._local = list(self._executor.local_stages)
            if self.deferred:
                # Only this rank's stages get storage; the others stay on meta.
                for st in self._local:
                    deferred.materialize(stages.modules[st], init_fn,
                                         skip=stages.units_of(st) if per_unit else ())
                stages.tied = [(n, users, _resolve(stages.modules, users, n, p)) for n, users, p in stages.tied]
            bad = [(n, s) for n, s, _ in stages.tied if not s <= {0, self.num_stages - 1}]
            if bad:
                raise ValueError(f"pipeline: weights {[n for n, _ in bad]} are shared by stages {[sorted(s) for _, s in bad]}; "
                                 "only weights tied between the first and the last stage are supported")
            local_ids = {id(p) for s in self._local for p in stages.modules[s].parameters()}
            # In stages.tied's order, the same on every rank: the two ends pair them up.
            self._tied = [p for _, _, p in stages.tied if id(p) in local_ids]
            self._stage_units = {s: stages.units_of(s) for s in self._local}
            modules = {s: stages.modules[s] for s in self._local}
            stage_modules = stages.modules
        else:
            if self.deferred:
                deferred.materialize(model, init_fn, skip=units if per_unit else ())
            self.num_stages = 1
            self._local = [0]
            self._tied = []
            self._stage_units = {0: units}
            modules = {0: model}
            stage_modules = [model]
        self._plain = modules  # unwrapped stage modules (names, ZB weight passes)
        # Every entry of the (tp-split) model's state dict: its local shape and dtype and the
        # first stage holding it, so full_state_dict() can collect it from its owner.
        self._entries = {}
        for stage, m in enumerate(stage_modules):
            for name, t in m.state_dict().items():
                if name not in self._entries:
                    self._entries[name] = (tuple(t.shape), t.dtype, stage)
        self._sync_initial_replicas()
        self._wrapped = {}
        tied_ids = {id(p) for p in self._tied}
        for s, m in modules.items():
            if self.dp > 1 and zero_stage == 0:
                self._wrapped[s] = DataParallel(m, mesh, bucket_cap_mb=bucket_cap_mb, exclude=tied_ids)
            elif self.dp > 1:
                self._wrapped[s] = fully_shard(m, mesh, units=self._stage_units[s], zero_stage=zero_stage,
                                               ignored_parameters=[p for p in m.parameters() if id(p) in tied_ids],
                                               init_fn=init_fn)
            else:
                self._wrapped[s] = m
        self.stages = nn.ModuleList([self._wrapped[s] for s in self._local])

    # -- what the optimizer sees ------------------------------------------------------
    def parameters(self, recurse: bool = True):
        seen = set()
        for m in self.stages:
            for p in list(m.parameters()) + (list(m.ignored_parameters) if hasattr(m, "ignored_parameters") else []):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def named_local_parameters(self):
        """(name in the original model, tensor, tp shard spec or None) for every parameter
        this rank holds whole along dp (all but ZeRO shards)."""
        for s in self._local:
            seen = set()
            for name, p in self._plain[s].named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p, self._tp_specs.get(name)

    def local_state_dict(self):
        """{name: tensor} of this rank's stages, whole along dp (ZeRO shards are gathered:
        every dp rank must call it), split along tp as ``tp_spec(name)`` says."""
        out = {}
        for s in self._local:
            w = self._wrapped[s]
            out.update(w.state_dict())
        return {k: v.detach() for k, v in out.items()}

    def full_state_dict(self):
        """The whole model's state dict on every rank, under the original names and shapes
        (loads into the unwrapped model): each entry is broadcast along pp from the rank
        holding its stage and, if tp split it, all-gathered along tp. Collective: every rank
        must call it. Memory: the whole model on every rank."""
        local = self.local_state_dict()
        pp_rank = self.mesh.coordinate("pp")
        out = {}
        for name, (shape, dtype, stage) in self._entries.items():
            owner = stage % self.pp
            if owner == pp_rank:
                t = local[name].contiguous().clone()
            else:
                t = torch.empty(shape, dtype=dtype)
            if self.pp > 1:
                self.mesh.group("pp").broadcast(t, owner).wait()
            spec = self._tp_specs.get(name)
            if spec is not None and self.tp > 1:
                stacked = torch.empty((self.tp,) + tuple(t.shape), dtype=t.dtype)
                self.mesh.group("tp").all_gather(stacked, t).wait()
                t = _runtime.unshard_tensor(list(stacked.unbind(0)), spec[0], spec[1])
            out[name] = t
        return out

    def state_dict(self, *args, **kwargs):
        """The whole model's state dict (``full_state_dict()``): loads into the unwrapped
        model, as ``torch.save(model.state_dict())`` users expect. Collective."""
        return self.full_state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True):
        """Loads a whole-model state dict (e.g. from the unwrapped model): every rank keeps
        its slice (its stages, its tp shard, and under ZeRO its dp shard of every unit)."""
        missing = [n for n in self._entries if n not in state_dict]
        unexpected = [n for n in state_dict if n not in self._entries]
        if strict and (missing or unexpected):
            raise RuntimeError(f"parallelize: load_state_dict: missing {missing}, unexpected {unexpected}")
        tp_rank = self.mesh.coordinate("tp")
        for s in self._local:
            # This stage's entries, cut to this rank's tp slices.
            mine = {}
            for name in self._plain[s].state_dict().keys():
                if name not in state_dict:
                    continue
                value = state_dict[name].detach()
                spec = self._tp_specs.get(name)
                if spec is not None:
                    value = _runtime.shard_tensor(value, spec[0], tp_rank, self.tp, spec[1], name)
                shape = self._entries[name][0]
                if tuple(value.shape) != shape:
                    raise RuntimeError(f"parallelize: load_state_dict: {name} has shape {tuple(value.shape)}, "
                                       f"this rank holds {shape}")
                mine[name] = value
            wrapped = self._wrapped[s]
            if hasattr(wrapped, "sharded_state_dict"):
                wrapped.load_state_dict(mine, strict=False)  # ZeRO: keeps this rank's slice of each unit
            else:
                held = self._plain[s].state_dict(keep_vars=True)
                for name, value in mine.items():
                    held[name].copy_(value)
        return _IncompatibleKeys(missing, unexpected)

    def local_batch(self, *tensors):
        """This dp rank's share (along dim 0) of each global-batch tensor: what ``train_step``
        takes. Ranks of one dp replica (across pp and tp) get the same share."""
        dp_rank = self.mesh.coordinate("dp")
        out = []
        for t in tensors:
            if t.shape[0] % self.dp != 0:
                raise ValueError(f"local_batch: a batch of {t.shape[0]} does not split over dp={self.dp}")
            out.append(t.chunk(self.dp, 0)[dp_rank])
        return tuple(out) if len(out) != 1 else out[0]

    def tp_spec(self, name):
        return self._tp_specs.get(name)

    @property
    def local_stages(self):
        return list(self._local)

    @property
    def executor(self):
        return self._executor

    # -- running ------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.pp > 1:
            raise RuntimeError("parallelize: a pipelined model runs through train_step() or predict(), "
                               "not a direct forward")
        return self.stages[0](*args, **kwargs)

    def train_step(self, inputs, targets, loss_fn):
        """Forward and backward of this dp rank's batch (``inputs`` and ``targets`` split into
        the plan's micro-batches along dim 0); returns the mean loss of the global batch on
        every rank. The caller zeroes gradients and steps the optimizer."""
        m = self.micro_batches
        xs, ys = _split(inputs, m, "inputs"), _split(targets, m, "targets")
        if self.pp == 1:
            total = 0.0
            model = self._wrapped[0]
            for k in range(m):
                # Gradient accumulation: data parallelism syncs on the last micro-batch only.
                last = k == m - 1
                with contextlib.nullcontext() if last or not isinstance(model, DataParallel) else model.no_sync():
                    loss = loss_fn(model(*_as_tuple(xs[k])), ys[k]) / m
                    loss.backward()
                total += loss.item()
            self.last_stats = None
        else:
            total = self._pipeline_step(xs, ys, loss_fn)
        return self._global_mean(total)

    @torch.no_grad()
    def predict(self, inputs):
        """Forward only (inference) through the pipeline; returns the model's outputs for
        the whole local batch on ranks of the last stage, None elsewhere."""
        if self.pp == 1:
            return self.stages[0](*_as_tuple(inputs))
        xs = _split(inputs, self.micro_batches, "inputs")
        outputs = {}

        def forward(stage, mb, received):
            out = self._run_stage(stage, mb, received, xs)
            if stage == self.num_stages - 1:
                outputs[mb] = out[0]
            return out

        work = _runtime.AutogradStageWork(self.num_stages, self.micro_batches, forward, None, 1.0)
        self.last_stats = self._executor.run(work, forward_only=True)
        if not outputs:
            return None
        return torch.cat([outputs[k] for k in sorted(outputs)], 0)

    def _run_stage(self, stage, mb, received, xs):
        module = self._wrapped[stage]
        out = module(*_as_tuple(xs[mb])) if stage == 0 else module(*received)
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        for i, t in enumerate(out):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"pipeline: stage {stage} returns a {type(t).__name__} as value {i}; only "
                                "tensors can cross a stage boundary")
        return out

    def _pipeline_step(self, xs, ys, loss_fn):
        def forward(stage, mb, received):
            return self._run_stage(stage, mb, received, xs)

        def loss(mb, outputs):
            return loss_fn(outputs[0], ys[mb])

        def stage_parameters(stage):
            return list(self._plain[stage].parameters())

        def before_backward(stage, mb, is_last):
            w = self._wrapped[stage]
            if isinstance(w, DataParallel):
                w._engine.set_sync(is_last)

        work = _runtime.AutogradStageWork(self.num_stages, self.micro_batches, forward, loss,
                                          1.0 / self.micro_batches, stage_parameters, before_backward)
        mean_loss, self.last_stats = self._executor.train_step(work)  # the loss, sent along pp
        for w in self._wrapped.values():
            if isinstance(w, DataParallel):
                w._engine.set_sync(True)
        if self._tied:
            # Both copies of a weight tied between the ends take the same optimizer step.
            _runtime.sync_tied_gradients(self._tied, self.mesh.group("dp") if self.dp > 1 else None,
                                         self.mesh.pipeline_ends_group())
        return mean_loss

    def _sync_initial_replicas(self):
        """Copies that must stay equal start equal: parameters and buffers tp did not split
        from tp rank 0, weights tied between the pipeline's ends from the first stage (dp
        replicas of everything else are broadcast by the data-parallel / sharded wrappers)."""
        if self.tp > 1:
            seen, replicated = set(), []
            for s in self._local:
                for t in list(self._plain[s].parameters()) + list(self._plain[s].buffers()):
                    if id(t) not in seen and shard_spec(t) is None:
                        seen.add(id(t))
                        replicated.append(t)
            _runtime.broadcast_from_root(replicated, self.mesh.group("tp"))
        if self._tied:
            _runtime.broadcast_from_root(self._tied, self.mesh.pipeline_ends_group())
            if self.dp > 1:  # the dp wrappers leave tied weights to this engine
                _runtime.broadcast_from_root(self._tied, self.mesh.group("dp"))

    def _global_mean(self, value):
        t = torch.tensor([value], dtype=torch.float64)
        if self.dp > 1:
            self.mesh.group("dp").all_reduce(t, average=True).wait()
        return t.item()


def _resolve(stage_modules, users, name, param):
    """The parameter called ``name`` as a local stage now holds it (materializing replaced the
    meta object); the meta one where no local stage holds it."""
    if not param.is_meta:
        return param
    for st in sorted(users):
        try:
            p = stage_modules[st].get_parameter(name)
        except AttributeError:
            continue
        if not p.is_meta:
            return p
    return param


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _split(x, m, what):
    if isinstance(x, tuple):
        parts = [_split(t, m, what) for t in x]
        return [tuple(p[k] for p in parts) for k in range(m)]
    if x.shape[0] % m != 0:
        raise ValueError(f"train_step: the local batch of {x.shape[0]} {what} does not split into {m} "
                         f"micro-batches")
    return list(x.chunk(m, 0))


def parallelize(model: nn.Module, mesh=None, plan=None, *, example_input=None, global_batch=None, cluster=None,
                dtype=None, tp=None, pp=None, dp=None, micro_batch=None, schedule=None, micro_batches=None,
                virtual_stages=None, unit_stage=None, units=None, tp_plan=None, sequence_parallel=None,
                zero_stage=None, bucket_cap_mb=None, sequence_dim=1, init_fn=None, recompute=None) -> ParallelModel:
    """Lays ``model`` out on the mesh.

    With ``example_input`` and ``global_batch`` and no ``plan``: the planner decides. The
    model is read on the meta device, the machine detected and its links probed, rank 0 plans
    (``tp``, ``pp``, ``dp``, ``zero_stage``, ``micro_batch``, ``schedule``, ``virtual_stages``,
    ``sequence_parallel`` pin choices) and broadcasts the plan, so every rank lays the model
    out alike. The plan is on the result as ``.plan``.

    A ``plan`` passed in (or loaded from edited JSON) is first checked against the model (with
    ``example_input``: layer by layer) and the world; every difference is listed in one
    ValueError before any group is created.

    A model built on the meta device (``torch_monarch.meta_init()``) is initialized late:
    each rank materializes only what it keeps (its pipeline stages; under ZeRO-3 one block at
    a time, keeping its slice), initialized by each submodule's ``reset_parameters()`` and
    then ``init_fn(submodule)``, so a model larger than one rank's memory can be
    parallelized (tp must be 1 for now).

    With a ``plan`` (torch_monarch.planner.Plan) the mesh,
    block-to-stage assignment, schedule, micro-batches, virtual stages, ZeRO stage, sequence
    parallelism and bucket size are the plan's; keywords override them.

    ``units``: the blocks a pipeline is cut between (default: the largest ModuleList);
    ``unit_stage``: stage of each block; ``tp_plan``: see ``tensor_parallel``;
    ``zero_stage``: 0 = DDP-style replicas along dp, 1-3 = ZeRO / FSDP.
    Every rank must call it, with the same model architecture; initial weights may differ:
    replicas start from one rank's (dp replicas from dp rank 0's, parameters tp does not
    split from tp rank 0's, weights tied between the pipeline's ends from the first
    stage's). Split weights are cut from each rank's own full weight, so seed alike across
    tp if the split model should equal the unsplit one.
    """
    from .api import check_plan, plan_for_job
    from .distributed import init
    info = None
    if plan is None and example_input is not None:
        if global_batch is None:
            raise ValueError("parallelize: planning needs global_batch= (samples per optimizer step, all ranks together)")
        pins = {k: v for k, v in dict(tp=tp, pp=pp, dp=dp, zero_stage=zero_stage, micro_batch=micro_batch,
                                         schedule=schedule, virtual_stages=virtual_stages,
                                         sequence_parallel=sequence_parallel, recompute=recompute).items()
                if v is not None}
        plan, info = plan_for_job(model, example_input, global_batch, world=init(), cluster=cluster, dtype=dtype,
                                  tp_plan=tp_plan, **pins)
        schedule = virtual_stages = sequence_parallel = zero_stage = None  # the plan's now
    elif plan is None and (tp, pp, dp, micro_batch) != (None, None, None, None):
        raise ValueError("parallelize: tp / pp / dp / micro_batch pins need example_input= and global_batch= "
                         "(to plan), or a mesh=")
    if plan is not None:
        # Everything checked against the model first, locally: a plan for another model is
        # refused on every rank before any group is created.
        if info is None and example_input is not None:
            from .graph import read_model
            info = read_model(model, example_input, tp_plan=tp_plan)
        check_plan(plan, model, info=info, world_size=mesh.size if mesh is not None else init().size)
        blocks = list(_default_units(model) if units is None else units)
        plan_stages = _plan_block_stages(plan, len(blocks))
        if mesh is None:
            mesh = device_mesh(pp=plan.mesh.pp, dp=plan.mesh.dp, tp=plan.mesh.tp)
        elif (mesh.axis_size("pp"), mesh.axis_size("dp"), mesh.axis_size("tp")) != (plan.mesh.pp, plan.mesh.dp, plan.mesh.tp):
            raise ValueError(f"parallelize: the mesh (pp, dp, tp) = ({mesh.axis_size('pp')}, {mesh.axis_size('dp')}, "
                             f"{mesh.axis_size('tp')}) differs from the plan's ({plan.mesh.pp}, {plan.mesh.dp}, {plan.mesh.tp})")
        schedule = schedule if schedule is not None else plan.schedule
        micro_batches = micro_batches or plan.num_micro_batches
        virtual_stages = virtual_stages or plan.virtual_stages
        if unit_stage is None and plan.mesh.pp > 1:
            unit_stage = plan_stages
        sequence_parallel = plan.sequence_parallel if sequence_parallel is None else sequence_parallel
        zero_stage = plan.zero_stage if zero_stage is None else zero_stage
        bucket_cap_mb = bucket_cap_mb or plan.dp_bucket_bytes / (1024 * 1024)
    mesh = mesh if mesh is not None else device_mesh()
    if schedule is not None and str(schedule).endswith("none"):
        schedule = None
    result = ParallelModel(model, mesh, schedule=schedule, micro_batches=micro_batches or 1,
                           virtual_stages=virtual_stages or 1, unit_stage=unit_stage, units=units,
                           tp_plan=tp_plan, sequence_parallel=bool(sequence_parallel), zero_stage=zero_stage or 0,
                           bucket_cap_mb=bucket_cap_mb or 25.0, sequence_dim=sequence_dim, init_fn=init_fn)
    result.plan = plan  # None when laid out by hand
    return result
