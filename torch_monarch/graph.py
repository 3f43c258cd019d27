"""Reads an ``nn.Module`` into the planner's model graph, on the meta device.

    info = read_model(model, example_input)     # nothing is materialized: a 175B model is fine
    info.graph                                  # planner ModelGraph (layers in execution order)
    info.modules["model.layers.0.self_attn"]    # per-module record: params, FLOPs, saved bytes, ...

One forward pass runs with every parameter replaced by a meta tensor of the same shape and
dtype (the model itself is not touched, and may itself live on ``meta``). The inputs and
buffers stay real, and so does what the forward computes from them alone (masks, positions,
padding checks that read values); whatever a parameter touches is meta, so no weight or
activation is allocated. Where the forward reads a meta value (``.item()``, ``nonzero``, as
MoE routing does) it gets "true" everywhere: that steers a branch, never a shape that
depends only on the inputs.
  * FLOPs are counted from the aten ops that run (mm, addmm, bmm, baddbmm, convolution and
    fused attention kernels; a multiply-add is 2 FLOPs), attributed to every module on the
    call stack. Matrix products of two activations (Q K^T, A V) are also counted as the
    attention part, which selective recomputation redoes (Korthikanti et al. 2022).
  * Activation bytes are the tensors autograd saves for backward (``saved_tensors_hooks``),
    parameters excluded, each storage once (views of one tensor saved by several ops hold its
    memory once: measured in bench/memory_prediction.py).
  * Blocks are the entries of the ``nn.ModuleList`` holding the most parameters (the rule the runtime cuts
    pipelines and shards by: ``blocks_of``). Layers of the graph are the blocks and the other
    top-level modules around them, in the order they first run.
  * Tensor-parallel structure comes from the same name-based default plan the runtime
    splits by (``tensor_parallel_modules.default_plan``), or ``tp_plan=``: attention (q/k/v,
    fused qkv, grouped KV heads read from the modules' head-count attributes), MLPs (plain or
    gated), vocabulary embeddings and heads. A block with column- and row-parallel linears
    becomes a ``block`` layer whose ``tp_dims`` name what tp must divide.
"""

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import planner as _planner
from .experts import is_experts_module
from .selective import makes_core
from .sharded import _default_units as blocks_of  # the one rule: the runtime cuts and shards by it
from .tensor_parallel_modules import (Colwise, Heads, Replicate, Rowwise, head_counts, linear_dims,
                                      VocabEmbedding, VocabHead, default_plan, resolve_plan)


@dataclass
class ModuleRecord:
    """What one forward of the example batch did inside one module (children included)."""
    name: str
    type: str
    params: int = 0                 # elements, each shared tensor once
    flops: float = 0.0              # forward FLOPs for the example batch
    attention_flops: float = 0.0    # the activation x activation matmuls among them
    saved_bytes: float = 0.0        # saved for backward, parameters excluded
    output_shapes: list = field(default_factory=list)
    order: int = -1                 # when it first ran (-1: never ran)
    output_spec: object = None      # pytree structure of its first output (pipeline_hooks rebuilds it)
    output_constants: dict = field(default_factory=dict)  # that output's non-tensor leaves, by position
    output_leaves: list = field(default_factory=list)     # that output's tensors: (shape, dtype), in order
    input_shape: tuple = None       # shape of its first tensor input
    # Ids of the tensors it took (blocks: every argument) and gave, in its first run: which
    # module feeds which block (pipeline_hooks checks that only the chain crosses stages).
    input_ids: set = field(default_factory=set)
    output_ids: set = field(default_factory=set)


@dataclass
class ModelInfo:
    """The model as read: per-module records, the planner graph and how layers map to modules."""
    graph: object                   # torch_monarch.planner.ModelGraph
    modules: dict                   # name -> ModuleRecord
    layer_modules: list             # per graph layer: the module name it stands for
    blocks: list                    # names of the blocks
    tied: list                      # lists of parameter names that are one tensor
    batch: int
    seq: int
    total_params: int
    tp_plan: dict                   # {module name: style} the layers' tp structure came from
    param_dtype: object = None      # planner DType of the model's own parameters

    def summary(self):
        lines = [f"{self.graph.name}: {self.total_params:,} parameters, {len(self.blocks)} blocks, "
                 f"batch {self.batch}" + (f", sequence {self.seq}" if self.seq else "")]
        for layer, module in zip(self.graph.layers, self.layer_modules):
            lines.append(f"  {layer.name:<28} {str(layer.kind).split('.')[-1]:<9} {layer.params:>14,} params "
                         f"{layer.forward_flops_per_sample:12.4g} FLOP/sample  tp={str(layer.tp).split('.')[-1]}")
        return "\n".join(lines)


# -- FLOPs of aten ops --------------------------------------------------------------------

def _numel(shape):
    return math.prod(int(s) for s in shape)


def _matmul_flops(name, args, out):
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
        return 2.0 * _numel(out.shape) * a.shape[-1], a, b
    if name == "_grouped_mm":  # MoE experts: every routed token through its expert's matrix once
        a, b = args[0], args[1]
        return 2.0 * _numel(out.shape) * a.shape[-1], a, b
    return None


def _conv_flops(args, out):
    weight = args[1]
    # Each output element: a dot product over in_channels / groups x kernel elements.
    return 2.0 * _numel(out.shape) * _numel(weight.shape[1:])


def _attention_flops(q, k):
    # softmax(Q K^T) V: two matmuls of b x heads x s_q x s_k x d.
    return 4.0 * _numel(q.shape[:-1]) * k.shape[-2] * q.shape[-1]


_ATTENTION_KERNELS = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
                      "_efficient_attention_forward", "scaled_dot_product_attention",
                      "_scaled_dot_product_flash_attention_for_cpu"}


