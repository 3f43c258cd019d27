"""torch_monarch.fully_shard: ZeRO-1/2/3 (FSDP) driven by the C++ engine.

Python's only job here is the module tree: it groups parameters into sharding units and
calls the engine around each unit's forward through module hooks.
"""

from collections import OrderedDict

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from . import _runtime, deferred
from .distributed import device_mesh
from .interop import refuse_foreign_layout


def _default_units(module: nn.Module):
    """The entries of the non-empty nn.ModuleList holding the most parameters (the
    transformer blocks in most models; on a tie, the one with more entries, then the first):
    the blocks the pipeline cuts between, ZeRO shards by and the model reader plans as block
    layers. By parameters, not by length: a block may hold a longer list of its own (a T5
    block's sub-layers, a mixture's experts), which must not win over the list of blocks.
    Without a ModuleList, for a model that is itself an nn.Sequential: the longest run (two or
    more) of its consecutive children of one type holding parameters (a GPT written as
    Sequential(embedding, block0, block1, ..., norm, head), as the C++ frontend's find_blocks
    reads a Sequential). Sequentials inside another model (a ResNet's stages) are not read.
    Empty if there is none."""
    best, best_key = None, None
    for sub in module.modules():
        if not isinstance(sub, nn.ModuleList) or len(sub) == 0:
            continue
        key = (sum(p.numel() for p in {id(p): p for p in sub.parameters()}.values()), len(sub))
        if best is None or key > best_key:
            best, best_key = sub, key
    if best is not None:
        return list(best)
    return _sequential_run(module)


def _sequential_run(module: nn.Module):
    """The longest run of consecutive same-type children with parameters of `module` when it
    is an nn.Sequential (the first on a tie), or []."""
    if not isinstance(module, nn.Sequential):
        return []
    best, run = [], []
    for child in list(module.children()) + [None]:
        holds = child is not None and any(True for _ in child.parameters())
        if holds and run and type(child) is type(run[0]):
            run.append(child)
            continue
        if len(run) >= 2 and len(run) > len(best):
            best = run
        run = [child] if holds else []
    return best


