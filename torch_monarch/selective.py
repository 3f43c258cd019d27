"""Selective activation recomputation (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Sec. 5): a block keeps everything autograd saves
except the attention core's s x s tensors (softmax output, dropout mask, dropped-out scores),
and its backward re-runs only the attention core's operators to rebuild them.

A user's attention core is no separate call (HF modules compute it inline), so it is found at
the operator level: while the block runs forward, a dispatch mode watches every aten op.
  * The core starts at a matrix product of two activations (Q K^T): neither operand lives in
    the block's parameters or buffers.
  * Every op reading a core tensor belongs to the core (scale, mask, softmax, dropout, and the
    views between them), except a matrix product (A V), which ends it: its output is the
    ordinary residual-stream width and is saved as usual.
Core ops are written to a tape (the op, its non-core inputs held by reference, core inputs by
tape position, the RNG state before a random op). A saved tensor that is a core output is
packed as a tape position instead of the tensor (``saved_tensors_hooks``); when backward
first unpacks one, the tape is replayed under no_grad, in forward order, with the recorded
RNG states, so the rebuilt tensors are bit-identical to the ones forward made (same ops, same
inputs, same dropout masks). Replayed tensors live until backward has used every one of the
block's packed positions. Gradients flow through the original graph, so the data-parallel and
ZeRO engines' hooks fire once, as without recomputation.

Fused attention kernels (``scaled_dot_product_attention`` in torch 2.x) keep no s x s tensors:
they are not taped and selective keeps what they save, as Korthikanti's term would be zero.
"""

import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_aten = torch.ops.aten
# Matrix products below autograd (matmul itself decomposes into these), every overload.
_MATMULS = {_aten.mm, _aten.bmm, _aten.baddbmm, _aten.addbmm, _aten.addmm}
_RANDOM = getattr(getattr(torch, "Tag", None), "nondeterministic_seeded", None)

# Counts since the process started (what tests and benches read): saved tensors left out of
# forward's memory, and saved tensors backward rebuilt and used.
STATS = {"dropped": 0, "rebuilt": 0}


