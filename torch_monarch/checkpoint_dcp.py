"""Continuing from a PyTorch distributed checkpoint (DCP): a model trained with FSDP2 (or DDP,
DTensor tensor parallelism, one process) and saved with ``torch.distributed.checkpoint``
loads into any torch_monarch layout, optimizer state included:

    model = torch_monarch.parallelize(model, plan=plan)
    opt = torch.optim.AdamW(model.parameters(), lr=...)
    torch_monarch.checkpoint.load_dcp(model, opt, "ckpt/step_1000")

The checkpoint is read through torch's own DCP reader (``FileSystemReader``, its metadata and
resharding); every rank reads the whole tensors it holds a part of, one at a time, and keeps
its part (its pipeline stages, tp shard, ZeRO rows): peak extra memory is one tensor.

Names: what the saving side's state dict called each entry, found under any prefix (``dcp.save(
{"model": ..., "optim": ...})``, torchtitan's ``{"model": ..., "optimizer": ...}``, the tutorial's
``{"app": {"model": ..., "optim": ...}}``) and through the wrappers' name segments
(``_orig_mod`` of torch.compile, ``_checkpoint_wrapped_module``, ``_fsdp_wrapped_module``,
DDP's ``module.``). Optimizer state in the FQN-keyed form ``get_state_dict`` /
``get_optimizer_state_dict`` save (``<prefix>.state.<param>.<key>``, hyper-parameters under
``<prefix>.param_groups``) or in ``optimizer.state_dict()``'s integer-keyed form with the
parameters in ``model.named_parameters()`` order.
"""

import re

import torch

_WRAPPER_SEGMENTS = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)(?=\.|$)")


def _normal(name):
    return _WRAPPER_SEGMENTS.sub("", name).lstrip(".")


class _DcpReader:
    """The reader interface checkpoint.load uses (``fill(name, target, placement)``), over a
    DCP checkpoint whose entries were matched to the model's names (``keys``: our name ->
    the DCP key)."""

    # Whole tensors read per dcp.load call: each call reads the metadata and plans anew, so one
    # tensor per call is slow (measured: 1.3 GB in 25 s); a batch bounds the memory held.
    BATCH_BYTES = 256 * 1024 * 1024

    def __init__(self, path, metadata, keys):
        self.directory = str(path)
        self.metadata = metadata
        self.keys = keys
        self._names = list(keys)
        self._cache = {}

    def _meta(self, name):
        key = self.keys.get(name)
        meta = self.metadata.state_dict_metadata.get(key) if key is not None else None
        return key, (meta if meta is not None and hasattr(meta, "size") else None)

    def full(self, name):
        """The whole tensor `name`, read together with the ones after it (the order load asks
        for them) up to BATCH_BYTES; each is handed out once."""
        from .checkpoint import CheckpointError
        if name in self._cache:
            return self._cache.pop(name)
        key, meta = self._meta(name)
        if meta is None:
            raise CheckpointError(f"checkpoint: the DCP checkpoint {self.directory} has no tensor for '{name}'")
        batch, total = {}, 0
        for other in [name] + self._names[self._names.index(name) + 1:]:
            k, m = self._meta(other)
            if m is None or other in self._cache:
                continue
            size = torch.empty((), dtype=m.properties.dtype).element_size()
            for d in m.size:
                size *= d
            if batch and total + size > self.BATCH_BYTES:
                break
            batch[other] = (k, torch.empty(tuple(m.size), dtype=m.properties.dtype))
            total += size
        buffers = {k: t for k, t in batch.values()}
        _load_alone(buffers, self.directory)
        for other, (k, _) in batch.items():
            self._cache[other] = buffers[k]
        return self._cache.pop(name)

    def fill(self, name, target, placement):
        from .checkpoint import CheckpointError
        whole = self.full(name)
        if tuple(whole.shape) != tuple(placement.global_shape):
            raise CheckpointError(f"checkpoint: tensor '{name}' is {list(whole.shape)} in {self.directory}, the "
                                  f"model has {list(placement.global_shape)}")
        out = torch.empty_like(target, device="cpu")
        for local, glob, lengths in placement.boxes():
            src = whole[tuple(slice(g, g + n) for g, n in zip(glob, lengths))]
            dst = out[tuple(slice(a, a + n) for a, n in zip(local, lengths))]
            dst.copy_(src.reshape(dst.shape))
        return out

    def close(self):
        self._cache.clear()


