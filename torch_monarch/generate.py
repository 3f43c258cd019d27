"""Token-by-token generation with a KV cache on a ``parallelize``d model
(``ParallelModel.generate`` delegates here).

    out = pm.generate(input_ids, max_new_tokens=32, attention_mask=mask)   # greedy
    out = pm.generate(input_ids, max_new_tokens=32, temperature=0.8, top_k=50, top_p=0.9, seed=1)

What runs (data and tensor parallelism, any ZeRO stage; pipelines below):

* **The model's own cache.** A Hugging Face decoder runs with ``use_cache=True`` and keeps its
  ``past_key_values``; under tensor parallelism its attention modules run this rank's heads
  (tensor_parallel_modules set their head counts), so the cache holds this rank's key/value
  heads only (kv_heads / tp per layer). A model of one's own generates with a cache when its
  forward takes ``cache=`` and it has ``new_cache()`` (examples/models.py: GPT-2 and Llama):
  an object on which generate sets ``attention_mask`` (batch x every token so far, those fed
  now included) and ``positions`` (batch x the tokens fed now) before each forward, and into
  which the attention layers append their keys and values.
* **Prompts of different lengths** are left-padded (Hugging Face's convention for decoder
  models) with ``attention_mask`` 0 on the padding; positions count real tokens only
  (``cumsum(mask) - 1``), so each row decodes as it would alone.
* **Whole logits.** Only the last position's logits are used. A vocabulary-split head (our
  models' ``VocabHead`` without ``gather_output``) gives [batch, vocab / tp] per rank: they are
  all-gathered over tp (batch x vocab values per token: small next to a forward's all-reduces).
* **One token on every tp rank.** The tp group's rank 0 chooses (greedy: argmax; sampled: one
  ``torch.Generator`` seeded with ``seed``, temperature, then top-k, then top-p as Hugging Face
  orders its warpers) and broadcasts the chosen ids over tp. Every rank also holds the same
  logits and the same seeded generator, so it would choose the same; the broadcast makes that
  a guarantee rather than an assumption about bitwise-equal collectives (NCCL's all-reduce need
  not be), for the price of batch int64s per token.
* **Data parallelism:** each dp rank generates its own prompts (its local batch, as
  ``train_step`` takes). Under ZeRO-3 every forward gathers parameters over dp, so the dp ranks
  run the same number of forwards: the "all sequences finished" test is agreed over dp.
* **Stopping.** A sequence stops at its first ``eos_token_id`` (an int or a list); after that it
  emits ``pad_token_id`` (default: the first EOS id). Generation ends after ``max_new_tokens``
  or when every sequence has stopped (the output is then shorter, as Hugging Face's is).
* **Modes.** The model is switched to eval for the call (dropout off) and back to what it was;
  no gradients are kept; a trained model generates from the weights it holds (no reload).

Returns [batch, prompt_len + generated] int64: the prompt (with its padding) followed by the
generated tokens, as Hugging Face's ``generate`` returns them.

Pipelines (pp > 1, one stage per rank): every stage runs the model's own forward with its own
cache, which fills only its layers, the blocks of earlier stages stubbed by what the stage
received (_Pipeline says how, for stages cut by module hooks (Hugging Face models) and by
torch.fx (examples/models.py's)); stage s receives the hidden state from s - 1 over the pp group
and sends its own on; the last stage chooses the tokens and sends them to the first, and at the
end broadcasts the output over pp. With ``micro_batches`` = 1 one batch of sequences is in
flight (a stage idles while the others compute); with more, the rows follow each other round the
pipeline in groups (_decode_pipelined). Virtual stages and context parallelism (cp > 1) are
refused.

The KV cache is pre-allocated for prompt + max_new_tokens by default (``cache="static"``) or grown
token by token (``"dynamic"``); ``pm.generate_stats`` says what it held, and the caches are let
go with the call.
"""

import inspect

import torch


def _max_positions(pm, plain):
    cfg = pm.hf_config
    if cfg is not None:
        for field in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(cfg, field, None)
            if isinstance(value, int) and value > 0:
                return value, f"{type(cfg).__name__}.{field}"
        return None, None
    limit = getattr(plain, "max_positions", None)
    if callable(limit):
        limit = limit()
    return (limit, f"{type(plain).__name__}.max_positions()") if limit else (None, None)