class FullyShardedModule(nn.Module):
    """The sharded model. ``parameters()`` / ``named_parameters()`` yield this rank's fp32
    shard of every parameter under the parameter's own name (its rows along dim 0, with the
    parameter's number of dimensions; possibly empty on the last ranks): build the optimizer
    over them, with parameter groups by name or shape as for the plain model (elementwise
    optimizers: SGD, Adam(W), ... behave exactly as unsharded). ``state_dict()`` returns the
    full, unsharded state that loads into the unwrapped model; ``sharded_state_dict()`` this
    rank's shards."""

    def __init__(self, module, mesh, units, zero_stage, reshard_after_forward, mixed_precision, reduce_dtype,
                 ignored_parameters=(), init_fn=None, reduction="flat", inter_node_compression=None,
                 overlap=True):
        super().__init__()
        self.module = module
        self.mesh = mesh
        self.ignored_parameters = list(ignored_parameters)
        ignored = {id(p) for p in self.ignored_parameters}
        # A parameter used by more than one unit (shared between blocks) would be freed by
        # one while the other still needs it: it goes to the root unit, gathered throughout.
        unit_ids, shared = {}, set()
        for i, unit in enumerate(units):
            for p in unit.parameters():
                if unit_ids.setdefault(id(p), i + 1) != i + 1:
                    shared.add(id(p))
        for pid in shared:
            unit_ids.pop(pid)
        groups = [[] for _ in range(len(units) + 1)]
        names = [[] for _ in range(len(units) + 1)]
        experts = []  # (name, parameter) split by torch_monarch.expert_parallel
        for name, p in module.named_parameters():
            if id(p) in ignored:
                continue
            if getattr(p, "_monarch_expert", False):
                experts.append((name, p))
                continue
            k = unit_ids.get(id(p), 0)
            groups[k].append(p)
            names[k].append(name)
        # Every name of every parameter (a tied weight has one per module), with its shape
        # taken now: under ZeRO-3 the parameters hold nothing between forwards.
        self._shapes = {f"{m}.{n}" if m else n: tuple(p.shape) for m, mod in module.named_modules()
                        for n, p in mod._parameters.items() if p is not None}
        options = _runtime.FullyShardOptions()
        options.zero_stage = zero_stage
        options.reshard_after_forward = reshard_after_forward
        if mixed_precision is not None:
            options.compute_dtype = str(mixed_precision).replace("torch.", "")
        if reduce_dtype is not None:
            options.reduce_dtype = str(reduce_dtype).replace("torch.", "")
        options.hierarchical = reduction == "hierarchical"
        options.inter_node_compression = inter_node_compression or "none"
        options.overlap = bool(overlap)
        materialize = None
        if any(p.is_meta for group in groups for p in group):
            if any(p.is_meta for p in self.ignored_parameters):
                raise ValueError("fully_shard: ignored parameters of a model on meta must be materialized first")

            def materialize(k):
                # Unit k's modules (the root unit: everything outside the units), then its
                # parameters by name: materializing replaced the meta objects.
                if k == 0:
                    deferred.materialize(module, init_fn, skip=units)
                else:
                    deferred.materialize(units[k - 1], init_fn, root=module)
                params = dict(module.named_parameters())
                return [params[n] for n in names[k]]
        # The replicas of a parameter are the ranks holding other tokens of it: dp x cp
        # (context parallelism's ranks hold other parts of the same sequences).
        self._engine = _runtime.FullyShardEngine(groups, mesh, "dp_cp", options, materialize)
        self._engines = [(self._engine, [n for group in names for n in group], units)]
        if experts:
            # Experts split over ep are replicated over the mesh's edp group only: a second
            # engine shards them there, one unit per module holding them (its root unit empty).
            if any(p.is_meta for _, p in experts):
                raise ValueError("fully_shard: expert-parallel weights must be materialized (expert_parallel "
                                 "takes each rank's experts from real tensors)")
            owners = [m for m in module.modules()
                      if any(getattr(p, "_monarch_expert", False) for p in m._parameters.values() if p is not None)]
            by_id = {id(p): n for n, p in experts}
            expert_groups = [[]] + [[p for p in m._parameters.values() if p is not None and id(p) in by_id]
                                    for m in owners]
            expert_names = [by_id[id(p)] for group in expert_groups for p in group]
            # Flat over edp: a split by node is collective over the whole world, and a pipeline
            # stage without experts would never join it.
            options.hierarchical = False
            options.inter_node_compression = "none"
            engine = _runtime.FullyShardEngine(expert_groups, mesh, "edp", options, None)
            self._engines.append((engine, expert_names, owners))
        self._names = [n for _, engine_names, _ in self._engines for n in engine_names]  # the engines' order
        self._shards = [s for engine, _, _ in self._engines for s in engine.shards()]
        for engine, _, _ in self._engines[1:]:
            for shard in engine.shards():
                shard._monarch_expert = True  # DataParallel / a second fully_shard leave them alone
        self._hooks = []
        for engine, _, engine_units in self._engines:
            for i, unit in enumerate(engine_units):
                self._hooks.append(unit.register_forward_pre_hook(self._make_pre_hook(engine, i + 1)))
                self._hooks.append(unit.register_forward_hook(self._make_post_hook(engine, i + 1)))

    @staticmethod
    def _make_pre_hook(engine, index):
        def hook(_module, _inputs):
            engine.before_forward(index)
        return hook

    @staticmethod
    def _make_post_hook(engine, index):
        def hook(_module, _inputs, output):
            engine.after_forward(index, _tensors(output))
        return hook

    def forward(self, *args, **kwargs):
        for engine, _, _ in self._engines:
            engine.before_forward(0)
        out = self.module(*args, **kwargs)
        for engine, _, _ in self._engines:
            engine.after_forward(0, _tensors(out))
        return out

    def _full_parameters(self):
        return [v for engine, _, _ in self._engines for v in engine.full_parameters()]

    def _load_full_parameters(self, values):
        start = 0
        for engine, engine_names, _ in self._engines:
            engine.load_full_parameters(values[start:start + len(engine_names)])
            start += len(engine_names)

    # The optimizer steps on the shards, one per parameter, under the parameters' names.
    def parameters(self, recurse: bool = True):
        return iter(self._shards)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, s in zip(self._names, self._shards):
            yield f"{prefix}{'.' if prefix else ''}{name}", s

    @property
    def zero_stage(self):
        return self._engine.zero_stage

    def state_dict(self, *args, **kwargs):
        by_id = {}
        params = dict(self.module.named_parameters())
        for name, value in zip(self._names, self._full_parameters()):
            by_id[id(params[name])] = value
        # Every name of a parameter (a tied weight has one per module) maps to its full value.
        aliases = {f"{m}.{n}" if m else n: id(p) for m, mod in self.module.named_modules()
                   for n, p in mod._parameters.items() if p is not None}
        out = OrderedDict()
        for name, value in self.module.state_dict().items():
            out[name] = by_id.get(aliases.get(name), value)
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True):
        """Loads a whole (unsharded) state dict, as ``state_dict()`` returns it or the
        unwrapped model saves it: each rank keeps its rows of every parameter (the parameters
        refresh from the shards before the next forward); buffers and ignored parameters,
        whole on every rank, are copied. Every entry's shape is checked before anything is
        copied (all mismatches in one error, by name); dtypes convert as in torch."""
        expected = self.module.state_dict(keep_vars=True)
        missing = [n for n in expected if n not in state_dict]
        unexpected = [n for n in state_dict if n not in expected]
        if strict and (missing or unexpected):
            raise RuntimeError(f"fully_shard: load_state_dict: missing {missing}, unexpected {unexpected}")
        wrong = []
        for name, value in state_dict.items():
            if name not in expected:
                continue
            want = self._shapes.get(name, tuple(expected[name].shape))
            if not isinstance(value, torch.Tensor):
                wrong.append(f"{name}: expected a tensor of shape {list(want)}, got {type(value).__name__}")
            elif tuple(value.shape) != want:
                wrong.append(f"{name}: the checkpoint holds {list(value.shape)}, the model {list(want)}")
        if wrong:
            raise RuntimeError("fully_shard: load_state_dict: shape mismatch:\n  " + "\n  ".join(wrong))
        self._load_full_parameters([state_dict.get(n) for n in self._names])
        params = dict(self.module.named_parameters())
        aliases = {f"{m}.{k}" if m else k: id(p) for m, mod in self.module.named_modules()
                   for k, p in mod._parameters.items() if p is not None}
        sharded_ids = {id(params[n]) for n in self._names}
        for name, t in expected.items():
            if name in state_dict and aliases.get(name) not in sharded_ids:
                t.detach().copy_(state_dict[name])
        return _IncompatibleKeys(missing, unexpected)

    def sharded_state_dict(self):
        """This rank's fp32 shards by parameter name, with where they belong: each rank
        saves and loads only its own rows."""
        # The engine shards over dp x cp (experts over edp: a second engine's shards, keyed by
        # the global rank and mesh so a checkpoint of another layout is refused).
        group = self.mesh.group("dp_cp")
        return {"rank": group.rank, "world": group.size, "global_rank": self.mesh.rank,
                "mesh": repr(self.mesh.shape),
                "shards": OrderedDict((n, s.detach().clone()) for n, s in zip(self._names, self._shards))}

    def load_sharded_state_dict(self, state):
        group = self.mesh.group("dp_cp")
        rank, world = group.rank, group.size
        if state.get("world") != world or state.get("rank") != rank:
            raise ValueError(f"sharded state dict: saved by rank {state.get('rank')} of "
                             f"{state.get('world')}, loading on rank {rank} of {world}")
        if len(self._engines) > 1 and (state.get("global_rank"), state.get("mesh")) != (self.mesh.rank,
                                                                                        repr(self.mesh.shape)):
            raise ValueError(f"sharded state dict: saved by global rank {state.get('global_rank')} on mesh "
                             f"{state.get('mesh')}, loading on rank {self.mesh.rank} of {self.mesh.shape!r} (expert "
                             "shards belong to one rank of one mesh)")
        saved = state.get("shards", {})
        problems = [f"{n}: missing" for n in self._names if n not in saved]
        problems += [f"{n}: not in the model" for n in saved if n not in self._names]
        problems += [f"{n}: saved {list(saved[n].shape)}, this rank holds {list(s.shape)}"
                     for n, s in zip(self._names, self._shards) if n in saved and saved[n].shape != s.shape]
        if problems:
            raise ValueError("sharded state dict (a different model or unit split?):\n  " + "\n  ".join(problems))
        with torch.no_grad():
            for name, shard in zip(self._names, self._shards):
                shard.copy_(saved[name])  # bumps the version: parameters refresh before the next forward