class _Recorder:
    """Module stack, FLOP and saved-tensor accounting for one capture."""

    def __init__(self, names_by_module, param_ids):
        self.names = names_by_module
        self.param_ids = param_ids
        self.stack = []
        self.records = {}
        self.order = 0
        self.seen_saved = {}
        self.seen_storages = set()  # storages already counted (views of one tensor hold it once)
        self.saved_by = []  # (tensor, stack snapshot, elements of its storage) for later classification
        self.alive = []     # tensors whose ids the records keep (held so no id is reused)
        self.core = {}      # id -> tensor: attention-core outputs (selective.makes_core), this block
        self.saved_core = set()  # ids of saved tensors that are attention-core tensors
        self.weight_ids = set()
        self.blocks = set()  # the runtime recomputes inside blocks, one block at a time
        self.gemms = []      # (module stack, M, N, K) of each weight GEMM (activation @ weight)
        self.experts = set()         # names of the MoE experts modules (experts.is_experts_module)
        self.experts_inputs = {}     # experts module name -> shapes of its tensor inputs, first call

    def is_core(self, t):
        return self.core.get(id(t)) is t

    def is_weight(self, t):
        return id(t) in self.weight_ids or (t._base is not None and id(t._base) in self.weight_ids)

    def in_block(self):
        return any(n in self.blocks for n in self.stack)

    def is_param(self, t):
        return id(t) in self.param_ids or (t._base is not None and id(t._base) in self.param_ids)

    def add(self, flops, attention):
        for name in self.stack:
            r = self.records[name]
            r.flops += flops
            r.attention_flops += attention

    def pack(self, t):
        if isinstance(t, torch.Tensor) and not self.is_param(t) and id(t) not in self.seen_saved:
            self.seen_saved[id(t)] = t  # (held: neither its id nor its storage's address is reused)
            # Memory is a storage's, held once however many views of it are saved: a linear
            # saves its own 2-D view of a 3-D input (q, k and v projections: three views of one
            # tensor), a batched matmul views of its operands, also saved by the op before it.
            key, elements = _storage_of(t)
            if key is not None:
                if key in self.seen_storages:
                    return t
                self.seen_storages.add(key)
            nbytes = float(elements * t.element_size())
            for name in self.stack:
                self.records[name].saved_bytes += nbytes
            self.saved_by.append((t, tuple(self.stack), elements))
            if self.in_block() and self.is_core(t):
                self.saved_core.add(id(t))
        return t


def _storage_of(t):
    """(identity, elements) of the storage ``t`` views, or (None, t.numel()) for a tensor without one.
    The storage's elements, not the view's: a saved view keeps all of it alive (and an expanded
    view holds fewer elements than it shows). Nested and sparse tensors have no single storage:
    their elements are counted."""
    if t.is_nested or t.layout != torch.strided:
        return None, t.numel()
    storage = t.untyped_storage()
    return storage._cdata, storage.nbytes() // max(t.element_size(), 1)


def _on_one_device(args, kwargs):
    """An op mixing meta tensors (anything computed from a parameter) with real ones (the
    inputs, and what the forward computes from them alone: masks, positions) runs on meta,
    the real ones moved there."""
    flat, spec = tree_flatten((args, kwargs))
    if any(isinstance(a, torch.Tensor) and a.is_meta for a in flat) and \
            any(isinstance(a, torch.Tensor) and not a.is_meta for a in flat):
        flat = [a.to("meta") if isinstance(a, torch.Tensor) and not a.is_meta else a for a in flat]
        args, kwargs = tree_unflatten(flat, spec)
    return args, kwargs


def _data_dependent_on_meta(func, args):
    """What the reader answers where the forward reads values it does not have (a meta
    tensor's ``.item()``: a padding check on a mask made on an activation's device, MoE
    routing's ``nonzero``): every element "true" (``.item()`` -> True / 1, ``nonzero`` -> every
    position). It only steers which branch the read takes; shapes of everything that does not
    depend on such values stay exact. None where the op can run."""
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_meta:
        return None
    t = args[0]
    if func is torch.ops.aten._local_scalar_dense.default:
        return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
    if func is torch.ops.aten.nonzero.default:
        return torch.empty((t.numel(), t.dim()), dtype=torch.long, device="meta")
    if func is torch.ops.aten._grouped_mm.default and t.dim() == 2 and args[1].dim() == 3:
        # Its meta kernel admits bf16 only (the CUDA kernel's rule); the shape is dtype-free:
        # (routed tokens, in) x (experts, in, out) -> (routed tokens, out).
        return torch.empty((t.shape[0], args[1].shape[-1]), dtype=t.dtype, device="meta")
    return None


def _make_mode(recorder):
    class FlopCounter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            args, kwargs = _on_one_device(args, kwargs or {})
            unknown = _data_dependent_on_meta(func, args)
            if unknown is not None:
                return unknown
            out = func(*args, **kwargs)
            name = func.overloadpacket.__name__
            flops = attention = 0.0
            mm = _matmul_flops(name, args, out)
            if mm is not None:
                flops, a, b = mm
                if not recorder.is_param(a) and not recorder.is_param(b):
                    attention = flops  # activation x activation: attention scores / context
                elif recorder.is_param(b) and not recorder.is_param(a) and out.dim() == 2:
                    recorder.gemms.append((tuple(recorder.stack), int(out.shape[0]), int(out.shape[1]),
                                           int(a.shape[-1])))
            elif name in ("convolution", "_convolution"):
                flops = _conv_flops(args, out)
            elif name in _ATTENTION_KERNELS:
                flops = attention = _attention_flops(args[0], args[1])
            if flops:
                recorder.add(flops, attention)
            tensors = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
            if recorder.in_block() and makes_core(func, tensors, recorder.is_core, recorder.is_weight):
                for o in tree_flatten(out)[0]:
                    if isinstance(o, torch.Tensor):
                        recorder.core[id(o)] = o
            return out

    return FlopCounter()