def _storage_ptr(t):
    """The tensor's storage address; None for tensors without one (sparse, nested, wrapper
    subclasses, meta): those are neither weights nor trackable core tensors."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta or t.layout != torch.strided \
            or getattr(t, "is_nested", False):
        return None
    ptr = t.untyped_storage().data_ptr() if hasattr(t, "untyped_storage") else t.storage().data_ptr()
    return ptr or None


def _key(t):
    if t.is_meta or _storage_ptr(t) is None:
        return None
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _is_matmul(func):
    return getattr(func, "overloadpacket", None) in _MATMULS


def _is_random(func):
    if _RANDOM is not None and _RANDOM in getattr(func, "tags", ()):
        return True
    name = str(func)
    return any(w in name for w in ("bernoulli", "dropout", "rand", "normal", "uniform", "exponential"))


def makes_core(func, tensors, is_core, is_weight):
    """Whether `func` applied to `tensors` belongs to the attention core (its outputs are core
    tensors): the rule this module recomputes by and the model reader counts by."""
    core_in = any(is_core(t) for t in tensors)
    if _is_matmul(func):
        # A product of two activations starts the core (Q K^T); one reading the core ends it (A V).
        return not core_in and len(tensors) >= 2 and not any(is_weight(t) for t in tensors)
    return core_in


class _Ref:
    """A core tensor in the tape: output `out` of entry `entry`."""
    __slots__ = ("entry", "out")

    def __init__(self, entry, out):
        self.entry, self.out = entry, out


class _Packed:
    """What autograd keeps for a saved core tensor: where the tape rebuilds it."""
    __slots__ = ("tape", "ref", "used")

    def __init__(self, tape, ref):
        self.tape, self.ref, self.used = tape, ref, False


class _Kept:
    """What autograd keeps for any other saved tensor: it, and its version when saved."""
    __slots__ = ("tensor", "version")

    def __init__(self, tensor, version):
        self.tensor, self.version = tensor, version


def _rng_states(tensors):
    cpu = torch.get_rng_state()
    cuda = {}
    for t in tensors:
        if t.is_cuda and t.device.index not in cuda:
            cuda[t.device.index] = torch.cuda.get_rng_state(t.device)
    return cpu, cuda


class _no_autocast:
    def __enter__(self):
        self.contexts = [torch.autocast("cpu", enabled=False)]
        if torch.cuda.is_available():
            self.contexts.append(torch.autocast("cuda", enabled=False))
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)


def _set_rng_states(states):
    cpu, cuda = states
    torch.set_rng_state(cpu)
    for index, state in cuda.items():
        torch.cuda.set_rng_state(state, torch.device("cuda", index))


class Tape:
    """The attention core's ops of one block's forward, replayable."""

    def __init__(self):
        self.entries = []     # (func, args, kwargs with _Ref for core inputs, rng states or None)
        self.versions = []    # per entry: (non-core input, its version when recorded)
        self.needed = set()   # (entry, out) positions some saved tensor points at
        self.results = None   # after replay: {(entry, out): tensor}
        self.last_use = {}    # (entry, out) -> the last entry reading it

    def record(self, func, args, kwargs, rng):
        self.entries.append((func, args, kwargs, rng))
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, _Ref):
                self.last_use[(a.entry, a.out)] = len(self.entries) - 1
        # Versions of the non-core inputs: one changed in place before backward would rebuild
        # different values (autograd's own check for saved tensors, extended to the tape).
        kept = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        self.versions.append([(a, a._version) for a in kept])
        return len(self.entries) - 1

    def get(self, ref):
        if self.results is None:
            self._replay()
        return self.results[(ref.entry, ref.out)]

    def _replay(self):
        values = {}

        def resolve(a):
            return values[(a.entry, a.out)] if isinstance(a, _Ref) else a

        saved_rng = None
        # Forward's ops, as forward ran them: no autocast that backward may run under.
        with torch.no_grad(), _no_autocast():
            try:
                for i, (func, args, kwargs, rng) in enumerate(self.entries):
                    for a, version in self.versions[i]:
                        if a._version != version:
                            raise RuntimeError(
                                f"selective recompute: an input of {func} (shape {tuple(a.shape)}) in the "
                                "attention core was modified in place after the forward; the core cannot be "
                                "rebuilt (use recompute='full' or 'none', or do not modify it in place)")
                    if rng is not None:
                        if saved_rng is None:
                            saved_rng = _rng_states([v for v in values.values()])
                        _set_rng_states(rng)
                    out = func(*tree_map(resolve, args), **tree_map(resolve, kwargs))
                    for j, o in enumerate(tree_flatten(out)[0]):
                        if isinstance(o, torch.Tensor):
                            values[(i, j)] = o
                    # What no later op reads and backward does not need is freed at once:
                    # replay holds no more of the core than forward did.
                    for k in [k for k in values if k not in self.needed and self.last_use.get(k, -1) <= i]:
                        del values[k]
            finally:
                if saved_rng is not None:
                    _set_rng_states(saved_rng)  # the caller's RNG stream is not disturbed
        self.results = {k: values[k] for k in self.needed}


class _CoreRecorder(TorchDispatchMode):
    """Watches one block's forward: tapes the attention core's ops and remembers, for every
    live core tensor, its tape position."""

    def __init__(self, tape, weight_storages):
        super().__init__()
        self.tape = tape
        self.weights = weight_storages
        self.core = {}  # _key(tensor) -> (weakref to the tensor, _Ref)

    def ref_of(self, t):
        key = _key(t)
        if key is None:
            return None
        hit = self.core.get(key)
        if hit is None:
            return None
        alive = hit[0]()
        # The same memory, shape and strides while the tensor that had them is alive: the same
        # tensor (or an alias of it), so the same values.
        return hit[1] if alive is not None else None

    def _refuse_writes_to_saved(self, func, args):
        """An in-place op on a core tensor backward will need would make replay hand backward
        the changed values: refused, as autograd refuses it for tensors it keeps."""
        try:
            schema_args = func._schema.arguments
        except AttributeError:
            return
        for i, arg in enumerate(schema_args[:len(args)]):
            alias = getattr(arg, "alias_info", None)
            if alias is None or not getattr(alias, "is_write", False) or not isinstance(args[i], torch.Tensor):
                continue
            ref = self.ref_of(args[i])
            if ref is not None and (ref.entry, ref.out) in self.tape.needed:
                raise RuntimeError(f"selective recompute: {func} modifies in place a tensor of the attention core "
                                   "that backward needs; rebuilding it would give backward the changed values "
                                   "(use recompute='full' or 'none', or an out-of-place op)")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if not makes_core(func, tensors, lambda t: self.ref_of(t) is not None,
                          lambda t: _storage_ptr(t) in self.weights):
            return func(*args, **kwargs)
        self._refuse_writes_to_saved(func, args)
        rng = _rng_states(tensors) if _is_random(func) else None

        def as_ref(a):
            if isinstance(a, torch.Tensor):
                r = self.ref_of(a)
                if r is not None:
                    return r
            return a

        entry = self.tape.record(func, tree_map(as_ref, args), tree_map(as_ref, kwargs), rng)
        out = func(*args, **kwargs)
        for j, o in enumerate(tree_flatten(out)[0]):
            key = _key(o) if isinstance(o, torch.Tensor) else None
            if key is not None:
                self.core[key] = (weakref.ref(o), _Ref(entry, j))
        return out


def run(fn, module, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a block's forward) with its attention core recomputed in backward."""
    tape = Tape()
    weights = {_storage_ptr(t) for t in module.parameters()} | {_storage_ptr(t) for t in module.buffers()}
    # Under mixed precision the block computes with copies of its parameters cast to the compute
    # dtype, which torch_monarch.mixed_precision puts in the owning modules' instance dicts:
    # weights too (else every linear would look like a product of two activations and start a
    # core, and the block would keep more than without recomputation).
    weights |= {_storage_ptr(v) for m in module.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)}
    weights.discard(None)
    recorder = _CoreRecorder(tape, weights)

    def pack(t):
        ref = recorder.ref_of(t)
        if ref is None:
            # Kept, detached (holding the tensor itself would tie an output to its own node:
            # a cycle no collector sees), with its version: autograd skips its in-place check
            # for tensors saved through hooks, so unpack makes it.
            with no_dispatch():
                return _Kept(t.detach(), t._version)
        tape.needed.add((ref.entry, ref.out))
        STATS["dropped"] += 1
        return _Packed(tape, ref)

    def unpack(p):
        # (Autograd re-attaches the saved tensor's node to what unpack returns, so double
        # backward goes through forward's own graph: nothing to refuse.)
        if isinstance(p, _Kept):
            if p.tensor._version != p.version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: a tensor of shape {tuple(p.tensor.shape)} saved in a block under selective "
                    f"recompute is at version {p.tensor._version}; expected version {p.version} instead")
            return p.tensor
        if not p.used:
            p.used = True
            STATS["rebuilt"] += 1
        return p.tape.get(p.ref)

    with saved_tensors_hooks(pack, unpack):
        with recorder:
            out = fn(*args, **kwargs)
    recorder.core.clear()
    return out
