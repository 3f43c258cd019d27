"""Predicted vs measured, on this machine: step time and peak memory of a small GPT trained
in several layouts on 4 ranks, beside what the planner predicts for each on a cluster
description measured in the same run.

Two launches through the launcher (`python3 -m torch_monarch.run`, torchrun's protocol).

The first measures the machine as the job sees it, all ranks at once (ranks share the cores,
so a rank's rate is what it gets while the others work too; class Rates): matmul FLOP/s on
the model's GEMM shape, memory bandwidth (a large add into a kept output), one block's
forward and backward, and each rank's matmul rate alone (the effective cores_per_node),
sampled eleven times, before the profile and after each profiled micro-batch size, the best
sample used; loopback all-reduce latency and bandwidth (cluster.probe). It measures a profile
of the model (torch_monarch.profile: each layer's forward and backward at micro-batch sizes 1
to 16, all ranks at once, in two passes, the faster kept). Each layout is predicted twice,
by the analytic model and from the profile, and the planner's picks for this job (search
with each estimator) are added. Then every layout is parallelized and kept, glibc keeping
freed memory (as the caching allocator keeps device memory); one untimed step each, then
rounds of STEPS steps of every layout, each round starting at a different layout; a layout's
time is the best of its steps (the median is kept too), the slowest rank's (forward,
backward, AdamW step). Best-of on both sides because this VM's other tenants only ever slow
it down, in spells of minutes (one run measured every layout 20-50% over its prediction in
four rounds and within 5% in the fifth). A sentinel (one block's forward, all ranks at once)
read between steps tells quiet steps from slow ones: at least ROUNDS rounds run, then more
until every layout has QUIET_STEPS quiet steps (at most MAX_ROUNDS); each layout also gets the
median of its quiet steps. The PyTorch baseline, the dp4
layout's computation under torch.nn.parallel.DistributedDataParallel (torch's Gloo process
group), is built, kept and timed in the same rounds. The plans are exported as JSON.

The second launch loads those plans and measures peak memory per rank, one layout at a time,
glibc returning freed memory at once (MALLOC_MMAP_THRESHOLD_): VmHWM growth over one step
after two warm-up steps, over the rank's memory before the model was built; the three steps'
losses; the baseline last.

    python3 bench/layouts.py [--out bench/results/layouts.json] [--predict-only EARLIER_JSON]
    MONARCH_LAYOUTS_ONLY=name,name MONARCH_LAYOUTS_ROUNDS=n MONARCH_LAYOUTS_MAX_ROUNDS=n
    MONARCH_LAYOUTS_STEPS=n (subsets)

Printed: per layout, both predicted and the measured step time, peak memory (predicted on
the most loaded rank, measured on the most loaded rank), the baseline's measured time and
peak below them; per estimator, Spearman's rank correlation of predicted and measured times
(best-of, of the medians and of the quiet medians) and where its pick finished.
"""

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from procmem import reset_peak, vm
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

STEPS = int(os.environ.get("MONARCH_LAYOUTS_STEPS", 1))   # timed steps per layout and round
ROUNDS = int(os.environ.get("MONARCH_LAYOUTS_ROUNDS", 6))            # at least
MAX_ROUNDS = int(os.environ.get("MONARCH_LAYOUTS_MAX_ROUNDS", 16))   # at most
QUIET_STEPS, QUIET_MARGIN = 2, 1.10   # see class Sentinel
ONLY = [n for n in os.environ.get("MONARCH_LAYOUTS_ONLY", "").split(",") if n]
VOCAB, HIDDEN, HEADS, LAYERS, SEQ, GLOBAL_BATCH = 1024, 256, 8, 4, 64, 16
# (name, pins): every kind of layout the runtime builds, on 4 ranks.
LAYOUTS = [
    ("dp4", dict(dp=4, tp=1, pp=1, zero=0, micro_batch=4, schedule="none")),
    ("dp4 mbs1", dict(dp=4, tp=1, pp=1, zero=0, micro_batch=1, schedule="none")),
    ("zero1", dict(dp=4, tp=1, pp=1, zero=1, micro_batch=4, schedule="none")),
    ("zero2", dict(dp=4, tp=1, pp=1, zero=2, micro_batch=4, schedule="none")),
    ("zero3", dict(dp=4, tp=1, pp=1, zero=3, micro_batch=4, schedule="none")),
    ("tp2 dp2", dict(dp=2, tp=2, pp=1, zero=0, micro_batch=8, schedule="none")),
    ("tp4", dict(dp=1, tp=4, pp=1, zero=0, micro_batch=16, schedule="none")),
    ("pp2 dp2 1f1b", dict(dp=2, tp=1, pp=2, zero=0, micro_batch=2, schedule="1f1b")),
    ("pp2 dp2 zb_h1", dict(dp=2, tp=1, pp=2, zero=0, micro_batch=2, schedule="zb_h1")),
    ("pp4 gpipe", dict(dp=1, tp=1, pp=4, zero=0, micro_batch=4, schedule="gpipe")),
    ("pp2 tp2 1f1b", dict(dp=1, tp=2, pp=2, zero=0, micro_batch=4, schedule="1f1b")),
    # Pipelines without enough micro-batches: the bubble, which on this machine (4 ranks on 2
    # cores) costs only where fewer ranks are busy than there are cores.
    ("pp2 dp2 m1", dict(dp=2, tp=1, pp=2, zero=0, micro_batch=8, schedule="gpipe")),
    ("pp4 1f1b m2", dict(dp=1, tp=1, pp=4, zero=0, micro_batch=8, schedule="1f1b")),
    ("pp4 m1", dict(dp=1, tp=1, pp=4, zero=0, micro_batch=16, schedule="gpipe")),
    # Recomputation.
    ("dp4 selective", dict(dp=4, tp=1, pp=1, zero=0, micro_batch=4, schedule="none", recompute="selective")),
    ("dp4 full recompute", dict(dp=4, tp=1, pp=1, zero=0, micro_batch=4, schedule="none", recompute="full")),
    ("zero3 full recompute", dict(dp=4, tp=1, pp=1, zero=3, micro_batch=4, schedule="none", recompute="full")),
    ("pp2 dp2 full recompute", dict(dp=2, tp=1, pp=2, zero=0, micro_batch=2, schedule="1f1b", recompute="full")),
]