@contextlib.contextmanager
def _sdpa_as_fused_kernel():
    """``F.scaled_dot_product_attention`` read as the fused kernel the model runs with. On the
    meta device torch picks its math fallback, which materializes the s x s scores (and repeats
    grouped key-value heads) and saves them for backward; on CPU and GPU it runs a fused kernel
    (FlashAttention, Dao et al. 2022; on CPU ``_scaled_dot_product_flash_attention_for_cpu``)
    that keeps q, k and v as given (grouped heads unrepeated), the output and one log-sum-exp
    per head and row. The CPU flash kernel's meta implementation saves exactly those, so the
    read counts what the runtime keeps (measured in bench/memory_prediction.py); calls it
    cannot take (nested tensors, arguments it refuses) go to torch's own function."""
    import torch.nn.functional as F
    original = F.scaled_dot_product_attention

    def fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        grouped = query.dim() == 4 and key.dim() == 4 and key.shape[-3] != query.shape[-3]
        if query.is_meta and query.dim() == 4 and not query.is_nested and (enable_gqa or not grouped) and \
                query.dtype == key.dtype == value.dtype:
            try:
                out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
                return out
            except RuntimeError:  # the kernel's own refusal of its arguments (a mask shape it cannot take)
                pass
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **({"enable_gqa": True} if enable_gqa else {}))

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _to_cpu(x):
    """Example inputs as real CPU tensors (an input given on meta, or on another device, keeps
    its shape and dtype: zeros stand in for values that were never there)."""
    if isinstance(x, torch.Tensor):
        return torch.zeros(x.shape, dtype=x.dtype) if x.is_meta else x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return x


def _shapes(x):
    if isinstance(x, torch.Tensor):
        return [tuple(x.shape)]
    if isinstance(x, (list, tuple)):
        return [s for v in x for s in _shapes(v)]
    if isinstance(x, dict):
        return [s for v in x.values() for s in _shapes(v)]
    if hasattr(x, "to_tuple"):  # Hugging Face ModelOutput
        return _shapes(x.to_tuple())
    return []


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    values = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
    for v in values:
        t = _first_tensor(v)
        if t is not None:
            return t
    return None


def _batch_and_seq(example_input):
    t = _first_tensor(example_input)
    if t is None or t.dim() == 0:
        raise ValueError("read_model: example_input holds no tensor with a batch dimension")
    batch = int(t.shape[0])
    # Token ids (batch, seq) or embeddings (batch, seq, hidden): a sequence model.
    is_tokens = t.dim() == 2 and not t.is_floating_point()
    seq = int(t.shape[1]) if is_tokens or t.dim() == 3 else 0
    return batch, seq


def _capture(model, example_input, recorder, tensors):
    args, kwargs = ((), dict(example_input)) if isinstance(example_input, dict) else (
        (tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)), {})
    handles = []

    def pre(module, _inputs, _kwargs):
        name = recorder.names.get(id(module))
        if name is None:
            return
        if name in recorder.blocks:
            recorder.core.clear()  # as the runtime: each block's core is its own
        recorder.stack.append(name)
        r = recorder.records[name]
        if r.order < 0:
            r.order = recorder.order
            recorder.order += 1
            first = _first_tensor((_inputs, _kwargs))  # keyword inputs too (HF calls by keyword)
            r.input_shape = tuple(first.shape) if first is not None else None
            if name in recorder.experts:  # (hidden [tokens, h], top_k_index [tokens, k], weights)
                recorder.experts_inputs[name] = [tuple(t.shape) for t in tree_flatten((_inputs, _kwargs))[0]
                                                  if isinstance(t, torch.Tensor)]

    def post(module, _inputs, output):
        name = recorder.names.get(id(module))
        if name is None:
            return
        r = recorder.records[name]
        if not r.output_shapes:
            r.output_shapes = _shapes(output)
        if r.output_spec is None:
            flat, r.output_spec = tree_flatten(output)
            r.output_constants = {i: v for i, v in enumerate(flat) if not isinstance(v, torch.Tensor)}
            r.output_leaves = [(tuple(v.shape), v.dtype) for v in flat if isinstance(v, torch.Tensor)]
            r.output_ids = {id(v) for v in flat if isinstance(v, torch.Tensor)}
            recorder.alive.extend(v for v in flat if isinstance(v, torch.Tensor))  # ids stay theirs
        if recorder.stack and recorder.stack[-1] == name:
            recorder.stack.pop()

    def block_inputs(module, args, kwargs):
        r = recorder.records[recorder.names[id(module)]]
        if not r.input_ids:
            inputs = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
            r.input_ids = {id(v) for v in inputs}
            recorder.alive.extend(inputs)

    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
        if recorder.names.get(id(module)) in recorder.blocks:
            handles.append(module.register_forward_pre_hook(block_inputs, with_kwargs=True))
    was_training = model.training
    model.train()  # what training saves for backward (dropout masks included)
    try:
        # The inputs stay real, and so does what the forward computes from them alone (a
        # causal mask from torch.ones, positions from torch.arange, a padding check such as
        # ``attention_mask.all()``, which reads values): only what a parameter touches is meta
        # (_on_one_device), so no activation or weight is ever allocated.
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), _make_mode(recorder), \
                _sdpa_as_fused_kernel():
            with torch.enable_grad():
                torch.func.functional_call(model, tensors, _to_cpu(args), _to_cpu(kwargs))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)


