"""Tensor parallelism over the mesh's ``tp`` axis (Megatron-LM, Shoeybi et al. 2019), with
optional sequence parallelism (Korthikanti et al. 2022).

The collectives are the C++ autograd functions of ``torch_monarch._runtime`` (the same ones
the C++ frontend uses); this module only swaps submodules of a Python module tree.

    model = tensor_parallel(model, mesh)                      # default plan for GPT/Llama-style names
    logits = model(tokens)                                    # this rank's vocabulary slice
    loss = vocab_parallel_cross_entropy(logits, targets, mesh)
"""

import contextlib
import fnmatch
import math
from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from . import _runtime
from . import tp_collectives as tpc


# ---------------------------------------------------------------------------------------
# Styles: how one module is split.

@dataclass(frozen=True)
class Colwise:
    """Output features split over tp (weight rows). ``fused_parts``: the weight stacks that
    many equal parts (q|k|v = 3, gate|up = 2), each split separately. ``gather_output``
    all-gathers the output features (otherwise the output stays split)."""
    fused_parts: int = 1
    gather_output: bool = False


@dataclass(frozen=True)
class Rowwise:
    """Input features split over tp (weight columns); the partial outputs are all-reduced
    (reduce-scattered along the sequence under sequence parallelism)."""


@dataclass(frozen=True)
class VocabEmbedding:
    """Embedding rows (the vocabulary) split over tp."""


@dataclass(frozen=True)
class VocabHead:
    """Output head split along the vocabulary: logits stay split (use
    ``vocab_parallel_cross_entropy``) unless ``gather_output``."""
    gather_output: bool = False


@dataclass(frozen=True)
class Replicate:
    """Not split (every tp rank holds it whole)."""


@dataclass(frozen=True)
class Heads:
    """An attention module holding its own projections (``nn.MultiheadAttention``): its heads
    split over tp, the q/k/v projections by rows (column-parallel), the output projection by
    columns (row-parallel, its output all-reduced)."""


_STYLES = (Colwise, Rowwise, VocabEmbedding, VocabHead, Replicate, Heads)

HEAD_COUNT_ATTRIBUTES = ("heads", "num_heads", "n_heads", "n_head", "num_attention_heads")
KV_HEAD_COUNT_ATTRIBUTES = ("kv_heads", "num_kv_heads", "n_kv_heads", "num_key_value_heads")


# Attributes holding the width of one part of a column-split projection (GPT-2's attention
# splits its fused q|k|v output into parts of ``split_size``): divided by tp with the heads.
WIDTH_ATTRIBUTES = ("split_size",)


def linear_dims(module):
    """(in_features, out_features) of a linear map tp can split: an ``nn.Linear`` (weight
    out x in), or a module keeping its weight transposed (in x out) as Hugging Face's
    ``Conv1D`` does (GPT-2: ``nf`` outputs, ``y = x @ W + b``); None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if _transposed_linear(module):
        return module.weight.shape[0], module.weight.shape[1]
    return None


def _transposed_linear(module):
    w = getattr(module, "weight", None)
    return (isinstance(w, nn.Parameter) and w.dim() == 2 and getattr(module, "nf", None) == w.shape[1]
            and type(module).__name__ == "Conv1D")


def _count(obj, attributes):
    for attr in attributes:
        v = getattr(obj, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return attr, v
    return None, 0


def head_counts(module):
    """(heads, kv_heads) of an attention module: its own head-count attributes, else those of
    the config it keeps (Hugging Face attention modules reshape with -1 and read the counts
    from ``self.config``); 0 where unknown, kv_heads = heads without grouped KV heads."""
    _, heads = _count(module, HEAD_COUNT_ATTRIBUTES)
    _, kv = _count(module, KV_HEAD_COUNT_ATTRIBUTES)
    config = getattr(module, "config", None)
    if config is not None and not heads:
        _, heads = _count(config, HEAD_COUNT_ATTRIBUTES)
        if not kv:
            _, kv = _count(config, KV_HEAD_COUNT_ATTRIBUTES)
    return heads, kv or heads

# Fused projections laid out as [q; k; v] (or [gate; up]) along the output features, each
# part split separately. GPT-NeoX / BLOOM's query_key_value interleaves per head and GQA
# fused weights have unequal parts: those need an explicit plan, not a guess.
_FUSED3 = {"qkv", "c_attn"}
_FUSED2 = {"gate_up_proj", "w13", "fc1_gate"}
_COLWISE = {"q_proj", "k_proj", "v_proj", "wq", "wk", "wv", "query", "key", "value", "q", "k", "v",
            "gate_proj", "up_proj", "w1", "w3", "fc1", "c_fc", "fc_in", "dense_h_to_4h", "up", "gate"}
_ROWWISE = {"o_proj", "out_proj", "proj", "c_proj", "wo", "o", "dense", "fc2", "down_proj", "w2", "fc_out",
            "dense_4h_to_h", "down"}

# BERT-style MLPs name both linears "dense": the one under "intermediate" widens (column-
# parallel), the one under "output" narrows (row-parallel).
_COLWISE_PARENTS = {"intermediate"}


def default_plan(model: nn.Module):
    """A tp plan from module names, as Megatron / Llama / GPT-2 / HF models spell them:
    fused q|k|v and gated projections column-parallel by parts, q/k/v/up/gate column-parallel,
    output / down projections row-parallel, the largest embedding split along the vocabulary
    and a Linear producing the vocabulary (tied or not) as a vocabulary-parallel head.
    A module with a ``monarch_tp_style`` attribute (e.g. ``monarch_tp_style = Colwise()`` on
    a custom projection class) gets that style. Everything else is replicated. Returns
    {qualified name: style}."""
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    vocab = max((m.num_embeddings for _, m in embeddings), default=None)
    plan = {}
    attention = []  # nn.MultiheadAttention modules: their out_proj is theirs to split
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if any(name.startswith(a + ".") for a in attention):
            continue
        annotated = getattr(module, "monarch_tp_style", None)
        if annotated is not None:
            # A custom module says how it splits (instance or class attribute).
            if not isinstance(annotated, _STYLES):
                raise ValueError(f"tensor parallel: '{name or '<root>'}'.monarch_tp_style is {annotated!r}, "
                                 f"not one of {[c.__name__ for c in _STYLES]}")
            plan[name] = annotated
        elif isinstance(module, nn.MultiheadAttention):
            plan[name] = Heads()
            attention.append(name)
        elif isinstance(module, nn.Embedding) and module.num_embeddings == vocab:
            plan[name] = VocabEmbedding()
        elif linear_dims(module) is not None:
            parent = name.rsplit(".", 2)[-2].lower() if name.count(".") >= 1 else ""
            # Names first: a projection whose width happens to equal the vocabulary (q|k|v of
            # a small model) is still a projection.
            if leaf in _FUSED3:
                plan[name] = Colwise(fused_parts=3)
            elif leaf in _FUSED2:
                plan[name] = Colwise(fused_parts=2)
            elif leaf in _COLWISE or (leaf == "dense" and parent in _COLWISE_PARENTS):
                plan[name] = Colwise()
            elif leaf in _ROWWISE:
                plan[name] = Rowwise()
            elif vocab is not None and linear_dims(module)[1] == vocab:
                # A model computing its own loss (Hugging Face's ``labels=``) reads whole
                # logits: the split head gathers them. Otherwise they stay split for
                # vocab_parallel_cross_entropy.
                plan[name] = VocabHead(gather_output=_computes_own_loss(model))
    _sequential_mlps(model, plan)
    _drop_unpaired_rowwise(model, plan)
    return plan


def _computes_own_loss(model):
    return hasattr(model, "loss_function") or getattr(model, "loss_type", None) is not None


def _drop_unpaired_rowwise(model, plan):
    """A row-parallel linear takes the split activation a column-parallel one makes: one named
    like an output projection (``dense``) with no column-parallel linear beside it (under its
    grandparent: the attention or MLP module around both) sees whole inputs, e.g. a masked-LM
    head's transform, and stays whole."""
    col = [n for n, s in plan.items() if isinstance(s, Colwise)]
    for name, style in list(plan.items()):
        if not isinstance(style, Rowwise):
            continue
        scope = name.rpartition(".")[0].rpartition(".")[0]
        prefix = f"{scope}." if scope else ""
        if not any(c.startswith(prefix) for c in col):
            del plan[name]


