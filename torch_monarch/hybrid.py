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
``torch_monarch.vocab_parallel_cross_entropy`` as the loss (it takes whole logits too), or
``parallelize(..., loss_parallel=False)`` to have the head gather them.
"""

import copy
import os
from collections import OrderedDict

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from . import _runtime, deferred
from . import compile as _compile
from . import recompute as _recompute
from . import zero_bubble as _zero_bubble
from . import planner as _planner
from .data_parallel import DataParallel
from .cluster import zero_overlap_pays_here
from .distributed import device_mesh
from .mixed_precision import CastParameters
from .sharded import FullyShardedModule, _default_units, fully_shard
from .pipeline import split_model
from .tensor_parallel_modules import shard_spec, tensor_parallel


def _schedule_kind(name):
    if name is None:
        return None
    kind = _planner._enum(_planner.ScheduleKind, name, "schedule") if isinstance(name, str) else name
    return None if kind == _planner.ScheduleKind.none else kind


def _recompute_kind(mode):
    name = _recompute.check_mode(mode)  # refuses what the runtime cannot do, by name
    return getattr(_planner.Recompute, name)


class ParallelModel(nn.Module):
    """What ``parallelize`` returns. ``parameters()``: what this rank's optimizer steps on.
    ``train_step``: one forward + backward over the local batch (micro-batched through the
    pipeline schedule when pp > 1), gradients synchronised, loss returned on every rank.

    Python does the module-tree work (tensor-parallel module swaps, the pipeline cut,
    hooks, wrappers); the C++ composition engine (``_runtime.Composition``, the same one
    ``monarch::parallelize`` uses) does the rest: micro-batch loop or pipeline schedule,
    replica and tied-weight sync, the global mean loss, whole-model state dicts."""

    def __init__(self, model, mesh, layout, *, units, tp_plan, sequence_dim, init_fn=None, mixed_precision=None,
                 info=None, compile_options=None, loss_parallel=None):
        super().__init__()
        self.mesh = mesh
        self.layout = layout
        self.pp, self.dp, self.tp = layout.pp, layout.dp, layout.tp
        self.micro_batches = layout.micro_batches
        self.zero_stage = layout.zero_stage
        # How the model's own loss averages (train_step's token weighting), read now: the
        # model object itself is not kept here.
        loss_type = getattr(model, "loss_type", None)  # Hugging Face: ForCausalLM, ForMaskedLM, ...
        name = type(model).__name__
        self._causal_lm = loss_type == "ForCausalLM" or (loss_type is None and ("CausalLM" in name or
                                                                               name.endswith("LMHeadModel")))
        zero_stage = layout.zero_stage
        units = list(_default_units(model) if units is None else units)
        # A Hugging Face model's config, as given (hf_checkpoint.save_pretrained writes it).
        config = getattr(model, "config", None)
        self.hf_config = copy.deepcopy(config) if hasattr(config, "save_pretrained") else None
        self.deferred = deferred.is_deferred(model)
        # ZeRO-3 materializes the blocks one at a time inside the engine (each rank keeps its
        # slice); every other layout materializes this rank's stages whole, after the cut (and
        # after tp split them: each rank materializes its shards only). With tp > 1 ZeRO-3's
        # blocks are materialized with the stage too: the weights tp leaves whole must be real
        # before the engine makes them equal across tp, which happens before ZeRO shards them.
        per_unit = self.deferred and self.dp > 1 and zero_stage == 3 and self.tp == 1
        # Experts first (expert parallelism takes each rank's experts from the whole model),
        # then tensor parallelism splits what is left of the blocks.
        self.ep, self.cp = layout.ep, layout.cp
        from .experts import expert_parallel, is_experts_module
        if layout.sequence_parallel and any(is_experts_module(m) for m in model.modules()):
            # The router, the capacity and the load-balancing loss would see one tp rank's part
            # of the sequence, and the tp ranks' expert gradients would be summed.
            raise ValueError("parallelize: sequence_parallel with MoE layers is not supported (the router and "
                             "experts need every token of the sequence on each tp rank): plan with it off")
        if self.ep > 1:
            if self.deferred:
                raise ValueError("parallelize: ep > 1 needs the model's weights (expert parallelism keeps each rank's "
                                 "experts of the whole tensors); build it without meta_init")
            expert_parallel(model, mesh)
        # Context parallelism: each cp rank runs its chunks of every sequence (train_step and
        # predict cut the inputs; attention passes keys and values around the cp ring).
        self._sequence_dim = sequence_dim
        if self.cp > 1:
            from .context_parallel import context_parallel
            if self.pp > 1:
                raise ValueError("parallelize: cp > 1 with a pipeline (pp > 1) is not supported yet")
            context_parallel(model, mesh)
        if self.tp > 1:
            tensor_parallel(model, mesh, tp_plan, sequence_parallel=layout.sequence_parallel,
                            sequence_dim=sequence_dim, units=units, gather_logits=loss_parallel is False)
        # Split logits and a loss that is not vocab_parallel_cross_entropy: train_step says so
        # (a plain cross-entropy would fail on a target beyond this rank's columns, or, where
        # every target falls in them, train on a wrong loss). loss_parallel=True: the caller's
        # loss knows.
        self._check_vocab_loss = self.tp > 1 and loss_parallel is None and bool(
            getattr(model, "_monarch_vocab_split", False))
        # Compiled blocks (compile.py): each block's own forward, after tp swapped its linears
        # and before recomputation wraps it.
        zero_bubble = self.pp > 1 and layout.schedule in (_planner.ScheduleKind.zero_bubble_h1,
                                                           _planner.ScheduleKind.zero_bubble_v)
        _compile.check(compile_options, layout.schedule.name if zero_bubble else None,
                       _recompute.mode_name(layout.recompute))
        if compile_options is not None:
            if not units:
                raise ValueError(f"parallelize: compile=True compiles each block, and {type(model).__name__} has none "
                                 "(no ModuleList of blocks; pass units=[...])")
            _compile.compile_blocks(model, units, compile_options)
        self.compiled = compile_options is not None
        # Inside each block's module hooks (ZeRO's gather and free stay once per block).
        if _recompute.mode_name(layout.recompute) != "none" and not units:
            raise ValueError(f"parallelize: recompute={_recompute.mode_name(layout.recompute)} recomputes blocks, "
                             f"and {type(model).__name__} has none (no ModuleList of blocks; pass units=[...])")
        _recompute.apply(units, _recompute.mode_name(layout.recompute))
        # How many linears wait for the zero-bubble schedule's W pass (0 under other schedules).
        self.deferred_linears = 0
        if zero_bubble:
            # B and W split one backward's work instead of W replaying it.
            self.deferred_linears = _zero_bubble.defer_weight_gradients(model)
        # Every name a parameter has (a tied weight has two), with how tp cut it.
        self._tp_specs = {f"{mname}.{pname}" if mname else pname: shard_spec(p)
                          for mname, mod in model.named_modules() for pname, p in mod._parameters.items()
                          if p is not None and shard_spec(p)}
        # Every name of every parameter -> its first name in the model (model.named_parameters()'
        # name): a weight tied between the pipeline's ends is "lm_head.weight" in the last
        # stage and "wte.weight" in the model; parameters are named as the model names them.
        first = {}
        for pname, p in model.named_parameters():
            first.setdefault(id(p), pname)
        self._canonical = {f"{m}.{n}" if m else n: first[id(p)] for m, mod in model.named_modules()
                           for n, p in mod._parameters.items() if p is not None and id(p) in first}
        pp_rank = mesh.coordinate("pp")
        self._local = list(layout.stages_of(pp_rank))  # the engine's rule (checked against the schedule)
        self._hook_stages = False
        if self.pp > 1:
            from .pipeline import trace_for_cut
            graph, problem = trace_for_cut(model, units)
            if problem is None:
                stages = split_model(model, layout.num_stages, units, list(layout.block_stage), graph=graph)
                from .pipeline_hooks import release_other_stages
                release_other_stages(stages, self._local)
            else:
                # A forward torch.fx cannot trace (Hugging Face models): cut by module hooks,
                # which needs the model as read on an example batch.
                if info is None:
                    raise ValueError(f"parallelize: pp={self.pp} needs the stages cut: {problem}; the hook-based "
                                     "cut needs example_input= (the model as read on an example batch)")
                from .pipeline_hooks import release_other_stages, split_by_hooks
                stages = split_by_hooks(model, layout.num_stages, units, list(layout.block_stage), info)
                release_other_stages(stages, self._local)
                self._hook_stages = True
                if self.deferred:
                    # Every stage runs the model's forward: buffers held by other stages' modules
                    # (rotary tables, position ids) must be real on every rank (they are small).
                    deferred.materialize(model, init_fn, buffers_only=True)
            self.num_stages = len(stages)
            # generate() runs the model's own forward (its KV cache path) on each stage, the
            # other stages' blocks stubbed (generate.py): it needs the model and its blocks.
            # Other stages' weights are on meta by now, so holding the model holds no memory.
            self._root, self._blocks = model, list(units)
            if self.deferred and stages.tied and layout.schedule == _planner.ScheduleKind.zero_bubble_v:
                # Materializing stage by stage would give the first and the last stage (both
                # on rank 0 in the V) two separate copies of the tied weight, with nothing
                # syncing them. Every rank refuses alike, before anything is allocated.
                raise ValueError(f"parallelize: schedule zbv with a model on meta and weights tied between the "
                                 f"first and the last stage ({[n for n, _, _ in stages.tied]}) is not supported; "
                                 "build the model with its weights, or use another schedule")
            if self.deferred:
                # Only this rank's stages get storage; the others stay on meta.
                with _shard_init_rng(mesh, self.tp):
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
                with _shard_init_rng(mesh, self.tp):
                    deferred.materialize(model, init_fn, skip=units if per_unit else ())
            self.num_stages = 1
            self._root, self._blocks = None, list(units)
            self._tied = []
            self._stage_units = {0: units}
            modules = {0: model}
            stage_modules = [model]
        self._plain = modules  # unwrapped stage modules (names, ZB weight passes)
        # Every entry of the (tp-split) model's state dict: its local shape and dtype, the
        # first stage holding it and how tp split it, for the engine's whole-model state dict.
        entries, seen_names = [], set()
        for stage, m in enumerate(stage_modules):
            for name, t in m.state_dict(keep_vars=True).items():
                if name not in seen_names:
                    seen_names.add(name)
                    spec = self._tp_specs.get(name)
                    entries.append(_runtime.StateEntry(name, t.detach(), stage, spec[0] if spec else None,
                                                       spec[1] if spec else 1,
                                                       experts=bool(getattr(t, "_monarch_expert", False))))
        # Copies that must stay equal start equal (in the engine's constructor, before the
        # dp wrappers take their shards): parameters and buffers tp did not split from tp
        # rank 0, weights tied between the pipeline's ends from the first stage.
        replicated = []
        if self.tp > 1:
            seen = set()
            for st in self._local:
                for t in list(self._plain[st].parameters()) + list(self._plain[st].buffers()):
                    if id(t) not in seen and shard_spec(t) is None:
                        seen.add(id(t))
                        replicated.append(t)
        local_stages = []
        for st in self._local:
            seen, params = set(), []
            for p in self._plain[st].parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
            local_stages.append((st, params, None))
        self._composition = _runtime.Composition(layout, mesh, local_stages, entries, self._tied, replicated)
        self._wrapped = {}
        tied_ids = {id(p) for p in self._tied}
        # The plan's compute dtype when it is not the parameters' (mixed_precision.py): ZeRO's
        # engine casts what it shards; everything else (plain replicas, tp, pp, the weights
        # tied between the pipeline's ends) is cast per forward here. Gradients and optimizer
        # state stay in the parameters' dtype; the dp reduction travels in bf16 when the plan
        # computes in it (the planner's grad_bytes = 2; FSDP's reduce_dtype defaults to its
        # param_dtype), and ZeRO's reduce-scatter in the compute dtype already.
        self.mixed_precision = mixed_precision
        self._casts = []
        if mixed_precision is not None:
            zero_casts = self.dp * self.cp > 1 and zero_stage > 0
            for s, m in modules.items():
                only = {id(p) for p in m.parameters() if id(p) in tied_ids} if zero_casts else None
                self._casts.append(CastParameters(m, mixed_precision, only=only))
        replicas = self.dp * self.cp  # ranks holding other tokens of the same weights
        for s, m in modules.items():
            if replicas > 1 and zero_stage == 0:
                self._wrapped[s] = DataParallel(m, mesh, bucket_cap_mb=layout.bucket_bytes / (1024 * 1024),
                                                exclude=tied_ids, reduction=layout.dp_reduction,
                                                inter_node_compression=layout.inter_node_compression,
                                                # fp16 sums would overflow before the average
                                                reduce_dtype=mixed_precision if mixed_precision == torch.bfloat16
                                                else None)
                self._composition.set_data_parallel(s, self._wrapped[s]._engine)
                for engine in self._wrapped[s]._engines[1:]:  # experts over edp
                    self._composition.add_data_parallel(s, engine)
            elif replicas > 1:
                self._wrapped[s] = fully_shard(m, mesh, units=self._stage_units[s], zero_stage=zero_stage,
                                               ignored_parameters=[p for p in m.parameters() if id(p) in tied_ids],
                                               init_fn=init_fn, mixed_precision=mixed_precision,
                                               reduction=layout.dp_reduction,
                                               inter_node_compression=layout.inter_node_compression,
                                               overlap=layout.zero_overlap)
                self._composition.set_fully_shard(s, self._wrapped[s]._engine)
                for engine, _, _ in self._wrapped[s]._engines[1:]:  # experts over edp
                    self._composition.add_fully_shard(s, engine)
            else:
                self._wrapped[s] = m
        self.stages = nn.ModuleList([self._wrapped[s] for s in self._local])
        # Under a pipeline the other ranks' stages' weights went to meta at the cut; what else
        # the model as built held (tensors its forward cached, the caller's references) becomes
        # garbage once the caller lets go of it, but reference cycles among modules keep it until
        # a collection runs, which a training loop may not trigger for many steps (measured
        # before the release at the cut: a pp=2 rank of a 285 MB model held the other stage's
        # 144 MiB through its whole run). The first step collects once.
        self._collect_before_first_step = self.pp > 1

    # -- what the optimizer sees ------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """What this rank's optimizer steps on, under the names the parameters have in the
        original model: its stages' parameters (tp shards where tp split them), ZeRO's
        per-parameter shards in their place (rows along dim 0, same number of dimensions),
        so parameter groups by name or shape work as for the unwrapped model. A weight tied
        between the pipeline's ends appears once, under its first name."""
        seen = set()
        dot = "." if prefix else ""
        for s in self._local:
            wrapped = self._wrapped[s]
            named = list(wrapped.named_parameters()) if isinstance(wrapped, FullyShardedModule) else []
            ignored = {id(p) for p in getattr(wrapped, "ignored_parameters", ())}
            plain = [(n, p) for n, p in self._plain[s].named_parameters()
                     if not named or id(p) in ignored]
            for name, p in named + plain:
                if id(p) not in seen:
                    seen.add(id(p))
                    yield f"{prefix}{dot}{self._canonical.get(name, name)}", p

    def parameters(self, recurse: bool = True):
        for _, p in self.named_parameters():
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
        self._composition.expect_all("state_dict()")
        return OrderedDict(self._composition.full_state_dict(self.local_state_dict()))

    def state_dict(self, *args, **kwargs):
        """The whole model's state dict (``full_state_dict()``): loads into the unwrapped
        model, as ``torch.save(model.state_dict())`` users expect. Collective."""
        return self.full_state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True):
        """Loads a whole-model state dict (e.g. from the unwrapped model): every rank keeps
        its slice (its stages, its tp shard, and under ZeRO its dp shard of every unit)."""
        missing, unexpected = self._composition.compare_keys(list(state_dict.keys()))
        if strict and (missing or unexpected):
            raise RuntimeError(f"parallelize: load_state_dict: missing {missing}, unexpected {unexpected}")
        names = [n for s in self._local for n in self._plain[s].state_dict().keys()]
        # This rank's tp slices, every shape checked (all problems in one error).
        wanted = set(names)
        mine_all = self._composition.local_slices({k: v for k, v in state_dict.items() if k in wanted}, names)
        for s in self._local:
            mine = {n: mine_all[n] for n in self._plain[s].state_dict().keys() if n in mine_all}
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
        out = [self._composition.local_batch(t) for t in tensors]
        return tuple(out) if len(out) != 1 else out[0]

    def tp_spec(self, name):
        return self._tp_specs.get(name)

    @property
    def local_stages(self):
        return list(self._local)

    @property
    def executor(self):
        return self._composition.executor

    @property
    def last_stats(self):
        """The pipeline executor's statistics of the last step (None without a pipeline)."""
        return self._composition.last_stats

    def trace(self, path):
        """Collective (every rank calls it): writes the measured timeline of every rank (each
        pipeline action and collective this process recorded, from a ring buffer that is
        always on; MONARCH_TRACE=off disables it) as one Chrome trace-event JSON file at
        ``path``, written by rank 0. Perfetto and chrome://tracing open it; ``monarch-plan
        report plan.json --trace path`` draws it under the plan's predicted timeline."""
        _runtime.save_trace(os.fspath(path), self.mesh)

    # -- running ------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.pp > 1:
            raise RuntimeError("parallelize: a pipelined model runs through train_step() or predict(), "
                               "not a direct forward")
        return self.stages[0](*args, **kwargs)

    def train_step(self, inputs, targets=None, loss_fn=None):
        """Forward and backward of this dp rank's batch (``inputs`` and ``targets`` split into
        the plan's micro-batches along dim 0); returns the mean loss of the global batch on
        every rank. The caller zeroes gradients and steps the optimizer.

        ``inputs``: a tensor, a tuple of positional inputs, or a dict of keyword inputs (a
        Hugging Face batch: ``input_ids``, ``attention_mask``, ``labels``, ...). The loss is
        ``loss_fn(output, targets)``, ``loss_fn(output)`` without targets, or, with neither,
        the model's own (``output.loss``, ``output["loss"]``, or the output itself when it is a
        single value).

        dp ranks may hold different numbers of samples (the last batch of an epoch): losses
        and gradients are weighted by each rank's sample count, so both are the mean over the
        whole global batch as one process would compute it (``loss_fn`` returns the mean over
        its samples, as ``F.cross_entropy`` does). A model's own loss over ``labels`` (Hugging
        Face's: the mean over label tokens that are not -100, after the causal shift for causal
        LMs) is weighted by those tokens instead, micro-batch by micro-batch, so padding
        spread unevenly over ranks still gives the global batch's token mean."""
        if self._collect_before_first_step:
            import gc
            self._collect_before_first_step = False
            gc.collect()
        m = self.micro_batches
        if self.cp > 1:
            # This cp rank's chunks of every sequence, inputs and targets cut alike; each rank's
            # loss is the mean over its tokens, and the engine averages over dp x cp.
            if targets is None and loss_fn is None:
                raise ValueError("parallelize: under cp > 1 train_step needs targets and loss_fn (a model's own "
                                 "loss would shift labels inside the model, across the chunks)")
            length = self._sequence_length(inputs)
            if isinstance(targets, torch.Tensor) and (targets.dim() <= self._sequence_dim
                                                      or targets.size(self._sequence_dim) != length):
                raise ValueError(f"parallelize: under cp > 1 targets must be per token, with the inputs' sequence "
                                 f"length {length} along dim {self._sequence_dim}; got shape {tuple(targets.shape)}")
            inputs, targets = self._cut_sequences(inputs, length), self._cut_sequences(targets, length)
        xs = _split(inputs, m, "inputs")
        ys = _split(targets, m, "targets") if targets is not None else [None] * m
        counts = _label_tokens(self._causal_lm, xs) if targets is None and loss_fn is None else None
        local = sum(counts) if counts is not None else _batch_size(inputs)

        def loss_of(mb, out):
            def call():
                return (loss_fn(out, ys[mb]) if targets is not None else loss_fn(out)) if loss_fn is not None \
                    else _model_loss(out)
            value = _vocab_split_loss(self, call, out) if loss_fn is not None and self._check_vocab_loss else call()
            if counts is None:
                return value
            # The composition averages micro-batches and weighs ranks by `local`: scaled so the
            # sum over both is the token mean (a micro-batch without label tokens adds 0).
            return value * (m * counts[mb] / local) if counts[mb] else _zero_loss(out, value)

        if self.pp == 1:
            # The model's output may be anything the loss takes: it stays here, not in C++.
            outputs = {}

            def forward(stage, mb, received):
                outputs[mb] = _call(self._wrapped[0], xs[mb])
                return []

            def loss(mb, _):
                return loss_of(mb, outputs.pop(mb))
        else:
            last = self.num_stages - 1

            def forward(stage, mb, received):
                out = self._run_stage(stage, mb, received, xs)
                if stage == last and self._hook_stages:
                    return [loss_of(mb, out)]  # the model's output is whatever it returns: its loss crosses
                return out

            def loss(mb, out):
                return out[0] if self._hook_stages else loss_of(mb, out[0])
        try:
            return self._composition.train_step(forward, loss, samples=local)
        finally:
            self.release_cast_copies()  # every backward of the step has run (or it failed)

    def release_cast_copies(self):
        """Mixed precision's per-forward copies dropped: attribute lookup finds the master
        parameters again (torch_monarch.mixed_precision; train_step does it at its end)."""
        for cast in self._casts:
            cast.release()

    def _cut_sequences(self, x, length):
        """Under cp: this rank's chunks (along the sequence dimension) of the tensors of ``x``
        (a tensor, or the tensors of a tuple / dict) whose ``sequence_dim`` has the inputs'
        sequence ``length``; other tensors (per sample) stay whole. A ``labels`` entry is
        refused: a model shifting its labels inside would pair the end of one chunk with the
        start of another."""
        from .context_parallel import shard_sequence
        dim = self._sequence_dim
        if isinstance(x, dict) and "labels" in x:
            raise ValueError("parallelize: under cp > 1 pass labels as train_step's targets with a loss_fn, not "
                             "as the model's 'labels' input (the model would shift them across chunks)")

        def cut(t):
            if isinstance(t, torch.Tensor) and t.dim() > dim and t.size(dim) == length:
                return shard_sequence(t, self.mesh, dim=dim)
            return t
        if isinstance(x, dict):
            return {k: cut(v) for k, v in x.items()}
        if isinstance(x, (tuple, list)):
            return type(x)(cut(t) for t in x)
        return cut(x)

    def _sequence_length(self, x):
        """The length along ``sequence_dim`` of the first input tensor that has that dimension."""
        dim = self._sequence_dim
        tensors = list(x.values()) if isinstance(x, dict) else list(x) if isinstance(x, (tuple, list)) else [x]
        length = next((t.size(dim) for t in tensors if isinstance(t, torch.Tensor) and t.dim() > dim), None)
        if length is None:
            raise ValueError(f"parallelize: under cp > 1 the inputs need a sequence dimension (dim {dim}); "
                             "none of them has one")
        return length

    @torch.no_grad()
    def predict(self, inputs):
        """Forward only (inference) through the pipeline; returns the model's outputs for
        the whole local batch on ranks of the last stage, None elsewhere. Under cp the inputs
        are cut along the sequence and a tensor output is gathered back whole."""
        if self.pp == 1:
            if self.cp > 1:
                from .context_parallel import gather_sequence
                length = self._sequence_length(inputs)
                out = _call(self.stages[0], self._cut_sequences(inputs, length))
                dim = self._sequence_dim
                if not isinstance(out, torch.Tensor) or out.dim() <= dim:
                    raise ValueError("parallelize: under cp > 1 predict gathers a tensor output along the sequence; "
                                     f"the model returned {type(out).__name__}"
                                     + (f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else ""))
                return gather_sequence(out, self.mesh, dim=dim)
            return _call(self.stages[0], inputs)
        xs = _split(inputs, self.micro_batches, "inputs")
        outputs = {}

        def forward(stage, mb, received):
            out = self._run_stage(stage, mb, received, xs)
            if stage == self.num_stages - 1:
                outputs[mb] = out if self._hook_stages else out[0]
                if self._hook_stages:
                    return []
            return out

        self._composition.predict(forward)
        if not outputs:
            return None
        if not all(isinstance(outputs[k], torch.Tensor) for k in outputs):
            return [outputs[k] for k in sorted(outputs)]  # the model's own outputs, per micro-batch
        return torch.cat([outputs[k] for k in sorted(outputs)], 0)

    def generate(self, input_ids, max_new_tokens, attention_mask=None, temperature=0.0, top_k=None, top_p=None,
                 eos_token_id=None, pad_token_id=None, seed=0, micro_batches=None, cache="static"):
        """Token-by-token generation with the model's KV cache (torch_monarch/generate.py):
        this rank's prompts [batch, prompt_len] (left-padded, ``attention_mask`` 0 on the
        padding) -> [batch, prompt_len + generated], the same on every tp and pp rank. Greedy at
        ``temperature=0``; sampled (top-k, top-p) from one generator seeded with ``seed``.
        ``micro_batches`` (pp > 1): the batch cut into that many groups of rows that follow each
        other round the pipeline; default: the inference plan's ``decode_micro_batches``, else 1.
        ``cache``: "static" (the KV cache pre-allocated for prompt + max_new_tokens, written in
        place, as the planner's memory counts it) or "dynamic" (grown token by token)."""
        from .generate import generate
        return generate(self, input_ids, max_new_tokens, attention_mask=attention_mask, temperature=temperature,
                        top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id, seed=seed,
                        micro_batches=micro_batches, cache=cache)

    def _run_stage(self, stage, mb, received, xs):
        module = self._wrapped[stage]
        if self._hook_stages:  # every stage runs the model's forward on the micro-batch's inputs
            out = module(*received, _monarch_inputs=xs[mb])
            if stage == self.num_stages - 1:
                return out  # the model's output (a loss is taken from it here)
        else:
            out = _call(module, xs[mb]) if stage == 0 else module(*received)
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        for i, t in enumerate(out):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"pipeline: stage {stage} returns a {type(t).__name__} as value {i}; only "
                                "tensors can cross a stage boundary")
        return out


