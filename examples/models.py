"""Models as users write them, with the module names of the libraries they come from (Hugging
Face GPT-2, Llama and BERT; a plain MLP; ResNet-18 as torchvision names it). Examples and tests build
them small; ``gpt3_175b`` builds the real size on the meta device for planning.

    python3 -m torch_monarch plan examples/models.py:gpt2_small --gpus 64 --cluster a100-80gb ...
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def init_weights(module, std=0.02):
    """Hugging Face's ``_init_weights``: linears and embeddings N(0, 0.02), biases zero, norms
    one (GPT-2, Llama, BERT all use it). Also what deferred initialization calls per module."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=std)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    elif isinstance(module, LlamaRMSNorm):
        nn.init.ones_(module.weight)


# -- KV cache for generation (torch_monarch.generate; forwards without cache= are unchanged)

class KVCache:
    """Keys and values of every token seen so far, per layer, for token-by-token generation.
    Whoever drives the loop (torch_monarch.generate) sets, before each forward,
    ``attention_mask`` [batch, every token so far, those fed now included] (1: a real token,
    0: left padding) and ``positions`` [batch, tokens fed now]; each attention layer appends its
    keys and values [batch, kv_heads (this rank's under tp), tokens, head_dim].

    ``max_tokens``: pre-allocated (a static cache): each layer's keys and values get storage for
    that many tokens at their first update and are written in place (``keys[i]`` / ``values[i]``
    are then views of the filled part); None: concatenated step by step."""

    def __init__(self, max_tokens=None):
        self.keys, self.values = {}, {}
        self.max_tokens = max_tokens
        self._storage = {}  # layer -> (keys, values) [batch, kv_heads, max_tokens, head_dim]
        self.attention_mask = None
        self.positions = None

    def layer(self, index):
        return _LayerCache(self, index)

    def allowed(self, queries, keys, device):
        """[batch, 1, queries, keys] bool: a query sees real keys at or before its own place
        (the last ``queries`` of the ``keys``), and always itself (a padding query would
        otherwise see nothing and give NaN)."""
        q = torch.arange(keys - queries, keys, device=device)[:, None]
        k = torch.arange(keys, device=device)[None, :]
        real = self.attention_mask[:, None, None, -keys:].bool()
        return ((k <= q) & real) | (k == q)


class _LayerCache:
    def __init__(self, cache, index):
        self.cache, self.index = cache, index

    def update(self, k, v):
        c, i = self.cache, self.index
        if c.max_tokens is None:
            if i in c.keys:
                k, v = torch.cat([c.keys[i], k], dim=2), torch.cat([c.values[i], v], dim=2)
            c.keys[i], c.values[i] = k, v
            return k, v
        if i not in c._storage:
            shape = (k.shape[0], k.shape[1], c.max_tokens, k.shape[3])
            c._storage[i] = (k.new_zeros(shape), v.new_zeros(shape[:3] + (v.shape[3],)))
        keys, values = c._storage[i]
        start = c.keys[i].shape[2] if i in c.keys else 0
        end = start + k.shape[2]
        if end > c.max_tokens:
            raise RuntimeError(f"KVCache: layer {i} would hold {end} tokens; it was allocated for {c.max_tokens}")
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        c.keys[i], c.values[i] = keys[:, :, :end], values[:, :, :end]
        return c.keys[i], c.values[i]


class _PastCache:
    """A layer's cache whose keys and values were appended already (Llama repeats kv heads
    after caching them, so the cache keeps this rank's kv heads, not the repeated ones)."""

    def __init__(self, layer_cache):
        self.cache = layer_cache.cache
        self._kv = (layer_cache.cache.keys[layer_cache.index], layer_cache.cache.values[layer_cache.index])

    def update(self, k, v):
        return k, v


def _cached_attention(q, k, v, cache, head_dim):
    """softmax(q k^T / sqrt(d)) v over the cached keys, masked by the cache's padding and order."""
    k, v = cache.update(k, v)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    allowed = cache.cache.allowed(q.shape[2], k.shape[2], q.device)
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


