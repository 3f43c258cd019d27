"""Hugging Face checkpoints straight in and out of a parallelized model (docs/huggingface.md).

    model = parallelize(meta_model, example_input=batch, global_batch=64, tp=2, pp=2)
    torch_monarch.hf_checkpoint.load_pretrained(model, "llama-dir")   # what save_pretrained wrote
    ...
    torch_monarch.hf_checkpoint.save_pretrained(model, "out-dir")      # from_pretrained reads it

Load: the directory's ``model.safetensors.index.json`` (or its one ``model.safetensors``)
becomes a checkpoint index whose tensors are each one whole slice in its file; the
checkpoint loader (checkpoint.py) then fills every rank's parameters and buffers with the
parts of them it holds (its pipeline stages, its tp shards, its ZeRO rows), reading the
files memory-mapped: a rank touches only the pages of the slices it needs (a shard along
dimension 0 is contiguous; one along dimension 1 touches the tensor's pages, one tensor at a
time). No rank reads the whole model. Failures are collective and name the tensor.

Save: every rank writes its slices (``checkpoint.save``, to ``<path>.monarch-staging``);
then the tensors are dealt out over the ranks by size, and each rank reads back whole only
the tensors dealt to it and writes them to its own ``model-0000k-of-0000n.safetensors``
(safetensors with ``{"format": "pt"}``); rank 0 writes ``model.safetensors.index.json`` and
the model's ``config.json``. A rank holds at most its share of the model at once. Weights
tied to others are saved under their first name (Hugging Face ties them again on load).
Both are collective: every rank calls them.
"""

import json
import os
import shutil

import torch

from . import checkpoint as _ckpt

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def hf_index(path):
    """The checkpoint index (checkpoint.py's form) of the Hugging Face directory ``path``."""
    path = os.fspath(path)
    index_file, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
    if os.path.exists(index_file):
        try:
            with open(index_file) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise _ckpt.CheckpointError(f"hf checkpoint: {index_file} is not a safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
    elif os.path.exists(single):
        weight_map, files = None, [SINGLE]
    else:
        raise _ckpt.CheckpointError(f"hf checkpoint: {path} holds neither {INDEX} nor {SINGLE}")
    tensors = {}
    for name in files:
        f = _ckpt._File(os.path.join(path, name))  # its header (the mapping reads nothing else)
        try:
            header = f.header
        finally:
            f.close()
        for key, h in header.items():
            if key == "__metadata__" or (weight_map is not None and weight_map.get(key) != name):
                continue
            if h.get("dtype") not in _ckpt._DTYPES:
                raise _ckpt.CheckpointError(f"hf checkpoint: {name}: tensor '{key}' is {h.get('dtype')}, which this "
                                            f"loader does not read (it reads {sorted(_ckpt._DTYPES)})")
            shape = list(h["shape"])
            tensors[key] = {"kind": "param", "dtype": h["dtype"], "shape": shape,
                            "slices": [{"file": name, "key": key, "offsets": [0] * len(shape), "lengths": shape,
                                        "unchecked": True}]}
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise _ckpt.CheckpointError(f"hf checkpoint: {INDEX} lists {absent[:5]} but their files do not hold them")
    return {"format": _ckpt.FORMAT, "tensors": tensors, "step": None, "world_size": None, "plan": None,
            "extra": None, "optimizer": None, "rng": None}


def load_pretrained(model, path, *, strict=True):
    """Fills ``model`` (what ``parallelize`` returned, also on meta before: it materialized
    what this rank holds; or a plain model) from the Hugging Face checkpoint directory
    ``path``. ``strict``: every parameter and persistent buffer must be in it. Collective."""
    _ckpt._finish_pending()
    job = _ckpt._Job(model)

    def open_checkpoint():
        index = hf_index(path)
        return os.fspath(path), index, _ckpt._Reader(os.fspath(path), index)

    with _ckpt._log.progress("checkpoint", f"loading Hugging Face checkpoint {os.fspath(path)}"):
        return _ckpt._load_from(job, model, None, open_checkpoint, strict=strict, restore_rng=False)


def _deal(names, sizes, ranks):
    """{name: writing rank}: largest first, each to the rank with the fewest bytes so far."""
    load, owner = [0] * ranks, {}
    for name in sorted(names, key=lambda n: (-sizes[n], n)):
        r = min(range(ranks), key=lambda k: (load[k], k))
        owner[name] = r
        load[r] += sizes[name]
    return owner


def save_pretrained(model, path, *, config=None):
    """Writes ``model`` (any layout; or a plain model) as a Hugging Face checkpoint directory
    at ``path``: safetensors shards, ``model.safetensors.index.json`` and ``config.json``
    (``config``, default the config of the model ``parallelize`` was given, when it had one).
    ``from_pretrained(path)`` loads it. Collective."""
    _ckpt._finish_pending()
    job = _ckpt._Job(model)
    path = os.fspath(path).rstrip("/")
    staging = path + ".monarch-staging"
    _ckpt.save(model, None, staging)
    directory, index = _ckpt.read_index(staging)
    names = [n for n, m in index["tensors"].items() if m["kind"] != "optimizer"]
    sizes = {n: int(torch.Size(index["tensors"][n]["shape"]).numel()) *
             torch.empty((), dtype=_ckpt._DTYPES[index["tensors"][n]["dtype"]]).element_size() for n in names}
    owner = _deal(names, sizes, job.size)
    writers = sorted(set(owner.values()))
    file_of = {r: (SINGLE if len(writers) == 1 else f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors")
               for i, r in enumerate(writers)}
    if config is None:
        config = getattr(model, "hf_config", None) or getattr(model, "config", None)

    def write():
        os.makedirs(path, exist_ok=True)
        mine = [n for n in names if owner[n] == job.rank]
        if not mine:
            return
        reader = _ckpt._Reader(directory, index)
        try:
            tensors = {}
            for n in mine:
                meta = index["tensors"][n]
                shape = tuple(meta["shape"])
                tensors[n] = reader.fill(n, torch.empty(shape, dtype=_ckpt._DTYPES[meta["dtype"]]),
                                         _ckpt.Placement.whole(shape))
        finally:
            reader.close()
        target = os.path.join(path, file_of[job.rank])
        _ckpt._write_file(target + ".partial", tensors, metadata={"format": "pt"})
        os.replace(target + ".partial", target)

    _ckpt._agree(job, "Hugging Face save failed", write)

    def finish():
        if job.rank != 0:
            return
        if len(writers) > 1:
            with open(os.path.join(path, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": sum(sizes.values())},
                           "weight_map": {n: file_of[owner[n]] for n in sorted(names)}}, f, indent=2)
        elif os.path.exists(os.path.join(path, INDEX)):
            os.remove(os.path.join(path, INDEX))  # a stale index of an earlier save
        for name in os.listdir(path):  # files of an earlier save (another file count, or one file)
            stale_shard = name.startswith("model-") and name.endswith(".safetensors")
            if (stale_shard or name == SINGLE) and name not in file_of.values():
                os.remove(os.path.join(path, name))
        if config is not None:
            config.save_pretrained(path)
        shutil.rmtree(staging, ignore_errors=True)

    _ckpt._agree(job, "Hugging Face save failed", finish)
    return path