def _shard_init_rng(mesh, tp):
    """While a model on meta is materialized after tp split it: the default generator seeded
    per tp rank (as tensor_parallel's per-rank generator is), so the ranks' shards of a split
    weight are different draws, not copies of one another (the weights tp leaves whole are
    made equal from tp rank 0 afterwards). Restored after."""
    import contextlib
    if tp == 1:
        return contextlib.nullcontext()
    from .tensor_parallel_modules import TensorParallelRNG
    return TensorParallelRNG(torch.initial_seed(), mesh.coordinate("tp")).fork()


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


def _call(module, inputs):
    """A module called on one micro-batch: keyword inputs from a dict, positional otherwise."""
    if isinstance(inputs, dict):
        return module(**inputs)
    return module(*_as_tuple(inputs))


def _split(x, m, what):
    if isinstance(x, dict):
        parts = {k: _split(v, m, f"{what}['{k}']") if isinstance(v, torch.Tensor) else [v] * m
                 for k, v in x.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(m)]
    if isinstance(x, tuple):
        parts = [_split(t, m, what) for t in x]
        return [tuple(p[k] for p in parts) for k in range(m)]
    if x.shape[0] % m != 0:
        raise ValueError(f"train_step: the local batch of {x.shape[0]} {what} does not split into {m} "
                         f"micro-batches")
    return list(x.chunk(m, 0))