def _sequential_mlps(model, plan):
    """MLPs written as ``nn.Sequential(Linear(h, f), activation..., Linear(f, h))``, by
    structure: the widening linear column-parallel, the narrowing one row-parallel (Megatron's
    MLP split), wherever the names gave neither a style. Between them only modules without
    parameters (activations, dropout) may run, elementwise."""
    prefix_of = {id(m): n for n, m in model.named_modules()}
    for module in model.modules():
        if not isinstance(module, nn.Sequential):
            continue
        children = list(module.named_children())
        base = prefix_of[id(module)]
        for i, (first_name, first) in enumerate(children):
            if linear_dims(first) is None:
                continue
            for second_name, second in children[i + 1:]:
                if linear_dims(second) is not None:
                    names = [f"{base}.{first_name}" if base else first_name,
                             f"{base}.{second_name}" if base else second_name]
                    (a_in, a_out), (b_in, _) = linear_dims(first), linear_dims(second)
                    if b_in == a_out and a_out > a_in and not any(n in plan for n in names):
                        plan[names[0]], plan[names[1]] = Colwise(), Rowwise()
                    break
                if any(True for _ in second.parameters()):
                    break  # a module with weights between them (a norm): not one MLP


# ---------------------------------------------------------------------------------------
# Modules

def _linear(x, weight, bias, transposed):
    if not transposed:
        return F.linear(x, weight, bias)
    y = torch.matmul(x, weight)
    return y if bias is None else y + bias


