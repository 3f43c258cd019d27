"""Pipeline stages cut by module hooks, for models torch.fx cannot trace (Hugging Face models:
mask builders, caches and output-capturing decorators stop a symbolic trace).

Every stage runs the model's own forward on the micro-batch's inputs (every pipeline rank holds
the batch), with three changes:
  * the blocks of earlier stages do not run: each returns what this stage received, the output
    of the last block before it (rebuilt in that output's structure, as the reader saw it), so
    the model's own code passes it on to this stage's first block;
  * modules before the first block whose weights another stage holds (the token embedding)
    return zeros of their output's shape (their value is never used here: it only feeds blocks
    that do not run); modules holding no weights (rotary tables, masks) run as they are;
  * after this stage's last block the forward stops (a stage that is not the last), and that
    block's output leaves are what the stage sends on.
So side inputs computed before the blocks (attention masks, position embeddings) are computed
on every stage from the inputs, and only the blocks' running output crosses stages. The model
must pass each block's output to the next (a chain: the cut rule of split_model too).

Which stage holds a module outside the blocks: the first if it first runs before the first
block (or never runs), the last if after the last block.
"""

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .pipeline import StageModules


class _StageDone(Exception):
    def __init__(self, output):
        super().__init__("stage done")
        self.output = output


def _leaves(output):
    """The tensors of a block's output, in pytree order."""
    return [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)]


class HookStage(nn.Module):
    """Stage ``index`` of ``model``: its parameters are the modules it holds (under their names
    in the model: state dicts and optimizers see the model's names); calling it runs the model's
    forward as the module docstring says. Called as ``stage(*received, _monarch_inputs=batch)``."""

    def __init__(self, model, index, num_stages, held, blocks, unit_stage, block_spec, foreign_pre):
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a child: its other stages' modules are not ours
        self.index, self.num_stages = index, num_stages
        self._blocks = blocks
        self._unit_stage = unit_stage
        self._block_spec = block_spec  # (treespec, non-tensor leaves by position) of a block's output
        self._foreign_pre = foreign_pre  # pre-block modules holding other stages' weights
        for name, module in held:
            _attach(self, name, module)

    def forward(self, *received, _monarch_inputs=None):
        model, me = self._model, self.index
        local = [i for i, s in enumerate(self._unit_stage) if s == me]
        inputs = _monarch_inputs if _monarch_inputs is not None else received
        out, stopped = run_as_stage(
            lambda: model(**inputs) if isinstance(inputs, dict) else model(*inputs), self._blocks, local[0], local[-1],
            self._rebuild(received) if me > 0 else None,
            [(m, _zeros_like_output(record)) for m, record in self._foreign_pre] if me > 0 else [],
            stop=me < self.num_stages - 1)
        return tuple(_leaves(out)) if stopped else out

    def _rebuild(self, received):
        spec, constants = self._block_spec
        leaves, tensors = [], iter(received)
        for position in range(spec.num_leaves):
            leaves.append(constants[position] if position in constants else next(tensors))
        return tree_unflatten(leaves, spec)


def run_as_stage(call, blocks, first, last, earlier_output, stubs, stop):
    """Runs ``call()`` (the model's own forward) as the pipeline stage holding blocks ``first`` to
    ``last``: the blocks before ``first`` return ``earlier_output`` (what the stage received, in a
    block's output structure; None on the first stage), each ``(module, forward)`` of ``stubs``
    runs that forward instead of its own (modules holding other stages' weights), and with
    ``stop`` the forward ends after block ``last``. Returns (block ``last``'s output, True) when
    stopped there, else (the model's output, False). Used by the hook cut (training) and by
    generate on stages of either cut."""
    undo = []
    try:
        if earlier_output is not None:
            for i in range(first):
                undo.append(_patch_forward(blocks[i], lambda *a, **k: earlier_output))
        for module, forward in stubs:
            undo.append(_patch_forward(module, forward))
        if stop:
            def hook(_module, _args, output):
                raise _StageDone(output)
            undo.append(blocks[last].register_forward_hook(hook).remove)
        try:
            return call(), False
        except _StageDone as done:
            return done.output, True
    finally:
        for u in reversed(undo):
            u()


def _attach(root, name, module):
    """``module`` under ``name`` (dotted) in ``root``, through plain containers."""
    parts = name.split(".")
    node = root
    for part in parts[:-1]:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(parts[-1], module)


def _patch_forward(module, fn):
    had = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    module.forward = fn

    def undo():
        if had:
            module.forward = old
        else:
            del module.forward
    return undo


def _zeros_like_output(record):
    """A forward giving zeros shaped as the module's output was in the example forward
    (``record``: graph.ModuleRecord), the leading dimensions its first input shared with that
    output (batch, sequence) taken from this call's first input. Its weights are another
    stage's, and it may hold collectives (a vocabulary-split embedding): it does not run."""
    example = record.input_shape or ()

    def zeros(*args, **kwargs):
        first = next((x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)), None)
        tensors = []
        for shape, dtype in record.output_leaves:
            k = len(example)
            if first is not None and k and tuple(shape[:k]) == tuple(example):
                shape = tuple(first.shape) + tuple(shape[k:])
            tensors.append(torch.zeros(shape, dtype=dtype))
        leaves, it = [], iter(tensors)
        for position in range(record.output_spec.num_leaves):
            leaves.append(record.output_constants[position] if position in record.output_constants else next(it))
        return tree_unflatten(leaves, record.output_spec)
    return zeros


