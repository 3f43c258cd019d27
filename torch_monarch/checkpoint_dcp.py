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

    def __init__(self, path, metadata, keys):
        self.directory = str(path)
        self.metadata = metadata
        self.keys = keys

    def full(self, name):
        from .checkpoint import CheckpointError
        key = self.keys.get(name)
        meta = self.metadata.state_dict_metadata.get(key) if key is not None else None
        if meta is None or not hasattr(meta, "size"):
            raise CheckpointError(f"checkpoint: the DCP checkpoint {self.directory} has no tensor for '{name}'")
        buffer = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}
        _load_alone(buffer, self.directory)
        return buffer[key]

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
        pass


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
    model_keys, prefix = _prefix_for(names, [k for k in tensor_keys if ".state." not in _normal(k)
                                             and not _normal(k).startswith("state.")])
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
        _match_optimizer(optimizer, entries, stored, tensor_keys, index, keys, path)
        index["optimizer"]["param_groups"] = _hyper_groups(path, metadata, stored, _param_names(optimizer, entries),
                                                           index.pop("_hyper_prefix", None))
    return index, _DcpReader(path, metadata, keys)


def _match_optimizer(optimizer, entries, stored, tensor_keys, index, keys, path):
    """Optimizer state keys: ``<prefix>state.<param name>.<key>`` (FQN-keyed, get_state_dict's
    form) or ``<prefix>state.<i>.<key>`` with i the parameter's position in
    model.named_parameters() (optimizer.state_dict()'s form)."""
    from .checkpoint import CheckpointError, _DTYPE_NAMES
    params = [name for name, _, _, kind in entries if kind == "param"]
    state_keys = {}
    for k in tensor_keys:
        nk = _normal(k)
        at = nk.find("state.")
        if at < 0 or (at > 0 and nk[at - 1] != "."):
            continue
        state_keys[nk[at + len("state."):]] = (k, nk[:at])
    found = {}
    hyper_prefix = None
    for i, name in enumerate(params):
        for key_name in (name, str(i)):
            hits = {rest[len(key_name) + 1:]: (k, pre) for rest, (k, pre) in state_keys.items()
                    if rest.startswith(key_name + ".") and "." not in rest[len(key_name) + 1:]}
            if hits:
                found[name] = hits
                hyper_prefix = next(iter(hits.values()))[1]
                break
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
    index["_hyper_prefix"] = hyper_prefix


def _hyper_groups(path, metadata, stored, names_per_group, prefix):
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
        if isinstance(group.get("params"), (list, tuple)) and all(isinstance(n, str) for n in group["params"]):
            group["params"] = [_normal(n) for n in group["params"]]
            groups.append(group)
    for names in names_per_group:
        hypers = [per_param.get(n) for n in names]
        if hypers and all(h is not None for h in hypers):
            group = {k: v for k, v in hypers[0].items() if k != "params"}
            group["params"] = list(names)
            groups.append(group)
    return groups