def make_model():
    import torch
    from models import GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(vocab=VOCAB, hidden=HIDDEN, heads=HEADS, layers=LAYERS, max_positions=SEQ, dropout=0.0)


def batch(step):
    import torch
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _all_max(group, value):
    import torch
    t = torch.tensor([float(value)], dtype=torch.float64)
    group.all_reduce_max(t).wait()
    return t.item()


class Rates:
    """This machine's compute rates as the ranks see them, all measuring at once (they share
    the cores, so a rank's rate is what it gets while the others work too), sampled several
    times over the run's first minutes (the machine is a shared VM whose speed drifts by up to
    +-15% over minutes, and was measured up to 30% slower for 4 minutes); the planner's
    cluster takes each rate's best sample, as the step times are best-of.
      * matmul FLOP/s per rank on the model's own GEMM shape (tokens x hidden x 4 hidden);
      * memory bandwidth per rank: a large add into a kept output (2 reads, 1 write);
      * one block's forward and backward at 4 sequences per rank;
      * the matmul rate of each rank alone (the others waiting): how much faster a rank runs
        while others idle (in a pipeline's bubble), which on this VM is more than the
        ranks / cores the machine reports (2 vCPUs; 4 ranks each get less than half of one).
        The cluster's cores_per_node is the effective number: ranks x all-busy rate / alone."""

    def __init__(self, everyone):
        import torch
        self.everyone = everyone
        self.tokens = GLOBAL_BATCH * SEQ // everyone.size
        self.a, self.b = torch.randn(self.tokens, HIDDEN), torch.randn(HIDDEN, 4 * HIDDEN)
        self.x, self.y, self.z = torch.randn(8 << 20), torch.randn(8 << 20), torch.empty(8 << 20)
        self.block = make_model().transformer.h[0]
        self.inp = torch.randn(4, SEQ, HIDDEN, requires_grad=True)
        self.samples = []

    def _timed(self, fn, repeats):
        fn()
        _all_max(self.everyone, 0)  # line everyone up
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return _all_max(self.everyone, (time.perf_counter() - t0) / repeats)

    def sample(self):
        import torch
        work = 2.0 * self.tokens * HIDDEN * 4 * HIDDEN
        flops = work / self._timed(lambda: self.a @ self.b, 20)
        # Each rank in turn alone (the others wait in the barrier); the ranks' mean.
        for r in range(self.everyone.size):
            _all_max(self.everyone, 0)
            if self.everyone.rank == r:
                self.a @ self.b
                t0 = time.perf_counter()
                for _ in range(10):
                    self.a @ self.b
                alone_rate = work / ((time.perf_counter() - t0) / 10)
            _all_max(self.everyone, 0)
        t = torch.tensor([alone_rate], dtype=torch.float64)
        self.everyone.all_reduce(t).wait()
        # Into a kept output: a fresh 32 MiB result would be a new mapping each time (glibc's
        # largest mmap threshold), and its page faults, not the memory, would be timed.
        hbm = 3 * self.x.numel() * 4 / self._timed(lambda: torch.add(self.x, self.y, out=self.z), 10)
        fwd, bwd = [], []
        _all_max(self.everyone, 0)
        for _ in range(4):
            t0 = time.perf_counter()
            out = self.block(self.inp)
            t1 = time.perf_counter()
            out.sum().backward()
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
        self.samples.append({"flops": flops, "flops_alone": t.item() / self.everyone.size, "hbm": hbm, "forward_s": _all_max(self.everyone, sorted(fwd)[1]),
                             "backward_s": _all_max(self.everyone, sorted(bwd)[1])})

    def best(self, key):
        """The fastest sample: the highest rate, or the shortest time (``_s``). Another
        tenant of this VM only ever slows a sample down, and the step times are best-of too."""
        values = [s[key] for s in self.samples]
        return min(values) if key.endswith("_s") else max(values)


