"""Tensor parallelism's communication, callable both eagerly and inside ``torch.compile``.

Eagerly each function is the C++ runtime's autograd function (``_runtime.tp_*``): one
call, the collective and its backward in C++. Dynamo cannot trace into a pybind call, so
inside a compiled region (``parallelize(..., compile=True)`` compiles each block) the same
collectives run as one registered operator, ``monarch::tp_collective``, which Dynamo and
AOTAutograd treat as opaque: it has a fake (shape-only) implementation for tracing and a
registered backward, and its kernel calls the same C++ collectives. A block holding
column/row-parallel linears therefore compiles into one graph, as blocks under DTensor do
(PyTorch's functional collectives, ``torch.distributed._functional_collectives``, are the
analogue there).

Groups cannot be operator arguments; they travel as a small integer key into ``_GROUPS``.
"""

import torch

from . import _runtime

# kind: what the operator's forward does (its backward is the kind named in _BACKWARD)
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, OWN_CHUNK, ALL_GATHER_THEN_CHUNK_GRAD = 0, 1, 2, 3, 4
_GROUPS = {}  # key -> Communicator
_SIZES = {}  # key -> the group's size
_KEYS = {}  # id(Communicator) -> key


def group_key(group):
    """The integer standing for ``group`` inside compiled graphs (registered on first use;
    the group object is kept alive with it)."""
    key = _KEYS.get(id(group))
    if key is None:
        key = len(_GROUPS)
        _GROUPS[key] = group
        _SIZES[key] = group.size
        _KEYS[id(group)] = key
    return key


def _run(x, group, dim, kind):
    with torch.no_grad():
        if kind == ALL_REDUCE:
            return _runtime.tp_reduce_from_group(x, group)
        if kind == REDUCE_SCATTER:
            return _runtime.tp_sequence_reduce_scatter(x.contiguous(), group, dim)
        if kind == OWN_CHUNK:
            return _runtime.tp_scatter_to_group(x.contiguous(), group, dim)
        return _runtime.tp_gather_from_group(x.contiguous(), group, dim)  # ALL_GATHER(_THEN_CHUNK_GRAD)


@torch.library.custom_op("monarch::tp_collective", mutates_args=())
def _tp_collective(x: torch.Tensor, group: int, dim: int, kind: int) -> torch.Tensor:
    out = _run(x, _GROUPS[group], dim, kind)
    # An operator's output never aliases its input: this rank's chunk can be a view of it.
    same = out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    return out.clone() if same else out


@_tp_collective.register_fake
def _(x, group, dim, kind):
    n = _SIZES[group]
    shape = list(x.shape)
    if kind in (ALL_GATHER, ALL_GATHER_THEN_CHUNK_GRAD):
        shape[dim] *= n
    elif kind in (REDUCE_SCATTER, OWN_CHUNK):
        shape[dim] //= n
    return x.new_empty(shape)


# The backward of each kind, as the forward of another: an all-reduce's gradient passes
# through (kind -1), a sequence gather's is reduce-scattered, a scatter's gathered.
_BACKWARD = {ALL_REDUCE: -1, ALL_GATHER: REDUCE_SCATTER, REDUCE_SCATTER: ALL_GATHER, OWN_CHUNK: ALL_GATHER,
             ALL_GATHER_THEN_CHUNK_GRAD: OWN_CHUNK}


def _setup_context(ctx, inputs, output):
    _, ctx.group, ctx.dim, ctx.kind = inputs


def _backward(ctx, grad):
    back = _BACKWARD[ctx.kind]
    g = grad if back < 0 else _tp_collective(grad.contiguous(), ctx.group, ctx.dim, back)
    return g, None, None, None


_tp_collective.register_autograd(_backward, setup_context=_setup_context)


class _CopyToGroup(torch.autograd.Function):
    """Identity forward (a view, no copy); the gradient all-reduced over the group."""

    @staticmethod
    def forward(x, key):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.key = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return _tp_collective(grad.contiguous(), ctx.key, 0, ALL_REDUCE), None


def _compiling():
    return torch.compiler.is_compiling()


# Each function takes the group's key (group_key(group), taken once where the layer or hook
# is built): an integer Dynamo folds into the graph, where a pybind group object would stop
# the trace.

def copy_to_group(x, key):
    """Identity forward; all-reduce of the gradient (enters a tensor-parallel region)."""
    if _SIZES[key] == 1:
        return x
    if _compiling():
        return _CopyToGroup.apply(x, key)
    return _runtime.tp_copy_to_group(x, _GROUPS[key])


def reduce_from_group(x, key):
    """All-reduce forward; identity backward (leaves a row-parallel region)."""
    if _SIZES[key] == 1:
        return x
    if _compiling():
        return _tp_collective(x.contiguous(), key, 0, ALL_REDUCE)
    return _runtime.tp_reduce_from_group(x, _GROUPS[key])


def _along(x, key, dim, kind, eager):
    if _SIZES[key] == 1:
        return x
    if _compiling():
        return _tp_collective(x.contiguous(), key, dim % x.dim(), kind)
    return eager(x.contiguous(), _GROUPS[key], dim)


def gather_from_group(x, key, dim):
    """All-gather along ``dim``; backward keeps this rank's slice of the gradient."""
    return _along(x, key, dim, ALL_GATHER_THEN_CHUNK_GRAD, _runtime.tp_gather_from_group)


def scatter_to_group(x, key, dim):
    """Keeps this rank's slice along ``dim``; backward all-gathers the gradient."""
    return _along(x, key, dim, OWN_CHUNK, _runtime.tp_scatter_to_group)


def sequence_gather(x, key, dim):
    """Sequence parallelism: all-gather along ``dim``; reduce-scatter of the gradient."""
    return _along(x, key, dim, ALL_GATHER, _runtime.tp_sequence_gather)


def sequence_reduce_scatter(x, key, dim):
    """Sequence parallelism: reduce-scatter along ``dim``; all-gather of the gradient."""
    return _along(x, key, dim, REDUCE_SCATTER, _runtime.tp_sequence_reduce_scatter)
