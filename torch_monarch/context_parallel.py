"""Context parallelism: the sequence split over the mesh's ``cp`` axis, attention run as ring
attention (Liu et al. 2023) by the C++ runtime (``monarch::cp``, docs/runtime.md).

Every cp rank holds 2 of the 2*cp equal chunks of each sequence, chunks i and 2cp-1-i (the
load-balanced causal layout of Megatron-Core and torchtitan), and computes everything but
attention on its own tokens; attention passes keys and values around the cp ring.

    from torch_monarch.context_parallel import context_parallel, shard_sequence
    mesh = torch_monarch.device_mesh(dp=2, cp=2)
    model = context_parallel(model, mesh)           # swaps the attention (and positions) in place
    model = torch_monarch.DataParallel(model, mesh) # gradients averaged over dp x cp
    x, y = shard_sequence(tokens, mesh), shard_sequence(targets, mesh)   # the same cut for both
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())          # mean over local tokens
    loss.backward()
    print(global_mean(loss, mesh))                  # the whole batch's mean, for logging

The loss. Shard tokens and targets (already shifted by one, as for the unsplit model) with
the same ``shard_sequence``; each rank takes the mean over its own tokens. Every rank holds
the same number of tokens, so the mean of the ranks' means is the mean over all tokens, and
the gradients must be averaged over the ``dp_cp`` group (dp x cp: every rank holding the same
parameters), which ``DataParallel`` (and ``fully_shard``) do on a mesh with cp. (Ring attention's backward already sends each key
and value gradient to the rank owning that chunk; what is left on each rank is its share of
the parameter gradients.) With ignored targets (``ignore_index``) the counts differ: take
``sum of local token losses * cp / count``, where ``count`` is the number of counted tokens
all-reduced (summed) over cp; the average over dp_cp is then still the global mean.

Positions. Rotary embeddings and learned position embeddings must see the global positions
of the rank's tokens (``sequence_positions``): ``context_parallel`` makes the model's own
rotary module (``rotary_emb``, called as ``rotary_emb(seq_len, device)``) and position
embedding (``wpe`` / ``position_embeddings``, indexed with ``arange(local length)``) return the
chunk's positions.

Tensor parallelism composes: ``tensor_parallel(model, mesh)`` before or after
``context_parallel`` (the attention then runs its local heads over the cp ring of its tp rank).
"""

import torch
from torch import nn

from . import _runtime


def _cp_group(mesh_or_group):
    """The cp Communicator of a DeviceMesh (None when the mesh has cp=1: no cp axis), or the
    Communicator itself."""
    if hasattr(mesh_or_group, "axis_size"):
        return mesh_or_group.group("cp") if mesh_or_group.axis_size("cp") > 1 else None
    return mesh_or_group


def ring_attention(q, k, v, group, causal: bool = True, scale: float = None, block_rows: int = 0):
    """softmax(q k^T * scale) v over the whole sequence, of this rank's queries.

    ``q`` [b, heads, s_local, d], ``k`` / ``v`` [b, kv_heads, s_local, d] are this rank's chunks
    (``shard_sequence`` along the sequence); kv_heads divides heads (grouped-query attention,
    as Llama's repeat_kv). ``group``: the mesh (its ``cp`` group is used) or a Communicator.
    Every cp rank calls it with the same shapes. Differentiable; float32 accumulation for
    bf16 / fp16 inputs. ``block_rows``: query rows per tile of a block (0: tiles of at most
    2^21 scores). Returns [b, heads, s_local, d_v] in q's dtype."""
    cp_group = _cp_group(group)
    if cp_group is None:
        raise ValueError("ring_attention: the mesh has cp=1 (no cp axis); pass a Communicator as the group (one of a "
                         "single rank runs the blockwise attention with no exchange)")
    return _runtime.cp_ring_attention(q, k, v, cp_group, causal, scale, block_rows)


def shard_sequence(x, mesh, dim: int = 1):
    """This rank's part of ``x`` along ``dim`` (default 1: [batch, seq, ...]): chunks i and
    2cp-1-i of 2*cp equal chunks, i the rank's cp coordinate. The length must divide by 2*cp.
    Use it for tokens, targets and anything else per token (masks, position ids)."""
    group = _cp_group(mesh)
    if group is None:
        return x
    return _runtime.cp_shard_sequence(x, dim, group.rank, group.size)