def read_model(model: nn.Module, example_input, *, name=None, tp_plan=None, dtype=None):
    """Reads ``model`` run on ``example_input`` (a tensor, a tuple of positional inputs, or a
    dict of keyword inputs, e.g. a Hugging Face batch; read as CPU tensors, and an input on
    meta as zeros of its shape)
    into a ``ModelInfo`` whose ``graph`` the planner plans. ``dtype`` (e.g. "bf16"): the dtype
    the plan trains in (default: the parameters' dtype). ``tp_plan`` overrides the name-based
    tensor-parallel structure as in ``tensor_parallel``."""
    names = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), mname)
    records = {n: ModuleRecord(n, type(m).__name__) for n, m in model.named_modules()}
    # Every parameter and buffer, under every name it has, as one meta tensor per tensor.
    meta_of = {}
    tensors = {}
    param_ids = set()
    weight_ids = set()  # parameters and buffers: what the attention-core rule calls weights
    tied = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in list(module._parameters.items()) + list(module._buffers.items()):
            if p is None:
                continue
            full = f"{mname}.{pname}" if mname else pname
            if id(p) not in meta_of:
                # A buffer stays itself (positions, token types, rotary frequencies: small, and
                # read for their values); a parameter, or a buffer still on meta, becomes meta.
                # A copy: the read forward must not update the model's own buffers (batch norm's
                # running statistics and its num_batches_tracked).
                real_buffer = not isinstance(p, nn.Parameter) and not p.is_meta
                m = p.detach().cpu().clone() if real_buffer else torch.empty(p.shape, dtype=p.dtype, device="meta")
                if isinstance(p, nn.Parameter):
                    m.requires_grad_(p.requires_grad)
                    param_ids.add(id(m))
                weight_ids.add(id(m))
                meta_of[id(p)] = m
            tensors[full] = meta_of[id(p)]
            if isinstance(p, nn.Parameter):
                tied.setdefault(id(p), []).append(full)
    for mname, module in model.named_modules():
        seen = set()
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                records[mname].params += p.numel()
    batch, seq = _batch_and_seq(example_input)
    recorder = _Recorder(names, param_ids)
    recorder.weight_ids = weight_ids
    block_ids = {id(b) for b in blocks_of(model)}  # (once: finding them walks the whole model)
    recorder.blocks = {n for n, m in model.named_modules() if id(m) in block_ids}
    recorder.records = records
    recorder.experts = {n for n, m in model.named_modules() if is_experts_module(m)}
    with _any_batch_size():
        _capture(model, example_input, recorder, tensors)
    experts = _read_experts(model, records, recorder)

    plan = resolve_plan(model, tp_plan)
    info_layers = _layers(model, records)
    graph = _planner.ModelGraph()
    graph.name = name or type(model).__name__
    compute_dtype = _planner._enum(_planner.DType, dtype, "dtype") if dtype is not None else _dtype_of(model)
    blocks = [n for n, m in _named(model, blocks_of(model))]
    hidden = _hidden_size(model, plan)
    layers = []
    for lname, kind in info_layers:
        layers.append(_layer(model, lname, kind, records[lname], recorder, plan, batch, seq, hidden,
                             compute_dtype, blocks, experts))
    graph.layers = layers
    graph.tied_groups, graph.tied_group_params = _tied_groups(model, info_layers)
    graph.transformer = _transformer_config(graph, plan, blocks, seq, hidden, compute_dtype, model, experts)
    _planner.validate(graph)
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return ModelInfo(graph=graph, modules=records, layer_modules=[n for n, _ in info_layers], blocks=blocks,
                     tied=[v for v in tied.values() if len(v) > 1], batch=batch, seq=seq, total_params=total,
                     tp_plan=plan, param_dtype=_dtype_of(model))


@contextlib.contextmanager
def _any_batch_size():
    """Batch norm in training mode refuses a batch with one value per channel (a one-sample
    example input to a BatchNorm1d), and updating its running variance divides by n - 1.
    Reading needs no batch statistics, only the operations and their shapes: while the model
    is read, the check is off and training-mode batch norm keeps no running statistics."""
    import torch.nn.functional as F
    check, batch_norm = getattr(F, "_verify_batch_size", None), F.batch_norm

    def reading_batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
                           momentum=0.1, eps=1e-5):
        if training:
            running_mean = running_var = None
        return batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)

    if check is not None:
        F._verify_batch_size = lambda size: None
    F.batch_norm = reading_batch_norm
    try:
        yield
    finally:
        F.batch_norm = batch_norm
        if check is not None:
            F._verify_batch_size = check


def _named(model, modules):
    ids = {id(m) for m in modules}
    return [(n, m) for n, m in model.named_modules() if id(m) in ids]


def _dtype_of(model):
    for p in model.parameters():
        if p.is_floating_point():
            return {torch.float32: _planner.DType.fp32, torch.bfloat16: _planner.DType.bf16,
                    torch.float16: _planner.DType.fp16}.get(p.dtype, _planner.DType.fp32)
    return _planner.DType.fp32