def _as_parameter(t):
    return t if t is None or isinstance(t, nn.Parameter) else nn.Parameter(t)


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's rows (output features) split: this rank holds rows
    [rank * out/tp, (rank + 1) * out/tp) of each fused part. The input is replicated (its
    gradient is all-reduced) or, under sequence parallelism, all-gathered along
    ``sequence_dim``."""

    def __init__(self, weight, bias, group, gather_output=False, sequence_parallel=False, sequence_dim=1,
                 fused_parts=1, transposed=False):
        super().__init__()
        self.weight = _as_parameter(weight)
        self.bias = _as_parameter(bias)
        self.group = group
        self.group_key = tpc.group_key(group)  # what the collectives take (tp_collectives.py)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.fused_parts = fused_parts
        self.transposed = transposed  # weight kept in x out (HF Conv1D), so state dicts keep its shape

    @classmethod
    def from_linear(cls, linear, group, fused_parts=1, gather_output=False, sequence_parallel=False,
                    sequence_dim=1, name="linear", shared=None):
        transposed = _transposed_linear(linear)
        weight = _shard_param(linear.weight, 1 if transposed else 0, group, fused_parts, name, shared)
        bias = None if linear.bias is None else _shard_param(linear.bias, 0, group, fused_parts, name, shared)
        out = cls(weight, bias, group, gather_output, sequence_parallel, sequence_dim, fused_parts, transposed)
        out._original = type(linear)
        return out

    def reset_parameters(self):
        _reset_linear_shard(self, self.weight.shape[0 if self.transposed else 1])

    def init_proxy(self):
        return _init_proxy(self)

    def forward(self, x):
        if self.sequence_parallel:
            x = tpc.sequence_gather(x, self.group_key, self.sequence_dim)
        else:
            x = tpc.copy_to_group(x, self.group_key)
        y = _linear(x, self.weight, self.bias, self.transposed)
        if self.gather_output:
            y = tpc.gather_from_group(y, self.group_key, -1)
        return y

    def extra_repr(self):
        i, o = (0, 1) if self.transposed else (1, 0)
        return (f"in={self.weight.shape[i]}, out_shard={self.weight.shape[o]}, tp={self.group.size}, "
                f"fused_parts={self.fused_parts}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's columns (input features) split; the input arrives split (the
    output of a column-parallel layer). The bias is added once, after the reduction."""

    def __init__(self, weight, bias, group, sequence_parallel=False, sequence_dim=1, transposed=False):
        super().__init__()
        self.weight = _as_parameter(weight)
        self.bias = _as_parameter(bias)
        self.group = group
        self.group_key = tpc.group_key(group)
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.transposed = transposed  # weight kept in x out (HF Conv1D)

    @classmethod
    def from_linear(cls, linear, group, sequence_parallel=False, sequence_dim=1, name="linear", shared=None):
        transposed = _transposed_linear(linear)
        weight = _shard_param(linear.weight, 0 if transposed else 1, group, 1, name, shared)
        bias = None if linear.bias is None else linear.bias
        out = cls(weight, bias, group, sequence_parallel, sequence_dim, transposed)
        out._original = type(linear)
        return out

    def reset_parameters(self):
        # The whole layer's fan-in: this rank holds 1/tp of the input features.
        _reset_linear_shard(self, self.weight.shape[0 if self.transposed else 1] * self.group.size)

    def init_proxy(self):
        return _init_proxy(self)

    def forward(self, x):
        y = _linear(x, self.weight, None, self.transposed)
        if self.sequence_parallel:
            y = tpc.sequence_reduce_scatter(y, self.group_key, self.sequence_dim)
        else:
            y = tpc.reduce_from_group(y, self.group_key)
        if self.bias is not None:
            # Under sequence parallelism each rank adds the bias to its own tokens, so its
            # gradient is a partial sum: enter it through copy_to_group (sums in backward).
            bias = tpc.copy_to_group(self.bias, self.group_key) if self.sequence_parallel else self.bias
            y = y + bias
        return y

    def extra_repr(self):
        i, o = (0, 1) if self.transposed else (1, 0)
        return (f"in_shard={self.weight.shape[i]}, out={self.weight.shape[o]}, tp={self.group.size}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split: this rank looks up tokens in
    [vocab_start, vocab_start + rows) and the partial results are summed over tp."""

    def __init__(self, weight, vocab_start, group, padding_idx=None):
        super().__init__()
        self.weight = _as_parameter(weight)
        self.vocab_start = vocab_start
        self.group = group
        self.padding_idx = padding_idx

    @classmethod
    def from_embedding(cls, emb, group, name="embedding", shared=None):
        weight = _shard_param(emb.weight, 0, group, 1, name, shared)
        out = cls(weight, group.rank * weight.shape[0], group, emb.padding_idx)
        out._original = type(emb)
        return out

    @property
    def num_embeddings(self):
        """The whole table's rows, as nn.Embedding's (code reading a model's sizes still works)."""
        return self.weight.shape[0] * self.group.size

    @property
    def embedding_dim(self):
        return self.weight.shape[1]

    def _local_padding_idx(self):
        pad = self.padding_idx
        rows = self.weight.shape[0]
        return pad - self.vocab_start if pad is not None and 0 <= pad - self.vocab_start < rows else None

    def reset_parameters(self):
        # nn.Embedding's: N(0, 1), the padding row zero (where this rank holds it).
        with torch.no_grad():
            self.weight.normal_()
            pad = self._local_padding_idx()
            if pad is not None:
                self.weight[pad].zero_()

    def init_proxy(self):
        return _init_proxy(self, padding_idx=self._local_padding_idx(), num_embeddings=self.weight.shape[0],
                           embedding_dim=self.weight.shape[1])

    def forward(self, tokens):
        pad = -1 if self.padding_idx is None else self.padding_idx
        return _runtime.vocab_parallel_embedding(tokens, self.weight, self.vocab_start, self.group, -1, pad)

    def extra_repr(self):
        return f"rows={self.weight.shape[0]} from {self.vocab_start}, dim={self.weight.shape[1]}, tp={self.group.size}"


def _reset_linear_shard(module, fan_in):
    """nn.Linear's initialization (kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(fan_in),
    1/sqrt(fan_in)), the bias alike) on this rank's shard, with the unsplit layer's fan-in:
    what a model built on meta gets before ``init_fn`` (deferred.py)."""
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        module.weight.uniform_(-bound, bound)
        if module.bias is not None:
            module.bias.uniform_(-bound, bound)


def _init_proxy(module, **attributes):
    """An instance of the split module's original class (nn.Linear, HF's Conv1D, nn.Embedding)
    holding this rank's shards as its parameters, for a model's own initializer
    (``init_fn``, e.g. a Hugging Face model's ``_init_weights``, which dispatches on the
    module's class): it initializes the shards in place, each element as it would have
    initialized the whole weight's (a shard of an N(0, s) weight is N(0, s))."""
    cls = getattr(module, "_original", None)
    if cls is None:
        return module
    proxy = cls.__new__(cls)
    nn.Module.__init__(proxy)
    proxy.weight = module.weight
    if hasattr(module, "bias"):  # (None too: initializers test `module.bias is not None`)
        proxy.register_parameter("bias", module.bias)
    for key, value in attributes.items():
        setattr(proxy, key, value)
    return proxy


class SequenceScatter(nn.Module):
    """Enters the sequence-parallel region: keeps this rank's slice of the sequence (the
    gradient is all-gathered)."""

    def __init__(self, group, sequence_dim=1):
        super().__init__()
        self.group = group
        self.group_key = tpc.group_key(group)
        self.sequence_dim = sequence_dim

    def forward(self, x):
        return tpc.scatter_to_group(x, self.group_key, self.sequence_dim)


class ParallelMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with its heads split over tp (Megatron-LM's attention split,
    Shoeybi et al. 2019, Sec. 3): this rank holds its heads' rows of the q/k/v projections
    (``in_proj_weight`` as q|k|v parts, or the separate ``q/k/v_proj_weight``), their
    biases and ``bias_k``/``bias_v`` columns, and the matching columns of ``out_proj``
    (a RowParallelLinear: the output is all-reduced). Same arguments, results and parameter
    names as the module it replaces (inputs (L, N, E), or (N, L, E) with ``batch_first``, or
    unbatched; ``key_padding_mask``, 2-D or per-head 3-D ``attn_mask``, ``add_bias_kv``,
    ``add_zero_attn``, ``kdim``/``vdim``); attention weights, when asked for, are averaged
    over all heads (an all-reduce) or gathered per head."""

    # What nn.TransformerEncoderLayer reads to choose its fused inference kernel, which would
    # run the shards without the output all-reduce: never taken with this module.
    _qkv_same_embed_dim = False

    def __init__(self, mha, group, name="attention", shared=None, rng=None):
        super().__init__()
        tp = group.size
        if mha.num_heads % tp:
            raise ValueError(f"tensor parallel: tp={tp} does not divide num_heads={mha.num_heads} of "
                             f"nn.MultiheadAttention '{name}' (legal tp: {_divisors(mha.num_heads)})")
        self.group, self.group_key, self.rng = group, tpc.group_key(group), rng
        self.embed_dim, self.kdim, self.vdim = mha.embed_dim, mha.kdim, mha.vdim
        self.total_heads, self.num_heads, self.head_dim = mha.num_heads, mha.num_heads // tp, mha.head_dim
        self.dropout, self.batch_first, self.add_zero_attn = mha.dropout, mha.batch_first, mha.add_zero_attn
        self._fused_qkv = mha._qkv_same_embed_dim
        self._original = type(mha)
        if self._fused_qkv:
            self.in_proj_weight = _shard_param(mha.in_proj_weight, 0, group, 3, name, shared)
            for key in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(key, None)
        else:
            self.register_parameter("in_proj_weight", None)
            for key in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                setattr(self, key, _shard_param(getattr(mha, key), 0, group, 1, name, shared))
        self.in_proj_bias = (None if mha.in_proj_bias is None
                             else _shard_param(mha.in_proj_bias, 0, group, 3, name, shared))
        for key in ("bias_k", "bias_v"):  # (1, 1, E): this rank's heads' columns
            t = getattr(mha, key)
            self.register_parameter(key, None if t is None else _shard_param(t, 2, group, 1, name, shared))
        self.out_proj = RowParallelLinear.from_linear(mha.out_proj, group, name=f"{name}.out_proj", shared=shared)

    def reset_parameters(self):
        # nn.MultiheadAttention's: xavier-uniform projections with the whole weight's fans
        # (fan_in E, fan_out 3E for the fused q|k|v), zero biases, xavier-normal bias_k/v.
        with torch.no_grad():
            if self._fused_qkv:
                bound = math.sqrt(6.0 / (self.embed_dim + 3 * self.embed_dim))
                self.in_proj_weight.uniform_(-bound, bound)
            else:
                for key, fan_in in (("q_proj_weight", self.embed_dim), ("k_proj_weight", self.kdim),
                                    ("v_proj_weight", self.vdim)):
                    bound = math.sqrt(6.0 / (fan_in + self.embed_dim))
                    getattr(self, key).uniform_(-bound, bound)
            if self.in_proj_bias is not None:
                self.in_proj_bias.zero_()
            for key in ("bias_k", "bias_v"):
                t = getattr(self, key)
                if t is not None:
                    t.normal_(0.0, math.sqrt(2.0 / (2 * self.embed_dim)))

    def _projections(self):
        if self._fused_qkv:
            w = self.in_proj_weight.chunk(3)
        else:
            w = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        b = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        return w, b

    def _mask(self, attn_mask, key_padding_mask, batch, length, source, dtype):
        """One additive float mask broadcastable to (N, local heads, L, S), or None."""
        mask = None
        if attn_mask is not None:
            m = attn_mask
            if m.dtype == torch.bool:
                m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
            m = m.to(dtype)
            if m.dim() == 2:
                m = m.view(1, 1, length, source)
            else:  # (N * all heads, L, S): this rank's heads
                first = self.group.rank * self.num_heads
                m = m.view(batch, self.total_heads, length, source)[:, first:first + self.num_heads]
            mask = m
        if key_padding_mask is not None:
            k = key_padding_mask
            if k.dtype == torch.bool:
                k = torch.zeros(k.shape, dtype=dtype, device=k.device).masked_fill(k, float("-inf"))
            k = k.to(dtype).view(batch, 1, 1, source)
            mask = k if mask is None else mask + k
        return mask

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if is_causal and attn_mask is None:
            raise RuntimeError("nn.MultiheadAttention: need attn_mask if specifying the is_causal hint")
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        length, batch, _ = query.shape
        (w_q, w_k, w_v), (b_q, b_k, b_v) = self._projections()
        # The inputs are replicated over tp: their gradients are all-reduced (copy_to_group),
        # once per distinct tensor (self-attention passes one three times).
        entered = {}

        def enter(x):
            if id(x) not in entered:
                entered[id(x)] = tpc.copy_to_group(x, self.group_key)
            return entered[id(x)]

        q, k, v = F.linear(enter(query), w_q, b_q), F.linear(enter(key), w_k, b_k), F.linear(enter(value), w_v, b_v)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(1, batch, -1)])
            v = torch.cat([v, self.bias_v.expand(1, batch, -1)])
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        h, d = self.num_heads, self.head_dim
        q = q.view(length, batch, h, d).permute(1, 2, 0, 3)
        k = k.view(k.shape[0], batch, h, d).permute(1, 2, 0, 3)
        v = v.view(v.shape[0], batch, h, d).permute(1, 2, 0, 3)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(batch, h, 1, d)], dim=2)
            v = torch.cat([v, v.new_zeros(batch, h, 1, d)], dim=2)
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        source = k.shape[2]
        mask = self._mask(attn_mask, key_padding_mask, batch, length, source, q.dtype)
        p = self.dropout if self.training else 0.0
        # Dropout masks differ across tp ranks (they hold different heads): drawn from the
        # per-tp-rank generator when tensor_parallel gave one.
        forked = self.rng.fork() if (p > 0 and self.rng is not None) else contextlib.nullcontext()
        weights = None
        with forked:
            if not need_weights:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
            else:
                scores = (q / math.sqrt(d)) @ k.transpose(-2, -1)
                if mask is not None:
                    scores = scores + mask
                probs = scores.softmax(-1)
                if p > 0:
                    probs = F.dropout(probs, p)
                weights = probs  # (after dropout, as nn.MultiheadAttention returns them)
                out = probs @ v
        out = out.permute(2, 0, 1, 3).reshape(length, batch, h * d)
        out = self.out_proj(out)
        if weights is not None:
            if average_attn_weights:  # the mean over every head: this rank's sum, all-reduced
                weights = tpc.reduce_from_group(weights.sum(1), self.group_key) / self.total_heads
            else:
                weights = tpc.gather_from_group(weights, self.group_key, 1)
            if unbatched:
                weights = weights.squeeze(0)
        if unbatched:
            out = out.squeeze(1)
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def extra_repr(self):
        return (f"embed_dim={self.embed_dim}, local_heads={self.num_heads} of {self.total_heads}, "
                f"tp={self.group.size}, batch_first={self.batch_first}")


_TP_MODULES = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, SequenceScatter,
               ParallelMultiheadAttention)


# {tp group's ranks: vocabulary sizes of heads that gather their logits over it}: what
# vocab_parallel_cross_entropy takes for whole logits; and the widths of split heads' logits
# over it, to refuse a width both could be (tensor_parallel records them).
_GATHERED_VOCABULARIES = {}
_SPLIT_WIDTHS = {}
# Calls of vocab_parallel_cross_entropy so far: ParallelModel.train_step checks that a loss on
# split logits went through it.
VOCAB_PARALLEL_LOSSES = [0]


def vocab_parallel_cross_entropy(logits, targets, mesh_or_group, ignore_index=-100, reduction="mean"):
    """Cross-entropy of logits split along the vocabulary over tp (the output of a
    ``VocabHead``), without forming full-vocabulary rows on any rank. ``reduction``: 'mean'
    (over targets != ignore_index), 'sum' or 'none'. Whole logits (tp = 1, or a head that
    gathers them: ``parallelize(loss_parallel=False)``, a model computing its own loss) get the
    plain cross-entropy, so one training loop serves every layout."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction: expected 'mean', 'sum' or 'none', got {reduction!r}")
    VOCAB_PARALLEL_LOSSES[0] += 1
    group = mesh_or_group.group("tp") if hasattr(mesh_or_group, "group") else mesh_or_group
    ranks, width = tuple(group.ranks), logits.shape[-1]
    whole = width in _GATHERED_VOCABULARIES.get(ranks, ())
    if whole and width in _SPLIT_WIDTHS.get(ranks, ()):
        raise ValueError(f"vocab_parallel_cross_entropy: logits {width} wide over tp ranks {list(ranks)} could be a "
                         f"gathering head's whole vocabulary or a split head's share of {width * group.size}: this "
                         "process laid out both kinds on these ranks; keep one model's logits split (or gathered)")
    if whole:
        losses = F.cross_entropy(logits.reshape(-1, width).float(), targets.reshape(-1),
                                 ignore_index=ignore_index, reduction="none").view(targets.shape)
    else:
        losses = _runtime.vocab_parallel_cross_entropy(logits.contiguous(), targets, group.rank * width, group,
                                                       ignore_index)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != ignore_index).sum().clamp(min=1)