def _vocab_size(pm, plain):
    if pm.hf_config is not None and isinstance(getattr(pm.hf_config, "vocab_size", None), int):
        return pm.hf_config.vocab_size
    from .tensor_parallel_modules import VocabParallelEmbedding
    best = None
    for m in plain.modules():
        if isinstance(m, VocabParallelEmbedding):
            rows = m.weight.shape[0] * m.group.size
        elif isinstance(m, torch.nn.Embedding):
            rows = m.num_embeddings
        else:
            continue
        best = rows if best is None else max(best, rows)
    return best


def _filter_top_k_top_p(logits, top_k, top_p):
    """Hugging Face's TopKLogitsWarper then TopPLogitsWarper (ties at the k-th value kept)."""
    if top_k is not None and top_k > 0:
        k = min(top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False  # the most likely token always stays
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def _check(pm, input_ids, max_new_tokens, attention_mask, temperature, top_k, top_p):
    if pm.pp > 1 and len(pm._local) != 1:
        raise ValueError(f"generate: {len(pm._local)} stages on one rank (virtual stages) are not supported; "
                         "lay the pipeline out with one stage per rank")
    if pm.cp > 1:
        raise ValueError(f"generate: cp={pm.cp} is not supported (the sequence would be cut over cp ranks)")
    if pm.tp > 1 and pm.layout.sequence_parallel:
        raise ValueError("generate: a sequence-parallel layout cuts each sequence over the tp ranks between blocks; "
                         "a decode step's one token cannot be cut (lay it out with sequence_parallel=False)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64,
                                                                                                 torch.int32):
        raise ValueError("generate: input_ids must be an integer tensor [batch, prompt_len], got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if input_ids.shape[1] == 0:
        raise ValueError("generate: the prompt is empty (input_ids has 0 columns)")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"generate: attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}")
    if temperature is None or temperature < 0:
        raise ValueError(f"generate: temperature must be >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"generate: top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"generate: top_p must be in (0, 1] or None, got {top_p!r}")


class _Decode:
    """What one generate call decodes with (shared by the one-stage and the pipelined loops)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def choose(self, logits):
        """The tokens from the last position's logits, the same on every tp rank."""
        gathered = self.tp_group is not None and self.vocab is not None and logits.shape[-1] != self.vocab
        logits = _whole_logits(logits.float(), self.vocab, self.tp_group)
        token = _choose(logits, self.temperature, self.top_k, self.top_p, self.generator)
        if self.tp_group is not None and (self.temperature != 0 or not gathered):
            # A greedy token from gathered logits needs no broadcast: the gather gives every tp
            # rank the same bits, so argmax agrees. Logits each rank computed whole (a head tp
            # left whole) may differ in a last bit (a CPU matmul's kernel can depend on its
            # buffers' alignment), and a sampled token comes from rank 0: broadcast.
            self.tp_group.broadcast(token, 0).wait()
        return token

    def after_step(self, step):
        """Once two steps ran with every collective's agreement check (the prefill and the
        first decode step: every collective a decode step makes has been compared across the
        group's members), later steps repeat them: the checks go off on the groups generate
        drives (each a small all-gather of its own per collective, doubling a decode step's
        latency-bound collectives), on every member after the same step; restored at the end."""
        if step != 1:
            return
        for name in ("tp", "pp", "dp"):
            group = self.pm.mesh.group(name)
            if group.size > 1 and group.checks_collectives:
                group.checks_collectives = False
                self.unchecked.append(group)

    def restore_checks(self):
        for group in self.unchecked:
            group.checks_collectives = True
        self.unchecked = []

    def agreed(self, running):
        """Under ZeRO-3 every forward gathers over dp: the dp ranks go on while any of them does."""
        if self.dp_group is None:
            return running
        flag = torch.tensor([1.0 if running else 0.0])  # all_reduce_max: fp32
        self.dp_group.all_reduce_max(flag).wait()
        return bool(flag.item())


@torch.no_grad()
def generate(pm, input_ids, max_new_tokens, attention_mask=None, temperature=0.0, top_k=None, top_p=None,
             eos_token_id=None, pad_token_id=None, seed=0, micro_batches=None, cache="static"):
    """See the module's docstring."""
    _check(pm, input_ids, max_new_tokens, attention_mask, temperature, top_k, top_p)
    if cache not in ("static", "dynamic"):
        raise ValueError(f"generate: cache must be 'static' (pre-allocated for prompt + max_new_tokens) or 'dynamic' "
                         f"(grown token by token), got {cache!r}")
    stage = pm._local[0]
    wrapped = pm._wrapped[stage]
    # The model as the user wrote it: a stage cut by torch.fx is a graph of its modules, and
    # generation runs the model's own forward (its cache path) instead (_Pipeline).
    plain = pm._root if pm.pp > 1 and not pm._hook_stages else pm._plain[stage]
    prompt_len = input_ids.shape[1]
    limit, where = _max_positions(pm, plain)
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise ValueError(f"generate: the prompt ({prompt_len} tokens) and max_new_tokens={max_new_tokens} need "
                         f"{prompt_len + max_new_tokens} positions; the model has {limit} ({where})")
    hf = pm.hf_config is not None
    if not hf and not (hasattr(plain, "new_cache") and "cache" in inspect.signature(plain.forward).parameters):
        raise ValueError(f"generate: {type(plain).__name__} has no KV cache interface (a Hugging Face model, or a "
                         "forward taking cache= and a new_cache() method, as examples/models.py's GPT-2 and Llama)")
    micro_batches = _micro_batches(pm, micro_batches, input_ids.shape[0])
    device = input_ids.device
    ids = input_ids.long()
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(device=device, dtype=torch.long)
    if eos_token_id is None:
        eos = []
    elif isinstance(eos_token_id, int):
        eos = [eos_token_id]
    else:
        eos = list(eos_token_id)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    # Every forward gathers over dp (ZeRO-3) or exchanges tokens over ep ranks inside dp (expert
    # parallelism): the dp ranks run the same number of forwards.
    dp_sync = pm.dp > 1 and (pm.zero_stage == 3 or pm.ep > 1)
    d = _Decode(pm=pm, stage=stage, wrapped=wrapped, plain=plain, hf=hf, device=device, ids=ids, mask=mask,
                static=cache == "static", total=prompt_len + max_new_tokens,
                max_new_tokens=max_new_tokens, eos=eos, eos_t=torch.tensor(eos, dtype=torch.long, device=device),
                pad=pad_token_id, temperature=temperature, top_k=top_k, top_p=top_p,
                generator=torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None,
                tp_group=pm.mesh.group("tp") if pm.tp > 1 else None,
                dp_group=pm.mesh.group("dp") if dp_sync else None, vocab=_vocab_size(pm, plain), unchecked=[])

    # The model's own forward runs on an fx-cut stage: its modules outside the stage too.
    modules = {id(m): m for m in list(wrapped.modules()) + list(plain.modules())}
    modes = [(m, m.training) for m in modules.values()]
    wrapped.eval()
    for m in plain.modules():
        m.training = False
    try:
        if pm.pp > 1:
            generated = _decode_pipelined(d, micro_batches)
        else:
            generated = _decode_one_stage(d)
        if eos and generated.shape[1]:
            # The step at which all of this rank's sequences had finished: under ZeRO-3 a rank
            # whose sequences all finished keeps stepping with the others (their forwards gather
            # over dp); its output ends where it would alone.
            hit = torch.isin(generated, d.eos_t)
            if bool(hit.any(dim=1).all()):
                done_at = int(hit.int().argmax(dim=1).max())
                generated = generated[:, :done_at + 1]
        return torch.cat([ids, generated], dim=1)
    finally:
        d.restore_checks()
        pm.release_cast_copies()  # mixed precision's per-forward copies
        for m, training in modes:
            m.training = training


def _micro_batches(pm, micro_batches, batch):
    """The decode micro-batches: as asked, else the inference plan's (at most this rank's batch:
    the plan's is for batch_per_replica sequences), else 1 (one batch in flight). Where every
    forward is collective over dp (ZeRO-3, expert parallelism) under a pipeline, the dp ranks
    agree first, so a rank's bad value is an error on every rank, not a hang."""
    if micro_batches is None:
        inference = getattr(getattr(pm, "plan", None), "inference", None)
        micro_batches = min(inference.decode_micro_batches, batch) if inference is not None else 1
    problem = None
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        problem = f"generate: micro_batches must be an int >= 1, got {micro_batches!r}"
        micro_batches = 1
    elif micro_batches > 1 and pm.pp == 1:
        problem = f"generate: micro_batches={micro_batches} splits the batch round a pipeline; this layout has pp=1"
    elif micro_batches > batch:
        problem = f"generate: micro_batches={micro_batches} is more than the batch ({batch} sequences)"
    if pm.pp > 1 and pm.dp > 1 and (pm.zero_stage == 3 or pm.ep > 1):
        # Each micro-batch is a forward that gathers (or exchanges) over dp.
        flags = torch.tensor([float(micro_batches), -float(micro_batches), 1.0 if problem else 0.0])
        pm.mesh.group("dp").all_reduce_max(flags).wait()
        if problem is None and flags[2] > 0:
            problem = "generate: another dp rank refused its micro_batches (its error names why)"
        elif problem is None and flags[0] != -flags[1]:
            problem = (f"generate: the dp ranks decode in {int(-flags[1])} to {int(flags[0])} micro-batches; under "
                       "ZeRO-3 (or expert parallelism) every forward is collective over dp: give every dp rank the "
                       "same micro_batches (and at least that many rows)")
    if problem is not None:
        raise ValueError(problem)
    return micro_batches


def _decode_one_stage(d):
    """Every layer on this rank (dp / tp / ZeRO): one forward per token for the whole batch."""
    pm, plain, wrapped = d.pm, d.plain, d.wrapped
    batch = d.ids.shape[0]
    finished = torch.zeros(batch, dtype=torch.bool, device=d.device)
    cache = _new_cache(d, plain)
    step_ids, mask = d.ids, d.mask
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    keeps_logits = d.hf and "logits_to_keep" in inspect.signature(type(plain).forward).parameters
    tokens = []
    for step in range(d.max_new_tokens):
        if d.hf:
            # Only the last position's logits (as HF's own generate asks): the prefill's head
            # and its tp gather then cover one position, not the whole prompt.
            keep = {"logits_to_keep": 1} if keeps_logits else {}
            res = wrapped(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                          past_key_values=cache, use_cache=True, **keep)
            cache = res.past_key_values
            logits = res.logits[:, -1]
        else:
            cache.attention_mask, cache.positions = mask, positions
            logits = wrapped(step_ids, cache=cache)[:, -1]
        token = d.choose(logits)
        if d.eos:
            token = torch.where(finished, torch.full_like(token, d.pad), token)
            finished |= torch.isin(token, d.eos_t)
        tokens.append(token)
        d.after_step(step)
        if step == d.max_new_tokens - 1 or (d.eos and not d.agreed(bool((~finished).any()))):
            break
        step_ids = token[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
    pm.generate_stats = _cache_stats([cache], 1)
    return torch.stack(tokens, dim=1) if tokens else d.ids[:, :0]


def _decode_pipelined(d, micro_batches):
    """Stage by stage, the batch cut into ``micro_batches`` row ranges that follow each other
    round the pipeline (while stage 1 runs micro-batch 0, stage 0 runs micro-batch 1). Each
    micro-batch has its own cache on every stage. The first stage decides, micro-batch by
    micro-batch, whether it goes on (a micro-batch whose sequences all stopped at EOS is
    skipped from then on; under ZeRO-3 the dp ranks agree) and passes the decision on with the
    hidden state; the last stage chooses the tokens and sends them to the first stage (point to
    point, so the stages never wait for each other in a collective mid-step). At the end the
    last stage broadcasts every generated token over pp, so every rank returns the output."""
    pm = d.pm
    pipe = _Pipeline(pm, d.stage, d.device)
    batch = d.ids.shape[0]
    base, extra = divmod(batch, micro_batches)
    rows, start = [], 0
    for j in range(micro_batches):
        size = base + (1 if j < extra else 0)
        rows.append(slice(start, start + size))
        start += size
    first, last = pipe.stage == 0, pipe.stage == pipe.last
    caches = [pipe.new_cache(d) for _ in rows]
    step_ids = [d.ids[r] for r in rows]
    masks = [d.mask[r] for r in rows]
    positions = [(m.cumsum(-1) - 1).masked_fill(m == 0, 1) for m in masks]
    finished = [torch.zeros(r.stop - r.start, dtype=torch.bool, device=d.device) for r in rows]
    active = [True] * len(rows)  # ran in the previous step
    generated = []
    for step in range(d.max_new_tokens):
        step_tokens = torch.full((batch,), d.pad, dtype=torch.long, device=d.device)
        ran = False
        for j, r in enumerate(rows):
            if not active[j]:
                continue  # stopped for good: no stage sends or expects anything for it
            if step > 0:
                if first:  # the tokens the last stage chose for it in the previous step
                    token = pipe.recv_tokens(j, r.stop - r.start)
                    if d.eos:
                        finished[j] |= torch.isin(token, d.eos_t)
                    step_ids[j] = token[:, None]
                else:
                    step_ids[j] = step_ids[j][:, -1:]  # a placeholder of the right shape: stubbed
                masks[j] = torch.cat([masks[j], torch.ones_like(masks[j][:, :1])], dim=1)
                positions[j] = positions[j][:, -1:] + 1
            if first:
                go = not d.eos or step == 0 or d.agreed(bool((~finished[j]).any()))
                received = None
            else:
                received, go = pipe.recv_hidden(j)
            if not go:
                active[j] = False
                if not last:
                    pipe.send_stop(j)
                continue
            ran = True
            logits = pipe.forward(j, caches[j], step_ids[j], masks[j], positions[j], received)
            if last:
                token = d.choose(logits)
                if d.eos:
                    token = torch.where(finished[j], torch.full_like(token, d.pad), token)
                    finished[j] |= torch.isin(token, d.eos_t)
                step_tokens[r] = token
                if step < d.max_new_tokens - 1:
                    pipe.send_tokens(j, token)
        if not ran:
            break
        generated.append(step_tokens)
        d.after_step(step)
    pipe.finish()
    steps = len(generated)
    out = torch.stack(generated, dim=1) if steps else torch.empty(batch, 0, dtype=torch.long, device=d.device)
    if steps:
        pipe.group.broadcast(out, pm.num_stages - 1).wait()
    pm.generate_stats = _cache_stats(caches, micro_batches)
    return out


def _cache_stats(caches, micro_batches):
    """What this rank's caches held at the end of the call (ParallelModel.generate_stats): the
    caches themselves are let go with the call (a serving loop would otherwise hold the last
    call's whole cache through the next call and any training after it).

    kv_cache_bytes: the key and value storage of every layer of every micro-batch's cache (the
    whole pre-allocation under cache="static"); layers: the layers this rank's caches hold;
    kv_heads: key/value heads per layer here (the model's / tp); positions: tokens held per
    layer; capacity: tokens allocated per layer (None: grown token by token); micro_batches."""
    total, layers, heads, positions, capacity = 0, set(), None, None, None
    for cache in caches:
        if hasattr(cache, "layers"):  # Hugging Face: a DynamicCache or StaticCache per rank / stage
            for i, layer in enumerate(cache.layers):
                keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
                if keys is None or not keys.numel():
                    continue
                layers.add(i)
                total += keys.numel() * keys.element_size() + values.numel() * values.element_size()
                heads, positions = keys.shape[1], int(layer.get_seq_length())
                capacity = keys.shape[2] if "Static" in type(layer).__name__ else None
        else:  # ours: keys/values per layer index (views of pre-allocated storage when static)
            for i in cache.keys:
                layers.add(i)
                storage = getattr(cache, "_storage", {}).get(i)
                tensors = storage if storage is not None else (cache.keys[i], cache.values[i])
                total += sum(t.numel() * t.element_size() for t in tensors)
                heads, positions = cache.keys[i].shape[1], cache.keys[i].shape[2]
                capacity = storage[0].shape[2] if storage is not None else None
    return {"kv_cache_bytes": total, "layers": sorted(layers), "kv_heads": heads, "positions": positions,
            "capacity": capacity, "micro_batches": micro_batches}


def _whole_logits(logits, vocab, tp_group):
    if tp_group is None or vocab is None or logits.shape[-1] == vocab:
        return logits
    if logits.shape[-1] * tp_group.size != vocab:
        raise RuntimeError(f"generate: the model's logits have {logits.shape[-1]} columns per rank, neither the "
                           f"vocabulary ({vocab}) nor its 1/{tp_group.size} share")
    from . import _runtime
    n = tp_group.size * logits.numel()
    if tp_group.node_local and logits.device.type == "cpu" and \
            0 < n * logits.element_size() <= _runtime.node_all_reduce_bytes():
        # The node's shared-memory all-reduce (on by default, up to MONARCH_NODE_ALL_REDUCE_BYTES;
        # docs/communication.md) runs small messages in the caller's thread; Gloo's all-gather
        # hands each one to its threads (0.5-1 ms a call over loopback, a decode step's worth of
        # tp all-reduces). Each rank's part in its own place and zeros elsewhere: the sum in
        # group order adds only zeros to a part, so every rank gets every part's bits (a -0.0
        # comes back +0.0, which neither argmax nor softmax tells apart).
        parts = torch.zeros(n, dtype=logits.dtype, device=logits.device)
        parts.view(tp_group.size, -1)[tp_group.rank].copy_(logits.reshape(-1))
        tp_group.all_reduce(parts).wait()
    else:
        parts = torch.empty(n, dtype=logits.dtype, device=logits.device)
        tp_group.all_gather(parts, logits.contiguous().view(-1)).wait()
    return torch.cat(list(parts.view((tp_group.size,) + tuple(logits.shape))), dim=-1)  # tp rank r holds vocabulary rows [r * V/tp, (r + 1) * V/tp)


def _choose(logits, temperature, top_k, top_p, generator):
    if temperature == 0:
        return logits.argmax(dim=-1)
    scores = _filter_top_k_top_p(logits / temperature, top_k, top_p)
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator)[:, 0]


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # a hop header's dtype codes


class _Pipeline:
    """One rank's stage of a pipelined generate (one stage per rank). Every stage runs the
    model's own forward with its own caches (one per micro-batch), which fill only its layers'
    entries.

    * Stages cut by module hooks (Hugging Face models) run as in training (pipeline_hooks.py).
    * Stages cut by torch.fx (a stage is a graph of the model's modules, traced without a cache)
      run the model's forward itself here, with the same stubs: the blocks of earlier stages
      return what this stage received; modules outside the blocks whose weights another stage
      holds (the token embedding) return zeros of their output's shape (their value only feeds
      the stubbed blocks); after this stage's last block the forward stops. The stage's wrapper
      (data parallelism, ZeRO's gathers, mixed precision's casts) is called as in training, its
      forward swapped for this one during the call.

    Messages, all point to point on the pp group and sent without waiting (a stage goes on to
    its next micro-batch; finish() waits for them): stage s -> s + 1 a header of 8 int64 (the
    hidden state's dtype and shape, which the receiver cannot know, or "stopped") and the hidden
    state; the last stage -> the first the chosen tokens of each micro-batch."""

    _STOP = -1

    def __init__(self, pm, stage, device):
        self.pm, self.stage, self.device = pm, stage, device
        self.last = pm.num_stages - 1
        self.group = pm.mesh.group("pp")
        self.local = [i for i, s in enumerate(pm.layout.block_stage) if s == stage]
        self._pending = {}  # micro-batch -> [(work, tensor)] of sends not waited for yet
        if not pm._hook_stages:
            self._foreign = _foreign_modules(pm._root, pm._blocks, pm._plain[stage])
        else:  # the last stage's head computes the last position only (HF's generate asks the same)
            model = pm._plain[stage]._model
            self._keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(
                type(model).forward).parameters else {}

    def new_cache(self, d):
        if self.pm._hook_stages:
            return _hf_stage_cache(self.pm.hf_config, self.local, d.total if d.static else None)
        return _new_cache(d, self.pm._root)

    def forward(self, j, cache, step_ids, mask, positions, received):
        """This stage on micro-batch j: the last stage returns the last position's logits; the
        others send their output on and return None."""
        pm, stage = self.pm, self.stage
        received = [] if received is None else [received]
        if pm._hook_stages:
            inputs = dict(input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                          use_cache=True, **self._keep)
            out = pm._run_stage(stage, 0, received, [inputs])
            if stage == self.last:
                return out.logits[:, -1]
            if len(out) != 1:
                raise RuntimeError(f"generate: stage {stage}'s last block gives {len(out)} tensors; a pipelined "
                                   "generate passes one (the hidden state)")
            out = out[0]
        else:
            cache.attention_mask, cache.positions = mask, positions
            out = self._run_fx_stage(cache, step_ids, received)
            if stage == self.last:
                return out[:, -1]
        self._send_hidden(j, out)
        return None

    def _run_fx_stage(self, cache, step_ids, received):
        from .pipeline_hooks import _patch_forward, run_as_stage
        pm, stage, blocks = self.pm, self.stage, self.pm._blocks
        first, last = self.local[0], self.local[-1]
        root = pm._root
        stubs = [(m, _zeros_of_output(n, m)) for n, m in self._foreign] if stage > 0 else []

        def run(*_args, **_kwargs):
            out, stopped = run_as_stage(lambda: root(step_ids, cache=cache), blocks, first, last,
                                        received[0] if stage > 0 else None, stubs, stop=stage != self.last)
            if stopped and not isinstance(out, torch.Tensor):
                raise RuntimeError(f"generate: block {last} of stage {stage} returns a {type(out).__name__}; a "
                                   "pipelined generate passes one tensor (the hidden state) between stages")
            return out

        undo_stage = _patch_forward(pm._plain[stage], run)
        try:
            return pm._wrapped[stage]()
        finally:
            undo_stage()

    # Sends are posted without waiting and kept (with their tensors) per micro-batch until they
    # are known to have arrived: once this stage receives micro-batch j's message of step t, every
    # message of step t - 1 for j has been received on every stage (the step-t message exists
    # only after the last stage's step t - 1 tokens reached the first stage), so waiting on
    # j's earlier sends then returns at once. A stage never waits on a send mid-step.

    def _post(self, j, tensor, peer):
        self._pending.setdefault(j, []).append((self.group.send(tensor, peer), tensor))

    def _settle(self, j):
        for work, _ in self._pending.pop(j, []):
            work.wait()

    def _send_hidden(self, j, tensor):
        tensor = tensor.contiguous()
        if tensor.dtype not in _DTYPES:
            raise RuntimeError(f"generate: stage {self.stage} passes a {tensor.dtype} hidden state; a pipelined "
                               f"generate passes {', '.join(str(t) for t in _DTYPES)}")
        header = torch.zeros(8, dtype=torch.long, device=tensor.device)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
        self._post(j, header, self.stage + 1)
        self._post(j, tensor, self.stage + 1)

    def send_stop(self, j):
        self._post(j, torch.full((8,), self._STOP, dtype=torch.long, device=self.device), self.stage + 1)

    def recv_hidden(self, j):
        """(the previous stage's output, True), or (None, False) when it stopped micro-batch j."""
        header = torch.empty(8, dtype=torch.long, device=self.device)
        self.group.recv(header, self.stage - 1).wait()
        self._settle(j)
        ndim, dtype, *dims = header.tolist()
        if ndim == self._STOP:
            return None, False
        buf = torch.empty(dims[:ndim], dtype=_DTYPES[dtype], device=self.device)
        self.group.recv(buf, self.stage - 1).wait()
        return buf, True

    def send_tokens(self, j, token):
        self._post(j, token.contiguous(), 0)

    def recv_tokens(self, j, rows):
        token = torch.empty(rows, dtype=torch.long, device=self.device)
        self.group.recv(token, self.last).wait()
        self._settle(j)
        return token

    def finish(self):
        for j in list(self._pending):
            self._settle(j)


def _new_cache(d, model):
    """A Hugging Face model: a StaticCache (its layers allocate at their first update from the
    keys they get: this rank's kv heads under tp) or None (the model makes a DynamicCache).
    Ours: new_cache(max_tokens=) when it takes one (examples/models.py's KVCache)."""
    if d.hf:
        if not d.static:
            return None
        from transformers import StaticCache
        return StaticCache(config=d.pm.hf_config, max_cache_len=d.total)
    if d.static and "max_tokens" in inspect.signature(model.new_cache).parameters:
        return model.new_cache(max_tokens=d.total)
    return model.new_cache()


def _hf_stage_cache(config, local, max_len):
    from transformers import DynamicCache, StaticCache

    base = DynamicCache if max_len is None else StaticCache

    class StageCache(base):
        """Hugging Face reads the cache's length (positions, mask sizes) from layer 0, or for
        each attention kind (sliding window, full) from the kind's first layer, which another
        stage may hold: this stage's first layer of the same kind answers instead."""

        def _here(self, layer_idx):
            if layer_idx in local:
                return layer_idx
            sliding = self.is_sliding  # one entry per layer of the model (its config's layer types)
            if layer_idx < len(sliding):
                return next((i for i in local if i < len(sliding) and sliding[i] == sliding[layer_idx]), local[0])
            return local[0]

        def get_seq_length(self, layer_idx=0):
            return super().get_seq_length(self._here(layer_idx))

        def get_mask_sizes(self, query_length, layer_idx=0):
            return super().get_mask_sizes(query_length, self._here(layer_idx))

    return StageCache(config=config) if max_len is None else StageCache(config=config, max_cache_len=max_len)


def _foreign_modules(root, blocks, stage_module):
    """Modules outside the blocks holding weights of their own that this stage does not hold
    (on meta here: another stage's); the stage holds the weights its graph reads."""
    held = {id(p) for p in stage_module.parameters()}  # fx inlines some modules: their weights count
    inside = {id(m) for b in blocks for m in b.modules()}
    return [(n, m) for n, m in root.named_modules() if id(m) not in inside
            and any(id(p) not in held for p in m.parameters(recurse=False))]


def _zeros_of_output(name, module):
    """A forward giving zeros shaped as ``module``'s output on this call's inputs, without its
    weights (another stage's; a vocabulary-split embedding would also all-reduce): an embedding
    gives [*ids, dim]; any other module is run on the meta device for its output's shape."""
    weight = getattr(module, "weight", None)

    def zeros(*args, **kwargs):
        first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None and not first.is_floating_point() and isinstance(weight, torch.Tensor) \
                and weight.dim() == 2:  # an embedding (torch's, a vocabulary-split one, ...)
            return torch.zeros(tuple(first.shape) + (weight.shape[1],), dtype=weight.dtype, device=first.device)
        params = {n: torch.empty_like(p, device="meta") for n, p in module.named_parameters()}
        params.update({n: torch.empty_like(b, device="meta") for n, b in module.named_buffers()})
        meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
        stub = module.__dict__.pop("forward")  # the module's own forward, on meta
        try:
            out = torch.func.functional_call(module, params, tuple(meta(a) for a in args),
                                             {k: meta(v) for k, v in kwargs.items()})
        except Exception as e:  # noqa: BLE001 - whatever the module's forward does on meta
            raise RuntimeError(f"generate: '{name}' ({type(module).__name__}) holds another pipeline stage's "
                               f"weights and runs on this stage; its output's shape could not be found on the "
                               f"meta device ({type(e).__name__}: {e})") from None
        finally:
            module.forward = stub
        if not isinstance(out, torch.Tensor):
            raise RuntimeError(f"generate: '{name}' ({type(module).__name__}) holds another pipeline stage's "
                               f"weights and returns a {type(out).__name__} on this stage; only a tensor can be "
                               "stubbed")
        return torch.zeros(out.shape, dtype=out.dtype, device=first.device if first is not None else "cpu")
    return zeros