def cluster_from(world, rates, graph):
    """The planner's Cluster for this machine: the loopback links (all-reduce latency and
    bandwidth fitted at 4 sizes) and the probe's own CPU rates (cluster.probe, what
    parallelize uses), then the rates' best samples in their place, the cores the ranks share,
    and the block's efficiency. The probe's values are kept beside them for comparison."""
    from torch_monarch import cluster as cl
    c = cl.probe(cl.detect(world_size=world.size, ranks_per_node=world.size, measure=False), world, use_cache=False)
    by_probe = {"flops": c.peak_flops_fp32, "hbm": c.hbm_bytes_per_s, "cores_per_node": c.cores_per_node}
    flops, hbm = rates.best("flops"), rates.best("hbm")
    c.peak_flops_fp32 = c.peak_flops_tf32 = c.peak_flops_bf16 = flops
    c.hbm_bytes_per_s = hbm
    # The rates above are with all ranks busy; a rank alone runs `over` times faster.
    over = rates.best("flops_alone") / flops
    c.cores_per_node = min(float(world.size), world.size / over)
    # From the block: the share of the GEMM rate the whole block reaches once its memory-bound
    # ops are counted at the measured bandwidth (matmul_efficiency), and backward / forward.
    fwd_s, bwd_s = rates.best("forward_s"), rates.best("backward_s")
    layer = next(l for l in graph.layers if str(l.kind).endswith("block"))
    a = layer.activations
    stored = 4 * (a.replicated + a.tp_sharded + a.attention_scores)
    gemm_s = max(fwd_s - 2 * stored / hbm, 1e-9)
    c.matmul_efficiency = min(1.0, 4 * layer.forward_flops_per_sample / flops / gemm_s)
    c.backward_forward_ratio = bwd_s / fwd_s
    cl._planner.validate(c)
    return c, by_probe


def keep_freed_memory():
    """glibc keeps freed memory in the heap for reuse, as PyTorch's caching allocator keeps
    device memory: the timing's policy. (The memory launch has glibc return it at once,
    through MALLOC_MMAP_THRESHOLD_, so VmHWM growth is what the tensors alive together
    needed; with that policy every large tensor of every step is a fresh, page-faulting
    mapping, which this VM makes slow and erratic.)"""
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    # 32 MiB is glibc's largest mmap threshold on 64-bit.
    if not (libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30)):
        raise RuntimeError("mallopt refused to keep freed memory")


def _job(plan, loss_fn):
    """The model parallelized by `plan`, its AdamW, and the loss its output takes."""
    import torch
    import torch_monarch
    from torch_monarch.tensor_parallel_modules import vocab_parallel_cross_entropy
    pm = torch_monarch.parallelize(make_model(), plan=plan)
    opt = torch.optim.AdamW([p for _, p in pm.named_parameters()], lr=1e-3)
    loss = (lambda out, y, mesh=pm.mesh: vocab_parallel_cross_entropy(out, y, mesh)) if pm.tp > 1 else loss_fn
    return pm, opt, loss


BASELINE = "torch DDP"   # the PyTorch baseline, timed and measured beside the layouts


class _DDPJob:
    """torch.nn.parallel.DistributedDataParallel over torch's own Gloo process group: the
    same model, AdamW and global batch as the dp4 layout (one micro-batch of 4 per rank), the
    interface _step drives."""

    def __init__(self):
        import torch
        import torch.distributed as dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.model = torch.nn.parallel.DistributedDataParallel(make_model())

    def local_batch(self, x, y):
        share = x.shape[0] // self.size
        return x[self.rank * share:(self.rank + 1) * share], y[self.rank * share:(self.rank + 1) * share]

    def train_step(self, x, y, loss_fn):
        import torch.distributed as dist
        loss = loss_fn(self.model(x), y)
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return mean / self.size


def _ddp_job(loss_fn):
    import torch
    import torch.distributed  # noqa: F401
    pm = _DDPJob()
    return pm, torch.optim.AdamW(pm.model.parameters(), lr=1e-3), loss_fn


def _job_for(name, plans, loss_fn):
    return _ddp_job(loss_fn) if name == BASELINE else _job(plans[name][0], loss_fn)


def _step(job, everyone, step):
    """One training step of `job` on the global batch `step`, every rank starting together:
    (the slowest rank's seconds, the loss)."""
    pm, opt, loss = job
    x, y = batch(step)
    _all_max(everyone, 0)
    t0 = time.perf_counter()
    opt.zero_grad()
    value = pm.train_step(*pm.local_batch(x, y), loss)
    opt.step()
    return _all_max(everyone, time.perf_counter() - t0), float(value)