def _layers(model, records):
    """(module name, kind hint) of each graph layer, in the order the layers first ran: the
    blocks, and the modules around them (ancestors of the blocks are opened up)."""
    blocks = blocks_of(model)
    block_ids = {id(b) for b in blocks}
    holders = set()  # modules with a block somewhere below them
    for name, m in model.named_modules():
        if any(id(x) in block_ids for x in m.modules()) and id(m) not in block_ids:
            holders.add(id(m))
    out = []

    def visit(prefix, module):
        if module._parameters and any(p is not None for p in module._parameters.values()):
            # Parameters held directly by a module the blocks live in (e.g. a learned position
            # table as a bare nn.Parameter): their own layer, named after the module.
            out.append((prefix or "", "own"))
        for cname, child in module.named_children():
            full = f"{prefix}.{cname}" if prefix else cname
            if id(child) in block_ids:
                out.append((full, "block"))
            elif id(child) in holders:
                visit(full, child)
            else:
                out.append((full, "module"))

    if id(model) in holders:
        visit("", model)
    else:
        out = [(n, "module") for n, _ in model.named_children()] or [("", "module")]
    kept = []
    for name, kind in out:
        r = records[name]
        if kind == "own" or r.params or r.flops or r.saved_bytes:
            kept.append((name, kind))
    big = max(len(records) + 1, 1)
    kept.sort(key=lambda item: records[item[0]].order if records[item[0]].order >= 0 else big)
    return kept


def _hidden_size(model, plan):
    for name, style in plan.items():
        m = model.get_submodule(name)
        if isinstance(style, VocabEmbedding) and isinstance(m, nn.Embedding):
            return m.embedding_dim
    for name, style in plan.items():
        m = model.get_submodule(name)
        if isinstance(style, Colwise) and linear_dims(m) is not None:
            return linear_dims(m)[0]
    return 0


def _kind(module, kind_hint, style_names, name):
    if kind_hint == "block":
        return _planner.LayerKind.block
    if isinstance(module, nn.Embedding):
        return _planner.LayerKind.embedding
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "norm" in type(module).__name__.lower():
        return _planner.LayerKind.norm
    if style_names.get(name) == "VocabHead":
        return _planner.LayerKind.head
    return _planner.LayerKind.other


def _tp_of(model, lname, plan):
    """(pattern, TpDims) of a layer from the tp styles of the modules in it."""
    prefix = lname + "." if lname else ""
    inside = {n: s for n, s in plan.items() if n == lname or n.startswith(prefix)}
    dims = _planner.TpDims()
    # An attention module split by heads (nn.MultiheadAttention) is its own column and row.
    fused = [n for n, s in inside.items() if isinstance(s, Heads)]
    col = [n for n, s in inside.items() if isinstance(s, Colwise)] + fused
    row = [n for n, s in inside.items() if isinstance(s, Rowwise)] + fused
    vocab = [model.get_submodule(n) for n, s in inside.items() if isinstance(s, (VocabEmbedding, VocabHead))]
    if vocab and not (col and row):
        m = vocab[0]
        dims.vocab = m.num_embeddings if isinstance(m, nn.Embedding) else linear_dims(m)[1]
        return _planner.TpPattern.vocab, dims
    if not col or not row:
        return _planner.TpPattern.replicated, dims
    heads, kv_heads = 0, 0
    for n in fused:
        heads = heads or model.get_submodule(n).num_heads
    for parent in sorted({n.rpartition(".")[0] for n in col if n not in fused}):
        h, kv = head_counts(model.get_submodule(parent) if parent else model)
        heads, kv_heads = heads or h, kv_heads or (kv if h else 0)
    dims.heads = heads
    dims.kv_heads = kv_heads or heads
    # The MLP's inner width: the widest input of a row-parallel linear (the attention
    # output projection takes heads x head_dim, the MLP's down projection takes ffn).
    widths = [linear_dims(model.get_submodule(n))[0] for n in row if linear_dims(model.get_submodule(n)) is not None]
    dims.ffn = max(widths) if widths else 0
    has_attention = heads > 0 or any(_looks_like_attention(n) for n in col)
    # (A head-split attention module's output projection is inside it, not among the rows.)
    has_mlp = len(widths) > (1 if has_attention and not fused else 0)
    if has_attention and has_mlp:
        return _planner.TpPattern.block, dims
    return (_planner.TpPattern.heads if has_attention else _planner.TpPattern.column_row), dims


def _looks_like_attention(name):
    leaf = name.rpartition(".")[2].lower()
    return leaf in {"q_proj", "k_proj", "v_proj", "wq", "wk", "wv", "query", "key", "value", "q", "k", "v", "qkv",
                    "c_attn"}


def _classify_saved(recorder, lname, plan, hidden, seq, per_sample, act_bytes):
    """Splits the bytes a layer saves into the planner's activation kinds (Korthikanti et al.
    2022, Sec. 4): attention scores (s x s), inside the tp-split region (after a column-
    parallel linear, before the row-parallel one), and the replicated residual stream."""
    col = {n for n, s in plan.items() if isinstance(s, (Colwise, VocabHead))}
    row = {n for n, s in plan.items() if isinstance(s, Rowwise)}
    # Inside a head-split attention module everything but its output is split too.
    split_parents = {n.rpartition(".")[0] for n in col} | {n for n, s in plan.items() if isinstance(s, Heads)}
    prefix = lname + "." if lname else ""
    a = _planner.ActivationBytes()
    sizes = []  # per sample, in the order the layer kept them
    for t, stack, elements in recorder.saved_by:
        if lname not in stack or any(n in recorder.experts for n in stack):
            continue  # (an experts module's are counted from its routing: _moe_of)
        # Floating activations in the dtype the plan computes in (autocast); masks and
        # indices keep their own.
        size = act_bytes if t.is_floating_point() else t.element_size()
        nbytes = elements * size / per_sample
        sizes.append(nbytes)
        leaf = stack[-1]
        inner = [n for n in stack if n == lname or n.startswith(prefix)]
        if id(t) in recorder.saved_core:
            a.attention_scores += nbytes  # what selective recomputation rebuilds
        elif leaf in row:
            a.tp_sharded += nbytes
        elif leaf in col:
            a.replicated += nbytes  # a column-parallel linear's input: the replicated stream
        elif any(n in split_parents for n in inner) and not (hidden and _per_token(t, seq) == hidden
                                                            and leaf not in split_parents):
            a.tp_sharded += nbytes
        else:
            a.replicated += nbytes
    a.backward_transient = _backward_transient(sizes)
    return a