def _prefix_for(names, keys):
    """The prefix under which the DCP keys hold these names (after wrapper segments are
    dropped): the one matching the most names; ({name: key}, prefix)."""
    by_normal = {}
    for k in keys:
        by_normal.setdefault(_normal(k), k)
    counts = {}
    for n in names:
        for nk in by_normal:
            if nk == n or nk.endswith("." + n):
                prefix = nk[:len(nk) - len(n)]
                counts[prefix] = counts.get(prefix, 0) + 1
    if not counts:
        return {}, None
    prefix = max(counts, key=lambda p: (counts[p], -len(p)))
    return {n: by_normal[prefix + n] for n in names if prefix + n in by_normal}, prefix


def _read_objects(path, metadata, keys):
    """Non-tensor entries (param_groups' hyper-parameters), loaded as DCP stores them."""
    if not keys:
        return {}
    holder = {k: None for k in keys}
    _load_alone(holder, str(path))
    return holder


def _load_alone(state, directory):
    """dcp.load without collectives: each rank reads what it needs by itself (the ranks of a
    parallel job need different parts). DCP warns that it assumes one process: it is meant."""
    import warnings
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=directory, no_dist=True)


def dcp_index(model, optimizer, path, *, strict=True):
    """The index (checkpoint.py's form) and reader that map a DCP checkpoint at ``path`` to
    ``model``'s and ``optimizer``'s names."""
    from torch.distributed.checkpoint import FileSystemReader
    from .checkpoint import CheckpointError, _DTYPE_NAMES, _entries, _param_names
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a directory without DCP metadata, or an unreadable one
        raise CheckpointError(f"checkpoint: {path} is not a readable torch.distributed.checkpoint directory "
                              f"({type(e).__name__}: {e})") from None
    stored = metadata.state_dict_metadata
    tensor_keys = [k for k, m in stored.items() if hasattr(m, "size")]
    entries = _entries(model)
    names = [name for name, _, _, kind in entries if kind in ("param", "buffer")]
    params = [name for name, _, _, kind in entries if kind == "param"]
    # (An optimizer key ends with its state's name, never with a parameter's: all keys can
    # be searched for the model's entries.)
    model_keys, prefix = _prefix_for(names, tensor_keys)
    missing = [n for n in params if n not in model_keys]
    if missing and strict:
        raise CheckpointError(f"checkpoint: the DCP checkpoint {path} has no entry for {len(missing)} of the model's "
                              f"parameters, e.g. {missing[:4]} (its tensors: {sorted(tensor_keys)[:6]} ...)")
    tensors = {}
    for name, key in model_keys.items():
        m = stored[key]
        tensors[name] = {"shape": list(m.size), "dtype": _DTYPE_NAMES.get(m.properties.dtype, "F32")}
    keys = dict(model_keys)
    index = {"tensors": tensors, "step": None, "extra": {"dcp": str(path), "prefix": prefix}, "world_size": None,
             "plan": None, "optimizer": {"param_groups": []}}
    if optimizer is not None:
        taken = set(model_keys.values())
        order = _order(optimizer, model, entries)
        hyper_prefix = _match_optimizer(params, order, stored, [k for k in tensor_keys if k not in taken], index,
                                        keys, path)
        index["optimizer"]["param_groups"] = _hyper_groups(path, metadata, stored, _param_names(optimizer, entries),
                                                           hyper_prefix, order or [])
    return index, _DcpReader(path, metadata, keys)


_STATE_SEGMENT = re.compile(r"(?:^|\.)state\.")


def _order(optimizer, model, entries):
    """What an integer-keyed optimizer state counts: the saving optimizer's parameters in its
    param_groups' order, taken to be this optimizer's (built over the same model by the same
    code). Only a rank that holds a part of every parameter has them all: a pipeline stage
    does not (None there)."""
    from .checkpoint import _param_names
    if getattr(model, "pp", 1) > 1:
        return None
    return [n for group in _param_names(optimizer, entries) for n in group]