class Sentinel:
    """How fast this machine is right now: one block's forward on one sequence, twice, every
    rank at once, the slowest rank's seconds. Taken before the first timed step and after
    every timed step, so each step sits between two readings; a step is quiet when neither
    reading is more than QUIET_MARGIN over the run's 5th-percentile reading. The readings do not
    change a layout's time (still the best of its steps); they decide how many rounds run
    (until every layout has QUIET_STEPS quiet steps, or MAX_ROUNDS) and give each layout a
    median over its quiet steps, a second statistic beside the best."""

    def __init__(self, everyone):
        import torch
        self.everyone = everyone
        self.block = make_model().transformer.h[0]
        self.inp = torch.randn(1, SEQ, HIDDEN)
        self.readings = []

    def read(self):
        import torch
        _all_max(self.everyone, 0)
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(2):
                self.block(self.inp)
        self.readings.append(_all_max(self.everyone, time.perf_counter() - t0))
        return len(self.readings) - 1

    def floor(self):
        # A low percentile, not the single fastest reading, which a lucky moment can set.
        return sorted(self.readings)[len(self.readings) // 20]

    def quiet(self, before, after):
        return max(self.readings[before], self.readings[after]) <= QUIET_MARGIN * self.floor()


def quiet_times(row, sentinel):
    return [t for t, (b, a) in zip(row["times"], row["sentinel"]) if sentinel.quiet(b, a)]


def time_layouts(everyone, layouts, plans, rows, loss_fn):
    """Step times, glibc keeping freed memory: every layout built and kept, one untimed step
    each, then rounds of STEPS steps of every layout, each round starting at a different
    layout, len / ROUNDS further on (a slow spell of this shared machine, which lasts minutes,
    lands on different layouts each round). At least ROUNDS rounds, then more until every
    layout has QUIET_STEPS quiet steps (class Sentinel), at most MAX_ROUNDS. A layout's time
    is the best of its steps (and their median, and the median of its quiet steps), the
    slowest rank's. Returns the sentinel."""
    jobs = [(name, _job_for(name, plans, loss_fn)) for name in [n for n, _ in layouts] + [BASELINE]]
    for i, (_, job) in enumerate(jobs):
        _step(job, everyone, i % 4)
    sentinel = Sentinel(everyone)
    last = sentinel.read()
    for rnd in range(max(ROUNDS, MAX_ROUNDS)):
        if rnd >= ROUNDS and all(len(quiet_times(rows[name], sentinel)) >= QUIET_STEPS for name, _ in jobs):
            break
        shift = rnd * len(jobs) // ROUNDS
        for i, (name, job) in enumerate(jobs[shift % len(jobs):] + jobs[:shift % len(jobs)]):
            for _ in range(STEPS):
                rows[name]["times"].append(_step(job, everyone, (rnd + i) % 4)[0])
                now = sentinel.read()
                rows[name]["sentinel"].append((last, now))
                last = now
    jobs.clear()
    gc.collect()
    return sentinel


def memory_worker(out_dir):
    """The second launch: peak memory per rank of every layout, one at a time, from the plans
    the first launch exported (JSON, as a user would review and load them). glibc returns
    freed memory at once (MALLOC_MMAP_THRESHOLD_ set by the launcher's environment), so the
    high-water mark's growth is what the tensors alive together needed: the rank's resident
    memory before the model is built, the model parallelized with its AdamW, two warm-up steps,
    then VmHWM over one more step. The three steps' losses come with it."""
    import torch
    import torch_monarch
    from torch_monarch import planner
    import torch.nn.functional as F

    torch.set_num_threads(1)
    import torch.distributed
    torch.distributed.init_process_group("gloo")  # for the baseline; init() joins its store
    world = torch_monarch.init(timeout=300)
    everyone = torch_monarch._runtime.DeviceMesh(world, pp=1, dp=world.size, tp=1).group("dp")
    with open(os.path.join(out_dir, "layouts.json")) as f:
        names = json.load(f)

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    # What the first training in a process sets up once (autograd's threads, Gloo's and the
    # allocator's first buffers) is paid here, not by the first layout measured.
    job = _job(planner.load(os.path.join(out_dir, "plan0.json")), loss_fn)
    _step(job, everyone, 0)
    del job
    out = {}
    for i, name in enumerate(names + [BASELINE]):
        plan = planner.load(os.path.join(out_dir, f"plan{i}.json")) if name != BASELINE else None
        gc.collect()
        base = vm("VmRSS")
        job = _ddp_job(loss_fn) if name == BASELINE else _job(plan, loss_fn)
        # Two warm-up steps: DDP rebuilds its gradient buckets in the second step's forward
        # (freeing the first set, filling the new one only in backward), so its second step
        # is lighter than every later one (measured: 89 against 102 MiB growth per rank).
        losses = [_step(job, everyone, 0)[1], _step(job, everyone, 2)[1]]
        gc.collect()
        reset_peak()
        losses.append(_step(job, everyone, 1)[1])
        out[name] = {"peak_bytes": vm("VmHWM") - base, "losses": losses}
        del job
    with open(os.path.join(out_dir, f"memory{world.rank}.json"), "w") as f:
        json.dump(out, f)


def worker(out_dir):
    import torch
    import torch_monarch
    from torch_monarch import planner
    from torch_monarch.api import model_graph, runtime_training
    from torch_monarch.profile import measure as measure_profile
    import torch.nn.functional as F

    torch.set_num_threads(1)
    import torch.distributed
    torch.distributed.init_process_group("gloo")  # for the baseline; init() joins its store
    world = torch_monarch.init(timeout=300)
    everyone = torch_monarch._runtime.DeviceMesh(world, pp=1, dp=world.size, tp=1).group("dp")
    x0, _ = batch(0)
    with torch_monarch.meta_init():
        meta = make_model()
    info, graph = model_graph(meta, x0[:1], dtype="fp32")
    keep_freed_memory()
    rates = Rates(everyone)
    rates.sample()
    training = runtime_training(info, GLOBAL_BATCH, dtype="fp32")

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    # The measured profile: every layer's forward and backward on the real model, all ranks at
    # once, at the micro-batch sizes the layouts use, one size at a time with a sample of the
    # rates after each, in two passes (sizes up, then down: a slow spell of this VM lasts
    # minutes, and each size is measured at two times); per layer and size the faster pass.
    torch.manual_seed(0)
    model = make_model()
    xs, ys = batch(0)
    t0 = time.perf_counter()
    best = {}
    sizes = (1, 2, 4, 8, 16)
    passes = {}          # size -> the whole model's forward + backward in each pass
    within = []          # each call's own repeatability (its 3 repeats)
    for b in sizes + sizes[::-1]:
        part = measure_profile(model, lambda b: (xs[:b], ys[:b]), layers=info.layer_modules, loss_fn=loss_fn,
                               micro_batches=(b,), repeats=3, world=world)
        within.append(part.repeatability)
        passes.setdefault(b, []).append(sum(pt.forward_s + pt.backward_s for layer in part.layers
                                            for pt in layer.points))
        for layer in part.layers:
            for pt in layer.points:
                old = best.get((layer.name, pt.micro_batch))
                if old is None or pt.forward_s + pt.backward_s < old.forward_s + old.backward_s:
                    best[(layer.name, pt.micro_batch)] = pt
        rates.sample()
    points = {n: [best[(n, b)] for b in sizes] for n in info.layer_modules}
    profile_s = time.perf_counter() - t0
    cluster, by_probe = cluster_from(world, rates, graph)
    prof = planner.MeasuredProfile(source="bench/layouts.py: 4 ranks on this machine, measuring at once",
                                   layers=[planner.LayerProfile(name=n, points=points[n]) for n in info.layer_modules])
    prof.intra_node = planner.LinkProfile(latency_s=cluster.intra_node_latency_s,
                                          bytes_per_s=cluster.intra_node_bytes_per_s)
    # Its repeatability: how far the two passes of a size differed (a slow spell lasts minutes,
    # longer than one call's repeats), or the calls' own spread, whichever is larger; both as
    # measure() defines it, (slowest - fastest) / median. (Size 16 is measured twice in a row,
    # at the turn: its two passes are the closest in time.)
    between = statistics.median((max(t) - min(t)) / statistics.median(t) for t in passes.values())
    prof.repeatability = min(0.49, max(between, statistics.median(within)))
    planner._P.validate_profile(prof)
    del model
    if world.rank == 0:
        planner.save_profile(prof, os.path.join(out_dir, "profile.json"))
    picks = {"analytic": planner.plan(graph, cluster, training, alternatives=0),
             "profile": planner.plan(graph, cluster, training, alternatives=0, profile=prof)}
    layouts = [l for l in LAYOUTS if not ONLY or l[0] in ONLY]
    for estimator, pick in picks.items():
        pick_pins = dict(dp=pick.mesh.dp, tp=pick.mesh.tp, pp=pick.mesh.pp, zero=pick.zero_stage,
                         micro_batch=pick.micro_batch_size, schedule=str(pick.schedule).split(".")[-1],
                         recompute=str(pick.recompute).split(".")[-1], sequence_parallel=pick.sequence_parallel)
        known = [{"recompute": "none", "sequence_parallel": False, **p} for _, p in layouts]
        if pick_pins not in known:
            layouts.append((f"pick ({estimator})", pick_pins))

    def both_plans(pins):
        pins = dict(pins)
        recompute = pins.pop("recompute", "none")
        sp = pins.pop("sequence_parallel", False)
        return tuple(planner.evaluate(graph, cluster, training, recompute=recompute, sequence_parallel=sp,
                                      allow_over_memory=True, profile=p, **pins) for p in (None, prof))

    def row(name, plan, from_profile):
        return {"layout": name, "plan": plan.summary(), "rank": world.rank,
                "pick": plan.summary() == picks["analytic"].summary(),
                "pick_profile": from_profile.summary() == picks["profile"].summary(),
                "predicted_s": plan.prediction.step_time_s,
                "predicted_profile_s": from_profile.prediction.step_time_s,
                "predicted_bytes": plan.prediction.memory_bytes_per_device,
                "predicted_breakdown": {k: getattr(plan.prediction.time, k) for k in
                                        ("compute", "recompute", "tp_comm", "dp_comm", "pp_comm", "bubble",
                                         "optimizer")},
                "times": [], "sentinel": [], "peak_bytes": 0, "losses": []}

    plans = {name: both_plans(pins) for name, pins in layouts}
    rows = {name: row(name, *plans[name]) for name, _ in layouts}
    # The baseline is the dp4 layout's computation run by PyTorch: its predictions are dp4's.
    dp4 = both_plans(dict(LAYOUTS[0][1]))
    rows[BASELINE] = dict(row(BASELINE, *dp4), plan="torch DDP " + dp4[0].summary(), pick=False, pick_profile=False,
                          baseline=True)
    sentinel = None
    if os.environ.get("MONARCH_LAYOUTS_PREDICT_ONLY"):  # --predict-only: every layout scored, none run
        for r in rows.values():
            r["times"] = [float("nan")]
    else:
        sentinel = time_layouts(everyone, layouts, plans, rows, loss_fn)
    if world.rank == 0:
        with open(os.path.join(out_dir, "layouts.json"), "w") as f:
            json.dump([name for name, _ in layouts], f)
        for i, (name, _) in enumerate(layouts):
            planner.save(plans[name][0], os.path.join(out_dir, f"plan{i}.json"))
    rows = list(rows.values())
    for r in rows:
        # Best of the rounds (as timeit reports: another tenant of this VM only ever slows a
        # step down, in spells of minutes); the median is kept beside it.
        r["measured_s"] = min(r["times"])
        r["median_s"] = statistics.median(r["times"])
        quiet = quiet_times(r, sentinel) if sentinel else []
        r["quiet_steps"] = len(quiet)
        r["quiet_median_s"] = statistics.median(quiet) if quiet else float("nan")
    with open(os.path.join(out_dir, f"rank{world.rank}.json"), "w") as f:
        json.dump({"cluster": {"flops": cluster.peak_flops_fp32, "hbm": cluster.hbm_bytes_per_s,
                               "efficiency": cluster.matmul_efficiency,
                               "backward_forward_ratio": cluster.backward_forward_ratio,
                               "latency": cluster.intra_node_latency_s, "bandwidth": cluster.intra_node_bytes_per_s,
                               "profile_seconds": profile_s, "rate_samples": rates.samples,
                               "profile_repeatability": prof.repeatability,
                               "cores_per_node": cluster.cores_per_node, "probe": by_probe,
                               "sentinel_s": sentinel.readings if sentinel else [],
                               "rounds": len(rows[0]["times"]) // STEPS if sentinel else 0},
                   "picks": {k: v.summary() for k, v in picks.items()},
                   "tie_breaks": {k: v.tie_break for k, v in picks.items()},
                   "rows": rows}, f)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spearman(a, b):
    if len(a) < 3 or any(x != x for x in list(a) + list(b)):
        return float("nan")  # a subset (MONARCH_LAYOUTS_ONLY) too small to rank, or a value missing
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):  # ties share their mean rank
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb)


