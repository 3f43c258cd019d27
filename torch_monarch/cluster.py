"""The machine a job runs on, as the planner's ``Cluster``: read from the launch environment
and the devices (``detect``), and its links timed on the real process groups (``probe``).

    cluster = detect()                 # world, ranks per node, memory, FLOP/s
    cluster = probe(cluster, world)    # + latency and bandwidth per link level, measured

Presets (``torch_monarch.planner.cluster("a100-80gb", 1024)``) remain for offline planning.
Measured values are cached per machine (``~/.cache/torch_monarch``, or
``$MONARCH_CACHE_DIR``) so later jobs on the same machine skip the measurement.
"""

import json
import os
import socket
import time

import torch

from . import planner as _planner
from .log import get as _log

# Known devices by the name CUDA reports, mapped to the planner preset that holds their
# peak FLOP/s (vendor data sheets, dense) and link figures; the first match wins.
_KNOWN_GPUS = (
    ("H200", "h200-141gb"),
    ("H100", "h100-80gb"),
    ("A100-SXM4-80GB", "a100-80gb"),
    ("A100 80GB", "a100-80gb"),
    ("A100", "a100-40gb"),
)


def _cache_dir():
    return os.environ.get("MONARCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_monarch")


def _cache_path(kind, world, local):
    return os.path.join(_cache_dir(), f"{kind}-{socket.gethostname()}-{world}x{local}.json")


def _read_cache(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_cache(path, values):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(values, f, indent=2)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs the next job a measurement


def _env_int(name, default):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"cluster: environment variable {name}={value!r} is not an integer") from None


def _cpu_memory_bytes():
    """This machine's RAM, or the cgroup's limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
            if text.isdigit():
                total = min(total, int(text))
        except OSError:
            pass
    return float(total)


def measure_matmul_flops(size=512, repeats=8, dtype=torch.float32, device="cpu"):
    """FLOP/s of a square matmul on this rank (2 n^3 per product), best of ``repeats``."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size ** 3 / best


def _cores():
    # The cores this job may use (a cpuset or container limit; ranks inherit the launcher's).
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_overlap_contention(ranks_per_node, cores):
    """The cost model's overlap contention for CPU ranks: Gloo copies, sends and sums on the
    cores that compute, so with at least as many busy ranks as cores a collective hides behind
    no computation (each slows the other fully: 1); with idle cores to spare it overlaps
    freely (0)."""
    return 1.0 if ranks_per_node >= cores else 0.0


def zero_overlap_pays_here():
    """The planner's zero_overlap rule (planner::zero_overlap_pays: overlap contention below 1)
    for this machine without measuring anything: GPUs overlap (their presets' contention is
    below 1); CPU ranks only with a core to spare per rank (cpu_overlap_contention)."""
    if torch.cuda.is_available():
        return True
    c = _planner.cluster_preset("cpu", 1)
    c.overlap_contention = cpu_overlap_contention(_env_int("LOCAL_WORLD_SIZE", 1), float(_cores()))
    return _planner.zero_overlap_pays(c)


def detect(world_size=None, ranks_per_node=None, measure=True):
    """The planner's Cluster for this job: world size and ranks per node from torchrun's
    environment (WORLD_SIZE, LOCAL_WORLD_SIZE), device memory (CUDA properties, or on CPU
    this machine's memory shared by its local ranks), peak FLOP/s from the known-device
    table or, for unknown devices and CPUs, a short measured matmul (cached per machine).
    Links start from the matching preset; ``probe`` measures them."""
    world = world_size or _env_int("WORLD_SIZE", 1)
    local = ranks_per_node or _env_int("LOCAL_WORLD_SIZE", world)
    if world % local != 0:
        raise ValueError(f"cluster: WORLD_SIZE={world} is not a whole number of nodes of LOCAL_WORLD_SIZE={local}")
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(_env_int("LOCAL_RANK", 0) % torch.cuda.device_count())
        preset = next((p for key, p in _KNOWN_GPUS if key in name), None)
        c = _planner.cluster_preset(preset or "a100-80gb", local)
        c.name = name
        c.device_memory_bytes = float(torch.cuda.get_device_properties(0).total_memory)
        if preset is None:
            flops = _measured("gpu-flops", world, local, lambda: measure_matmul_flops(
                4096, dtype=torch.bfloat16, device="cuda"), measure)
            c.peak_flops_bf16 = c.peak_flops_tf32 = flops
            c.peak_flops_fp32 = flops / 2
            c.matmul_efficiency = 1.0
    else:
        c = _planner.cluster_preset("cpu", 1)
        c.name = f"cpu ({socket.gethostname()})"
        c.device_memory_bytes = _cpu_memory_bytes() / local
        c.memory_reserved_bytes = min(c.memory_reserved_bytes, 0.25 * c.device_memory_bytes)
        # Cached per thread count: the share below assumes the rate of this many threads.
        flops = _measured(f"cpu-flops-{torch.get_num_threads()}t", world, local, measure_matmul_flops, measure)
        # The node's ranks share its cores: the planner's rates are per rank with all busy
        # (a fair share of a core each when there are more ranks than cores).
        c.cores_per_node = float(_cores())
        c.overlap_contention = cpu_overlap_contention(local, c.cores_per_node)
        # The rate was measured with `threads` threads on an idle machine; with all ranks
        # busy each gets its share of the cores (ranks here run one thread each, as
        # torch_monarch.run sets OMP_NUM_THREADS).
        threads = max(1, torch.get_num_threads())
        share = min(float(threads), c.cores_per_node / local) / threads
        if flops:
            # The measured rate is what a matmul achieves here: it is the peak, at efficiency 1.
            c.peak_flops_fp32 = c.peak_flops_tf32 = c.peak_flops_bf16 = flops * share
            c.matmul_efficiency = 1.0
    c.devices_per_node = local
    c.nodes = world // local
    _planner.validate(c)
    return c