def cut_problem(model: nn.Module, units, info):
    """Why the hook-based cut cannot cut ``model`` (None when it can): the blocks must each run
    once, in order, in the example forward, and no module wrapping the blocks may hold weights
    of its own (no stage could hold them)."""
    names = {id(m): n for n, m in model.named_modules()}
    block_names = [names.get(id(u)) for u in units]
    if None in block_names:
        return "a block is not a submodule of the model"
    orders = [info.modules[n].order if n in info.modules else -1 for n in block_names]
    if any(o < 0 for o in orders) or orders != sorted(orders):
        return (f"the blocks do not run once each in order in the example forward (first runs: "
                f"{dict(zip(block_names, orders))})")
    ancestors = {n.rsplit(".", k)[0] for n in block_names for k in range(1, n.count(".") + 1)} | {""}
    for name in sorted(ancestors):
        module = model.get_submodule(name) if name else model
        if any(True for _ in module.parameters(recurse=False)):
            return f"'{name or type(model).__name__}' wraps the blocks and holds parameters of its own"
    # Only the chain crosses stages: a module with weights outside the blocks may feed the
    # first block only (later stages stub it with zeros), and none may run between blocks.
    first, last = orders[0], orders[-1]
    inside = set(block_names)
    ran = {id(p) for n, m in model.named_modules() if n in info.modules and info.modules[n].order >= 0
           for p in m.parameters(recurse=False)}
    for name, module in model.named_modules():
        record = info.modules.get(name)
        if name in ancestors or record is None or name in inside or \
                any(name.startswith(b + ".") for b in inside) or not any(True for _ in module.parameters()):
            continue
        if record.order < 0:
            tied_only = all(id(p) in ran for p in module.parameters())  # its weights are others' too
            if name.rpartition(".")[0] in ancestors and not tied_only:
                return (f"'{name}' holds weights but never ran as a module in the example forward (its weights "
                        "may be read directly): no stage can be chosen for it")
            continue
        if first < record.order < last:
            return f"'{name}' runs between the blocks and holds weights"
        if record.order < first:
            for b in block_names[1:]:
                if record.output_ids & info.modules[b].input_ids:
                    return (f"'{name}' (before the blocks, with weights) feeds block '{b}' directly, not only "
                            "through the chain of blocks")
    return None


def split_by_hooks(model: nn.Module, num_stages: int, units, unit_stage, info) -> StageModules:
    """Stages of ``model`` at block boundaries (``unit_stage[i]``: block i's stage) cut by
    hooks; ``info``: the model as read (graph.read_model) on an example batch, for the run order
    of the modules and the structure of a block's output."""
    names = {id(m): n for n, m in model.named_modules()}
    block_names = [names[id(u)] for u in units]
    first_order = info.modules[block_names[0]].order
    last_order = info.modules[block_names[-1]].order
    record = info.modules[block_names[-1]]
    if getattr(record, "output_spec", None) is None:
        raise ValueError(f"pipeline: block '{block_names[-1]}' did not run in the example forward; cannot cut")
    block_spec = (record.output_spec, record.output_constants)
    # The modules each stage holds: the blocks, and every largest subtree without a block.
    inside = {n for n in block_names}
    ancestors = {n.rsplit(".", k)[0] for n in block_names for k in range(1, n.count(".") + 1)} | {""}
    held = [[] for _ in range(num_stages)]
    pre_with_weights = []
    for i, n in enumerate(block_names):
        held[unit_stage[i]].append((n, units[i]))
    for name, module in model.named_modules():
        if name in ancestors or name in inside or any(name.startswith(b + ".") for b in inside):
            if name in ancestors and any(True for _ in module.parameters(recurse=False)):
                raise ValueError(f"pipeline: '{name or type(model).__name__}' holds parameters of its own and "
                                 "wraps the blocks: no stage can hold them")
            continue
        parent = name.rpartition(".")[0]
        if parent not in ancestors:
            continue  # inside a subtree already placed
        order = info.modules[name].order if name in info.modules else -1
        stage = num_stages - 1 if order > last_order else 0
        held[stage].append((name, module))
        if stage == 0 and 0 <= order < first_order and any(True for _ in module.parameters()):
            pre_with_weights.append((module, info.modules[name]))
    modules = [HookStage(model, s, num_stages, held[s], list(units), list(unit_stage), block_spec,
                         pre_with_weights if s > 0 else []) for s in range(num_stages)]
    # Weights held by several stages (an embedding tied to the output head).
    pnames = {id(p): n for n, p in model.named_parameters()}
    users = {}
    for s, m in enumerate(modules):
        for p in m.parameters():
            users.setdefault(id(p), (pnames.get(id(p), "?"), set(), p))[1].add(s)
    tied = [entry for entry in users.values() if len(entry[1]) > 1]
    return StageModules(modules, list(unit_stage), list(units), tied)


def release_other_stages(stages: StageModules, local):
    """Every rank holds the whole model object (each stage runs its forward): the weights of
    stages this rank does not run go to meta, keeping shapes and dtypes (what the stubs and the
    engine's state-dict entries read), unless a local stage holds them too (tied)."""
    mine = {id(p) for s in local for p in stages.modules[s].parameters()}
    with torch.no_grad():
        for s, stage in enumerate(stages.modules):
            if s in local:
                continue
            for module in stage.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None and id(p) not in mine and not p.is_meta:
                        stub = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                            requires_grad=p.requires_grad)
                        # What the layout marked on the tensor goes with it (an expert-parallel
                        # weight, a tp shard): the engine's whole-model state dict reads the
                        # marks of every stage's entries, a released one's included.
                        for key, value in vars(p).items():
                            if key.startswith("_monarch"):
                                setattr(stub, key, value)
                        module._parameters[name] = stub