def _backward_transient(sizes):
    """What a layer's backward holds at once beyond what it kept (the planner's
    ActivationBytes.backward_transient), from the sizes of the tensors it kept, in forward
    order: backward runs last to first, freeing each tensor once the op that kept it is done,
    and the op that kept tensor k holds the gradients of k's size twice over (its output's and
    its input's) while the tensors kept after k are already gone: max over k of
    2 size(k) - sum of the sizes after k (0 at least). Exact for eager SwiGLU (silu(gate) x up)
    and a softmax; one ffn-wide tensor high for a plain activation (GeLU keeps its input, not
    its output). Checked against measured peaks in bench/memory_prediction.py."""
    best, after = 0.0, 0.0
    for size in reversed(sizes):
        best = max(best, 2 * size - after)
        after += size
    return best


def _per_token(t, seq):
    if t.dim() == 0:
        return 0
    tokens = t.shape[0] * (t.shape[1] if seq and t.dim() >= 2 and t.shape[1] == seq else 1)
    return t.numel() // max(tokens, 1)


def _layer(model, lname, kind_hint, record, recorder, plan, batch, seq, hidden, dtype, blocks, experts=None):
    module = model.get_submodule(lname) if lname else model
    style_names = {n: type(s).__name__ for n, s in plan.items()}
    layer = _planner.Layer()
    layer.name = lname or "<root>"
    layer.param_dtype = dtype
    if kind_hint == "own":
        layer.kind = _planner.LayerKind.other
        layer.params = sum(p.numel() for p in module._parameters.values() if p is not None)
        layer.name = (lname + ".<own>") if lname else "<root>.<own>"
        return layer
    layer.kind = _kind(module, kind_hint, style_names, lname)
    layer.params = record.params
    layer.forward_flops_per_sample = record.flops / batch
    layer.attention_flops_per_sample = record.attention_flops / batch
    elem = 2.0 if dtype in (_planner.DType.bf16, _planner.DType.fp16) else 4.0
    layer.activations = _classify_saved(recorder, lname, plan, hidden, seq, batch, elem)
    out = record.output_shapes[0] if record.output_shapes else None
    layer.output_bytes_per_sample = (_numel(out) / batch * elem) if out else 0.0
    if layer.kind == _planner.LayerKind.head and out:
        # The loss runs outside the model (as build_transformer's head): it keeps the fp32
        # softmax of the logits (F.cross_entropy on fp32 logits: log_softmax's output; the
        # vocabulary-parallel one's softmax, split over tp), not the logits, which the runtime
        # drops once the loss is computed (read once: memory traffic, not memory); its backward
        # makes the fp32 gradients of the log-probabilities and of the logits.
        logits = _numel(out) / batch
        layer.activations.tp_sharded += 4.0 * logits
        layer.activations.read_once = elem * logits
        layer.activations.backward_transient = max(layer.activations.backward_transient, 2 * 4.0 * logits)
        layer.output_bytes_per_sample = 0.0
    inputs = _input_bytes_per_sample(recorder, lname, batch, elem)
    layer.activations.layer_input = inputs if inputs else layer.output_bytes_per_sample
    pattern, dims = _tp_of(model, lname, plan)
    layer.tp, layer.tp_dims = pattern, dims
    layer.gemms = _gemms_of(recorder, lname, plan, batch, pattern != _planner.TpPattern.replicated)
    layer.recomputable = layer.kind != _planner.LayerKind.head
    layer.kv_elements_per_token = _kv_elements_per_token(model, lname, plan, dims)
    inside = [e for n, e in (experts or {}).items() if n == lname or not lname or n.startswith(lname + ".")]
    if inside:
        _moe_of(layer, inside, batch, elem)
    return layer


@dataclass
class ExpertsRecord:
    """One MoE layer's routed experts as read: sizes from the experts module's parameters
    (transformers 5's layout: gate_up_proj [experts, 2 ffn, hidden], down_proj [experts, hidden,
    ffn]), top_k from its router, tokens from what the example batch sent it."""
    name: str
    experts: int
    top_k: int
    hidden: int
    ffn: int
    gated: bool
    params: int                  # every expert's parameters (elements): what ep divides
    tokens: int                  # tokens of the example batch routed through the layer
    capacity_factor: float = 0.0  # 0: dropless
    shared_ffn: int = 0          # inner width of the shared (always-on) experts beside it, 0: none

    @property
    def matrices(self):
        return 3 if self.gated else 2

    @property
    def routed_flops(self):
        """Forward FLOPs of the example batch through its experts, balanced: each token through
        top_k experts' matrices (not all of them)."""
        return 2.0 * self.tokens * self.top_k * self.matrices * self.hidden * self.ffn


def _top_k_of(model, name, observed):
    """Experts per token for the experts module ``name``: its router's (a sibling with an
    integer ``top_k``: HF's MixtralTopKRouter / Qwen2MoeTopKRouter, examples/models.py's
    MoERouter), else the MoE block's own ``top_k`` / ``num_experts_per_tok`` (or its config's),
    else the width of the routing indices the experts module was called with."""
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    leaf = name.rpartition(".")[2]
    candidates = [c for n, c in parent.named_children() if n != leaf] + [parent, getattr(parent, "config", None)]
    for c in candidates:
        for attr in ("top_k", "num_experts_per_tok"):
            k = getattr(c, attr, None)
            if isinstance(k, int) and not isinstance(k, bool) and k > 0:
                return k
    if len(observed) >= 2 and len(observed[1]) >= 1:
        return int(observed[1][-1])
    raise ValueError(f"read_model: found no top_k for the experts module '{name}' (no router with a top_k "
                     "attribute beside it, and it was not called with routing indices)")