def _batch_size(inputs):
    if isinstance(inputs, dict):
        inputs = tuple(v for v in inputs.values() if isinstance(v, torch.Tensor))
    first = inputs[0] if isinstance(inputs, tuple) else inputs
    return first.shape[0]


def _vocab_split_loss(pm, call, out):
    """``call()``: the loss_fn on a micro-batch's logits split along the vocabulary, checked to have gone
    through vocab_parallel_cross_entropy (every tp rank of the stage computing the loss raises
    alike; under pp the other stages' ranks then fail as at any loss error)."""
    from . import tensor_parallel_modules as tpm
    before = tpm.VOCAB_PARALLEL_LOSSES[0]
    problem = (f"parallelize: the model's output head splits the vocabulary over tp={pm.tp} (each rank's logits "
               f"hold {out.shape[-1] if isinstance(out, torch.Tensor) else 'a share'} of the columns), and the "
               "loss_fn given to train_step did not call torch_monarch.vocab_parallel_cross_entropy(logits, "
               "targets, model.mesh), which takes them as they are (and whole logits too); or pass "
               "loss_parallel=False to parallelize to have the head gather them (whole logits on every rank), "
               "or loss_parallel=True if your loss handles split logits itself")
    try:
        value = call()
    except Exception as e:
        if tpm.VOCAB_PARALLEL_LOSSES[0] == before:
            raise ValueError(f"{problem} (it raised {type(e).__name__}: {e})") from e
        raise
    if tpm.VOCAB_PARALLEL_LOSSES[0] == before:
        raise ValueError(problem)
    return value