# -- GPT-2 (Hugging Face names: transformer.wte / wpe / h.N.attn.c_attn / ln_f, tied lm_head)

class GPT2Attention(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.num_heads = heads
        self.head_dim = hidden // heads
        self.c_attn = nn.Linear(hidden, 3 * hidden)  # fused q|k|v
        self.c_proj = nn.Linear(hidden, hidden)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x, cache=None):
        b, s, _ = x.size()
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            out = _cached_attention(q, k, v, cache, self.head_dim).transpose(1, 2).reshape(b, s, -1)
            return self.resid_dropout(self.c_proj(out))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = self.attn_dropout(scores.softmax(-1))
        out = (probs @ v).transpose(1, 2).reshape(b, s, -1)
        return self.resid_dropout(self.c_proj(out))


class GPT2MLP(nn.Module):
    def __init__(self, hidden, dropout):
        super().__init__()
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.c_proj = nn.Linear(4 * hidden, hidden)
        self.act = nn.GELU()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = GPT2Attention(hidden, heads, dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = GPT2MLP(hidden, dropout)

    def forward(self, x, cache=None):
        x = x + (self.attn(self.ln_1(x)) if cache is None else self.attn(self.ln_1(x), cache))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, vocab, hidden, heads, layers, max_positions, dropout):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(max_positions, hidden)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPT2Block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, tokens, cache=None):
        if isinstance(cache, KVCache):  # generation (torch.fx traces a proxy here: the path below)
            x = self.drop(self.wte(tokens) + self.wpe(cache.positions))
            for i, block in enumerate(self.h):
                x = block(x, cache.layer(i))
            return self.ln_f(x)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, vocab=50257, hidden=768, heads=12, layers=12, max_positions=1024, dropout=0.0):
        super().__init__()
        self.transformer = GPT2Model(vocab, hidden, heads, layers, max_positions, dropout)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        self.apply(init_weights)

    def forward(self, tokens, cache=None):
        if isinstance(cache, KVCache):
            return self.lm_head(self.transformer(tokens, cache))
        return self.lm_head(self.transformer(tokens))

    def new_cache(self, max_tokens=None):
        return KVCache(max_tokens)

    def max_positions(self):
        return self.transformer.wpe.num_embeddings


def gpt2_small():
    """GPT-2 small (124M parameters, sequence 1024), as published (Radford et al. 2019)."""
    return GPT2LMHeadModel()


def gpt3_175b():
    """GPT-3 175B's shape (Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads,
    context 2048; vocabulary 51200 as Narayanan et al. 2021 pad it). Build it under
    ``torch_monarch.meta_init()``: it is never materialized."""
    return GPT2LMHeadModel(vocab=51200, hidden=12288, heads=96, layers=96, max_positions=2048)


def llama3_8b():
    """Llama-3 8B's shape (32 layers, hidden 4096, 32 query / 8 KV heads, MLP 14336,
    vocabulary 128256)."""
    return LlamaForCausalLM(vocab=128256, hidden=4096, heads=32, kv_heads=8, intermediate=14336, layers=32)


# -- Llama (Hugging Face names: model.embed_tokens / layers.N.self_attn.q_proj / norm / lm_head)