def _measured(kind, world, local, fn, measure):
    path = _cache_path(kind, world, local)
    cached = _read_cache(path)
    if cached and "value" in cached:
        return float(cached["value"])
    if not measure:
        return None
    value = float(fn())
    _write_cache(path, {"value": value, "measured_at": time.time()})
    return value


# -- links ------------------------------------------------------------------------------------

def _time_all_reduces(group, sizes, rounds, device):
    """The median time of one all-reduce at each of ``sizes`` (bytes), on the group's slowest
    member. The sizes are interleaved, one of each per round, so a slow spell of the machine
    (another tenant of a VM, a rank descheduled while its peers wait) lands on all sizes alike
    instead of on whichever size it happened to coincide with: with 4 ranks on 2 vCPUs, a
    best-of-3 per size in turn gave bandwidths from 0.7 to 9.6 GB/s over twelve probes (and
    in one bench run no positive slope at all); interleaved medians gave 1.1-1.6 ms and
    1.2-2.3 GB/s over ten."""
    import statistics
    bufs = [torch.zeros(max(1, s // 4), dtype=torch.float32, device=device) for s in sizes]
    cuda = device != "cpu"
    for b in bufs:  # warm-up: connection set-up, buffers (checked: every member has the same sizes)
        group.all_reduce(b).wait()
    # The link alone: without the agreement check's own exchange before each call (on CPU
    # ranks of one node it costs more than a small all-reduce through shared memory: 0.6 ms
    # against 20 us at tp=2 here), as generate's decode steps run once checked.
    checks = getattr(group, "checks_collectives", None) if getattr(group, "node_local", False) and \
        _runtime_limit() > 0 else None
    if checks is not None:
        group.checks_collectives = False
    per = [[] for _ in sizes]
    try:
        for _ in range(rounds):
            for i, b in enumerate(bufs):
                if cuda:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                group.all_reduce(b).wait()
                if cuda:
                    torch.cuda.synchronize(device)
                per[i].append(time.perf_counter() - t0)
    finally:
        if checks is not None:
            group.checks_collectives = checks
    # Every member takes the slowest member's time: a collective ends when all have it.
    out = torch.tensor([statistics.median(p) for p in per], dtype=torch.float64)
    group.all_reduce_max(out).wait()
    return out.tolist()


def fit_error(sizes, seconds, n, latency, bandwidth):
    """The largest relative gap between measured times and the fitted ring model."""
    steps = 2.0 * (n - 1)
    return max(abs(steps * latency + steps / n * s / bandwidth - t) / t for s, t in zip(sizes, seconds))


# A fit whose worst point is further than this from the line (relative to the point: twice
# the time, or below zero) is measured again with twice the rounds, and kept only if the
# second is within it; otherwise the preset's figures stay.
_FIT_TOLERANCE = 1.0


def measure_link(group, n, sizes, rounds, device):
    """Latency and bandwidth of the link under ``group`` (n members; every member calls it),
    fitted to interleaved medians (_time_all_reduces) and checked: a fit with no positive
    slope, or a point further than _FIT_TOLERANCE from it, is measured again with twice the
    rounds. Returns (latency, bandwidth, times, error); (0, 0, ...) if no measurement fits, and
    the caller keeps the preset's figures (with a warning naming the measured times)."""
    for attempt in range(2):
        times = _time_all_reduces(group, sizes, rounds * (attempt + 1), device)
        latency, bandwidth = fit_alpha_beta(sizes, times, n)
        if 0 < bandwidth < float("inf"):
            error = fit_error(sizes, times, n, latency, bandwidth)
            if error <= _FIT_TOLERANCE:
                return latency, bandwidth, times, error
    return 0.0, 0.0, times, float("inf")


def fit_alpha_beta(sizes, seconds, n):
    """Latency alpha (s per message) and bandwidth (bytes/s) of the ring all-reduce model
    T(S) = 2(n-1) alpha + 2(n-1)/n S / B (Thakur et al. 2005; Patarasuk and Yuan 2009), by
    least squares over measured (size, time) pairs."""
    steps = 2.0 * (n - 1)
    xs = [steps / n * s for s in sizes]
    mean_x = sum(xs) / len(xs)
    mean_y = sum(seconds) / len(seconds)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, seconds)) / var if var > 0 else 0.0
    intercept = mean_y - slope * mean_x
    bandwidth = 1.0 / slope if slope > 0 else float("inf")
    latency = max(intercept / steps, 1e-7)
    return latency, bandwidth


def _slowest_rate(group, work, fn, repeats):
    """work / seconds per call of ``fn`` on the group's slowest member, all members running at
    once (lined up by a collective first)."""
    fn()
    t = torch.zeros(1, dtype=torch.float64)
    group.all_reduce_max(t).wait()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    t[0] = (time.perf_counter() - t0) / repeats
    group.all_reduce_max(t).wait()
    return work / t.item()


def measure_cpu_rates(everyone, local, samples=3, size=512):
    """This node's compute rates as a job's ranks get them (every member of ``everyone`` must
    call it; ranks fill nodes in order, ``local`` per node): the matmul FLOP/s of the slowest
    rank while all compute at once, the mean FLOP/s of a rank computing alone on its node
    (local rank i of every node in turn, the others waiting), and the memory bandwidth per
    rank, all busy (an add into a kept output: 2 reads, 1 write). Medians of ``samples``.

    On a CPU the ranks share the cores and, on a VM, more than the cores: a rank alone may run
    faster than cores / ranks predicts (measured 2.1-2.7x alone here, with 4 ranks on 2
    vCPUs, where the share predicts 2x). The effective cores per node is ranks x busy / alone."""
    import statistics
    g = torch.Generator().manual_seed(0)  # the job's own random stream is left alone
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    x, y, z = torch.randn(4 << 20, generator=g), torch.randn(4 << 20, generator=g), torch.empty(4 << 20)
    work = 2.0 * size ** 3
    me = everyone.rank % local
    busy, alone, hbm = [], [], []
    for _ in range(samples):
        busy.append(_slowest_rate(everyone, work, lambda: a @ b, 4))
        rate = torch.zeros(1, dtype=torch.float64)
        for turn in range(local):
            everyone.all_reduce_max(torch.zeros(1, dtype=torch.float64)).wait()  # the others wait
            if me == turn:
                a @ b
                t0 = time.perf_counter()
                for _ in range(4):
                    a @ b
                rate[0] = work / ((time.perf_counter() - t0) / 4)
            everyone.all_reduce_max(torch.zeros(1, dtype=torch.float64)).wait()
        everyone.all_reduce(rate).wait()
        alone.append(rate.item() / everyone.size)
        hbm.append(_slowest_rate(everyone, 3.0 * x.numel() * 4, lambda: torch.add(x, y, out=z), 4))
    return statistics.median(busy), statistics.median(alone), statistics.median(hbm)


def effective_cores(ranks, busy, alone, detected):
    """The cores a node's ``ranks`` effectively share, from a rank's rate with all busy and
    alone: ranks x busy / alone (at least 1). At 95% of the alone rate or better the ranks do
    not contend: the ``detected`` core count, or one per rank if that is more."""
    if busy < 0.95 * alone:
        return max(1.0, ranks * busy / alone)
    return max(float(detected), float(ranks))


_CPU_KEYS = ("cpu_flops_busy", "cpu_flops_alone", "cpu_hbm_bytes_per_s")


def _cpu_cache_usable(cached):
    """A links cache holds this job's CPU rates: measured on CPU ranks with this thread count
    (the rates, and so the effective cores, depend on it)."""
    return all(k in cached for k in _CPU_KEYS) and cached[_CPU_KEYS[0]] > 0 and \
        cached.get("cpu_threads") == torch.get_num_threads()


# All-reduce sizes the probe times (bytes): latency-bound to bandwidth-bound on each kind of
# link (on GPUs NVLink reaches its bandwidth only at tens of MiB).
_PROBE_SIZES_CPU = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 23)
_PROBE_SIZES_CUDA = (1 << 16, 1 << 20, 1 << 24, 1 << 26, 1 << 28)
# Cached links are reused only if timed this way (2: interleaved medians, fit checked; 3: on
# CPU ranks of one node, latency from the messages the shared-memory path takes).
_LINKS_METHOD = 3