def _shared_ffn(model, name, plan):
    """Inner width of the shared experts beside the experts module ``name`` (a sibling whose
    name says ``shared`` holding a row-parallel linear: Qwen2-MoE's shared_expert,
    DeepSeek's shared_experts); 0 if none."""
    parent_name = name.rpartition(".")[0]
    prefix = parent_name + "." if parent_name else ""
    widths = [linear_dims(model.get_submodule(n))[0] for n, style in plan.items()
              if isinstance(style, Rowwise) and n.startswith(prefix) and "shared" in n[len(prefix):].split(".")[0]
              and linear_dims(model.get_submodule(n)) is not None]
    return sum(widths)


def _read_experts(model, records, recorder):
    """{name: ExpertsRecord} of the experts modules that ran, and the records' FLOPs set to
    the routed experts' balanced count. On meta the routing is unknown (its ``nonzero`` reads
    "every position"), so what the forward computed there is no measure: a loop over experts
    sends every token to every expert, Hugging Face's skips them all. The FLOPs of each experts
    module (and of the modules around it) become top_k of experts per token's; its weight
    GEMMs and saved tensors are replaced by the grouped GEMMs and routed copies _moe_of adds."""
    out = {}
    for name in sorted(recorder.experts):
        record = records.get(name)
        if record is None or record.order < 0:
            continue  # never ran
        module = model.get_submodule(name)
        e, two_f, h = (int(d) for d in module.gate_up_proj.shape)
        f = int(module.down_proj.shape[-1])
        gated = two_f == 2 * f
        observed = recorder.experts_inputs.get(name, [])
        tokens = _numel(observed[0][:-1]) if observed and observed[0] and observed[0][-1] == h else 0
        params = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
        cf = getattr(module, "capacity_factor", None)
        parent_name = name.rpartition(".")[0]
        if cf is None:
            cf = getattr(model.get_submodule(parent_name) if parent_name else model, "capacity_factor", 0.0)
        x = ExpertsRecord(name=name, experts=e, top_k=_top_k_of(model, name, observed), hidden=h, ffn=f, gated=gated,
                          params=params, tokens=tokens, capacity_factor=float(cf or 0.0))
        if not 1 <= x.top_k <= e:
            raise ValueError(f"read_model: experts module '{name}' routes top_k={x.top_k} of {e} experts")
        delta, attention = x.routed_flops - record.flops, record.attention_flops
        for n, r in records.items():
            if n == name or not n or name.startswith(n + "."):
                r.flops += delta
                r.attention_flops -= attention
        out[name] = x
    if out:
        recorder.gemms = [g for g in recorder.gemms if not any(n in out for n in g[0])]
    return out


def _moe_of(layer, experts, batch, elem):
    """A layer's MoE dims, grouped expert GEMMs and routed activations (as
    build_transformer's MoE blocks: transformer_builder.cpp), from its experts modules. The
    runtime keeps every expert whole on its ep rank (no expert tensor parallelism): the
    GEMMs are not split, the routed activations are replicated over tp."""
    x0 = experts[0]
    m = layer.moe
    m.experts, m.top_k = x0.experts, x0.top_k
    m.expert_params = sum(x.params for x in experts)
    m.routed_flops_per_sample = sum(x.routed_flops for x in experts) / batch
    m.dispatch_bytes_per_sample = sum(elem * x.tokens * x.hidden * x.top_k for x in experts) / batch
    m.capacity_factor = x0.capacity_factor
    m.imbalance = 1.0
    gemms = list(layer.gemms)
    for x in experts:
        rows = x.tokens * x.top_k / batch
        copies = x.top_k * (x.capacity_factor if x.capacity_factor > 0 else 1.0)
        gemms.append(_planner.Gemm(m_per_sample=rows, n=(2 if x.gated else 1) * x.ffn, k=x.hidden,
                                   split=_planner.GemmSplit.none, experts=x.experts))
        gemms.append(_planner.Gemm(m_per_sample=rows, n=x.hidden, k=x.ffn, split=_planner.GemmSplit.none,
                                   experts=x.experts))
        # Per routed copy: the dispatched row and the expert's inner activations.
        layer.activations.replicated += elem * x.tokens * copies * (x.hidden + x.matrices * x.ffn) / batch
    layer.gemms = gemms


def _kv_elements_per_token(model, lname, plan, dims):
    """Keys and values per token of a layer's attention (k and v, every kv head): what
    context parallelism's ring sends. From the key / value projections' widths, a fused q|k|v
    projection's (equal thirds), or kv_heads x head_dim; 0 without attention."""
    if not dims.heads:
        return 0.0
    prefix = lname + "." if lname else ""
    inside = {n: s for n, s in plan.items() if n == lname or n.startswith(prefix)}
    kv = 0
    for n, style in inside.items():
        leaf = n.rpartition(".")[2].lower()
        d = linear_dims(model.get_submodule(n))
        if isinstance(style, Heads):
            kv += 2 * model.get_submodule(n).embed_dim * dims.kv_heads // dims.heads
        elif d is not None and leaf in ("k_proj", "v_proj", "wk", "wv", "key", "value", "k", "v"):
            kv += d[1]
        elif d is not None and leaf in ("qkv", "c_attn", "query_key_value", "wqkv") and dims.kv_heads == dims.heads:
            kv += 2 * d[1] // 3  # [q; k; v] of equal widths (grouped kv heads: head_dim below)
    if kv:
        return float(kv)
    for n in sorted({n.rpartition(".")[0] for n in inside}):
        head_dim = getattr(model.get_submodule(n) if n else model, "head_dim", None)
        if isinstance(head_dim, int) and head_dim > 0:
            return float(2 * dims.kv_heads * head_dim)
    return 0.0