def gather_sequence(x, mesh, dim: int = 1):
    """Every cp rank's part of ``x`` along ``dim``, back in sequence order. Differentiable:
    backward keeps this rank's chunks of the gradient, so what follows the gather must run
    alike on every cp rank."""
    group = _cp_group(mesh)
    return x if group is None else _runtime.cp_gather_sequence(x, group, dim)


def sequence_positions(seq_len: int, mesh):
    """The global positions (int64) of the tokens this rank holds of a sequence of ``seq_len``."""
    group = _cp_group(mesh)
    if group is None:
        return torch.arange(seq_len)
    return _runtime.cp_sequence_positions(seq_len, group.rank, group.size)


def global_mean(loss, mesh):
    """The mean of a per-rank mean loss over the dp x cp ranks (every rank holds as many
    tokens): the whole batch's mean loss, as a Python float, for logging. Collective."""
    t = torch.tensor([float(loss)], dtype=torch.float64)
    mesh.group("dp_cp").all_reduce(t, average=True).wait()  # dp when the mesh has no cp axis
    return t.item()


# ---------------------------------------------------------------------------------------
# Module swaps. As tensor_parallel's gradient summing does, a converted module keeps its
# object, parameters, names and attributes: only its class becomes a subclass whose forward
# runs the context-parallel version (one subclass per original class, not per module).

_CLASSES = {}


def _converted(module, kind, forward, group):
    cls = type(module)
    if getattr(cls, "_monarch_context_parallel", None) == kind:
        return  # shared by several converted modules (one rotary table for every layer): once
    key = (cls, kind)
    sub = _CLASSES.get(key)
    if sub is None:
        # `_monarch_original`: the class whose forward the converted one calls (never the MRO's
        # next entry, which a second conversion would make the converted class itself).
        sub = _CLASSES[key] = type(f"ContextParallel{cls.__name__}", (cls,),
                                   {"forward": forward, "_monarch_context_parallel": kind,
                                    "_monarch_original": cls})
    module._monarch_cp_group = group
    module.__class__ = sub


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _llama_attention_forward(self, hidden_states):
    # examples/models.py's LlamaAttention with its attention core replaced by ring attention;
    # head counts come from the projections' widths (-1), so tp's local heads work too.
    bsz, q_len, _ = hidden_states.size()
    q = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
    k = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
    v = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
    cos, sin = self.rotary_emb(q_len, hidden_states.device)  # the chunk's positions (converted)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    out = _runtime.cp_ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), self._monarch_cp_group, True,
                                     None)
    return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


def _gpt2_attention_forward(self, x):
    if self.training and self.attn_dropout.p > 0:
        raise ValueError(f"context_parallel: dropout p={self.attn_dropout.p} on the attention probabilities is not "
                         "supported by ring attention (the probabilities are never formed whole); set it to 0")
    b, s, _ = x.size()
    q, k, v = self.c_attn(x).chunk(3, dim=-1)
    q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2).contiguous() for t in (q, k, v))
    out = _runtime.cp_ring_attention(q, k, v, self._monarch_cp_group, True, None)
    return self.resid_dropout(self.c_proj(out.transpose(1, 2).reshape(b, s, -1)))


def _rotary_forward(self, seq_len, device):
    # The model's own rotary table for the whole sequence, rows at this rank's positions.
    group = self._monarch_cp_group
    cos, sin = type(self)._monarch_original.forward(self, seq_len * group.size, device)
    positions = _runtime.cp_local_sequence_positions(seq_len, group.rank, group.size).to(cos.device)
    return cos[positions], sin[positions]


def _position_embedding_forward(self, positions):
    group = self._monarch_cp_group
    local = positions.shape[-1]
    if not torch.equal(positions.reshape(-1, local)[0].cpu(), torch.arange(local)):
        raise ValueError("context_parallel: a position embedding converted for cp was indexed with positions other "
                         f"than 0..{local - 1} (the model's own arange over its local length is what it maps to "
                         "the chunk's global positions); pass global positions from sequence_positions() to an "
                         "unconverted embedding instead")
    mapped = _runtime.cp_local_sequence_positions(local, group.rank, group.size).to(positions.device)
    return nn.Embedding.forward(self, mapped.expand_as(positions))


_LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "rotary_emb")
_GPT2 = ("c_attn", "c_proj", "attn_dropout")
_POSITION_EMBEDDINGS = ("wpe", "position_embeddings")


def _has(module, names):
    return all(hasattr(module, n) for n in names) and isinstance(getattr(module, "head_dim", None), int)


def attention_kind(module):
    """'llama' or 'gpt2' for an attention module ``context_parallel`` converts (by structure,
    see its docstring), else None."""
    if _has(module, _LLAMA):
        return "llama"
    if _has(module, _GPT2):
        return "gpt2"
    return None


def convertible(model: nn.Module) -> bool:
    """Whether ``context_parallel(model, mesh)`` would convert the model (what the planner may
    pick cp > 1 for): some attention it recognises, with a rotary table called as
    rotary_emb(seq_len, device), and no nn.MultiheadAttention."""
    if any(isinstance(m, nn.MultiheadAttention) for m in model.modules()):
        return False
    return any(attention_kind(m) == "gpt2" or (attention_kind(m) == "llama" and hasattr(m.rotary_emb, "inv_freq"))
               for m in model.modules())


def context_parallel(model: nn.Module, mesh):
    """Makes ``model`` run with its sequence split over the mesh's ``cp`` axis, in place, and
    returns it. Recognised by structure (examples/models.py's names, Hugging Face's):

    * Llama-style attention (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``rotary_emb``,
      ``head_dim``; grouped-query heads): causal ring attention, and its ``rotary_emb`` gives
      the chunk's positions;
    * GPT-2-style attention (``c_attn`` fused q|k|v, ``c_proj``, ``attn_dropout``, ``head_dim``):
      causal ring attention;
    * learned position embeddings (an ``nn.Embedding`` named ``wpe`` or
      ``position_embeddings``, indexed by the model with ``arange(local length)``): they
      return the chunk's global positions.

    Feed it ``shard_sequence(tokens, mesh)``; see the module's docstring for the loss and
    gradients. An ``nn.MultiheadAttention`` or a model with no attention it recognises is an
    error. A mesh with cp=1 leaves the model as it is. ``mesh`` may also be a Communicator
    used as the cp group; one of a single rank converts the model to ring attention with no
    exchange: tiled blockwise attention that never forms the s x s probabilities (the
    one-process baseline of bench/context_parallel.py)."""
    group = _cp_group(mesh)
    refused = [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    if refused:
        raise ValueError(f"context_parallel: nn.MultiheadAttention at {refused} is not supported (its attention "
                         "core cannot be replaced); use Llama- or GPT-2-style attention modules")
    attention = []
    for name, module in model.named_modules():
        if getattr(type(module), "_monarch_context_parallel", None):
            raise ValueError(f"context_parallel: module '{name}' is already converted")
        kind = attention_kind(module)
        if kind == "llama" and not hasattr(module.rotary_emb, "inv_freq"):
            raise ValueError(f"context_parallel: '{name}.rotary_emb' is {type(module.rotary_emb).__name__}, "
                             "expected a rotary embedding called as rotary_emb(seq_len, device)")
        if kind is not None:
            attention.append((name, module, kind))
    if not attention:
        raise ValueError("context_parallel: found no attention module it can convert in "
                         f"{type(model).__name__} (Llama-style: {', '.join(_LLAMA)}, head_dim; GPT-2-style: "
                         f"{', '.join(_GPT2)}, head_dim)")
    positions = [(n, m) for n, m in model.named_modules()
                 if n.rpartition(".")[2] in _POSITION_EMBEDDINGS and isinstance(m, nn.Embedding)]
    if group is None:  # a mesh with cp=1
        return model
    for _, module, kind in attention:
        if kind == "llama":
            _converted(module, "attention", _llama_attention_forward, group)
            _converted(module.rotary_emb, "rotary", _rotary_forward, group)
        else:
            _converted(module, "attention", _gpt2_attention_forward, group)
    for _, module in positions:
        _converted(module, "positions", _position_embedding_forward, group)
    return model


def converted_modules(model: nn.Module):
    """{name: what} of the modules context_parallel converted ('attention', 'rotary', 'positions')."""
    return {n: type(m)._monarch_context_parallel for n, m in model.named_modules()
            if getattr(type(m), "_monarch_context_parallel", None)}