def _split_at_node_limit(group, sizes, device):
    """For a node's group on CPU ranks: (small, large) probe sizes on either side of the
    shared-memory all-reduce's limit (small messages run there, in the caller's thread, large
    ones over Gloo: communicator.h, set_node_local), when each side has two sizes to fit;
    else None (one path serves every size)."""
    limit = _runtime_limit()
    if device != "cpu" or not getattr(group, "node_local", False) or limit <= 0:
        return None
    small = tuple(s for s in sizes if s <= limit)
    large = tuple(s for s in sizes if s > limit)
    return (small, large) if len(small) >= 2 and len(large) >= 2 else None


def _runtime_limit():
    from . import _runtime
    return _runtime.node_all_reduce_bytes()


def probe(cluster, world, sizes=None, rounds=12, use_cache=True):
    """Times all-reduces at a few sizes on the real process groups (all ranks of a node;
    one rank per node between nodes) and fits latency and bandwidth per link level into a
    copy of ``cluster``. On CPU ranks it also measures the compute rates the ranks get
    (measure_cpu_rates): the peak FLOP/s and memory bandwidth per rank all busy, and the
    effective cores per node, in place of detect()'s cores / ranks share. Every rank must
    call it. Cached per machine and world shape, unless a link's times fit no line (then that
    link keeps the preset's figures, with a warning, and the next job measures again)."""
    local = cluster.devices_per_node
    on_cpu = not torch.cuda.is_available()
    path = _cache_path("links", world.size, local)
    cached = _read_cache(path) if use_cache else None
    if cached and on_cpu and not _cpu_cache_usable(cached):
        cached = None  # measured before the CPU rates were part of the probe, on GPUs, or at other threads
    from . import _runtime
    # The collectives a job runs: CUDA tensors go over NCCL, CPU tensors over Gloo.
    device = "cpu"
    if not on_cpu and _runtime.built_with_nccl:
        device = f"cuda:{_env_int('LOCAL_RANK', 0) % torch.cuda.device_count()}"
    backend = "gloo" if device == "cpu" else "nccl"
    # Whether small CPU all-reduces inside a node take the shared-memory path (the default): the
    # latency a job sees differs by 10-50x, so a cache timed the other way is not reused.
    shared = device == "cpu" and _runtime_limit() > 0
    if cached and cached.get("links_shared", False) != shared:
        cached = None
    if cached and (cached.get("links_method") != _LINKS_METHOD or cached.get("links_backend") != backend):
        # Links timed the earlier way (best of 3 per size in turn: too noisy to keep), or over
        # the other backend (a build with or without NCCL).
        cached = None
    values = torch.zeros(7, dtype=torch.float64)
    have = torch.tensor([1.0 if cached else 0.0], dtype=torch.float64)
    everyone = _runtime.DeviceMesh(world, pp=1, dp=world.size, tp=1).group("dp")
    everyone.all_reduce(have).wait()
    if have.item() == world.size:  # every rank has the same machine's measurement
        values = torch.tensor([cached["intra_latency_s"], cached["intra_bytes_per_s"], cached["inter_latency_s"],
                               cached["inter_bytes_per_s"]] + [cached.get(k, 0.0) for k in _CPU_KEYS],
                              dtype=torch.float64)
    else:
        # With the shared-memory all-reduce on (MONARCH_NODE_ALL_REDUCE_BYTES), tp groups of one
        # node each: the path tensor parallelism's all-reduces take (docs/communication.md).
        intra = _runtime.DeviceMesh(world, pp=cluster.nodes, dp=1 if shared else local, tp=local if shared else 1)
        intra_axis = "tp" if shared else "dp"
        inter = _runtime.DeviceMesh(world, pp=1, dp=cluster.nodes, tp=local) if cluster.nodes > 1 else None
        if device == "cpu" and not on_cpu and world.rank == 0:
            _log("cluster").warning("torch_monarch was built without NCCL: the links are timed over Gloo with CPU "
                                    "tensors, and CUDA tensors cannot be reduced by this build")
        sizes = sizes or (_PROBE_SIZES_CPU if device == "cpu" else _PROBE_SIZES_CUDA)
        for level, group, n, at in (("intra-node", intra.group(intra_axis) if local > 1 else None, local, 0),
                                    ("inter-node", inter.group("dp") if inter is not None else None, cluster.nodes, 2)):
            if group is None:
                continue
            split = _split_at_node_limit(group, sizes, device)
            if split is None:
                latency, bandwidth, times, error = measure_link(group, n, sizes, rounds, device)
                sizes_timed = sizes
            else:
                # The cost model has one latency + size / bandwidth line per link: its latency
                # from the small messages (the path they take), its bandwidth from the large
                # ones (Gloo's ring). Either fit failing keeps the preset's figures.
                latency, _, small_times, _ = measure_link(group, n, split[0], rounds, device)
                _, bandwidth, large_times, _ = measure_link(group, n, split[1], rounds, device)
                times, sizes_timed = small_times + large_times, split[0] + split[1]
                if latency == 0 or bandwidth == 0:
                    latency = bandwidth = 0.0
            values[at], values[at + 1] = latency, bandwidth
            if bandwidth == 0 and world.rank == 0:
                _log("cluster").warning(
                    "the %s all-reduce times fit no latency + size / bandwidth line (medians %s s at %s bytes); "
                    "keeping the %s preset's %.3g s and %.3g B/s for this link", level,
                    ", ".join(f"{t:.3g}" for t in times), ", ".join(str(s) for s in sizes_timed), cluster.name,
                    *((cluster.intra_node_latency_s, cluster.intra_node_bytes_per_s) if at == 0 else
                      (cluster.inter_node_latency_s, cluster.inter_node_bytes_per_s)))
        if device != "cpu":
            torch.cuda.empty_cache()  # the probe's buffers (up to 256 MiB each) back to the device
        if on_cpu:
            values[4], values[5], values[6] = measure_cpu_rates(everyone, local)
        everyone.broadcast(values, 0).wait()  # one measurement for all ranks
        fitted = (local == 1 or values[1] > 0) and (inter is None or values[3] > 0)
        if world.rank % local == 0 and fitted:
            cpu = {k: values[4 + i].item() for i, k in enumerate(_CPU_KEYS)} if on_cpu else {}
            if on_cpu:
                cpu["cpu_threads"] = torch.get_num_threads()
            _write_cache(path, {"intra_latency_s": values[0].item(), "intra_bytes_per_s": values[1].item(),
                                "inter_latency_s": values[2].item(), "inter_bytes_per_s": values[3].item(),
                                "links_method": _LINKS_METHOD, "links_backend": backend, "links_shared": shared,
                                **cpu})
    c = _copy_cluster(cluster)
    if values[1] > 0:  # measured (measure_link returns 0 for a link that fits no line)
        c.intra_node_latency_s, c.intra_node_bytes_per_s = values[0].item(), values[1].item()
    if values[3] > 0:
        c.inter_node_latency_s, c.inter_node_bytes_per_s = values[2].item(), values[3].item()
    elif cluster.nodes == 1:
        c.inter_node_latency_s, c.inter_node_bytes_per_s = c.intra_node_latency_s, c.intra_node_bytes_per_s
    if on_cpu and values[4] > 0 and values[5] > 0:
        busy, alone = values[4].item(), values[5].item()
        c.peak_flops_fp32 = c.peak_flops_tf32 = c.peak_flops_bf16 = busy
        c.matmul_efficiency = 1.0  # the measured rate is what a matmul achieves: it is the peak
        c.hbm_bytes_per_s = values[6].item()
        c.cores_per_node = effective_cores(local, busy, alone, c.cores_per_node)
        c.overlap_contention = cpu_overlap_contention(local, c.cores_per_node)
    _planner.validate(c)
    return c


def _copy_cluster(cluster):
    c = _planner.Cluster()
    for field in ("name", "nodes", "devices_per_node", "device_memory_bytes", "memory_reserved_bytes",
                  "peak_flops_fp32", "peak_flops_tf32", "peak_flops_bf16", "peak_flops_fp8", "matmul_efficiency",
                  "backward_forward_ratio", "cores_per_node", "sm_count", "overlap_contention", "hbm_bytes_per_s",
                  "intra_node_bytes_per_s", "intra_node_latency_s", "inter_node_bytes_per_s", "inter_node_latency_s",
                  "straggler_spread", "levels"):  # levels last: it sets the two-level fields from its first two
        setattr(c, field, getattr(cluster, field))
    return c