class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _repeat_kv(x, n_rep):
    """(b, kv_heads, s, d) -> (b, kv_heads * n_rep, s, d), each KV head serving n_rep query heads."""
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):  # also what deferred initialization calls
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=self.inv_freq.device).float()
                                                     / self.dim)))

    def forward(self, seq_len, device):
        t = torch.arange(seq_len, device=device, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def at(self, positions):
        """cos, sin [batch, 1, tokens, dim] at given positions [batch, tokens] (generation)."""
        freqs = positions[..., None].to(self.inv_freq.dtype) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos(), emb.sin()


class LlamaAttention(nn.Module):
    """Reads the sequence length from its input and views with its own head counts, as the
    Hugging Face implementation does."""

    def __init__(self, hidden, heads, kv_heads):
        super().__init__()
        self.num_heads = heads
        self.num_key_value_heads = kv_heads
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim)

    def forward(self, hidden_states, cache=None):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        if cache is not None:  # generation: rotary at each token's position; the cache keeps kv heads
            cos, sin = self.rotary_emb.at(cache.cache.positions)
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k, v = cache.update(k, v)
            cache = _PastCache(cache)  # keys and values are already in
            n_rep = self.num_heads // self.num_key_value_heads
            out = _cached_attention(q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), cache, self.head_dim)
            return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim))
        cos, sin = self.rotary_emb(q_len, hidden_states.device)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # as Hugging Face's: bf16 queries stay bf16
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v = _repeat_kv(k, self.num_heads // self.num_key_value_heads), _repeat_kv(v, self.num_heads // self.num_key_value_heads)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=hidden_states.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden, heads, kv_heads, intermediate):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(hidden)
        self.self_attn = LlamaAttention(hidden, heads, kv_heads)
        self.post_attention_layernorm = LlamaRMSNorm(hidden)
        self.mlp = LlamaMLP(hidden, intermediate)

    def forward(self, x, cache=None):
        x = x + (self.self_attn(self.input_layernorm(x)) if cache is None
                 else self.self_attn(self.input_layernorm(x), cache))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, vocab, hidden, heads, kv_heads, intermediate, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaDecoderLayer(hidden, heads, kv_heads, intermediate) for _ in range(layers))
        self.norm = LlamaRMSNorm(hidden)

    def forward(self, tokens, cache=None):
        x = self.embed_tokens(tokens)
        if isinstance(cache, KVCache):  # generation (torch.fx traces a proxy here: the path below)
            for i, layer in enumerate(self.layers):
                x = layer(x, cache.layer(i))
            return self.norm(x)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab=32000, hidden=4096, heads=32, kv_heads=8, intermediate=14336, layers=32):
        super().__init__()
        self.model = LlamaModel(vocab, hidden, heads, kv_heads, intermediate, layers)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.apply(init_weights)

    def forward(self, tokens, cache=None):
        if isinstance(cache, KVCache):
            return self.lm_head(self.model(tokens, cache))
        return self.lm_head(self.model(tokens))

    def new_cache(self, max_tokens=None):
        return KVCache(max_tokens)


# -- Mixture-of-Experts decoder (Hugging Face Qwen3-MoE / Mixtral names in transformers 5:
# model.layers.N.mlp.gate.weight, mlp.experts.gate_up_proj [experts, 2 * ffn, hidden],
# mlp.experts.down_proj [experts, hidden, ffn]; DeepSeek-style shared expert mlp.shared_expert)

class MoERouter(nn.Module):
    """Softmax over experts, the top_k of them per token, their weights renormalized to sum to
    one when ``norm_topk_prob`` (Mixtral, Qwen3-MoE). Returns (logits, weights, indices)."""

    def __init__(self, hidden, num_experts, top_k, norm_topk_prob=True):
        super().__init__()
        self.top_k, self.num_experts, self.norm_topk_prob = top_k, num_experts, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        logits = F.linear(x, self.weight)
        probs = logits.float().softmax(-1)
        weights, indices = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(x.dtype), indices