def run(ranks, timeout=3600):
    out = tempfile.mkdtemp(prefix="monarch-layouts-")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch_monarch.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), __file__, "--worker", out]
    subprocess.run(cmd, check=True, timeout=timeout, env=env)
    if not os.environ.get("MONARCH_LAYOUTS_PREDICT_ONLY"):  # the memory launch, from the exported plans
        cmd[cmd.index("--master-port") + 1] = str(free_port())
        cmd[cmd.index("--worker")] = "--memory-worker"
        subprocess.run(cmd, check=True, timeout=timeout, env=dict(env, MALLOC_MMAP_THRESHOLD_="65536"))
    per_rank = []
    for r in range(ranks):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            per_rank.append(json.load(f))
        path = os.path.join(out, f"memory{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                memory = json.load(f)
            for row in per_rank[-1]["rows"]:
                row.update(memory[row["layout"]])
    table = []
    for i, row in enumerate(per_rank[0]["rows"]):
        rows = [p["rows"][i] for p in per_rank]
        table.append({"layout": row["layout"], "plan": row["plan"], "pick": row["pick"],
                      "baseline": row.get("baseline", False),
                      "pick_profile": row["pick_profile"],
                      "predicted_s": row["predicted_s"], "predicted_profile_s": row["predicted_profile_s"],
                      "profile_ratio": row["measured_s"] / row["predicted_profile_s"],
                      "measured_s": row["measured_s"], "median_s": row["median_s"],
                      "quiet_median_s": row.get("quiet_median_s", float("nan")),
                      "quiet_steps": row.get("quiet_steps", 0), "sentinel": row.get("sentinel", []),
                      "ratio": row["measured_s"] / row["predicted_s"],
                      "predicted_bytes": row["predicted_bytes"],
                      "peak_bytes": max(r["peak_bytes"] for r in rows),
                      "peak_bytes_per_rank": [r["peak_bytes"] for r in rows],
                      "predicted_breakdown": row["predicted_breakdown"], "losses": row["losses"],
                      "times": row["times"]})
    extra = {"picks": per_rank[0]["picks"], "tie_breaks": per_rank[0]["tie_breaks"],
             "baseline": [r for r in table if r["baseline"]]}
    return per_rank[0]["cluster"], [r for r in table if not r["baseline"]], extra


def ordered_pairs(rows, margin):
    """Pairs of layouts whose predicted times differ by more than `margin` (relative), and how
    many of them the measurement orders the same way."""
    pairs = agree = 0
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            lo, hi = sorted((a, b), key=lambda r: r["predicted_s"])
            if hi["predicted_s"] > lo["predicted_s"] * (1 + margin):
                pairs += 1
                agree += hi["measured_s"] > lo["measured_s"]
    return pairs, agree


def summarize(cluster, table, extra):
    """Per estimator (analytic, measured profile): rank correlation over the pinned layouts,
    worst deviation, and where its pick finished among all measured layouts."""
    pinned = [r for r in table if not r["layout"].startswith("pick (")]
    fastest = min(r["measured_s"] for r in table)
    out = {"cluster": cluster, "fastest": min(table, key=lambda r: r["measured_s"])["plan"],
           "fastest_s": fastest}
    for estimator, key, flag in (("analytic", "predicted_s", "pick"), ("profile", "predicted_profile_s", "pick_profile")):
        shown = [dict(r, predicted_s=r[key]) for r in pinned]
        pairs, agree = ordered_pairs(shown, 0.10)
        pick = next((r for r in table if r[flag]), None)
        if pick is None:  # --predict-only: the pick was not among the layouts measured earlier
            pick = {"measured_s": float("nan")}
        out[estimator] = {
            "spearman": spearman([r[key] for r in pinned], [r["measured_s"] for r in pinned]),
            "spearman_of_medians": spearman([r[key] for r in pinned], [r["median_s"] for r in pinned]),
            "pairs_apart_10pct": pairs, "pairs_ordered_right": agree,
            "worst_time_deviation": max(abs(r["measured_s"] / r[key] - 1) for r in table),
            "pick": extra["picks"][estimator], "tie_break": extra["tie_breaks"][estimator],
            "pick_measured_s": pick["measured_s"], "pick_vs_fastest": pick["measured_s"] / fastest,
            "pick_median_vs_fastest_median": pick.get("median_s", float("nan")) / min(r["median_s"] for r in table),
            "spearman_of_quiet_medians": spearman([r[key] for r in pinned], [r["quiet_median_s"] for r in pinned]),
            "pick_quiet_vs_fastest_quiet": pick.get("quiet_median_s", float("nan")) /
            min((r["quiet_median_s"] for r in table if r["quiet_median_s"] == r["quiet_median_s"]),
                default=float("nan"))}
    out["layouts"] = table
    out["baseline"] = extra["baseline"]
    # Every layout trains the same model on the same batches as the baseline: the memory
    # launch's three losses (fp32; tensor parallelism sums in another order) side by side.
    base = extra["baseline"][0]["losses"] if extra["baseline"] else []
    out["loss_vs_baseline"] = max((abs(a - b) / abs(b) for r in table if len(r["losses"]) == len(base)
                                   for a, b in zip(r["losses"], base)), default=float("nan"))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--memory-worker")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "layouts.json"))
    ap.add_argument("--predict-only", metavar="MEASURED_JSON",
                    help="measure the cluster and the profile, predict every layout with both estimators, "
                         "and compare with the measured times of an earlier run's results file (no training)")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    if args.memory_worker:
        memory_worker(args.memory_worker)
        return 0
    if args.predict_only:
        with open(args.predict_only) as f:
            earlier = {r["plan"]: r for r in json.load(f)["layouts"]}
        os.environ["MONARCH_LAYOUTS_PREDICT_ONLY"] = "1"
        cluster, table, extra = run(args.ranks)
        missing = [r["plan"] for r in table if r["plan"] not in earlier]
        table = [r for r in table if r["plan"] in earlier]
        for r in table:
            m = earlier[r["plan"]]
            r.update(measured_s=min(m["times"]), median_s=statistics.median(m["times"]),
                     ratio=min(m["times"]) / r["predicted_s"],
                     profile_ratio=min(m["times"]) / r["predicted_profile_s"],
                     **{k: m[k] for k in ("peak_bytes", "peak_bytes_per_rank", "times", "losses", "quiet_median_s",
                                          "quiet_steps", "sentinel") if k in m})
        if missing:
            print(f"not in {args.predict_only} (not compared): {missing}")
        print(f"measured times from {args.predict_only}; predictions from this run")
    else:
        cluster, table, extra = run(args.ranks)
    s = summarize(cluster, table, extra)
    print(f"GPT-2 style, {LAYERS} blocks, hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, vocab {VOCAB}, global batch "
          f"{GLOBAL_BATCH}, fp32, AdamW, {args.ranks} ranks on this machine")
    print(f"measured cluster: matmul {cluster['flops'] / 1e9:.1f} GFLOP/s per rank (a block reaches "
          f"{cluster['efficiency']:.2f} of it), backward/forward {cluster['backward_forward_ratio']:.2f}, memory "
          f"{cluster['hbm'] / 1e9:.1f} GB/s per rank, loopback {cluster['bandwidth'] / 1e9:.2f} GB/s, "
          f"latency {cluster['latency'] * 1e6:.0f} us, effective cores {cluster['cores_per_node']:.2f}")
    pr = cluster["probe"]
    print(f"cluster.probe's own CPU rates (what parallelize plans with): matmul {pr['flops'] / 1e9:.1f} GFLOP/s per "
          f"rank, memory {pr['hbm'] / 1e9:.1f} GB/s, effective cores {pr['cores_per_node']:.2f}")
    print(f"{'layout':<24}{'plan':<52}{'analytic s':>11}{'profile s':>10}{'best s':>8}{'median s':>9}"
          f"{'quiet s':>8}{'(n)':>5}{'pred MiB':>10}{'peak MiB':>10}")
    for r in table:
        mark = ("*" if r["pick"] else "") + ("+" if r["pick_profile"] else "")
        print(f"{r['layout'] + (' ' + mark if mark else ''):<24}{r['plan']:<52}{r['predicted_s']:>11.3f}"
              f"{r['predicted_profile_s']:>10.3f}{r['measured_s']:>8.3f}{r['median_s']:>9.3f}"
              f"{r.get('quiet_median_s', float('nan')):>8.3f}{r.get('quiet_steps', 0):>5}"
              f"{r['predicted_bytes'] / 2**20:>10.0f}{r['peak_bytes'] / 2**20:>10.0f}")
    for r in extra["baseline"]:
        print(f"{r['layout'] + ' (baseline)':<24}{'same computation as dp4, PyTorch DDP':<52}{'':>11}{'':>10}"
              f"{r['measured_s']:>8.3f}{r['median_s']:>9.3f}{r.get('quiet_median_s', float('nan')):>8.3f}"
              f"{r.get('quiet_steps', 0):>5}{'':>10}{r['peak_bytes'] / 2**20:>10.0f}")
    print("* the planner's pick from the analytic model; + its pick from the measured profile "
          f"(profiled in {cluster['profile_seconds']:.0f} s; its repeatability "
          f"{cluster.get('profile_repeatability', 0) * 100:.1f}%, the search's resolution for it)")
    readings = cluster.get("sentinel_s") or []
    if readings:
        floor = sorted(readings)[len(readings) // 20]
        print(f"{cluster['rounds']} rounds; sentinel (one block's forward, twice) {min(readings) * 1e3:.0f} ms at best, "
              f"{floor * 1e3:.0f} ms at the 5th percentile, median {statistics.median(readings) * 1e3:.0f} ms, worst "
              f"{max(readings) * 1e3:.0f} ms; a step is quiet when the readings around it are within "
              f"{(QUIET_MARGIN - 1) * 100:.0f}% of the 5th percentile")
    for estimator in ("analytic", "profile"):
        e = s[estimator]
        print(f"{estimator:>8}: Spearman (pinned layouts, predicted vs measured) {e['spearman']:.2f} (of the medians "
              f"{e['spearman_of_medians']:.2f}); worst deviation "
              f"{e['worst_time_deviation'] * 100:.0f}%; pairs predicted >10% apart {e['pairs_apart_10pct']}, measured in "
              f"the same order {e['pairs_ordered_right']}; pick {e['pick']} is {(e['pick_vs_fastest'] - 1) * 100:.1f}% "
              f"behind the measured fastest ({s['fastest']})")
        print(f"          over the quiet steps' medians: Spearman {e['spearman_of_quiet_medians']:.2f}, pick "
              f"{(e['pick_quiet_vs_fastest_quiet'] - 1) * 100:.1f}% behind the fastest")
        if e["tie_break"]:
            print(f"          tie break: {e['tie_break']}")
    print(f"losses against the baseline's (3 steps, every layout): worst relative difference "
          f"{s['loss_vs_baseline']:.1e}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(s, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