# ---------------------------------------------------------------------------------------
# Rewriting a module tree

def _shard_param(param, dim, group, fused_parts, name, shared):
    """This rank's slice of ``param``; a parameter shared by several modules (tied weights)
    is sharded once and the same shard Parameter is returned for every module."""
    if shared is not None and id(param) in shared:
        return shared[id(param)][1]
    with torch.no_grad():
        shard = _runtime.shard_tensor(param.detach(), dim, group.rank, group.size, fused_parts, name)
    out = nn.Parameter(shard, requires_grad=param.requires_grad)
    out._monarch_tp = (dim, fused_parts)  # how it was cut, for state dicts and tests
    if shared is not None:
        shared[id(param)] = (param, out)  # the original kept alive: its id stays its own
    return out


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _set_submodule(root, name, new):
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


def _head_count_attributes(model, plan, tp):
    """(module, attribute, count) for every head count of a module with a column-split
    child, refusing a tp that does not divide one (attention reads them for its reshapes)."""
    found = []
    for parent_name in sorted({n.rpartition(".")[0] for n, style in plan.items() if isinstance(style, Colwise)}):
        parent = model.get_submodule(parent_name) if parent_name else model
        for attr in HEAD_COUNT_ATTRIBUTES + KV_HEAD_COUNT_ATTRIBUTES:
            count = getattr(parent, attr, None)
            if isinstance(count, int) and not isinstance(count, bool):
                if count % tp != 0:
                    raise ValueError(f"tensor parallel: tp={tp} does not divide {attr}={count} of module "
                                     f"'{parent_name or '<root>'}' (legal tp: {_divisors(count)})")
                found.append((parent, attr, count))
        for attr in WIDTH_ATTRIBUTES:
            width = getattr(parent, attr, None)
            if isinstance(width, int) and not isinstance(width, bool):
                if width % tp != 0:
                    raise ValueError(f"tensor parallel: tp={tp} does not divide {attr}={width} of module "
                                     f"'{parent_name or '<root>'}'")
                found.append((parent, attr, width))
        # Counts the module reads from its config (shared by every layer: checked, not changed).
        heads, kv = head_counts(parent)
        for what, count in (("heads", heads), ("key/value heads", kv)):
            if count and count % tp != 0:
                raise ValueError(f"tensor parallel: tp={tp} does not divide the {count} {what} of module "
                                 f"'{parent_name or '<root>'}' (legal tp: {_divisors(count)})")
    return found