class MoEExperts(nn.Module):
    """All experts' weights as two 3-D tensors; each token's chosen experts, weighted and summed.

    ``capacity_factor`` 0 is dropless. Otherwise each expert takes at most
    ceil(capacity_factor * tokens * top_k / experts) token slots of the batch: first choices
    before second ones, earlier tokens first (GShard, Lepikhin et al. 2020, Sec. 2.2); a
    dropped slot adds nothing."""

    def __init__(self, hidden, intermediate, num_experts, capacity_factor=0.0):
        super().__init__()
        self.num_experts, self.capacity_factor = num_experts, capacity_factor
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act_fn = nn.SiLU()
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def kept(self, top_k_index):
        """[tokens, top_k] bool: the slots within their expert's capacity."""
        if not self.capacity_factor:
            return torch.ones_like(top_k_index, dtype=torch.bool)
        tokens, top_k = top_k_index.shape
        capacity = math.ceil(self.capacity_factor * tokens * top_k / self.num_experts)
        # Queue order: choice-major, then token: the slot's place among its expert's slots.
        by_choice = top_k_index.t().reshape(-1)
        one_hot = F.one_hot(by_choice, self.num_experts)
        place = (one_hot.cumsum(0) * one_hot).sum(-1) - 1
        return (place < capacity).reshape(top_k, tokens).t()

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        kept = self.kept(top_k_index)
        for e in range(self.num_experts):
            token, choice = torch.where((top_k_index == e) & kept)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, choice, None])
        return out


