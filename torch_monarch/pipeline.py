"""Splitting a model into pipeline stages (torch.fx), for the C++ pipeline executor.

The model is traced with its blocks (the pipeline units) and tensor-parallel modules kept
as leaves; each stage becomes a GraphModule holding the original submodule objects (so
hooks, tied weights and wrappers stay in place). Values live across a stage boundary
(activations, and anything a later stage still needs, such as an attention mask) travel as
a tuple of tensors; weights read by several stages (a tied embedding / output head) are
read locally by each stage and kept in sync by the engine.
"""

import contextlib
import functools

import torch
from torch import fx, nn

from .sharded import _default_units


# Tensor factories called with a traced value (torch.arange(tokens.shape[1])) are not
# traceable by torch.fx in torch 1.13; while tracing they record a call instead.
_FACTORIES = ("arange", "ones", "zeros", "full", "empty", "rand", "randn", "randint", "eye")


def _first_proxy(args, kwargs):
    found = []
    fx.node.map_aggregate((args, kwargs), lambda x: found.append(x) if isinstance(x, fx.Proxy) else None)
    return found[0] if found else None


@contextlib.contextmanager
def _traceable_factories():
    originals = {name: getattr(torch, name) for name in _FACTORIES}

    def wrap(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            proxy = _first_proxy(args, kwargs)
            if proxy is None:
                return fn(*args, **kwargs)
            return proxy.tracer.create_proxy("call_function", fn, args, kwargs)
        return wrapper

    try:
        for name, fn in originals.items():
            setattr(torch, name, wrap(fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)


class _Tracer(fx.Tracer):
    def __init__(self, leaves):
        super().__init__()
        self._leaves = {id(m) for m in leaves}

    def is_leaf_module(self, m, qualname):
        if id(m) in self._leaves or type(m).__module__.startswith("torch_monarch."):
            return True
        return super().is_leaf_module(m, qualname)

    def trace(self, root, concrete_args=None):
        with _traceable_factories():
            return super().trace(root, concrete_args)


def trace_problem(model: nn.Module, units=None):
    """Why ``model`` cannot be cut into pipeline stages here, or None when it can: the cut
    needs a torch.fx trace of its forward with the blocks as leaves. The answer names the
    error and the line of the model's code that stopped the trace (data-dependent control
    flow such as ``assert x.shape[1] <= n``, calls fx cannot follow)."""
    return trace_for_cut(model, units)[1]


def trace_for_cut(model: nn.Module, units=None):
    """(graph, None) with the torch.fx trace ``split_model`` cuts, or (None, why not) as
    ``trace_problem`` says it: one trace serves both."""
    import traceback
    units = list(_default_units(model) if units is None else units)
    try:
        return _Tracer(units).trace(model), None
    except Exception as e:  # noqa: BLE001 - any failure of the user's forward under fx is the answer
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/torch/" not in f.filename
                  and "/torch_monarch/" not in f.filename]
        where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, f"torch.fx could not trace {type(model).__name__}.forward: {type(e).__name__}: {message}{where}"


def boundaries_from_sizes(sizes):
    """[2, 3, 3] -> stage of each unit: [0, 0, 1, 1, 1, 2, 2, 2]."""
    out = []
    for stage, n in enumerate(sizes):
        out += [stage] * n
    return out


def even_split(num_units, num_stages):
    if num_units < num_stages:
        raise ValueError(f"pipeline: {num_units} blocks cannot fill {num_stages} stages "
                         f"(legal stage counts: 1..{num_units})")
    base, extra = divmod(num_units, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


class StageModules:
    """The stages of a split model. ``modules[s]`` is stage s's GraphModule: stage 0 takes
    the model's inputs, stage s > 0 takes the tuple stage s-1 returns, the last stage
    returns the model's output."""

    def __init__(self, modules, unit_stage, units, tied):
        self.modules = modules
        self.unit_stage = unit_stage
        self.units = units
        self.tied = tied  # [(name, {stages using it}, parameter)] for weights read by several stages

    def __len__(self):
        return len(self.modules)

    def units_of(self, stage):
        return [u for u, s in zip(self.units, self.unit_stage) if s == stage]


def split_model(model: nn.Module, num_stages: int, units=None, unit_stage=None, graph=None) -> StageModules:
    """Cuts ``model`` into ``num_stages`` stages at block boundaries.

    ``units``: the blocks, in execution order (default: the entries of the largest
    ``nn.ModuleList``). ``unit_stage[i]``: the stage of block i (non-decreasing, every stage
    used; default: as even as possible). Code before the first block joins stage 0, code
    after the last joins the last stage. ``graph``: the model's trace from ``trace_for_cut``
    with the same units (traced here when not given).
    """
    units = list(_default_units(model) if units is None else units)
    if not units:
        raise ValueError(f"pipeline: {type(model).__name__} has no ModuleList of blocks to cut at; "
                         "pass units=[...] (the blocks, in order)")
    names = {id(m): n for n, m in model.named_modules()}
    unit_names = [names.get(id(u), f"<block {i}: not a submodule>") for i, u in enumerate(units)]
    if unit_stage is None:
        try:
            unit_stage = boundaries_from_sizes(even_split(len(units), num_stages))
        except ValueError as e:
            raise ValueError(f"{e}; the model can only be cut between its blocks {unit_names}") from None
    unit_stage = list(unit_stage)
    if len(unit_stage) != len(units):
        raise ValueError(f"pipeline: {len(unit_stage)} stage assignments for {len(units)} blocks")
    if unit_stage[0] != 0 or any(b < a for a, b in zip(unit_stage, unit_stage[1:])) or \
            sorted(set(unit_stage)) != list(range(num_stages)):
        raise ValueError(f"pipeline: stage assignment {unit_stage} for blocks {unit_names} must start at 0, "
                         f"never decrease and use every stage 0..{num_stages - 1} (a stage may only be cut "
                         "between consecutive blocks)")
    unit_index = {}
    for i, u in enumerate(units):
        if id(u) not in names:
            raise ValueError(f"pipeline: block {i} ({type(u).__name__}) is not a submodule of the model")
        unit_index[names[id(u)]] = i

    if graph is None:
        graph = _Tracer(units).trace(model)
    # Stage of every node: the stage of the last block seen (stage 0 before the first).
    stage_of = {}
    current = 0
    seen_units = []
    for node in graph.nodes:
        if node.op == "call_module" and node.target in unit_index:
            i = unit_index[node.target]
            seen_units.append(i)
            current = unit_stage[i]
        if node.op == "output":
            current = num_stages - 1
        stage_of[node] = current
    if seen_units != list(range(len(units))):
        ran = [unit_names[i] for i in seen_units]
        raise ValueError(f"pipeline: the blocks do not run once each in order (forward runs {ran}, "
                         f"registered {unit_names}); the model cannot be cut into a chain of stages at them; "
                         "pass units=[...] in execution order")

    def is_attr(n):
        return n.op == "get_attr"

    # Values crossing boundary k (stage k -> k+1): defined at stage <= k, used after k.
    nodes = [n for n in graph.nodes if n.op != "output"]
    last_use = {}
    for n in graph.nodes:
        for inp in n.all_input_nodes:
            last_use[inp] = max(last_use.get(inp, -1), stage_of[n])
    crossing = []
    for k in range(num_stages - 1):
        crossing.append([n for n in nodes if not is_attr(n) and stage_of[n] <= k and last_use.get(n, -1) > k])

    modules = []
    for s in range(num_stages):
        g = fx.Graph()
        env = {}
        if s == 0:
            for n in nodes:
                if n.op == "placeholder":
                    env[n] = g.node_copy(n)
        else:
            for i, n in enumerate(crossing[s - 1]):
                env[n] = g.placeholder(f"in_{i}_{n.name}")

        def lookup(n, g=g, env=env):
            if n not in env and is_attr(n):
                env[n] = g.node_copy(n)  # a weight read here too: read it locally
            return env[n]

        for n in nodes:
            if stage_of[n] != s or n.op == "placeholder" or is_attr(n):
                continue
            env[n] = g.node_copy(n, lookup)
        output = next(n for n in graph.nodes if n.op == "output")
        if s == num_stages - 1:
            g.output(fx.node.map_arg(output.args[0], lookup))
        else:
            g.output(tuple(lookup(n) for n in crossing[s]))
        g.lint()
        modules.append(fx.GraphModule(model, g, class_name=f"Stage{s}"))

    # Weights read by more than one stage.
    names = {id(p): n for n, p in model.named_parameters()}
    users = {}
    for s, m in enumerate(modules):
        for p in m.parameters():
            users.setdefault(id(p), (names.get(id(p), "?"), set(), p))[1].add(s)
    tied = [entry for entry in users.values() if len(entry[1]) > 1]
    return StageModules(modules, unit_stage, units, tied)