def _model_loss(out):
    """The loss a model computed itself (Hugging Face's ``labels=``)."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor) and out.numel() == 1:
        loss = out
    if loss is None:
        raise ValueError(f"train_step: the model returned a {type(out).__name__} without a loss; pass "
                         "labels in the inputs (Hugging Face models compute their loss from them) or a loss_fn")
    return loss


def _zero_loss(out, value):
    """The loss of a micro-batch without label tokens: 0, with a backward through the model's
    other outputs (its logits) that gives every parameter a zero gradient. The model's own
    loss there is 0/0 (NaN), whose backward would make every gradient NaN even scaled by 0.
    A model returning its loss alone (no other output to build the zero from) still gets
    ``value * 0``: NaN there."""
    if isinstance(out, dict):  # Hugging Face's ModelOutput is one
        parts = [t.sum() * 0.0 for k, t in out.items() if k != "loss" and isinstance(t, torch.Tensor)
                 and t.is_floating_point() and t.requires_grad]
        if parts:
            return sum(parts)
    return value * 0.0


def _label_tokens(causal, xs):
    """Per micro-batch, the label tokens a model's own loss averages over (Hugging Face: labels
    other than -100; a causal LM predicts token t+1 from t, so its first label is never used);
    None without labels (the loss is then taken as a mean over samples)."""
    if not all(isinstance(x, dict) and isinstance(x.get("labels"), torch.Tensor) for x in xs):
        return None
    counts = []
    for x in xs:
        labels = x["labels"]
        used = labels[..., 1:] if causal and labels.dim() > 1 else labels
        counts.append(int((used != -100).sum()))
    return counts


def parallelize(model: nn.Module, mesh=None, plan=None, *, example_input=None, global_batch=None, cluster=None,
                dtype=None, tp=None, pp=None, dp=None, micro_batch=None, schedule=None, micro_batches=None,
                virtual_stages=None, unit_stage=None, units=None, tp_plan=None, sequence_parallel=None,
                zero_stage=None, bucket_cap_mb=None, sequence_dim=1, init_fn=None, recompute=None,
                embeddings=None, profile=None, compile=None, ep=None, cp=None, mode="training", batch=None,
                prompt_len=None, max_new_tokens=None, latency_target=None, objective=None,
                inference_options=None, loss_parallel=None) -> ParallelModel:
    """Lays ``model`` out on the mesh.

    ``mode="inference"`` (with ``example_input``, ``batch`` sequences per replica, ``prompt_len``
    and ``max_new_tokens``; ``latency_target`` seconds or ``objective="throughput"`` for the most
    tokens/s under it): the planner's inference objective chooses tp x pp (pins ``tp`` / ``pp``)
    with dp replicas, and ``generate`` decodes with the plan's micro-batches (torch_monarch.api.plan,
    docs/cost_model.md "Inference"). ``inference_options``: more of planner.plan_inference's
    keywords (hbm_efficiency, host_seconds_per_op, ops_per_block, host_seconds_per_step,
    host_overlaps_device, max_batch, weight_bytes, kv_bytes), e.g. this machine's eager dispatch cost per operator.

    With ``example_input`` and ``global_batch`` and no ``plan``: the planner decides. The
    model is read on the meta device, the machine detected and its links probed, rank 0 plans
    (``tp``, ``pp``, ``dp``, ``zero_stage``, ``micro_batch``, ``schedule``, ``virtual_stages``,
    ``sequence_parallel``, ``ep`` (experts over ep ranks of dp x cp), ``cp`` (the sequence over
    cp ranks) pin choices) and broadcasts the plan, so every rank lays the model
    out alike. The plan is on the result as ``.plan``. ``profile``: per-layer times measured
    on this machine (``torch_monarch.profile.measure``; a MeasuredProfile or its JSON path)
    for the planner to use instead of its analytic model.

    A ``plan`` passed in (or loaded from edited JSON) is first checked against the model (with
    ``example_input``: layer by layer) and the world; every difference is listed in one
    ValueError before any group is created.

    A model built on the meta device (``torch_monarch.meta_init()``) is initialized late:
    each rank materializes only what it keeps (its pipeline stages; under ZeRO-3 one block at
    a time, keeping its slice), initialized by each submodule's ``reset_parameters()`` and
    then ``init_fn(submodule)``, so a model larger than one rank's memory can be
    parallelized (a Hugging Face model's ``_init_weights`` is the default ``init_fn``; its
    weights then load with ``torch_monarch.hf_checkpoint.load_pretrained``).

    With a ``plan`` (torch_monarch.planner.Plan) the mesh,
    block-to-stage assignment, schedule, micro-batches, virtual stages, ZeRO stage, sequence
    parallelism, recomputation and bucket size are the plan's; keywords override them. The
    plan's compute dtype (laid out by hand: ``dtype=``, e.g. ``torch.bfloat16``) is carried
    out in every layout: where it is not the parameters' dtype they stay the master weights
    (the optimizer's, with their gradients and its state in their dtype) and each forward
    computes with copies in the compute dtype (ZeRO casts what it gathers; the rest is cast
    per forward, torch_monarch.mixed_precision), floating-point inputs cast alike, and the dp
    reduction of a bf16 plan travels in bf16.
    ``recompute="full"`` re-runs each block's forward in its backward, ``"selective"`` only its
    attention core (torch_monarch.recompute).

    ``compile=True`` (or a dict of ``torch.compile`` keywords) compiles each block's forward
    inside the layout's wrappers (torch_monarch.compile): parity with eager, no graph break
    from the runtime inside a block.

    ``loss_parallel``: under tp > 1 the default plan splits the output head along the
    vocabulary. None (the default) and True keep its logits split: no rank holds the whole
    vocabulary's logits (what the planner's memory counts) and the loss is
    ``torch_monarch.vocab_parallel_cross_entropy``; with None, ``train_step`` raises one clear
    error when the ``loss_fn`` it gets did not call it (a plain cross-entropy would fail on a
    target beyond this rank's columns, or train on a wrong loss), with True the caller's loss
    is trusted. False gathers them (an all-gather per forward): the model returns what the
    unsplit model returns and any loss works, at the memory of whole logits per rank
    (torchtitan without loss parallelism). Models computing their own loss (Hugging Face's
    ``labels=``) always gather.

    ``units``: the blocks a pipeline is cut between (default: the ModuleList holding the most parameters, else a
    run of same-type children when the model is an nn.Sequential);
    ``unit_stage``: stage of each block; ``tp_plan``: see ``tensor_parallel``;
    ``zero_stage``: 0 = DDP-style replicas along dp, 1-3 = ZeRO / FSDP.
    A model holding an ``EmbeddingBagCollection`` (recommendation models) has its tables
    planned and sharded over every rank and the rest run data-parallel
    (``torch_monarch.embeddings.parallelize_recommendation``); ``embeddings`` passes the
    tables' options (``optimizer``, ``lr``, ``pins``, ``plan``, ...). ``.plan`` is then the
    tables' EmbeddingPlan.

    Every rank must call it, with the same model architecture; initial weights may differ:
    replicas start from one rank's (dp replicas from dp rank 0's, parameters tp does not
    split from tp rank 0's, weights tied between the pipeline's ends from the first
    stage's). Split weights are cut from each rank's own full weight, so seed alike across
    tp if the split model should equal the unsplit one.
    """
    from .api import check_plan, plan_for_job
    from .distributed import init
    from .embeddings import EmbeddingBagCollection, EmbeddingCollection, parallelize_recommendation
    from .interop import refuse_foreign_layout
    refuse_foreign_layout(model, "torch_monarch.parallelize")
    compile_options = _compile.compile_options(compile)
    if any(isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)) for m in model.modules()):
        ignored = {k: v for k, v in dict(mesh=mesh, example_input=example_input, dtype=dtype, tp=tp, pp=pp, dp=dp,
                                         ep=ep, cp=cp,
                                         micro_batch=micro_batch, schedule=schedule, micro_batches=micro_batches,
                                         virtual_stages=virtual_stages, unit_stage=unit_stage, units=units,
                                         tp_plan=tp_plan, sequence_parallel=sequence_parallel, zero_stage=zero_stage,
                                         init_fn=init_fn, recompute=recompute, profile=profile,
                                         compile=compile_options).items()
                   if v is not None}
        if plan is not None or ignored:
            raise ValueError("parallelize: a model with embedding tables runs its dense part data-parallel over every "
                             f"rank; {sorted(ignored) + (['plan'] if plan is not None else [])} cannot be honoured "
                             "(pass the tables' plan as embeddings=dict(plan=...))")
        return parallelize_recommendation(model, global_batch=global_batch, cluster=cluster,
                                          bucket_cap_mb=bucket_cap_mb or 25.0, **(embeddings or {}))
    if embeddings is not None:
        raise ValueError("parallelize: embeddings= given, but the model holds no embedding collection")
    if init_fn is None and any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
                               for c in type(model).__mro__):
        # A Hugging Face model built on meta is initialized as its own constructor would
        # (its _init_weights(module): weights, and buffers such as rotary tables).
        init_fn = model._init_weights
    info = None
    if mode not in ("training", "inference"):
        raise ValueError(f"parallelize: mode must be 'training' or 'inference', got {mode!r}")
    if loss_parallel not in (None, True, False):
        raise ValueError(f"parallelize: loss_parallel must be None, True or False, got {loss_parallel!r}")
    generation = dict(batch=batch, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                      latency_target=latency_target, objective=objective)
    if inference_options is not None:
        known = {"hbm_efficiency", "host_seconds_per_op", "ops_per_block", "host_seconds_per_step",
                 "host_overlaps_device", "max_batch", "weight_bytes", "kv_bytes", "tie_tolerance"}
        unknown = sorted(set(inference_options) - known)
        if mode != "inference" or unknown:
            raise ValueError("parallelize: inference_options are planner.plan_inference's keywords for "
                             f"mode='inference' ({sorted(known)}); got {sorted(inference_options)} with mode={mode!r}")
        generation.update(inference_options)
    if mode == "training" and any(v is not None for v in generation.values()):
        raise ValueError(f"parallelize: {sorted(k for k, v in generation.items() if v is not None)} plan generation: "
                         "pass mode='inference'")
    if mode == "inference":
        if plan is not None or mesh is not None or example_input is None:
            raise ValueError("parallelize: mode='inference' plans generation: it needs example_input= (and no plan= "
                             "or mesh=: lay a given inference plan out with plan=)")
        if batch is None or prompt_len is None or max_new_tokens is None:
            raise ValueError("parallelize: mode='inference' needs batch=, prompt_len= and max_new_tokens=")
        training_only = {k: v for k, v in dict(dp=dp, micro_batch=micro_batch, schedule=schedule,
                                                 micro_batches=micro_batches, virtual_stages=virtual_stages,
                                                 sequence_parallel=sequence_parallel, zero_stage=zero_stage,
                                                 recompute=recompute, profile=profile, ep=ep, cp=cp,
                                                 global_batch=global_batch).items() if v is not None}
        if training_only:
            raise ValueError(f"parallelize: {sorted(training_only)} are training choices; mode='inference' pins tp "
                             "and pp only")
        plan, info = plan_for_job(model, example_input, None, world=init(), cluster=cluster, dtype=dtype,
                                  tp_plan=tp_plan, inference={k: v for k, v in generation.items() if v is not None},
                                  **{k: v for k, v in dict(tp=tp, pp=pp).items() if v is not None})
        tp = pp = None
    if profile is not None and (plan is not None or example_input is None):
        raise ValueError("parallelize: profile= is what the planner plans from; it needs example_input= and "
                         "global_batch= and no plan= (a given plan is already made)")
    if plan is None and example_input is not None:
        if global_batch is None:
            raise ValueError("parallelize: planning needs global_batch= (samples per optimizer step, all ranks together)")
        pins = {k: v for k, v in dict(tp=tp, pp=pp, dp=dp, zero_stage=zero_stage, micro_batch=micro_batch,
                                         schedule=schedule, virtual_stages=virtual_stages,
                                         sequence_parallel=sequence_parallel, recompute=recompute,
                                         ep=ep, cp=cp).items()
                if v is not None}
        plan, info = plan_for_job(model, example_input, global_batch, world=init(), cluster=cluster, dtype=dtype,
                                  tp_plan=tp_plan, profile=profile, compile=compile_options, **pins)
        schedule = virtual_stages = sequence_parallel = zero_stage = recompute = None  # the plan's now
    elif plan is None and (tp, pp, dp, micro_batch, ep, cp) != (None,) * 6:
        raise ValueError("parallelize: tp / pp / dp / ep / cp / micro_batch pins need example_input= and "
                         "global_batch= (to plan), or a mesh=")
    elif plan is not None and ((ep is not None and ep != plan.mesh.ep) or (cp is not None and cp != plan.mesh.cp)):
        raise ValueError(f"parallelize: ep={ep} cp={cp} differ from the plan's mesh (ep={plan.mesh.ep}, "
                         f"cp={plan.mesh.cp}); the mesh is the plan's")
    blocks = list(_default_units(model) if units is None else units)
    module_names = {id(m): n for n, m in model.named_modules()}
    block_names = [module_names.get(id(b), f"block {i}") for i, b in enumerate(blocks)]
    mib = 1024 * 1024
    if plan is not None:
        # Everything checked against the model first, locally: a plan for another model is
        # refused on every rank before any group is created.
        if info is None and example_input is not None:
            from .graph import read_model
            info = read_model(model, example_input, tp_plan=tp_plan)
        world_size = mesh.size if mesh is not None else init().size
        check_plan(plan, model, info=info, world_size=world_size)
        if all(v is None for v in (schedule, micro_batches, virtual_stages, unit_stage, sequence_parallel,
                                   zero_stage, bucket_cap_mb, recompute)):
            layout = _runtime.layout_from_plan(plan, len(blocks), world_size, block_names)
        else:  # keywords override the plan's choices
            plan_layout = _runtime.layout_from_plan(plan, len(blocks), world_size, block_names)
            layout = _runtime.layout_from_pins(
                len(blocks), world_size, pp=plan.mesh.pp, dp=plan.mesh.dp, tp=plan.mesh.tp,
                virtual_stages=virtual_stages or plan.virtual_stages,
                block_stage=list(unit_stage) if unit_stage is not None else
                (list(plan_layout.block_stage) if plan.mesh.pp > 1 else []),
                schedule=_schedule_kind(schedule if schedule is not None else plan.schedule),
                micro_batches=micro_batches or plan.num_micro_batches,
                zero_stage=plan.zero_stage if zero_stage is None else zero_stage,
                sequence_parallel=plan.sequence_parallel if sequence_parallel is None else bool(sequence_parallel),
                bucket_bytes=int(bucket_cap_mb * mib) if bucket_cap_mb else int(plan.dp_bucket_bytes),
                block_names=block_names,
                recompute=_recompute_kind(recompute if recompute is not None else plan.recompute),
                zero_overlap=plan.zero_overlap, cp=plan.mesh.cp, ep=plan.mesh.ep,
                # The plan's dp reduction holds while the override keeps the replicated engine.
                **({"dp_reduction": plan.dp_reduction, "inter_node_compression": plan.inter_node_compression}
                   if zero_stage in (None, 0) and plan.zero_stage == 0 else {}))
        want = (plan.mesh.pp, plan.mesh.dp, plan.mesh.cp, plan.mesh.tp, plan.mesh.ep)
        if mesh is None:
            mesh = device_mesh(pp=plan.mesh.pp, dp=plan.mesh.dp, tp=plan.mesh.tp, cp=plan.mesh.cp, ep=plan.mesh.ep)
        elif tuple(mesh.axis_size(a) for a in ("pp", "dp", "cp", "tp", "ep")) != want:
            got = tuple(mesh.axis_size(a) for a in ("pp", "dp", "cp", "tp", "ep"))
            raise ValueError(f"parallelize: the mesh (pp, dp, cp, tp, ep) = {got} differs from the plan's {want}")
    else:
        mesh = mesh if mesh is not None else device_mesh()
        layout = _runtime.layout_from_pins(
            len(blocks), mesh.size, pp=mesh.axis_size("pp"), dp=mesh.axis_size("dp"), tp=mesh.axis_size("tp"),
            virtual_stages=virtual_stages or 1, block_stage=list(unit_stage) if unit_stage is not None else [],
            schedule=_schedule_kind(schedule), micro_batches=micro_batches or 1, zero_stage=zero_stage or 0,
            sequence_parallel=bool(sequence_parallel), bucket_bytes=int((bucket_cap_mb or 25.0) * mib),
            block_names=block_names, recompute=_recompute_kind(recompute),
            zero_overlap=zero_overlap_pays_here(), cp=mesh.axis_size("cp"), ep=mesh.axis_size("ep"))
    # The compute dtype: the plan's (or, laid out by hand, ``dtype=``); where it is not the
    # parameters' dtype the runtime computes in it with master weights in theirs.
    from .api import mixed_precision_for, mixed_precision_of, torch_dtype
    if plan is not None:
        mixed = mixed_precision_of(plan, model)
    elif dtype is not None:
        try:
            mixed = mixed_precision_for(torch_dtype(dtype), model)
        except ValueError as e:
            raise ValueError(f"parallelize: {e}") from None
    else:
        mixed = None
    if info is None and example_input is not None and layout.mesh.pp > 1:
        from .graph import read_model
        info = read_model(model, example_input, tp_plan=tp_plan)
    result = ParallelModel(model, mesh, layout, units=blocks, tp_plan=tp_plan, sequence_dim=sequence_dim,
                           init_fn=init_fn, mixed_precision=mixed, info=info, compile_options=compile_options,
                           loss_parallel=loss_parallel)
    result.plan = plan  # None when laid out by hand
    return result