class LoadBalancingLoss(nn.Module):
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4) as Hugging Face's MoE
    models compute it: experts * sum_e (share of tokens choosing e, per choice) * (mean router
    probability of e)."""

    def __init__(self, num_experts):
        super().__init__()
        self.num_experts = num_experts

    def forward(self, router_probs, top_k_index):
        tokens = router_probs.shape[0]
        chosen = F.one_hot(top_k_index, self.num_experts).float().sum((0, 1)) / tokens
        return self.num_experts * (chosen * router_probs.float().mean(0)).sum()


class MoEBlock(nn.Module):
    """Router, routed experts, an optional always-on shared expert; keeps its load-balancing
    loss in ``aux_loss`` (the model sums them)."""

    def __init__(self, hidden, intermediate, num_experts, top_k, shared_intermediate=0, capacity_factor=0.0):
        super().__init__()
        self.gate = MoERouter(hidden, num_experts, top_k)
        self.experts = MoEExperts(hidden, intermediate, num_experts, capacity_factor)
        self.shared_expert = LlamaMLP(hidden, shared_intermediate) if shared_intermediate else None
        self.balance = LoadBalancingLoss(num_experts)
        self.aux_loss = None

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits, weights, indices = self.gate(flat)
        out = self.experts(flat, indices, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        self.aux_loss = self.balance(logits.float().softmax(-1), indices)
        return out.reshape(shape)


class MoEDecoderLayer(LlamaDecoderLayer):
    def __init__(self, hidden, heads, kv_heads, intermediate, num_experts, top_k, shared_intermediate,
                 capacity_factor):
        super().__init__(hidden, heads, kv_heads, intermediate)
        self.mlp = MoEBlock(hidden, intermediate, num_experts, top_k, shared_intermediate, capacity_factor)


class MoEForCausalLM(nn.Module):
    """A Llama-style decoder whose MLPs are MoE blocks (Qwen3-MoE / DeepSeek-style layout).
    ``aux_loss()``: the sum of the blocks' load-balancing losses of the last forward."""

    def __init__(self, vocab=32000, hidden=2048, heads=32, kv_heads=4, intermediate=768, layers=24,
                 num_experts=128, top_k=8, shared_intermediate=0, capacity_factor=0.0):
        super().__init__()
        self.model = LlamaModel(vocab, hidden, heads, kv_heads, intermediate, layers)
        self.model.layers = nn.ModuleList(
            MoEDecoderLayer(hidden, heads, kv_heads, intermediate, num_experts, top_k, shared_intermediate,
                            capacity_factor) for _ in range(layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.apply(init_weights)

    def forward(self, tokens):
        return self.lm_head(self.model(tokens))

    def aux_loss(self):
        losses = [m.aux_loss for m in self.modules() if isinstance(m, MoEBlock) and m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else torch.zeros(())


# -- BERT (Hugging Face names: bert.embeddings / encoder.layer.N.attention.self.query / ...)

class BertEmbeddings(nn.Module):
    def __init__(self, vocab, hidden, max_positions):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.LayerNorm = nn.LayerNorm(hidden)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.LayerNorm(self.word_embeddings(tokens) + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.num_attention_heads = heads
        self.attention_head_size = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, _ = x.size()
        q, k, v = (m(x).view(b, s, self.num_attention_heads, self.attention_head_size).transpose(1, 2)
                   for m in (self.query, self.key, self.value))
        probs = (q @ k.transpose(-1, -2) / math.sqrt(self.attention_head_size)).softmax(-1)
        return (probs @ v).transpose(1, 2).reshape(b, s, self.num_attention_heads * self.attention_head_size)


class BertSelfOutput(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class BertAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.self = BertSelfAttention(hidden, heads)
        self.output = BertSelfOutput(hidden)

    def forward(self, x):
        return self.output(self.self(x), x)


class BertIntermediate(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)

    def forward(self, x):
        return F.gelu(self.dense(x))


class BertOutput(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.dense = nn.Linear(intermediate, hidden)
        self.LayerNorm = nn.LayerNorm(hidden)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class BertLayer(nn.Module):
    def __init__(self, hidden, heads, intermediate):
        super().__init__()
        self.attention = BertAttention(hidden, heads)
        self.intermediate = BertIntermediate(hidden, intermediate)
        self.output = BertOutput(hidden, intermediate)

    def forward(self, x):
        a = self.attention(x)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    def __init__(self, hidden, heads, intermediate, layers):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(hidden, heads, intermediate) for _ in range(layers))

    def forward(self, x):
        for layer in self.layer:
            x = layer(x)
        return x


class BertModel(nn.Module):
    def __init__(self, vocab, hidden, heads, intermediate, layers, max_positions):
        super().__init__()
        self.embeddings = BertEmbeddings(vocab, hidden, max_positions)
        self.encoder = BertEncoder(hidden, heads, intermediate, layers)

    def forward(self, tokens):
        return self.encoder(self.embeddings(tokens))


class BertForSequenceClassification(nn.Module):
    def __init__(self, vocab=30522, hidden=768, heads=12, intermediate=3072, layers=12, max_positions=512,
                 num_labels=2):
        super().__init__()
        self.bert = BertModel(vocab, hidden, heads, intermediate, layers, max_positions)
        self.classifier = nn.Linear(hidden, num_labels)
        self.apply(init_weights)

    def forward(self, tokens):
        return self.classifier(self.bert(tokens)[:, 0])


# -- a plain MLP ----------------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, inputs=32, hidden=64, outputs=10, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(inputs if i == 0 else hidden, hidden), nn.ReLU()) for i in range(depth))
        self.out = nn.Linear(hidden, outputs)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class BasicBlock(nn.Module):
    """ResNet's two-convolution block with its shortcut (He et al. 2016, Fig. 2 and Table 1),
    with torchvision's attribute names."""

    def __init__(self, inputs, channels, stride, norm):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = norm(channels)
        self.downsample = None
        if stride != 1 or inputs != channels:
            self.downsample = nn.Sequential(nn.Conv2d(inputs, channels, 1, stride=stride, bias=False), norm(channels))

    def forward(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + shortcut)


class ResNet18(nn.Module):
    """ResNet-18 (He et al. 2016, Table 1): a 7x7 stem, four stages of two basic blocks
    (64, 128, 256, 512 channels), global average pooling and a linear classifier; module names
    and initialization as torchvision's ``resnet18`` (Kaiming-normal convolutions, norms one)."""

    def __init__(self, num_classes=1000, norm=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = norm(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, inputs = [], 64
        for channels, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages.append(nn.Sequential(BasicBlock(inputs, channels, stride, norm), BasicBlock(channels, channels, 1, norm)))
            inputs = channels
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes=10, batch_stats=True):
    """ResNet-18. ``batch_stats=False`` swaps BatchNorm for GroupNorm: batch statistics are per
    rank under data parallelism (as with DDP without SyncBatchNorm), so only a norm without
    them can match a one-process run exactly."""
    norm = nn.BatchNorm2d if batch_stats else (lambda channels: nn.GroupNorm(8, channels))
    return ResNet18(num_classes=num_classes, norm=norm)