def resolve_plan(model: nn.Module, plan=None, keep_replicate=False):
    """{module name: style} of the modules tp splits: ``plan`` ({name or glob: style}) with its
    globs expanded, or the name-based ``default_plan``; ``Replicate`` entries dropped. The one
    rule both the model reader (what the planner sees) and ``tensor_parallel`` use."""
    base = default_plan(model) if plan is None else {}
    if plan is not None:
        for pattern, style in plan.items():
            matched = [n for n, _ in model.named_modules() if n == pattern or fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                raise ValueError(f"tensor parallel plan: '{pattern}' matches no module of {type(model).__name__}")
            for n in matched:
                base[n] = style
    return {n: s for n, s in base.items() if keep_replicate or not isinstance(s, Replicate)}


def _describe_module(name, module):
    if linear_dims(module) is not None:
        return f"'{name}' ({type(module).__name__} {linear_dims(module)[0]}->{linear_dims(module)[1]})"
    if isinstance(module, nn.Embedding):
        return f"'{name}' (Embedding {module.num_embeddings}x{module.embedding_dim})"
    return f"'{name}' ({type(module).__name__})"


def _check_coverage(model, plan, tp, units):
    """tp > 1 must split something, and in a model made of blocks it must split the blocks'
    work: a plan that splits nothing, or none of the blocks' linear layers (names no rule
    recognises), leaves every tp rank computing the whole model (nothing gained, and a loss
    written for split logits goes wrong); a vocabulary-sized Linear left whole next to a
    split embedding hands full-vocabulary logits to a vocabulary-parallel loss. Each is an
    error listing what was seen, so the user can name the modules (``plan=``) or annotate
    them (``monarch_tp_style``). The planner applies the same rule (search.cpp tp_conflict).
    ``plan`` includes Replicate entries."""
    modules = [(n, m) for n, m in model.named_modules()
               if isinstance(m, (nn.Linear, nn.Embedding, nn.MultiheadAttention))]
    seen = ", ".join(_describe_module(n, m) for n, m in modules[:24]) + (", ..." if len(modules) > 24 else "")
    fix = ("name them in plan= ({'blocks.*.attn.qkv': Colwise(fused_parts=3), 'blocks.*.attn.out': Rowwise(), ...}) "
           "or give their class a monarch_tp_style attribute")
    split = {n for n, s in plan.items() if not isinstance(s, Replicate)}
    if not split:
        raise ValueError(f"tensor parallel: tp={tp} but the plan splits nothing of {type(model).__name__}: every tp "
                         f"rank would compute the whole model. Modules seen: {seen or 'none'}. To split them, {fix}; "
                         f"to replicate the model, use tp=1.")
    names = {id(m): n for n, m in model.named_modules()}
    prefixes = [names[id(u)] + "." for u in units if id(u) in names and names[id(u)]]
    in_blocks = [n for n, m in modules if (linear_dims(m) is not None or isinstance(m, nn.MultiheadAttention))
                 and any(n.startswith(p) for p in prefixes)]
    projections = {n for n, s in plan.items() if isinstance(s, (Colwise, Rowwise, Heads))}
    if in_blocks and not any(any(n.startswith(p) for p in prefixes) for n in projections):
        raise ValueError(f"tensor parallel: tp={tp} but the plan splits none of the linear layers in "
                         f"{type(model).__name__}'s blocks (their names match no known projection; only "
                         f"{sorted(split)} would be split): every tp rank would compute every block whole. "
                         f"Modules seen: {seen}. To split them, {fix}; to replicate the model, use tp=1.")
    split_vocab = {model.get_submodule(n).num_embeddings for n, s in plan.items() if isinstance(s, VocabEmbedding)}
    for name, module in modules:
        outside_blocks = not any(name.startswith(p) for p in prefixes)  # where output heads live
        if linear_dims(module) is not None and linear_dims(module)[1] in split_vocab and name not in plan \
                and outside_blocks:
            raise ValueError(f"tensor parallel: {_describe_module(name, module)} produces the vocabulary "
                             f"({linear_dims(module)[1]}, as the split embedding) but is not split: its logits would "
                             f"be whole on every tp rank, wrong for vocab_parallel_cross_entropy. Mark it "
                             f"VocabHead() in plan= (or Replicate() to keep it whole and use a plain loss). "
                             f"Modules seen: {seen}.")


def tensor_parallel(model: nn.Module, mesh, plan=None, sequence_parallel: bool = False, sequence_dim: int = 1,
                    units=None, rng=None, gather_logits: bool = False):
    """Splits ``model`` in place over the mesh's ``tp`` axis and returns it.

    ``plan``: {module name or glob: style} (``Colwise``, ``Rowwise``, ``VocabEmbedding``,
    ``VocabHead``, ``Replicate``); default ``default_plan(model)``. Attention head counts
    (``heads``, ``num_heads``, ``n_kv_heads``, ...) of modules with a column-split child are
    divided by tp, so attention code that reads them (and reshapes with -1) runs on its
    local heads. Weights shared between modules (tied embedding and head) stay shared.

    ``sequence_parallel``: activations outside the attention / MLP cores (norms, residuals,
    dropout) are split along ``sequence_dim``; the sequence is split at the input of the
    first of ``units`` (the blocks; default: the entries of the ModuleList holding the most parameters);
    column-parallel layers all-gather it and row-parallel ones reduce-scatter. Gradients of
    replicated parameters used on sequence shards (in the blocks and after them: norms and
    anything tp did not split) are summed over tp.

    Dropout: masks on activations that differ across tp (attention-probability dropouts
    next to column-split projections; under sequence parallelism every dropout in the
    blocks) draw from ``rng`` (a ``TensorParallelRNG``; default seeded from
    ``torch.initial_seed()`` and the tp rank); the others use the default generator, which
    the caller seeds alike on every tp rank (``seed_tensor_parallel_rng``).

    ``gather_logits``: every vocabulary-split head (``VocabHead``, the default plan's or a given
    plan's) all-gathers its output, so the model returns whole logits (any loss works on them,
    at the memory of the whole vocabulary per rank).
    """
    from .interop import refuse_foreign_layout
    refuse_foreign_layout(model, "torch_monarch.tensor_parallel")
    group = mesh.group("tp")
    tp = group.size
    whole = resolve_plan(model, plan, keep_replicate=True)
    if gather_logits:
        whole = {n: VocabHead(gather_output=True) if isinstance(s, VocabHead) else s for n, s in whole.items()}
    plan = {n: s for n, s in whole.items() if not isinstance(s, Replicate)}
    if tp == 1:
        return model
    from .sharded import _default_units
    _check_coverage(model, whole, tp, list(_default_units(model) if units is None else units))
    head_counts = _head_count_attributes(model, plan, tp)  # checked before anything changes
    per_head = _per_head_norms(model, plan, tp)
    shared = {}
    for name, style in plan.items():
        module = model.get_submodule(name)
        if isinstance(style, VocabEmbedding):
            if not isinstance(module, nn.Embedding):
                raise ValueError(f"tensor parallel: '{name}' is {type(module).__name__}, VocabEmbedding needs nn.Embedding")
            new = VocabParallelEmbedding.from_embedding(module, group, name=name, shared=shared)
        elif isinstance(style, (Colwise, VocabHead)):
            if linear_dims(module) is None:
                raise ValueError(f"tensor parallel: '{name}' is {type(module).__name__}, {type(style).__name__} needs "
                                 "nn.Linear (or a transposed linear such as HF's Conv1D)")
            parts = style.fused_parts if isinstance(style, Colwise) else 1
            if isinstance(style, VocabHead):
                # vocab_parallel_cross_entropy over this group meets whole or split logits.
                kind = _GATHERED_VOCABULARIES if style.gather_output else _SPLIT_WIDTHS
                width = linear_dims(module)[1] // (1 if style.gather_output else tp)
                kind.setdefault(tuple(group.ranks), set()).add(width)
                if not style.gather_output:
                    model._monarch_vocab_split = True  # the model returns split logits (train_step checks its loss)
            new = ColumnParallelLinear.from_linear(module, group, fused_parts=parts,
                                                   gather_output=style.gather_output,
                                                   sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                                                   name=name, shared=shared)
        elif isinstance(style, Heads):
            if not isinstance(module, nn.MultiheadAttention):
                raise ValueError(f"tensor parallel: '{name}' is {type(module).__name__}, Heads needs "
                                 "nn.MultiheadAttention")
            if sequence_parallel:
                raise ValueError(f"tensor parallel: sequence parallelism with nn.MultiheadAttention ('{name}') is "
                                 "not supported yet; use sequence_parallel=False")
            if rng is None:
                rng = TensorParallelRNG(torch.initial_seed(), group.rank)
            new = ParallelMultiheadAttention(module, group, name=name, shared=shared, rng=rng)
        elif isinstance(style, Rowwise):
            if linear_dims(module) is None:
                raise ValueError(f"tensor parallel: '{name}' is {type(module).__name__}, Rowwise needs nn.Linear "
                                 "(or a transposed linear such as HF's Conv1D)")
            new = RowParallelLinear.from_linear(module, group, sequence_parallel=sequence_parallel,
                                                sequence_dim=sequence_dim, name=name, shared=shared)
        else:
            raise ValueError(f"tensor parallel: unknown style {style!r} for '{name}'")
        _set_submodule(model, name, new)
    # A split parameter that another module also holds (Hugging Face ties a masked-LM
    # decoder's bias to ``predictions.bias``): that module gets the same shard.
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None and id(p) in shared and shared[id(p)][0] is p:
                module._parameters[pname] = shared[id(p)][1]
    for parent, attr, count in head_counts:
        setattr(parent, attr, count // tp)  # the local heads
    from .sharded import _default_units
    units = list(_default_units(model) if units is None else units)
    if sequence_parallel:
        if not units:
            raise ValueError("sequence parallel: no ModuleList of blocks found; pass units=[...] (the blocks)")
        _enable_sequence_parallel(model, group, sequence_dim, units)  # sums the norms' gradients too
    else:
        for module in per_head:
            _sum_parameter_gradients_over(module, group)
    if rng is None:
        rng = TensorParallelRNG(torch.initial_seed(), group.rank)
    split_parents = {n.rpartition(".")[0] for n, s in plan.items() if isinstance(s, Colwise)}
    model._monarch_forked_dropouts = _fork_split_dropouts(model, rng, sequence_parallel, units, split_parents)
    return model


def _per_head_norms(model, plan, tp):
    """Modules beside an attention's column-split projections with weights of one head's
    width (Qwen3's / Gemma3's q_norm and k_norm, normalizing each head): they run on this
    rank's heads only, so their weights' gradients are partial sums over tp. One whose
    weights span a whole split projection (a norm over all heads together, OLMo2's) cannot
    run on a part of the heads: refused, by name."""
    found = []
    for parent_name in sorted({n.rpartition(".")[0] for n, s in plan.items() if isinstance(s, Colwise)}):
        parent = model.get_submodule(parent_name) if parent_name else model
        heads, kv = head_counts(parent)
        linears = {n: linear_dims(model.get_submodule(n)) for n, s in plan.items()
                   if isinstance(s, Colwise) and n.rpartition(".")[0] == parent_name}
        split = {dims[1]: n for n, dims in linears.items() if dims}
        inputs = {dims[0] for dims in linears.values() if dims}  # a norm this wide runs on the whole input
        head_dims = {width // count for width in split for count in (heads, kv)
                     if count and width % count == 0} - inputs
        for child_name, child in parent.named_children():
            if isinstance(child, _TP_MODULES) or linear_dims(child) is not None:
                continue
            sizes = {p.shape[-1] for p in child.parameters(recurse=False) if p.dim() >= 1}
            if not sizes:
                continue
            full = sizes & set(split)
            if full and not (sizes & head_dims):
                width = full.pop()
                raise ValueError(f"tensor parallel: '{parent_name}.{child_name}' ({type(child).__name__}) has weights "
                                 f"as wide as the whole output of '{split[width]}' ({width}), which tp={tp} splits "
                                 "by heads: it would normalize a part of the heads as if it were all of them")
            if sizes and sizes <= head_dims:
                found.append(child)
    return found


def _enable_sequence_parallel(model, group, sequence_dim, units):
    scatter = SequenceScatter(group, sequence_dim)
    units[0].register_forward_pre_hook(lambda _m, args: (scatter(args[0]),) + tuple(args[1:]))
    _gather_at_module_inputs(group, sequence_dim, units)
    # Inside the blocks and after them every rank sees only its tokens: the gradients of
    # replicated parameters used there (norms, gates, anything tp did not split) are
    # partial sums. Before the first block the sequence is still whole: nothing to sum.
    for module in _sequence_parallel_region(model, units):
        if isinstance(module, _TP_MODULES):
            continue  # split weights; the row-parallel bias is summed in its forward
        if any(p is not None and shard_spec(p) is None for p in module._parameters.values()):
            _sum_parameter_gradients_over(module, group)


def _gather_at_module_inputs(group, sequence_dim, units):
    """Under sequence parallelism the sequence is gathered where a module inside a block
    (attention, MLP) receives it, not inside its column-parallel linears, so code in the
    module that reads the sequence length from its input (``bsz, q_len, _ =
    hidden_states.size()``, rotary positions) sees the whole sequence, as torchtitan's
    ``PrepareModuleInput`` arranges. The gather's backward keeps this rank's slice of the
    gradient, and the linears inside go back to all-reducing their input gradient: that is
    exact whatever else the module does with its input (a reduce-scatter at the gather,
    as Megatron-LM does, would count any replicated use of the input tp times).
    Column-parallel linears directly in a block (no module of their own) keep gathering
    inside the linear."""
    hooked = set()
    for unit in units:
        for parent in unit.modules():
            if parent is unit:
                continue
            linears = [m for m in parent.children() if isinstance(m, ColumnParallelLinear)]
            if not linears or id(parent) in hooked:
                continue
            hooked.add(id(parent))
            for m in linears:
                m.sequence_parallel = False
            parent.register_forward_pre_hook(_sequence_gather_hook(group, sequence_dim), with_kwargs=True)


def _sequence_gather_hook(group, sequence_dim):
    key = tpc.group_key(group)

    def hook(_module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return (tpc.gather_from_group(args[0], key, sequence_dim),) + tuple(args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            kwargs = dict(kwargs, hidden_states=tpc.gather_from_group(kwargs["hidden_states"], key, sequence_dim))
            return args, kwargs
        raise ValueError("sequence parallel: a module with column-parallel linears inside a block takes no "
                         "hidden states (first positional argument or hidden_states=) to gather")
    return hook


def _sequence_parallel_region(model, units):
    """The modules inside the blocks, and those registered after the last block (final
    norm, head: module registration follows execution in GPT / Llama-style models)."""
    unit_ids = {id(u) for u in units}
    inside, after, seen_last = [], [], False
    last = units[-1]
    for name, m in model.named_modules():
        if id(m) in unit_ids:
            inside.extend(m.modules())
            if m is last:
                seen_last = True
            continue
        if seen_last and not any(m is x for x in inside):
            after.append(m)
    return inside + after


def _sum_parameter_gradients_over(module, group):
    """Makes ``module`` use its own parameters through ``copy_to_group`` (identity forward,
    all-reduce of the gradient in backward), so the gradient that reaches the parameter, and
    any data-parallel hook on it, is already summed over the group. Done by swapping the
    module's class for a subclass whose forward substitutes the parameters for the call:
    names, state dicts and the module's own forward stay as they were. (A tensor hook would
    not do: in torch 1.13 C++ hooks, such as the data-parallel engine's, see the gradient
    before Python hooks change it.)"""
    module._monarch_sum_group = tpc.group_key(group)
    module.__class__ = _summing_class(type(module))


# One subclass per module class, not per module: torch.compile guards on a module's class,
# so per-module classes would compile every block anew.
_SUMMING_CLASSES = {}


def _summing_class(cls):
    if getattr(cls, "_monarch_sums_gradients", False):
        return cls
    sub = _SUMMING_CLASSES.get(cls)
    if sub is not None:
        return sub

    def forward(self, *args, **kwargs):
        group_key = self._monarch_sum_group
        originals = dict(self._parameters)
        # Under mixed precision the module computes with cast copies of its parameters, in
        # its instance __dict__ (mixed_precision.py): those are what must be summed.
        shadowed = {k: self.__dict__[k] for k in originals if k in self.__dict__}
        try:
            for key, p in originals.items():
                if key in shadowed:
                    self.__dict__[key] = tpc.copy_to_group(shadowed[key], group_key)
                elif p is not None:
                    self._parameters[key] = tpc.copy_to_group(p, group_key)
            return cls.forward(self, *args, **kwargs)
        finally:
            self._parameters.update(originals)
            self.__dict__.update(shadowed)

    sub = _SUMMING_CLASSES[cls] = type(f"SequenceParallel{cls.__name__}", (cls,),
                                       {"forward": forward, "_monarch_sums_gradients": True})
    return sub


# ---------------------------------------------------------------------------------------
# Randomness (dropout) under tensor parallelism, as Megatron-LM arranges it: where the tp
# ranks hold the same activations (the replicated residual stream without sequence
# parallelism) their dropout masks must be equal, so the default generator is seeded alike
# on every tp rank; where they hold different pieces (attention heads, sequence shards) the
# masks must differ, so those dropouts draw from a second generator seeded per tp rank.

_TP_SEED_OFFSET = 2718


class TensorParallelRNG:
    """The per-tp-rank generator: ``with rng.fork():`` draws from it (CPU default generator
    swapped in and out), leaving the default generator's sequence untouched."""

    def __init__(self, seed, tp_rank):
        self.seed = seed
        self.tp_rank = tp_rank
        self._state = torch.Generator().manual_seed(seed + _TP_SEED_OFFSET + tp_rank).get_state()

    def fork(self):
        return _Forked(self)


class _Forked:
    def __init__(self, rng):
        self.rng = rng

    def __enter__(self):
        self.saved = torch.get_rng_state()
        torch.set_rng_state(self.rng._state)

    def __exit__(self, *exc):
        self.rng._state = torch.get_rng_state()
        torch.set_rng_state(self.saved)
        return False


def seed_tensor_parallel_rng(mesh, seed):
    """Seeds the default generator with ``seed`` on every rank (equal masks across tp) and
    returns the per-tp-rank generator for regions split over tp."""
    torch.manual_seed(seed)
    return TensorParallelRNG(seed, mesh.coordinate("tp"))


class ForkedDropout(nn.Module):
    """A dropout drawing from the per-tp-rank generator (its input differs across tp)."""

    def __init__(self, dropout, rng):
        super().__init__()
        self.p = dropout.p
        self.inplace = dropout.inplace
        self.rng = rng

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        with self.rng.fork():
            return F.dropout(x, self.p, True, self.inplace)


def _fork_split_dropouts(model, rng, sequence_parallel, units, split_parents):
    """Dropouts on activations that differ across tp draw per rank: under sequence
    parallelism every dropout inside the blocks; otherwise those in modules with a
    column-split child named like attention-probability dropouts."""
    unit_ids = {id(u) for u in units}
    inside = set()
    for name, m in model.named_modules():
        if id(m) in unit_ids:
            inside.update(f"{name}.{n}" if n else name for n, _ in m.named_modules())
    forked = []
    for name, m in list(model.named_modules()):
        if not isinstance(m, nn.Dropout) or not name:
            continue
        parent = name.rpartition(".")[0]
        leaf = name.rpartition(".")[2].lower()
        attention = parent in split_parents and ("attn" in leaf or "attention" in leaf or "prob" in leaf)
        if attention or (sequence_parallel and name in inside):
            _set_submodule(model, name, ForkedDropout(m, rng))
            forked.append(name)
    return forked


def shard_spec(param):
    """(dim, fused_parts) if ``param`` is a tensor-parallel shard, else None."""
    return getattr(param, "_monarch_tp", None)