def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    if isinstance(output, dict):
        return [t for t in output.values() if isinstance(t, torch.Tensor)]
    return []


def fully_shard(module: nn.Module, mesh=None, units=None, zero_stage: int = 3,
                reshard_after_forward: bool = True, mixed_precision=None, reduce_dtype=None,
                ignored_parameters=(), init_fn=None, reduction: str = "flat",
                inter_node_compression: str = None, overlap: bool = None) -> FullyShardedModule:
    """Shards ``module`` over the mesh's ``dp`` axis.

    ``units``: submodules gathered and freed as one piece (default: the entries of the
    largest ``nn.ModuleList``); the remaining parameters form the root unit, gathered for
    the whole forward and backward. ``zero_stage``: 1 (optimizer state), 2 (+ gradients),
    3 (+ parameters). ``mixed_precision``: compute dtype (e.g. ``torch.bfloat16``) with fp32
    shards. ``reduce_dtype``: the dtype gradients travel in (default: the compute dtype, as
    FSDP's MixedPrecision; ``torch.float32`` for full-precision reduction); each rank's parts
    are summed in fp32 into its fp32 shard. ``ignored_parameters`` stay whole and unsynchronised
    (the caller owns them, e.g. weights tied across pipeline stages); they are not in
    ``parameters()`` but in ``ignored_parameters``.

    A ``module`` on the meta device (built under ``torch_monarch.meta_init()``) is
    materialized one unit at a time, each rank keeping its slice (``init_fn(submodule)``, or
    each submodule's ``reset_parameters()``): under ZeRO-3 no rank ever holds more than one
    whole unit. Ignored parameters must already be real.

    ``reduction="hierarchical"`` (ZeRO++, Wang et al. 2023; stage 3, jobs over several nodes,
    L ranks per node from ``LOCAL_WORLD_SIZE``): each unit is gathered between nodes first
    (every rank's shard to the ranks at its place on the other nodes), then inside the node;
    what the first hop brought stays on the rank (1/L of the unit) until the unit's backward,
    whose re-gather then never leaves the node; gradients are reduce-scattered inside the
    node, then between nodes. ``inter_node_compression="int8"`` (one fp32 scale per 256
    values) or ``"bf16"`` rounds what crosses nodes: the weights of the forward gather
    (rounded afresh from the fp32 shards each time) and the gradients (with error feedback:
    each rank keeps the residual of the chunks it sends, ``(nodes - 1) / world`` of the
    model in fp32). The plan's ``dp_reduction`` / ``inter_node_compression`` say the same.

    ``overlap``: keep a unit's gradient reduce-scatter in flight while the next unit's
    backward runs, or wait for each as it is launched, holding one unit's gradient buffer
    less (ZeRO-3 prefetches the next unit's parameters either way). Default (None): the
    planner's rule for this machine
    (``torch_monarch.cluster.zero_overlap_pays_here``): on GPUs, overlap; on CPU ranks that
    have no core to spare (Gloo sums and copies on the cores that compute), none. The plan's
    ``zero_overlap`` says the same.
    """
    refuse_foreign_layout(module, "torch_monarch.fully_shard")
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage: expected 1, 2 or 3, got {zero_stage}")
    if reduction not in ("flat", "hierarchical"):
        raise ValueError(f"reduction: expected 'flat' or 'hierarchical', got {reduction!r}")
    if inter_node_compression not in (None, "none", "bf16", "int8"):
        raise ValueError(f"inter_node_compression: expected None, 'bf16' or 'int8', got {inter_node_compression!r}")
    mesh = mesh if mesh is not None else device_mesh()
    units = _default_units(module) if units is None else list(units)
    if overlap is None:
        from .cluster import zero_overlap_pays_here
        overlap = zero_overlap_pays_here()
    return FullyShardedModule(module, mesh, units, zero_stage, reshard_after_forward, mixed_precision,
                              reduce_dtype, ignored_parameters, init_fn, reduction, inter_node_compression,
                              overlap)