def _gemms_of(recorder, lname, plan, batch, split):
    """The layer's weight GEMMs per sample, with the dimension tp divides (from the tp style of
    the module that ran it: column-parallel and vocabulary heads cut N, row-parallel K)."""
    out = []
    for stack, m, n, k in recorder.gemms:
        if lname not in stack:
            continue
        style = plan.get(stack[-1]) if split and stack else None
        cut = (_planner.GemmSplit.n if isinstance(style, (Colwise, VocabHead, Heads)) else
               _planner.GemmSplit.k if isinstance(style, Rowwise) else _planner.GemmSplit.none)
        out.append(_planner.Gemm(m_per_sample=m / batch, n=n, k=k, split=cut))
    return out


def _input_bytes_per_sample(recorder, lname, batch, act_bytes):
    # The input a full recompute keeps: the first tensor the layer saved is usually its input
    # (floating ones in the dtype the plan computes in, as _classify_saved counts them).
    for t, stack, elements in recorder.saved_by:
        if lname in stack:
            return elements * (act_bytes if t.is_floating_point() else t.element_size()) / batch
    return 0.0


def _tied_groups(model, layers):
    """Graph layers that hold one and the same parameter tensor, and the elements those
    tensors hold per group (a layer may hold more: a masked-LM head around the tied decoder
    weight)."""
    owners, tensors = {}, {}
    for i, (lname, kind) in enumerate(layers):
        module = model.get_submodule(lname) if lname else model
        ps = module._parameters.values() if kind == "own" else module.parameters()
        for p in ps:
            if p is not None:
                owners.setdefault(id(p), set()).add(i)
                tensors[id(p)] = p
    sizes = {}
    for pid, s in owners.items():
        if len(s) > 1:
            key = tuple(sorted(s))
            sizes[key] = sizes.get(key, 0) + tensors[pid].numel()
    groups = sorted(sizes)
    return [list(g) for g in groups], [sizes[g] for g in groups]


_GATE_NAMES = {"gate_proj", "gate", "w1", "w3", "gate_up_proj", "w13", "fc1_gate"}


def _transformer_config(graph, plan, blocks, seq, hidden, dtype, model=None, experts=None):
    """The hyperparameters, when the model reads as a transformer (blocks with attention
    heads and a vocabulary): plans record them, and tokens/s counts the sequence."""
    block_layers = [layer for layer in graph.layers if layer.name in set(blocks)]
    vocab = max((layer.tp_dims.vocab for layer in graph.layers), default=0)
    if not block_layers or not seq or not hidden or not vocab or not block_layers[0].tp_dims.heads:
        return None
    d = block_layers[0].tp_dims
    c = _planner.TransformerConfig()
    c.name = graph.name
    c.layers, c.hidden, c.heads, c.kv_heads, c.ffn = len(block_layers), hidden, d.heads, d.kv_heads, d.ffn
    c.seq, c.vocab = seq, vocab
    first = blocks[0] + "."
    c.gated_mlp = any(n.startswith(first) and n.rpartition(".")[2] in _GATE_NAMES for n in plan)
    c.tied_embeddings = bool(graph.tied_groups)
    c.dtype = dtype
    # What the model's attention did when read: kept s x s tensors (materialized) or not (a
    # fused kernel such as torch 2.x's scaled_dot_product_attention).
    c.attention = (_planner.AttentionKernel.materialized if block_layers[0].activations.attention_scores > 0
                   else _planner.AttentionKernel.flash)
    # What was read is eager PyTorch, op by op (not Megatron's fused kernels), with dropout
    # when the model has a dropout module that drops anything.
    c.fused_kernels = False
    c.dropout = model is not None and any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    # Per-head width where heads x head_dim is not the hidden size (Qwen3): from the keys.
    kv = block_layers[0].kv_elements_per_token
    if kv and c.kv_heads and kv % (2 * c.kv_heads) == 0 and kv // (2 * c.kv_heads) * c.heads != hidden:
        c.head_dim = int(kv // (2 * c.kv_heads))
    if experts:
        _moe_config(c, graph, block_layers, plan, model, experts)
    return c


def _moe_config(c, graph, block_layers, plan, model, experts):
    """The transformer's MoeConfig from the blocks read: experts, top_k, expert width, shared
    experts (their width in experts of that width), which blocks are MoE (first_dense_layers,
    every), the capacity factor."""
    moe_blocks = [i for i, layer in enumerate(block_layers) if layer.moe.experts > 0]
    x = next(iter(experts.values()))
    m = _planner.MoeConfig()
    m.experts, m.top_k, m.expert_ffn = x.experts, x.top_k, x.ffn
    shared = _shared_ffn(model, x.name, plan) if model is not None else 0
    m.shared_experts = max(1, round(shared / x.ffn)) if shared else 0
    m.first_dense_layers = moe_blocks[0]
    m.every = moe_blocks[1] - moe_blocks[0] if len(moe_blocks) > 1 else 1
    m.capacity_factor = x.capacity_factor
    c.moe = m
    if not c.ffn or c.ffn == shared:
        # No dense MLP (every block is MoE): the blocks' ffn read is the shared experts'.
        dense = [layer.tp_dims.ffn for i, layer in enumerate(block_layers) if i not in moe_blocks]
        c.ffn = dense[0] if dense and dense[0] else x.ffn
    c.gated_mlp = c.gated_mlp or x.gated
