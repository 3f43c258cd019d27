"""Distributed checkpoints that load into any layout (docs/checkpoints.md).

    torch_monarch.checkpoint.save(model, optimizer, "ckpt/step_100", step=100)
    info = torch_monarch.checkpoint.load(model, optimizer, "ckpt/step_100")   # any layout

A checkpoint is a directory: one file per writing rank in the safetensors layout (8-byte
little-endian header length, a JSON header, raw little-endian tensor bytes: no pickle, so
loading an untrusted checkpoint runs no code) and ``index.json``: every tensor's global name,
shape and dtype, which file holds which slice (offsets and lengths per dimension) with a
CRC-32C per slice, the plan, the step and the RNG states. Optimizer state is saved under the
parameters' names (``optimizer.<param>.<key>``).

Save: every rank writes only the slices it holds (its pipeline stages, its tp shard, its ep
rank's experts, its ZeRO rows), each slice once over all replicas (the lowest rank holding it
writes it), with no gather to one rank. Files go to ``<path>.partial`` and the directory is renamed into
place after every rank finished and the index is complete: a crash at any moment leaves
the previous checkpoint at ``path`` loadable (between the two renames of a replacement it
is at ``<path>.old``, which ``load`` falls back to).

Load: every rank reads, memory-mapped, only the stored slices that overlap its own, checks
their CRC, and fills its parameters and optimizer state, whatever layout and world size
saved them. Nothing is overwritten unless every rank read everything it needs; otherwise
every rank raises the same CheckpointError naming the file and tensor.

``save_async`` stages this rank's slices in host memory and writes the files in a
background thread while training goes on; ``wait()`` on what it returns finishes the save.

Both are collective in a parallel job: every rank calls them.
"""

import functools
import itertools
import json
import mmap
import os
import shutil
import struct
import sys
import warnings
import zlib

import numpy as np
import torch

from . import _runtime
from . import log as _log

FORMAT = "monarch-checkpoint"
VERSION = 2
# Version 1 stored zlib's CRC-32 per slice ("crc32"); version 2 stores CRC-32C ("crc32c",
# computed in C++ with the SSE4.2 instruction). Both are read.
_READABLE_VERSIONS = (1, 2)
INDEX = "index.json"

_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}
# numpy views of the raw bytes (bf16 has no numpy type: read as int16, viewed as bf16).
_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.int16, "F64": np.float64, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read, with the file and tensor named."""


# -- where each local tensor sits in its global tensor ----------------------------------------

class Placement:
    """A local tensor's place in the global one: per dimension, segments (local start, global
    start, length). A tp shard of a fused weight (q, k, v) has one segment per fused part;
    ZeRO keeps rows [a, b) of the tp-local tensor."""

    def __init__(self, global_shape, segments, empty=False):
        self.global_shape = tuple(int(s) for s in global_shape)
        self.segments = segments
        self.empty = empty  # holds nothing of it (a ZeRO rank past a scalar's one row)

    @staticmethod
    def whole(shape):
        return Placement(shape, [[(0, 0, int(s))] for s in shape])

    def boxes(self):
        """(local offsets, global offsets, lengths) of every box, empty ones left out."""
        if self.empty:
            return []
        out = []
        for combo in itertools.product(*self.segments):
            lengths = tuple(seg[2] for seg in combo)
            if all(n > 0 for n in lengths):
                out.append((tuple(seg[0] for seg in combo), tuple(seg[1] for seg in combo), lengths))
        return out


def _with_progress(what):
    """Progress lines (torch_monarch.log) around a save or load of the checkpoint at `path`."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(model, optimizer, path, **kwargs):
            with _log.progress("checkpoint", f"{what} {os.fspath(path)}"):
                return fn(model, optimizer, path, **kwargs)
        return run
    return wrap


def _tp_segments(global_size, fused_parts, tp, rank):
    part = global_size // fused_parts
    piece = part // tp
    return [(j * piece, j * part + rank * piece, piece) for j in range(fused_parts)]


def _take_rows(segments, start, count):
    """Segments of the local rows [start, start + count) of a dimension cut into `segments`,
    renumbered from 0."""
    out = []
    for local, glob, length in segments:
        a, b = max(local, start), min(local + length, start + count)
        if a < b:
            out.append((a - start, glob + a - local, b - a))
    return out


def _placement(local_full_shape, tp_spec, tp_rank, tp_size, zero=None, experts=None, name=None):
    """Placement of a tensor whose tp-local full shape is `local_full_shape`, cut by tp as
    `tp_spec` (dim, fused parts) says, of which this rank holds `zero` = (row start, rows)
    when ZeRO shards it. `experts` = (first expert, experts in all): expert parallelism's
    rows of dim 0 (the local tensor holds experts [first, first + rows)); ZeRO's rows are then
    rows of that local tensor."""
    shape = list(local_full_shape)
    segments = [[(0, 0, s)] for s in shape]
    global_shape = list(shape)
    if experts is not None:
        first, total = experts
        global_shape[0] = int(total)
        segments[0] = [(0, int(first), shape[0])]
    if tp_spec is not None and tp_size > 1:
        dim, fused = tp_spec
        dim = dim % len(shape)
        if experts is not None and dim == 0:
            raise CheckpointError(f"checkpoint: '{name}' is split along dim 0 by both expert and tensor parallelism")
        global_shape[dim] = shape[dim] * tp_size
        segments[dim] = _tp_segments(global_shape[dim], fused, tp_size, tp_rank)
    if zero is not None:
        start, rows = zero
        segments[0] = _take_rows(segments[0], start, rows)
    return Placement(global_shape, segments)