def _match_optimizer(params, order, stored, tensor_keys, index, keys, path):
    """Adds the optimizer state of ``params`` to ``index`` and ``keys``; returns the prefix
    the state was found under. Keys: ``<prefix>state.<param name>.<key>`` (FQN-keyed,
    get_state_dict's form) or ``<prefix>state.<i>.<key>`` with i the parameter's position in
    ``order`` (optimizer.state_dict()'s form)."""
    from .checkpoint import CheckpointError, _DTYPE_NAMES
    position = {name: i for i, name in enumerate(order or [])}
    state_keys = {}
    for k in tensor_keys:
        nk = _normal(k)
        hits = list(_STATE_SEGMENT.finditer(nk))
        if not hits:
            continue
        at = hits[-1]  # the last "state." segment: prefixes may hold "state" too
        state_keys[nk[at.end():]] = (k, nk[:at.end() - len("state.")])
    found = {}
    hyper_prefix = None
    positional = any(rest.split(".")[0].isdigit() for rest in state_keys) and \
        not any(rest.startswith(n + ".") for rest in state_keys for n in params)
    if positional and order is None:
        raise CheckpointError(f"checkpoint: the DCP checkpoint {path} keys its optimizer state by position "
                              "(optimizer.state_dict()), which a pipeline stage cannot map to parameter names; "
                              "save it by name (torch.distributed.checkpoint.state_dict.get_optimizer_state_dict) "
                              "or load it into a layout without pp and save that")
    for name in params:
        key_name = str(position[name]) if positional else name
        hits = {rest[len(key_name) + 1:]: (k, pre) for rest, (k, pre) in state_keys.items()
                if rest.startswith(key_name + ".") and "." not in rest[len(key_name) + 1:]}
        if hits:
            found[name] = hits
            hyper_prefix = next(iter(hits.values()))[1]
    if not found:
        raise CheckpointError(f"checkpoint: the DCP checkpoint {path} holds no optimizer state this model's "
                              "parameters can be matched to (load with optimizer=None for the weights only)")
    for name, hits in found.items():
        for key, (dcp_key, _) in hits.items():
            m = stored[dcp_key]
            ours = f"optimizer.{name}.{key}"
            index["tensors"][ours] = {"shape": list(m.size), "dtype": _DTYPE_NAMES.get(m.properties.dtype, "F32"),
                                      "like_param": len(m.size) > 0}
            keys[ours] = dcp_key
    return hyper_prefix


def _hyper_groups(path, metadata, stored, names_per_group, prefix, order):
    """The saved param_groups' hyper-parameters (lr, betas, weight_decay, ...) in checkpoint.py's
    form ([{"params": [names], "lr": ...}]), from ``<prefix>param_groups.<i>.<hyper>`` entries
    with the group's parameter names in ``.params`` (get_optimizer_state_dict's form) or
    ``<prefix>param_groups.<param name>.<hyper>`` ones; none: our groups keep theirs."""
    if prefix is None:
        return []
    head = prefix + "param_groups."
    object_keys = [k for k, m in stored.items() if not hasattr(m, "size") and _normal(k).startswith(head)]
    if not object_keys:
        return []
    values = _read_objects(path, metadata, object_keys)
    by_index, per_param = {}, {}
    for k, v in values.items():
        rest = _normal(k)[len(head):]
        first, _, hyper = rest.partition(".")
        if first.isdigit() and hyper and "." not in hyper:
            by_index.setdefault(int(first), {})[hyper] = v
        else:
            param, _, hyper = rest.rpartition(".")
            per_param.setdefault(param, {})[hyper] = v
    groups = []
    for i in sorted(by_index):
        group = dict(by_index[i])
        listed = group.get("params")
        if isinstance(listed, (list, tuple)) and all(isinstance(n, str) for n in listed):
            group["params"] = [_normal(n) for n in listed]
            groups.append(group)
        elif isinstance(listed, (list, tuple)) and all(isinstance(n, int) and 0 <= n < len(order) for n in listed):
            group["params"] = [order[n] for n in listed]  # optimizer.state_dict()'s positions
            groups.append(group)
    # Positions are only names if the saving optimizer's groups were ours: the same sizes.
    from .checkpoint import CheckpointError
    saved_sizes = [len(by_index[i].get("params") or []) for i in sorted(by_index)
                   if all(isinstance(n, int) for n in (by_index[i].get("params") or []))]
    if saved_sizes and saved_sizes != [len(names) for names in names_per_group]:
        raise CheckpointError(f"checkpoint: the DCP checkpoint {path} keys its optimizer state by position, in "
                              f"param groups of {saved_sizes} parameters; this optimizer's groups hold "
                              f"{[len(n) for n in names_per_group]}: build it as the saving run did (or save the "
                              "state by name, get_optimizer_state_dict)")
    for names in names_per_group:
        hypers = [per_param.get(n) for n in names]
        if hypers and all(h is not None for h in hypers):
            group = {k: v for k, v in hypers[0].items() if k != "params"}
            group["params"] = list(names)
            groups.append(group)
    return groups