def _entries(model):
    """(global name, local tensor, Placement, kind) for every parameter and buffer this rank
    holds, parameters as its optimizer sees them."""
    from .data_parallel import DataParallel
    from .hybrid import ParallelModel
    from .sharded import FullyShardedModule
    if isinstance(model, FullyShardedModule):
        raise CheckpointError("checkpoint: a module wrapped by fully_shard() alone is not supported; lay the model "
                              "out with parallelize(..., zero_stage=N), whose result saves and loads in any layout")
    if not isinstance(model, ParallelModel):
        # One process, or DataParallel replicas (every rank holds the whole model: the lowest
        # rank writes it), with embedding tables sharded over the ranks and experts split over
        # ep (each ep rank's rows of the whole tensors; replicas over edp written once).
        module = model.module if isinstance(model, DataParallel) else model
        experts = _expert_rows(module)
        seen, out = set(), []
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                placement = (_placement(p.shape, None, 0, 1, experts=experts[name], name=name) if name in experts
                             else Placement.whole(p.shape))
                out.append((name, p, placement, "param"))
        for name, b in _persistent_buffers(module):
            out.append((name, b, Placement.whole(b.shape), "buffer"))
        out += _embedding_entries(module)
        return out
    mesh = model.mesh
    tp_rank, tp_size = mesh.coordinate("tp"), mesh.axis_size("tp")
    # ZeRO shards over the group its engines run on: the other parameters' replicas (dp, or
    # dp x cp), the experts' (the mesh's edp group, dp x cp / ep ranks).
    replicas = mesh.group("dp_cp") if mesh.size > 1 else None
    expert_replicas = mesh.group("edp") if mesh.size > 1 and mesh.axis_size("ep") > 1 else None
    out, seen = [], set()
    for s in model._local:
        wrapped, plain = model._wrapped[s], model._plain[s]
        sharded = isinstance(wrapped, FullyShardedModule)
        ignored = {id(p) for p in getattr(wrapped, "ignored_parameters", ())}
        named = list(wrapped.named_parameters()) if sharded else []
        experts = _expert_rows(plain)
        for name, shard in named:
            full = wrapped._shapes[name]
            if not full:  # a scalar parameter: ZeRO keeps it as one row, on the first rank
                out.append((model._canonical.get(name, name), shard, Placement((), [], empty=shard.numel() == 0),
                            "param"))
                seen.add(id(shard))
                continue
            group = expert_replicas if name in experts else replicas
            zero_rank, zero_size = (group.rank, group.size) if group is not None else (0, 1)
            chunk = -(-full[0] // zero_size) if full else 0
            start = zero_rank * chunk
            rows = max(0, min(full[0] - start, chunk)) if full else 0
            out.append((model._canonical.get(name, name), shard,
                        _placement(full, model._tp_specs.get(name), tp_rank, tp_size, (start, rows),
                                   experts=experts.get(name), name=name), "param"))
            seen.add(id(shard))
        for name, p in plain.named_parameters():
            if id(p) in seen or (sharded and id(p) not in ignored):
                continue
            seen.add(id(p))
            out.append((model._canonical.get(name, name), p,
                        _placement(p.shape, model._tp_specs.get(name), tp_rank, tp_size, experts=experts.get(name),
                                   name=name), "param"))
        for name, b in _persistent_buffers(plain):
            if id(b) not in seen:
                seen.add(id(b))
                out.append((name, b, _placement(b.shape, model._tp_specs.get(name), tp_rank, tp_size), "buffer"))
    return out


def _expert_rows(module):
    """{parameter name in `module`: (first expert, experts in all)} for the experts that
    expert_parallel split (torch_monarch.experts): this ep rank holds rows [first, first +
    local_experts) of dim 0 of the whole [experts, ...] tensors, under the same names."""
    from .experts import ExpertParallelExperts
    out = {}
    for mname, m in module.named_modules():
        if isinstance(m, ExpertParallelExperts):
            for pname, p in m._parameters.items():
                if p is not None:
                    out[f"{mname}.{pname}" if mname else pname] = (m.first_expert, m.num_experts)
    return out


def _embedding_entries(module):
    """Sharded embedding tables (torch_monarch.embeddings): each shard of a table as a box of
    the whole table under the unsharded collection's name (``<prefix>.tables.<t>.weight``),
    and the fused optimizer's state under ``optimizer.<that name>.<key>``: row-wise Adagrad's
    accumulator ``sum`` [rows], Adam's ``exp_avg`` / ``exp_avg_sq`` [rows, dim] and its step
    count ``optimizer.<prefix>.tables.step``. The engine's own tensors: loading writes into
    the tables (what cannot be, _restore_embedding_state copies after the load)."""
    from .embeddings import ShardedEmbeddingCollection
    out = []
    for prefix, sec in module.named_modules():
        if not isinstance(sec, ShardedEmbeddingCollection):
            continue
        base = f"{prefix}.tables" if prefix else "tables"
        dims = {t.name: (t.rows, t.dim) for t in sec.configs}
        # Column chunks of the same rows on one rank hold equal Adagrad accumulators (each
        # gets the whole row's gradient): one entry, copied into the others after a load.
        sums, aliases = {}, []
        for table, r0, rows, c0, cols, weight, state in sec._engine.shard_views():
            shape = dims[table]
            box = Placement(shape, [[(0, r0, rows)], [(0, c0, cols)]])
            name = f"{base}.{table}.weight"
            out.append((name, weight, box, "param"))
            if state is None:
                continue
            if state.dim() == 1:
                key = (table, r0, rows)
                if key in sums:
                    aliases.append((sums[key], state))
                    continue
                sums[key] = state
                out.append((f"optimizer.{name}.sum", state, Placement((shape[0],), [[(0, r0, rows)]]), "optimizer"))
            else:  # Adam's two moments
                out.append((f"optimizer.{name}.exp_avg", state[0], box, "optimizer"))
                out.append((f"optimizer.{name}.exp_avg_sq", state[1], box, "optimizer"))
        sec._checkpoint_aliases = aliases
        sec._checkpoint_step = None
        if str(sec.plan.optimizer) == "adam":
            # Every rank counts Adam's steps (shards or not) and declares the count, so the
            # count written is every rank's and every rank's is restored.
            step = torch.tensor(sec._engine.adam_step, dtype=torch.int64)
            sec._checkpoint_step = step
            out.append((f"optimizer.{base}.step", step, Placement((), []), "optimizer"))
    return out


def _restore_embedding_state(model):
    """After a load: Adam's step count into the engines, Adagrad accumulators into the column
    chunks that share one entry."""
    from .data_parallel import DataParallel
    from .embeddings import ShardedEmbeddingCollection
    module = model.module if isinstance(model, DataParallel) else model
    for sec in module.modules():
        if not isinstance(sec, ShardedEmbeddingCollection):
            continue
        for primary, alias in getattr(sec, "_checkpoint_aliases", ()):
            alias.copy_(primary)
        step = getattr(sec, "_checkpoint_step", None)
        if step is not None:
            sec._engine.adam_step = int(step)
        sec._checkpoint_aliases, sec._checkpoint_step = (), None


def _distributed_parts(model):
    """Submodules that exist only across ranks (sharded tables, fully_shard units, experts
    split over ep)."""
    from .embeddings import ShardedEmbeddingCollection
    from .experts import ExpertParallelExperts
    from .sharded import FullyShardedModule
    return [n or "the model" for n, m in model.named_modules()
            if isinstance(m, (ShardedEmbeddingCollection, FullyShardedModule, ExpertParallelExperts))]


def _persistent_buffers(module):
    """Buffers that go in a state dict (not those registered persistent=False: caches)."""
    for mname, m in module.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                yield (f"{mname}.{bname}" if mname else bname), b


def _optimizer_entries(optimizer, entries):
    """(global name, tensor, Placement, shaped like its parameter) of the optimizer's state: a
    tensor shaped like its parameter is placed like it, anything else (Adam's step) is one
    value per parameter."""
    if optimizer is None:
        return []
    by_id = {id(t): (name, placement) for name, t, placement, kind in entries if kind == "param"}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise CheckpointError(f"checkpoint: the optimizer steps on a tensor of shape {list(p.shape)} that is "
                                      "not one of the model's parameters (build it over model.parameters())")
            name, placement = by_id[id(p)]
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0:
                    out.append((f"optimizer.{name}.{key}", value, placement, True))
                elif isinstance(value, torch.Tensor) and value.dim() == 0:
                    out.append((f"optimizer.{name}.{key}", value, Placement.whole(()), False))
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    out.append((f"optimizer.{name}.{key}", torch.tensor(value, dtype=torch.float64),
                                Placement.whole(()), False))
                else:
                    raise CheckpointError(f"checkpoint: optimizer state '{key}' of '{name}' is a "
                                          f"{type(value).__name__}; only tensors and numbers are saved")
    return out


def _param_names(optimizer, entries):
    by_id = {id(t): name for name, t, _, kind in entries if kind == "param"}
    return [[by_id[id(p)] for p in g["params"]] for g in optimizer.param_groups]


# -- the job's ranks -----------------------------------------------------------------------

class _Job:
    """This rank and a world-wide group (None on one process)."""

    def __init__(self, model):
        self.group = None
        self.rank, self.size = 0, 1
        # What parallelize returns (ParallelModel) or DataParallel: a model spread over a mesh.
        mesh = getattr(model, "mesh", None)
        if not isinstance(mesh, _runtime.DeviceMesh):
            from . import distributed
            parts = _distributed_parts(model) if isinstance(model, torch.nn.Module) else []
            if parts and distributed._world is not None and distributed._world.size > 1:
                # Every rank holds part of it and calls save: without the job's mesh each rank
                # would take itself for a single process and they would write over each other.
                raise CheckpointError(
                    f"checkpoint: {', '.join(parts[:3])} {'is' if len(parts) == 1 else 'are'} spread over the ranks but "
                    "the model has no mesh: save what parallelize() returned, or DataParallel(model) around the "
                    "whole model")
        if isinstance(mesh, _runtime.DeviceMesh) and mesh.size > 1:
            group = getattr(model, "_monarch_checkpoint_group", None)
            if group is None:
                from .distributed import init
                flat = _runtime.DeviceMesh(init(), pp=1, dp=mesh.size, tp=1)
                group = (flat, flat.group("dp"))
                model._monarch_checkpoint_group = group
            self.group = group[1]
            self.rank, self.size = model.mesh.rank, model.mesh.size

    def all_gather_json(self, value):
        """Every rank's `value` (JSON-serializable), in rank order."""
        if self.group is None:
            return [value]
        data = json.dumps(value).encode()
        lengths = torch.zeros(self.size, dtype=torch.int64)
        lengths[self.rank] = len(data)
        self.group.all_reduce(lengths).wait()
        width = int(lengths.max().item())
        buf = torch.zeros(self.size, max(width, 1), dtype=torch.int32)
        if data:
            buf[self.rank, :len(data)] = torch.tensor(list(data), dtype=torch.int32)
        self.group.all_reduce(buf).wait()
        return [json.loads(bytes(buf[r, :int(lengths[r])].to(torch.uint8).tolist()).decode())
                for r in range(self.size)]

    def barrier(self):
        if self.group is not None:
            self.group.barrier()


# -- safetensors files ---------------------------------------------------------------------

def _raw(t):
    """The tensor's bytes (one contiguous host staging copy at most)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def _write_file(path, tensors, metadata=None):
    """Writes {key: tensor} in the safetensors layout (``metadata``: the header's
    ``__metadata__``, str -> str); returns {key: crc32c}. fsynced."""
    header, offset = ({"__metadata__": dict(metadata)} if metadata else {}), 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    crcs = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for key, t in tensors.items():
            data = _raw(t)
            crcs[key] = _runtime.crc32c(data)
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return crcs


def _slice_checksum(view, entry):
    """The checksum of a stored slice's bytes, of the kind its index entry records."""
    if "crc32c" in entry:
        return _runtime.crc32c(view)
    if "crc32" in entry:
        return zlib.crc32(view)
    raise CheckpointError(f"checkpoint: slice '{entry.get('key')}' records no checksum")


class _File:
    """A memory-mapped safetensors file: header checked against the file's size."""

    def __init__(self, path):
        self.path = path
        try:
            self.f = open(path, "rb")
        except OSError as e:
            raise CheckpointError(f"checkpoint: cannot open {path}: {e.strerror}") from None
        size = os.fstat(self.f.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"checkpoint: {path} is truncated ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", self.f.read(8))
        if n > size - 8:
            raise CheckpointError(f"checkpoint: {path} is truncated (header of {n} bytes, file of {size})")
        try:
            self.header = json.loads(self.f.read(n))
        except ValueError as e:
            raise CheckpointError(f"checkpoint: {path}: the header is not JSON ({e})") from None
        self.start = 8 + n
        end = max((v["data_offsets"][1] for k, v in self.header.items() if k != "__metadata__"), default=0)
        if self.start + end > size:
            raise CheckpointError(f"checkpoint: {path} is truncated: its tensors need {self.start + end} bytes, "
                                  f"the file has {size}")
        self.map = mmap.mmap(self.f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
        self.checked = set()

    def tensor(self, key, checksum=None):
        """The stored tensor `key` (a read-only view of the mapping), its checksum (a slice's
        index entry: "crc32c", or "crc32" in version 1) checked once."""
        if key not in self.header:
            raise CheckpointError(f"checkpoint: {self.path} has no tensor '{key}'")
        h = self.header[key]
        begin, end = h["data_offsets"]
        view = memoryview(self.map)[self.start + begin:self.start + end]
        if checksum is not None and key not in self.checked:
            if _slice_checksum(view, checksum) != checksum.get("crc32c", checksum.get("crc32")):
                raise CheckpointError(f"checkpoint: {self.path}: tensor '{key}' fails its checksum (the file is "
                                      "corrupt)")
            self.checked.add(key)
        array = np.frombuffer(view, dtype=_NUMPY[h["dtype"]])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only: copied out before anything writes
            t = torch.from_numpy(array)
        if h["dtype"] == "BF16":
            t = t.view(torch.bfloat16)
        return t.reshape(h["shape"])

    def release(self, key):
        """Drops the pages of tensor `key` from this process's resident memory (they stay in
        the page cache): a rank reading slices of many tensors holds the pages of one at a
        time, not of every tensor it touched."""
        if self.map is None or key not in self.header or not hasattr(mmap, "MADV_DONTNEED"):
            return
        begin, end = self.header[key]["data_offsets"]
        start = (self.start + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        length = self.start + end - start
        if length > 0:
            self.map.madvise(mmap.MADV_DONTNEED, start, length)

    def close(self):
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:
                pass  # a view of it is still referenced (an error's traceback): freed with it
        self.f.close()


# -- save ------------------------------------------------------------------------------------

def _plan_json(model):
    plan = getattr(model, "plan", None)
    try:
        return json.loads(plan.to_json()) if plan is not None and hasattr(plan, "to_json") else None
    except Exception:  # noqa: BLE001 - an embedding plan or a foreign object: not recorded
        return None


def _describe(e):
    if isinstance(e, OSError):
        where = f" {e.filename}" if e.filename else ""
        return f"{e.strerror or e}{where}"
    return f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)


def _agree(job, what, fn):
    """Runs fn() on every rank; if it failed anywhere, every rank raises one CheckpointError
    naming the ranks (the ranks stay in step: each reaches the same collectives)."""
    value, error = None, ""
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - reported on every rank, below
        error = _describe(e) or type(e).__name__  # never empty: empty means success
    # The same message from several ranks is said once, naming them.
    ranks_by_error = {}
    for rank, e in enumerate(job.all_gather_json(error)):
        if e:
            ranks_by_error.setdefault(e, []).append(rank)
    if ranks_by_error:
        parts = [f"{'rank' if len(r) == 1 else 'ranks'} {', '.join(map(str, r))}: {e}"
                 for e, r in ranks_by_error.items()]
        raise CheckpointError(f"checkpoint: {what}: " + "; ".join(parts))
    return value


class _Save:
    """One save, in the phases both the blocking and the asynchronous save go through."""

    def __init__(self, model, optimizer, path, step, extra):
        self.model, self.optimizer, self.step, self.extra = model, optimizer, step, extra
        self.path = os.fspath(path).rstrip("/")
        self.job = _Job(model)
        self.partial = self.path + ".partial"
        self.failed = "save failed, nothing was replaced"

    def begin(self):
        """Collective: what every rank holds, who writes each slice (the lowest rank holding
        it), and a fresh <path>.partial."""
        model, optimizer, job = self.model, self.optimizer, self.job

        def describe():
            json.dumps(self.extra)  # refused before anything is written
            entries = _entries(model)
            tensors = [(name, t, placement, kind) for name, t, placement, kind in entries]
            state = _optimizer_entries(optimizer, entries)
            like = {name for name, _, _, shaped in state if shaped}
            tensors += [(name, t, placement, "optimizer") for name, t, placement, _ in state]
            unknown = sorted({str(t.dtype) for _, t, _, _ in tensors if t.dtype not in _DTYPE_NAMES})
            if unknown:
                raise CheckpointError(f"cannot store dtype(s) {unknown}")
            declared = [[name, kind, _DTYPE_NAMES[t.dtype], list(p.global_shape), name in like]
                        for name, t, p, kind in tensors]
            boxes = [[name, list(g), list(n)] for name, t, p, kind in tensors for _, g, n in p.boxes()]
            groups = _param_names(optimizer, entries) if optimizer is not None else []
            return tensors, {"declared": declared, "boxes": boxes, "groups": groups}

        self.tensors, mine = _agree(job, self.failed, describe)
        self.everyone = job.all_gather_json(mine)
        self.writer = {}
        for r, info in enumerate(self.everyone):
            for name, offsets, lengths in info["boxes"]:
                self.writer.setdefault((name, tuple(offsets), tuple(lengths)), r)

        def prepare():
            if job.rank == 0:
                shutil.rmtree(self.partial, ignore_errors=True)  # left by a save that crashed
                os.makedirs(self.partial)

        _agree(job, self.failed, prepare)

    def collect(self, copy):
        """This rank's slices ({key: tensor}, their index entries) and its RNG state; with
        `copy`, staged in host memory the training step may not touch."""
        out, slices = {}, []
        for name, t, placement, kind in self.tensors:
            for local, glob, lengths in placement.boxes():
                if self.writer.get((name, glob, lengths)) != self.job.rank:
                    continue
                key = f"{name}@{','.join(map(str, glob))}" if glob else name
                piece = t.detach()[tuple(slice(a, a + n) for a, n in zip(local, lengths))]
                out[key] = piece.to("cpu", copy=True).contiguous() if copy else piece
                slices.append([name, key, list(glob), list(lengths)])
        rng = torch.get_rng_state().tolist() if self.job.size <= 64 else None
        return out, slices, rng

    def write(self, out, slices, rng):
        """Writes this rank's file (no collective: may run in a background thread)."""
        file = f"rank{self.job.rank:05d}.safetensors"
        crcs = _write_file(os.path.join(self.partial, file), out) if out else {}
        return {"file": file if out else None, "slices": slices, "crcs": crcs, "rng": rng}

    def finish(self, produce_report):
        """Collective: every rank's report agreed on, then rank 0 writes the index and renames
        <path>.partial into place. On any failure the partial directory is removed."""
        job = self.job
        try:
            report = _agree(job, self.failed, produce_report)
        except CheckpointError:
            if job.rank == 0:
                shutil.rmtree(self.partial, ignore_errors=True)
            raise
        reports = job.all_gather_json(report)
        everyone, optimizer = self.everyone, self.optimizer

        def index_and_rename():
            if job.rank != 0:
                return
            meta = {}
            for info in everyone:
                for name, kind, dtype, shape, like in info["declared"]:
                    entry = {"kind": kind, "dtype": dtype, "shape": shape, "slices": []}
                    if like:
                        entry["like_param"] = True  # sliced as its parameter is
                    meta.setdefault(name, entry)
            for rep in reports:
                for name, key, offsets, lengths in rep["slices"]:
                    meta[name]["slices"].append({"file": rep["file"], "key": key, "offsets": offsets,
                                                 "lengths": lengths, "crc32c": rep["crcs"][key]})
            groups = None
            if optimizer is not None:
                # Each group's parameters over every rank (a pipeline rank holds only its stages').
                names = [sorted({n for info in everyone for n in info["groups"][g]})
                         for g in range(len(everyone[0]["groups"]))]
                groups = [dict({k: v for k, v in grp.items() if k != "params"
                                and isinstance(v, (int, float, str, bool, list, tuple, type(None)))}, params=n)
                          for grp, n in zip(optimizer.param_groups, names)]
            index = {"format": FORMAT, "version": VERSION, "step": int(self.step), "world_size": job.size,
                     "tensors": meta, "plan": _plan_json(self.model), "extra": self.extra,
                     "optimizer": {"param_groups": groups} if groups is not None else None,
                     "rng": {"cpu": [r["rng"] for r in reports]}}
            with open(os.path.join(self.partial, INDEX), "w") as f:
                json.dump(index, f)
                f.flush()
                os.fsync(f.fileno())
            _put_in_place(self.partial, self.path)

        try:
            _agree(job, self.failed, index_and_rename)
        except CheckpointError:
            if job.rank == 0:
                shutil.rmtree(self.partial, ignore_errors=True)
            raise
        return self.path


# Asynchronous saves not yet finished, oldest first (see save_async).
_pending = []


def _finish_pending():
    """Finishes the pending asynchronous saves before another save or load (collective, as
    every rank has the same pending saves). One that failed is logged on every rank, not
    raised: the caller asked for another operation, which goes ahead; its own ``wait()``
    still raises the failure."""
    while _pending:
        pending = _pending[0]
        try:
            pending.wait()
        except CheckpointError as e:
            _log.get("checkpoint").error("an asynchronous save to %s failed (finished before the next save or "
                                         "load): %s", pending.path, e)


@_with_progress("saving checkpoint")
def save(model, optimizer, path, *, step=0, extra=None):
    """Saves ``model`` (a ParallelModel or any nn.Module) and ``optimizer`` (or None) to the
    directory ``path``, replacing a checkpoint already there only once the new one is
    complete. ``extra``: JSON-serializable values stored in the index (data loader position,
    ...), returned by ``load``. Collective: a failure on any rank raises the same
    CheckpointError on every rank, and nothing is replaced. An asynchronous save still
    pending is finished first."""
    _finish_pending()
    this = _Save(model, optimizer, path, step, extra)
    this.begin()
    return this.finish(lambda: this.write(*this.collect(copy=False)))


class PendingSave:
    """An asynchronous save (``save_async``): its files are being written in the background."""

    def __init__(self, save, thread, result):
        self._save, self._thread, self._result = save, thread, result
        self._error = None  # the CheckpointError wait() raised, raised again by later calls
        self.path = save.path

    def done(self):
        """True when this rank's file is written (``wait`` still has to run). Per rank: do not
        decide whether to call ``wait`` from it, as ranks may differ and ``wait`` is collective."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self):
        """Collective (every rank calls it): waits for every rank's file, writes the index and
        renames the checkpoint into place; the same CheckpointError on every rank if any rank
        failed, and nothing replaced. Returns the path. A later call returns at once, or raises
        the same error again."""
        if self._thread is None:
            if self._error is not None:
                raise self._error
            return self.path
        with _log.progress("checkpoint", f"finishing checkpoint {self.path}"):
            self._thread.join()
            self._thread = None
            if self in _pending:
                _pending.remove(self)

            def report():
                if "error" in self._result:
                    raise self._result["error"]
                return self._result["report"]

            try:
                return self._save.finish(report)
            except CheckpointError as e:
                self._error = e
                raise


def save_async(model, optimizer, path, *, step=0, extra=None):
    """Starts a save like ``save`` and returns as soon as this rank's slices are copied to a
    staging buffer in host memory (as large as what this rank writes); a background thread
    writes the files while training goes on. ``wait()`` on the returned PendingSave
    (collective) finishes it: the index, the rename, the errors of any rank. A later
    ``save``, ``save_async`` or ``load`` finishes a pending save first. Collective."""
    import threading
    _finish_pending()
    this = _Save(model, optimizer, path, step, extra)
    with _log.progress("checkpoint", f"staging checkpoint {this.path}"):
        this.begin()
        try:
            staged = _agree(this.job, this.failed, lambda: this.collect(copy=True))
        except CheckpointError:
            if this.job.rank == 0:
                shutil.rmtree(this.partial, ignore_errors=True)
            raise
    result = {}

    def background():
        try:
            result["report"] = this.write(*staged)
        except Exception as e:  # noqa: BLE001 - raised on every rank by wait()
            result["error"] = e

    thread = threading.Thread(target=background, name=f"monarch-checkpoint-{this.job.rank}", daemon=True)
    thread.start()
    pending = PendingSave(this, thread, result)
    _pending.append(pending)
    return pending


def _put_in_place(partial, path):
    old = path + ".old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(partial, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(d):
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- load ------------------------------------------------------------------------------------

def read_index(path):
    """The index of the checkpoint at ``path`` (falling back to ``path.old`` when a
    replacement was interrupted between its renames). CheckpointError when there is none."""
    path = os.fspath(path).rstrip("/")
    for d in (path, path + ".old"):
        f = os.path.join(d, INDEX)
        if os.path.exists(f):
            try:
                with open(f) as fh:
                    index = json.load(fh)
            except ValueError as e:
                raise CheckpointError(f"checkpoint: {f} is not valid JSON ({e})") from None
            if not isinstance(index, dict) or index.get("format") != FORMAT:
                raise CheckpointError(f"checkpoint: {f} is not a {FORMAT} index")
            if index.get("version") not in _READABLE_VERSIONS:
                raise CheckpointError(f"checkpoint: {f} has version {index.get('version')}; this build reads "
                                      f"versions {', '.join(map(str, _READABLE_VERSIONS))}")
            return d, index
    raise CheckpointError(f"checkpoint: no complete checkpoint at {path} (no {INDEX})")


def _intersect(a_off, a_len, b_off, b_len):
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_len, b_off, b_len)]
    if any(l >= h for l, h in zip(lo, hi)):
        return None
    return lo, [h - l for l, h in zip(lo, hi)]


class _Reader:
    def __init__(self, directory, index):
        self.directory = directory
        self.index = index
        self.files = {}

    def file(self, name):
        if name not in self.files:
            self.files[name] = _File(os.path.join(self.directory, name))
        return self.files[name]

    def fill(self, name, target, placement):
        """A new tensor like `target` holding this rank's part of the global tensor `name`."""
        meta = self.index["tensors"].get(name)
        if meta is None:
            raise CheckpointError(f"checkpoint: {self.directory} has no tensor '{name}' (a checkpoint of another "
                                  "model, or of a model without it)")
        if tuple(meta["shape"]) != placement.global_shape:
            raise CheckpointError(f"checkpoint: tensor '{name}' is {meta['shape']} in {self.directory}, the model "
                                  f"has {list(placement.global_shape)}")
        out = torch.empty_like(target, device="cpu")
        for local, glob, lengths in placement.boxes():
            covered = 0
            for s in meta["slices"]:
                overlap = _intersect(glob, lengths, s["offsets"], s["lengths"])
                if overlap is None:
                    continue
                # (Slices of files written by others, Hugging Face's, carry no checksum.)
                stored = self.file(s["file"]).tensor(s["key"], None if s.get("unchecked") else s)
                lo, n = overlap
                src = stored[tuple(slice(l - o, l - o + k) for l, o, k in zip(lo, s["offsets"], n))]
                dst = out[tuple(slice(a + l - g, a + l - g + k) for a, l, g, k in zip(local, lo, glob, n))]
                dst.copy_(src.reshape(dst.shape))
                del src, stored
                self.file(s["file"]).release(s["key"])
                covered += int(np.prod(n))
                if not glob:
                    break  # a single value: the first copy is it
            want = int(np.prod(lengths))
            if covered != want:
                raise CheckpointError(f"checkpoint: tensor '{name}' in {self.directory}: the stored slices cover "
                                      f"{covered} of the {want} elements at {list(glob)}+{list(lengths)} this rank "
                                      "needs")
        return out

    def close(self):
        for f in self.files.values():
            f.close()


@_with_progress("loading checkpoint")
def load(model, optimizer, path, *, strict=True, restore_rng=True):
    """Loads the checkpoint at ``path`` into ``model`` and ``optimizer`` (or None), whatever
    layout and world size saved it. Returns {"step", "extra", "world_size", "plan"}.
    ``strict``: every parameter and buffer of the model must be in the checkpoint. Raises
    CheckpointError on every rank, before changing anything, when any rank cannot read
    what it needs. A pending asynchronous save is finished first. Collective."""
    _finish_pending()
    job = _Job(model)

    def open_checkpoint():
        directory, index = read_index(path)
        return directory, index, _Reader(directory, index)

    return _load_from(job, model, optimizer, open_checkpoint, strict=strict, restore_rng=restore_rng)


@_with_progress("loading DCP checkpoint")
def load_dcp(model, optimizer, path, *, strict=True):
    """Loads a ``torch.distributed.checkpoint`` (DCP) directory written by PyTorch's own stack
    (FSDP2, DTensor, DDP, one process) into ``model`` (any layout) and ``optimizer`` (or None):
    the way users move a run from FSDP2 to torch_monarch (checkpoint_dcp.py: names, prefixes,
    optimizer state forms). Read through torch's DCP reader; errors as ``load``'s. Collective."""
    from .checkpoint_dcp import dcp_index
    _finish_pending()
    job = _Job(model)

    def open_checkpoint():
        index, reader = dcp_index(model, optimizer, path, strict=strict)
        return str(path), index, reader

    return _load_from(job, model, optimizer, open_checkpoint, strict=strict, restore_rng=False)


def _load_from(job, model, optimizer, open_checkpoint, *, strict, restore_rng):
    def read():
        directory, index, reader = open_checkpoint()
        staged = []
        try:
            entries = _entries(model)
            for name, t, placement, kind in entries:
                # The tables' fused optimizer state is optional (a weights-only checkpoint, from
                # monarch-ckpt import, has none): absent, it keeps its current value.
                if name not in index["tensors"] and (not strict or kind == "optimizer"):
                    continue
                staged.append((t, reader.fill(name, t, placement)))
            if optimizer is not None:
                staged += _stage_optimizer(reader, optimizer, entries, index)
        finally:
            reader.close()
        return directory, index, staged

    directory, index, staged = _agree(job, "load failed, nothing was changed", read)
    with torch.no_grad():
        for target, value in staged:
            if callable(target):
                target(value)
            else:
                target.copy_(value)
    with torch.no_grad():
        _restore_embedding_state(model)
    rng = (index.get("rng") or {}).get("cpu")
    if restore_rng and rng and index.get("world_size") == job.size and rng[job.rank] is not None:
        torch.set_rng_state(torch.tensor(rng[job.rank], dtype=torch.uint8))
    return {"step": index.get("step"), "extra": index.get("extra"), "world_size": index.get("world_size"),
            "plan": index.get("plan"), "path": directory}


def _stage_optimizer(reader, optimizer, entries, index):
    by_id = {id(t): (name, placement) for name, t, placement, kind in entries if kind == "param"}
    saved_groups = ((index.get("optimizer") or {}).get("param_groups")) or []
    staged = []
    for group in optimizer.param_groups:
        names = [by_id[id(p)][0] for p in group["params"] if id(p) in by_id]
        match = next((g for g in saved_groups if set(g.get("params", [])) >= set(names)), None)
        if match is not None:
            hyper = {k: (tuple(v) if isinstance(group[k], tuple) else v) for k, v in match.items()
                     if k != "params" and k in group}
            staged.append((lambda v, g=group: g.update(v), hyper))
        for p in group["params"]:
            if id(p) not in by_id:
                raise CheckpointError("checkpoint: the optimizer steps on a tensor that is not one of the model's "
                                      "parameters")
            name, placement = by_id[id(p)]
            prefix = f"optimizer.{name}."
            keys = [k[len(prefix):] for k in index["tensors"] if k.startswith(prefix)]
            if not keys:
                if not index.get("optimizer"):
                    raise CheckpointError(f"checkpoint: {reader.directory} has no optimizer state for '{name}' (saved "
                                          "without an optimizer)")
                # Saved with an optimizer that kept no state for it (SGD without momentum, a
                # parameter that never had a gradient): none after the load either.
                staged.append((lambda v, p=p: optimizer.state.pop(p, None), None))
                continue
            state = {}
            for key in keys:
                meta = index["tensors"][prefix + key]
                if meta.get("like_param"):
                    value = reader.fill(prefix + key, torch.empty(p.shape, dtype=_DTYPES[meta["dtype"]]), placement)
                else:
                    value = reader.fill(prefix + key, torch.empty((), dtype=_DTYPES[meta["dtype"]]),
                                        Placement.whole(()))
                state[key] = value
            staged.append((lambda v, p=p, g=group: optimizer.state.__setitem__(p, _typed_state(optimizer, g, p, v)),
                           state))
    return staged


def _typed_state(optimizer, group, p, values):
    """The loaded state in the types the optimizer keeps now (a number stays a number; state
    it has not created yet comes as tensors, as torch >= 1.12's Adam keeps its step, on the
    CPU unless the optimizer is capturable or fused)."""
    current = optimizer.state.get(p, {})
    on_device = bool(group.get("capturable") or group.get("fused"))
    out = {}
    for key, value in values.items():
        now = current.get(key)
        if isinstance(now, (int, float)) and not isinstance(now, bool):
            out[key] = type(now)(value.item())
        elif value.dim() == 0 and not on_device:
            out[key] = value
        elif value.dim() == 0:
            out[key] = value.to(p.device)
        else:  # moments in the parameter's dtype, as torch.optim's load_state_dict casts them
            out[key] = value.to(p.device, p.dtype)
    return out


def latest(root):
    """The newest complete checkpoint directory under ``root`` (the one whose index has the
    highest step), or None."""
    best = None
    if not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        if name.endswith((".partial", ".old")) or not os.path.exists(os.path.join(d, INDEX)):
            continue
        try:
            _, index = read_index(d)
        except CheckpointError:
            continue
        if best is None or index["step"] > best[0]:
            best = (index["step"], d)
    return best[1] if best else None


# -- tools -----------------------------------------------------------------------------------

def inspect(path):
    """Text: every tensor with its shape, dtype and slices; the files and their sizes."""
    directory, index = read_index(path)
    lines = [f"{directory}: step {index['step']}, saved by {index['world_size']} rank(s)"]
    files = sorted({s["file"] for m in index["tensors"].values() for s in m["slices"]})
    total = 0
    for f in files:
        size = os.path.getsize(os.path.join(directory, f)) if os.path.exists(os.path.join(directory, f)) else -1
        total += max(size, 0)
        lines.append(f"  {f}: {size} bytes" if size >= 0 else f"  {f}: MISSING")
    for name, m in index["tensors"].items():
        lines.append(f"  {name} [{m['kind']}] {m['dtype']} {m['shape']}: {len(m['slices'])} slice(s)")
        for s in m["slices"]:
            kind = "crc32c" if "crc32c" in s else "crc32"
            lines.append(f"      {s['file']} {s['key']} at {s['offsets']}+{s['lengths']} {kind} {s[kind]:08x}")
    lines.append(f"{len(index['tensors'])} tensors, {len(files)} files, {total} bytes")
    return "\n".join(lines)


def consolidate(path, output):
    """Writes the model's weights (parameters and buffers, whole, under their names) to one
    safetensors file ``output``, readable by anything that reads safetensors."""
    directory, index = read_index(path)
    reader = _Reader(directory, index)
    try:
        tensors = {}
        for name, m in index["tensors"].items():
            if m["kind"] == "optimizer":
                continue
            shape = tuple(m["shape"])
            tensors[name] = reader.fill(name, torch.empty(shape, dtype=_DTYPES[m["dtype"]]), Placement.whole(shape))
    finally:
        reader.close()
    _write_file(output, tensors)
    return output


def import_safetensors(file, path, *, step=0):
    """The reverse of consolidate: a one-writer checkpoint at ``path`` from a safetensors
    file of weights (no optimizer state), loadable into any layout."""
    f = _File(os.fspath(file))
    try:
        tensors = {k: f.tensor(k).clone() for k in f.header if k != "__metadata__"}
    finally:
        f.close()
    partial = os.fspath(path).rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    crcs = _write_file(os.path.join(partial, "rank00000.safetensors"), tensors)
    index = {"format": FORMAT, "version": VERSION, "step": step, "world_size": 1, "plan": None, "extra": None,
             "optimizer": None, "rng": None,
             "tensors": {k: {"kind": "param" if t.is_floating_point() else "buffer", "dtype": _DTYPE_NAMES[t.dtype],
                             "shape": list(t.shape),
                             "slices": [{"file": "rank00000.safetensors", "key": k, "offsets": [0] * t.dim(),
                                         "lengths": list(t.shape), "crc32c": crcs[k]}]}
                         for k, t in tensors.items()}}
    with open(os.path.join(partial, INDEX), "w") as fh:
        json.dump(index, fh)
    _put_in_place(partial, os.fspath(path).rstrip("/"))
    return path


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="monarch-ckpt", description="Inspect and convert torch_monarch checkpoints.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("inspect", help="tensors, slices, files, checksums").add_argument("dir")
    c = sub.add_parser("consolidate", help="the model's weights as one safetensors file")
    c.add_argument("dir")
    c.add_argument("-o", "--output", required=True)
    i = sub.add_parser("import", help="a checkpoint from a safetensors file of weights")
    i.add_argument("file")
    i.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "inspect":
            print(inspect(args.dir))
        elif args.cmd == "consolidate":
            print(f"wrote {consolidate(args.dir, args.output)}")
        else:
            print(f"wrote {import_safetensors(args.file, args.output)}")
    except (CheckpointError, OSError) as e:
        print(f"monarch-ckpt: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
