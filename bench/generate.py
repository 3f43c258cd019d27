"""Generation (torch_monarch/generate.py, ParallelModel.generate) on 1, 2 and 4 ranks against
one-process Hugging Face ``generate``, beside the planner's inference predictions
(planner.plan_inference through torch_monarch.plan(model, x, mode="inference")). Prints a table
and writes JSON.

    python3 bench/generate.py [--repeats 3] [--out bench/results/generate.json]

The model: a Hugging Face LlamaForCausalLM built from its config (test/python/hf_models.py's
style, bigger so that a decode step is not only Python overhead): hidden 512, ffn 1536 (gated
SiLU), 6 layers, 8 query heads over 4 key/value heads (head dim 64), vocabulary 4096, untied
head, fp32: 23.1 M parameters, 92 MB. Weights of std 0.05 (not HF's 0.02, under which a random
model repeats one token: token-for-token equality would be a weak check). 4 prompts of 32, 20,
12 and 27 tokens, left-padded to 32, greedy, 64 new tokens, no EOS.

Runs (each one launch of python -m torch_monarch.run; MALLOC_MMAP_THRESHOLD_=1 MiB):
  hf     1 process, 1 torch thread: HF's own model.generate(do_sample=False) on the model.
  w1     the same process, after hf: parallelize(model) on a world of 1, pm.generate.
  tp2    2 ranks x 1 thread, parallelize(model, mesh tp=2): each rank 2 kv heads, half the MLP.
  tp4    4 ranks x 1 thread, tp=4 (4 kv heads: tp=4 divides them): 1 kv head per rank.
One thread per rank everywhere (one rank = one core, as one rank = one device on a cluster).
With 2 threads the one-process runs stalled whenever another process held a core (two-thread
GEMMs wait for each other): a trial measured 920 ms per token for w1 at load 2-3, against
10 ms with one thread.
Each run: one warm-up generate of 4 new tokens, then REPEATS timed generates of 64.

Timing, by a forward pre-hook on the first decoder layer (model.model.layers[0]): its start
time in each of the 64 forwards a generate of 64 tokens runs (one prefill, 63 decode steps;
both generates run the same forwards, which the bench checks). Then
  TTFT       = from the call of generate to the second forward's layer 0: the prefill forward,
               choosing the first token (and, under tp, its broadcast), the second step's input
               and embedding (microseconds);
  per-token  = the median over the 63 intervals between successive forwards' layer 0 (the last
               one: to generate's return): one decode step with everything the loop does around
               it (choosing the token, the tp broadcast, appending it, the mask), as a user of
               generate sees it. Pooled over the repeats. Under tp the ranks step in lockstep
               (each forward's all-reduces), so the slowest rank's median is reported.
  tokens/s   = 4 x 64 / the median wall time of one generate call.
The hook costs one Python call per forward (under a microsecond).

KV cache, measured: the bytes of the key and value tensors the cache holds after the timed
generate, per rank, and its tokens and kv heads. hf: HF's DynamicCache
(generate(return_dict_in_generate=True).past_key_values), 32 + 63 = 95 positions (the 64th token
is chosen, never fed), 1/96 = 1.04% below the planner's pre-allocated P + N = 96. Ours:
pm.generate_stats, the pre-allocated cache generate held (cache="static": 96 positions).

Predicted: planner.plan_inference(<the model's graph>, cluster, batch=4, prompt_len=32,
max_new_tokens=64, tp=<the run's>, pp=1, ...) with inputs measured in the run on generic kernels,
never on the bench's model or its decode:
  pred     (the scored one, "probed_host") cluster.probe(cluster.detect(...)) on the run's own
           ranks (loopback Gloo latency and bandwidth fitted; FLOP/s and memory bandwidth per
           rank with all ranks busy); the host's time (host_probe: HF generate's decode step
           on a tiny HF Llama at 2 and 4 layers, a line: per block, as seconds per aten op x
           ops per block counted at the dispatcher, and the loop's own time per step, outside
           the blocks; a CPU rank dispatches and computes on one thread; every rank probes at
           once, after a barrier, as its ranks decode in lockstep); and the bandwidth a
           decode's skinny matmuls reach (decode_read_probe: 256 MiB of 1024 x 4096 weights
           times a [4, 1024] input) as hbm_efficiency = that / the probe's bandwidth;
  no host  the probed cluster with the default hbm_efficiency 0.7 and no host term (what the
           planner assumes without these measurements: a GPU under CUDA graphs);
  preset   planner.cluster("cpu", n): the preset's 20 GB/s, 100 GFLOP/s at 0.5, 50 us links.
The error columns are predicted / measured - 1; the issue's targets: per-token latency within
25%, KV cache within 10%.

Peak memory: VmHWM growth over the resident memory just before the timed generates (model
built and parallelized, warm-up done), largest rank: the cache, the forwards' activations and
logits, and whatever the allocator keeps.

Diagnostics beside the prediction (second table): the "linear floor" (one pass of F.linear
over the rank's linear weights on a [4, in] input: the decode step's matmuls alone, so
linear bytes / floor is the bandwidth decode's reads reach here), the all-reduce of [4, 512]
fp32 over tp back to back and each after a matmul (as in decode: ranks arrive at different
times and a waiting process can lose its core), and "calib": the planner again with those
measured numbers as its bandwidth (hbm_efficiency 1) and all-reduce latency, which separates
wrong inputs (the probe's) from what the model leaves out.

WHAT 2 SHARED CORES MEAN: tp=2 and tp=4 are 2 and 4 one-thread processes on 2 cores, talking by
Gloo over loopback; hf and w1 run one thread on the same 2 cores. A decode step here is
skinny matmuls (a CPU core multiplies a batch of 4 far below its streaming bandwidth), per-
operator dispatch (HF Llama runs 71 aten ops per layer per step, about 3 us each here), and
under tp Gloo's loopback all-reduces, 13 per token, each of which needs both processes on a
core at once: with other work on the machine a rank waits to be scheduled at every one (a
profile of tp=2 under a load of 1.4: 7 ms of CPU per token, 40 ms of wall time). The table
prints the load average; tp timings mean something only on a quiet machine.
"""

import os as _os
# tp decode's all-reduces through the node's shared memory (the default limit, said here so a
# run names it; docs/communication.md); the ranks this bench launches inherit it.
_os.environ.setdefault("MONARCH_NODE_ALL_REDUCE_BYTES", str(256 * 1024))
import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 512, 1536, 6, 8, 4, 4096
HEAD_DIM = HIDDEN // HEADS
LENGTHS = (32, 20, 12, 27)
WIDTH = max(LENGTHS)
BATCH = len(LENGTHS)
NEW = 64
WARMUP_NEW = 4
PAD = 0
STD = 0.05
BYTES = 4  # fp32
KV_WITHIN, LATENCY_WITHIN = 0.10, 0.25  # the targets
# name: (ranks, torch threads per rank, tp, what)
RUNS = {
    "hf": (1, 1, 1, "1 process, HF model.generate(do_sample=False), 1 thread"),
    "w1": (1, 1, 1, "1 process, parallelize(model) world 1, pm.generate, 1 thread"),
    "tp2": (2, 1, 2, "2 ranks x 1 thread, tp=2, pm.generate"),
    "tp4": (4, 1, 4, "4 ranks x 1 thread, tp=4, pm.generate"),
}
# launches: (ranks, threads, the runs it does in order)
LAUNCHES = [(1, 1, ("hf", "w1")), (2, 1, ("tp2",)), (4, 1, ("tp4",))]


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks, threads, names, repeats):
    out = tempfile.mkdtemp(prefix="monarch-generate-")
    cmd = [sys.executable, "-m", "torch_monarch.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), __file__, "--worker", ",".join(names), "--repeats", str(repeats), out]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    subprocess.run(cmd, check=True, timeout=900, stdout=subprocess.DEVNULL, env=env)
    results = {}
    for name in names:
        results[name] = []
        for r in range(ranks):
            with open(os.path.join(out, f"{name}.rank{r}.json")) as f:
                results[name].append(json.load(f))
    return results


# ---------------------------------------------------------------------------------------
# Worker

def make_model():
    import torch
    import transformers as T
    config = T.LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                           max_position_embeddings=2 * (WIDTH + NEW), attention_dropout=0.0)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, STD)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model.eval()


def prompts():
    import torch
    g = torch.Generator().manual_seed(100)
    ids = torch.full((BATCH, WIDTH), PAD, dtype=torch.long)
    mask = torch.zeros(BATCH, WIDTH, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        ids[i, WIDTH - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, WIDTH - n:] = 1
    return ids, mask


def cache_bytes(cache):
    """Bytes of the key and value tensors a DynamicCache holds, its positions and kv heads."""
    total, tokens, heads = 0, None, None
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None and t.numel():
                total += t.numel() * t.element_size()
                heads, tokens = t.shape[1], t.shape[2]
    return total, tokens, heads


class Stamps:
    """Start times of the first decoder layer's forward (one per model forward)."""

    def __init__(self, layer):
        self.times = []
        layer.register_forward_pre_hook(lambda *_: self.times.append(time.perf_counter()))


def timed(run, stamps, repeats):
    """Runs ``run()`` (one generate of NEW tokens) ``repeats`` times: TTFTs, decode intervals, wall times."""
    ttft, steps, walls, out = [], [], [], None
    for _ in range(repeats):
        stamps.times.clear()
        start = time.perf_counter()
        out = run()
        end = time.perf_counter()
        t = stamps.times
        if len(t) != NEW:
            raise RuntimeError(f"expected {NEW} forwards per generate, the hook saw {len(t)}")
        ttft.append(t[1] - start)
        steps.extend([b - a for a, b in zip(t[1:], t[2:] + [end])])
        walls.append(end - start)
    return ttft, steps, walls, out


def predictions(model, tp, cluster, host, read_bw):
    """The planner's predictions for the run: on the probed cluster (default hbm_efficiency 0.7),
    the same with hbm_efficiency 1, and on the cpu preset; and the one the bench scores
    ("probed_host"): the probed cluster with what decode reaches on this machine, measured on
    generic kernels (``host``: host_probe's seconds per op, ops per block and the loop's
    seconds per step, a CPU rank dispatching and computing on one thread; ``read_bw``: decode_read_probe's bytes/s, as
    hbm_efficiency = read_bw / the probe's bandwidth)."""
    import torch
    import torch_monarch
    from torch_monarch import planner
    from torch_monarch.api import model_graph
    x = torch.zeros(1, WIDTH + NEW, dtype=torch.long)
    out = {}
    _, graph = model_graph(model, x)
    out["probed_host"] = planner.plan_inference(graph, cluster, batch=BATCH, prompt_len=WIDTH, max_new_tokens=NEW,
                                                tp=tp, pp=1, host_seconds_per_op=host["seconds_per_op"],
                                                ops_per_block=host["ops_per_block"],
                                                host_seconds_per_step=host["seconds_per_step"],
                                                host_overlaps_device=False,
                                                hbm_efficiency=min(1.0, read_bw / cluster.hbm_bytes_per_s))
    for key, c, eff in (("probed", cluster, None), ("probed_eff1", cluster, 1.0)):
        if eff is None:
            plan = torch_monarch.plan(model, x, cluster=c, mode="inference", batch=BATCH, prompt_len=WIDTH,
                                      max_new_tokens=NEW, tp=tp, pp=1)
        else:  # api.plan has no hbm_efficiency=: the planner's own entry with the same graph
            from torch_monarch import planner
            from torch_monarch.api import model_graph
            _, graph = model_graph(model, x)
            plan = planner.plan_inference(graph, c, batch=BATCH, prompt_len=WIDTH, max_new_tokens=NEW, tp=tp, pp=1,
                                          hbm_efficiency=eff)
        out[key] = plan
    from torch_monarch import planner
    out["preset"] = torch_monarch.plan(model, x, cluster=planner.cluster("cpu", tp), mode="inference", batch=BATCH,
                                       prompt_len=WIDTH, max_new_tokens=NEW, tp=tp, pp=1)
    result = {}
    for key, plan in out.items():
        p = plan.inference.prediction
        result[key] = {k: getattr(p, k) for k in dir(p) if not k.startswith("_") and isinstance(getattr(p, k), float)}
        result[key]["choice"] = plan.choices[0] if plan.choices else ""
    return result


def host_probe(tp=None, repeats=3):
    """The host's time in an eager decode step, measured apart from the bench's model: a Hugging
    Face Llama of the same architecture but tiny (hidden 64, 8 heads over 4 kv heads, vocabulary
    256), whose decode step does next to no arithmetic, with 2 and with 4 layers, through the
    run's engine: HF's ``generate`` (``tp`` None) or ``parallelize(tiny, mesh tp=tp)`` and
    ``pm.generate`` (every rank of the run calls it: tp's own modules and collectives are part of
    a block's host time). Each depth generates the bench's prompts' shape, 64 new tokens,
    ``repeats`` times; its step is the median interval between the first layer's forwards, as
    the bench times the runs: the whole loop, choosing the token and the cache's bookkeeping
    included. The two depths give a line: its slope is the host time per decoder block, its
    intercept at 0 layers the loop's own time per step (the planner's host_seconds_per_step).
    The operators (aten ops, counted at the dispatcher) of one decode step are those of a
    generate of 2 tokens less those of 1; the difference between the depths / 2 is the
    operators per block (the planner's ops_per_block), and the slope / that count the seconds
    per operator. Under tp the steps also wait for the tiny model's tp collectives (2 all-reduces
    per block; the embedding's and the logits' gather per step), which the planner counts apart
    (decode_tp_comm_s): one all-reduce's time on the group, measured here back to back, comes
    off the slope twice and off the intercept twice. Returns {"seconds_per_op", "ops_per_block",
    "seconds_per_step", "step_s": {2: s, 4: s}, "ops": {2: n, 4: n}, "collective_s", "engine"}."""
    import torch
    import torch_monarch
    import transformers as T
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    ids = torch.randint(3, 256, (BATCH, WIDTH), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(BATCH, WIDTH, dtype=torch.long)
    ops, step_s, collective = {}, {}, 0.0
    for layers in (2, 4):
        cfg = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=256, max_position_embeddings=256)
        torch.manual_seed(0)
        model = T.LlamaForCausalLM(cfg).eval()
        if tp is None:
            first = model.model.layers[0]

            def run(n=NEW):
                with torch.no_grad():
                    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                          do_sample=False, pad_token_id=PAD, eos_token_id=None)
        else:
            pm = torch_monarch.parallelize(model, mesh=torch_monarch.device_mesh(tp=tp))
            first = pm._plain[0].model.layers[0]

            def run(n=NEW):
                return pm.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=PAD)
        run(WARMUP_NEW)
        counted = []
        for n in (1, 2):
            counter = Count()
            with counter:
                run(n)
            counted.append(counter.n)
        ops[layers] = counted[1] - counted[0]
        _, steps, _, _ = timed(run, Stamps(first), repeats)
        step_s[layers] = statistics.median(steps)
        if tp is not None and tp > 1 and layers == 4:
            collective = all_reduce_time(pm.mesh.group("tp"))
    slope = (step_s[4] - step_s[2]) / 2
    per_block = max(0.0, slope - 2 * collective)
    ops_per_block = (ops[4] - ops[2]) / 2
    return {"seconds_per_op": per_block / ops_per_block, "ops_per_block": ops_per_block,
            "seconds_per_step": max(0.0, step_s[2] - 2 * slope - 2 * collective), "step_s": step_s, "ops": ops,
            "collective_s": collective, "engine": "HF generate" if tp is None else f"pm.generate tp={tp}"}


def cluster_dict(c):
    keys = ("peak_flops_fp32", "matmul_efficiency", "hbm_bytes_per_s", "intra_node_latency_s",
            "intra_node_bytes_per_s", "cores_per_node", "devices_per_node")
    return {k: getattr(c, k) for k in keys}


def decode_read_probe(repeats=7):
    """The bytes per second a decode step's matmuls read weights at on this rank, measured on
    generic matrices, not the bench's model: 16 fp32 weights of 1024 x 4096 (256 MiB, beyond
    the caches) each multiplied by a [BATCH, 1024] input, median of ``repeats`` passes. On a
    GPU this share of the HBM peak is gpt-fast's 0.69 (the planner's hbm_efficiency); a CPU
    core's skinny GEMM reaches far less of what a streaming add does (cluster.probe's figure)."""
    import torch
    import torch.nn.functional as F
    weights = [torch.randn(4096, 1024) for _ in range(16)]
    x = torch.randn(BATCH, 1024)
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for w in weights:
                F.linear(x, w)
            times.append(time.perf_counter() - t0)
    return sum(w.numel() * 4 for w in weights) / statistics.median(times)


def gemv_floor(module, repeats=7):
    """Median seconds of one pass of F.linear over every linear weight this rank holds, on a
    [batch, in] input: the matmuls a decode step runs (reading each weight once), without the
    model's other operators or its Python."""
    import torch
    import torch.nn.functional as F
    weights = [m.weight for name, m in module.named_modules()
               if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
               and "embed" not in name]  # the (possibly vocabulary-split) embedding: a lookup, not read
    xs = [torch.randn(BATCH, w.shape[1]) for w in weights]
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for x, w in zip(xs, weights):
                F.linear(x, w)
            times.append(time.perf_counter() - t0)
    return statistics.median(times), sum(w.numel() * w.element_size() for w in weights)


def all_reduce_time(group, weight=None, repeats=50):
    """Median seconds of one all-reduce of [batch, hidden] fp32 over ``group`` (what each tp
    collective of a decode step moves): back to back, or (``weight``) each after a matmul of
    [batch, in] by that weight, as in a decode step (only the all-reduce is timed; a rank that
    arrives first waits for the others, and a waiting process may be descheduled)."""
    import torch
    import torch.nn.functional as F
    t = torch.randn(BATCH, HIDDEN)
    x = torch.randn(BATCH, weight.shape[1]) if weight is not None else None
    times = []
    group.all_reduce(t).wait()  # checked once; then unchecked, as generate's decode steps run
    group.checks_collectives = False
    try:
        with torch.no_grad():
            for _ in range(repeats):
                if weight is not None:
                    F.linear(x, weight)
                t0 = time.perf_counter()
                group.all_reduce(t).wait()
                times.append(time.perf_counter() - t0)
    finally:
        group.checks_collectives = True
    return statistics.median(times)


def worker(names, repeats, out_dir):
    import torch
    import torch_monarch
    from procmem import reset_peak, vm
    from torch_monarch import cluster as cl

    ranks, threads = RUNS[names[0]][:2]
    torch.set_num_threads(threads)
    rank = int(os.environ["RANK"])
    world = torch_monarch.init(timeout=600)
    load_before = os.getloadavg()
    # This job's cluster, measured on its own ranks (links over loopback Gloo, CPU rates).
    began = time.perf_counter()
    cluster = cl.probe(cl.detect(world_size=world.size, ranks_per_node=world.size), world, use_cache=False)
    # Every rank probes at once (a barrier before each probe): the contention the run's ranks
    # see when they decode in lockstep.
    everyone = torch_monarch._runtime.DeviceMesh(world, pp=1, dp=world.size, tp=1).group("dp")
    everyone.all_reduce(torch.zeros(1)).wait()
    read_bw = decode_read_probe()
    probe_s = time.perf_counter() - began
    ids, mask = prompts()
    base = make_model()
    for name in names:
        tp = RUNS[name][2]
        model = copy.deepcopy(base)
        everyone.all_reduce(torch.zeros(1)).wait()
        host = host_probe(None if name == "hf" else tp)  # through the run's own engine
        result = {"rank": rank, "load_before": load_before, "probe_s": probe_s, "cluster": cluster_dict(cluster),
                  "host_probe": host, "decode_read_bytes_per_s": read_bw}
        if rank == 0:
            result["predicted"] = predictions(make_model(), tp, cluster, host, read_bw)
        if name == "hf":
            local = model
            stamps = Stamps(model.model.layers[0])

            def run(n=NEW):
                with torch.no_grad():
                    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                          pad_token_id=PAD, eos_token_id=None, return_dict_in_generate=True)
            run(WARMUP_NEW)
            baseline = vm("VmRSS")
            reset_peak()
            ttft, steps, walls, res = timed(run, stamps, repeats)
            out, cache = res.sequences, res.past_key_values
        else:
            pm = torch_monarch.parallelize(model, mesh=torch_monarch.device_mesh(tp=tp))
            local = pm._plain[0]  # this rank's model (its tp shards)
            layer = local.model.layers[0]
            stamps = Stamps(layer)

            def run(n=NEW):
                return pm.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=PAD)
            run(WARMUP_NEW)
            baseline = vm("VmRSS")
            reset_peak()
            ttft, steps, walls, out = timed(run, stamps, repeats)
            stats = pm.generate_stats
            result["mesh"] = {"tp": pm.tp, "dp": pm.dp, "pp": pm.pp}
            if tp > 1:
                result["all_reduce_s"] = all_reduce_time(pm.mesh.group("tp"))
                result["all_reduce_after_matmul_s"] = all_reduce_time(
                    pm.mesh.group("tp"), local.model.layers[0].mlp.down_proj.weight)
        peak = vm("VmHWM") - baseline
        result["gemv_floor_s"], result["linear_bytes"] = gemv_floor(local)
        if name == "hf":
            kv, kv_tokens, kv_heads = cache_bytes(cache)
        else:  # the pre-allocated cache generate held (prompt + new tokens per layer)
            kv, kv_tokens, kv_heads = stats["kv_cache_bytes"], stats["capacity"], stats["kv_heads"]
        result.update(ttft_s=ttft, step_s=steps, wall_s=walls, out=out.tolist(), kv_bytes=kv, kv_tokens=kv_tokens,
                      kv_heads=kv_heads, peak_growth=peak, load_after=os.getloadavg(),
                      param_bytes=sum(p.numel() * p.element_size() for p in local.parameters()))
        with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(result, f)
        del model


# ---------------------------------------------------------------------------------------
# Summary and the table

def summarize(name, results):
    ranks, threads, tp, what = RUNS[name]
    r0 = results[0]
    outs = [r["out"] for r in results]
    if any(o != outs[0] for o in outs):
        raise AssertionError(f"{name}: the tp ranks' outputs differ")
    per_token = max(statistics.median(r["step_s"]) for r in results)
    ttft = max(statistics.median(r["ttft_s"]) for r in results)
    wall = max(statistics.median(r["wall_s"]) for r in results)
    kv = max(r["kv_bytes"] for r in results)
    pred = r0["predicted"]["probed_host"]
    row = {"run": name, "what": what, "ranks": ranks, "threads_per_rank": threads, "tp": tp,
           "mesh": r0.get("mesh"), "ttft_ms": ttft * 1e3, "per_token_ms": per_token * 1e3,
           "per_token_ms_p10_p90": [statistics.quantiles(sorted(s for r in results for s in r["step_s"]), n=10)[i] * 1e3
                                    for i in (0, 8)],
           "per_token_ms_per_rank": [statistics.median(r["step_s"]) * 1e3 for r in results],
           "tokens_per_s": BATCH * NEW / wall, "generate_s": wall,
           "generate_s_all": [r["wall_s"] for r in results],
           "kv_bytes_per_rank": [r["kv_bytes"] for r in results], "kv_tokens": r0["kv_tokens"],
           "kv_heads_per_rank": r0["kv_heads"],
           "param_bytes_per_rank": [r["param_bytes"] for r in results],
           "peak_growth_per_rank": [r["peak_growth"] for r in results],
           "load_before": max(r["load_before"][0] for r in results),
           "load_after": max(r["load_after"][0] for r in results),
           "probe_s": r0["probe_s"], "cluster_probed": r0["cluster"],
           "predicted": r0["predicted"],
           "per_token_error": pred["per_token_s"] / per_token - 1,
           "ttft_error": pred["ttft_s"] / ttft - 1,
           "tokens_per_s_error": pred["tokens_per_s"] / (BATCH * NEW / wall) - 1,
           "kv_error": pred["kv_cache_bytes"] / kv - 1,
           "per_token_error_preset": r0["predicted"]["preset"]["per_token_s"] / per_token - 1,
           "per_token_error_no_host": r0["predicted"]["probed"]["per_token_s"] / per_token - 1,
           "host_probe": r0["host_probe"],
           "per_token_error_eff1": r0["predicted"]["probed_eff1"]["per_token_s"] / per_token - 1,
           "gemv_floor_ms": max(r["gemv_floor_s"] for r in results) * 1e3,
           "linear_bytes_per_rank": r0["linear_bytes"],
           "out": r0["out"]}
    if tp > 1:
        row["all_reduce_ms"] = max(r["all_reduce_s"] for r in results) * 1e3
        row["all_reduce_after_matmul_ms"] = max(r["all_reduce_after_matmul_s"] for r in results) * 1e3
    return row


def calibrated(rows):
    """The planner again, its inputs taken from this run instead of the probe: memory bandwidth
    = the rank's linear bytes / the linear floor (what the decode's matmuls reach), hbm_efficiency
    1, and the link latency alpha set so that its all-reduce latency term (2 ceil(log2 tp) alpha)
    equals the all-reduce measured in the run, and the host dispatch as probed. What is left of
    the error is what the model leaves out (operators outside the blocks, the loop's own)."""
    import math
    import torch
    from torch_monarch import planner
    from torch_monarch.api import model_graph
    model = make_model()
    _, graph = model_graph(model, torch.zeros(1, WIDTH + NEW, dtype=torch.long))
    for r in rows:
        c = planner.cluster("cpu", r["tp"])
        probed = r["cluster_probed"]
        c.peak_flops_fp32 = c.peak_flops_tf32 = c.peak_flops_bf16 = probed["peak_flops_fp32"]
        c.matmul_efficiency = 1.0
        c.hbm_bytes_per_s = r["linear_bytes_per_rank"] / (r["gemv_floor_ms"] / 1e3)
        if r["tp"] > 1:
            c.intra_node_latency_s = c.inter_node_latency_s = r["all_reduce_after_matmul_ms"] / 1e3 / (
                2 * math.ceil(math.log2(r["tp"])))
        host = r["host_probe"]
        plan = planner.plan_inference(graph, c, batch=BATCH, prompt_len=WIDTH, max_new_tokens=NEW, tp=r["tp"], pp=1,
                                      hbm_efficiency=1.0, host_seconds_per_op=host["seconds_per_op"],
                                      ops_per_block=host["ops_per_block"],
                                      host_seconds_per_step=host["seconds_per_step"], host_overlaps_device=False)
        p = plan.inference.prediction
        r["predicted"]["calibrated"] = {"per_token_s": p.per_token_s, "ttft_s": p.ttft_s,
                                        "tokens_per_s": p.tokens_per_s, "decode_weights_s": p.decode_weights_s,
                                        "decode_tp_comm_s": p.decode_tp_comm_s,
                                        "hbm_bytes_per_s": c.hbm_bytes_per_s,
                                        "intra_node_latency_s": c.intra_node_latency_s}
        r["per_token_error_calibrated"] = p.per_token_s / (r["per_token_ms"] / 1e3) - 1


def print_table(rows, repeats):
    mib = 2.0 ** 20
    print(f"HF LlamaForCausalLM hidden {HIDDEN}, ffn {FFN}, {LAYERS} layers, {HEADS} heads / {KV_HEADS} kv heads, "
          f"vocab {VOCAB}, fp32; {BATCH} prompts of {LENGTHS} tokens (left-padded to {WIDTH}), greedy, {NEW} new "
          f"tokens; {repeats} timed generates per run")
    print("Times: 2 shared CPU cores; tp ranks are 1-thread processes on those 2 cores + Gloo over loopback. "
          "pred: planner on the cluster probed in the run.")
    print(f"{'run':<4} {'ranks':>5} {'TTFT ms':>8} {'pred':>7} {'ms/tok':>7} {'p10-p90':>11} {'pred':>6} "
          f"{'err':>6} {'no host':>8} {'preset':>6} {'tok/s':>6} {'pred':>6} {'KV KiB/rank':>11} {'pred':>7} {'err':>6} "
          f"{'kv h':>4} {'peak MiB':>8} {'load':>9}")
    for r in rows:
        p = r["predicted"]["probed_host"]
        lo, hi = r["per_token_ms_p10_p90"]
        print(f"{r['run']:<4} {r['ranks']:>5} {r['ttft_ms']:>8.1f} {p['ttft_s'] * 1e3:>7.1f} {r['per_token_ms']:>7.2f} "
              f"{lo:>5.1f}-{hi:<5.1f} {p['per_token_s'] * 1e3:>6.2f} {r['per_token_error']:>+6.0%} "
              f"{r['per_token_error_no_host']:>+8.0%} "
              f"{r['predicted']['preset']['per_token_s'] * 1e3:>6.2f} {r['tokens_per_s']:>6.0f} "
              f"{p['tokens_per_s']:>6.0f} {max(r['kv_bytes_per_rank']) / 1024:>11.1f} "
              f"{p['kv_cache_bytes'] / 1024:>7.1f} {r['kv_error']:>+6.1%} {r['kv_heads_per_rank']:>4} "
              f"{max(r['peak_growth_per_rank']) / mib:>8.1f} {r['load_before']:>4.1f}-{r['load_after']:<4.1f}")
    print(f"{'run':<4} {'ms/tok':>7} {'linear floor':>12} {'lin MiB':>7} {'all-red ms':>10} {'after mm':>8} "
          f"{'probe: GB/s':>11} {'alpha us':>8} {'calib':>6} {'err':>5}  pred decode: weights + kv + tp comm + host (ms)")
    for r in rows:
        c, p = r["cluster_probed"], r["predicted"]["probed_host"]
        ar = (f"{r['all_reduce_ms']:>10.2f} {r['all_reduce_after_matmul_ms']:>8.2f}" if "all_reduce_ms" in r
              else f"{'-':>10} {'-':>8}")
        alpha = f"{c['intra_node_latency_s'] * 1e6:>8.0f}" if r["ranks"] > 1 else f"{'-':>8}"
        print(f"{r['run']:<4} {r['per_token_ms']:>7.2f} {r['gemv_floor_ms']:>12.2f} "
              f"{r['linear_bytes_per_rank'] / mib:>7.1f} {ar} {c['hbm_bytes_per_s'] / 1e9:>11.1f} {alpha} "
              f"{r['predicted']['calibrated']['per_token_s'] * 1e3:>6.2f} {r['per_token_error_calibrated']:>+5.0%}  "
              f"{p['decode_weights_s'] * 1e3:.2f} + {p['decode_kv_s'] * 1e3:.2f} + {p['decode_tp_comm_s'] * 1e3:.2f} + "
              f"{p['decode_host_s'] * 1e3:.2f}")
    for r in rows:
        h = r["host_probe"]
        steps = {int(k): v for k, v in h["step_s"].items()}
        print(f"host probe {r['run']:<4} ({h['engine']}, a tiny Llama, rank 0): decode step {steps[2] * 1e3:.2f} ms at 2 "
              f"layers, {steps[4] * 1e3:.2f} ms at 4: {h['seconds_per_step'] * 1e3:.2f} ms per step outside the blocks + "
              f"{h['ops_per_block']:.0f} ops per block at {h['seconds_per_op'] * 1e6:.1f} us")
    print("TTFT: call to the 2nd forward (prefill + first token); ms/tok: median decode step (63 per generate, "
          "pooled over repeats, slowest rank),\np10-p90 of those; pred / err: the planner on the probed cluster "
          "(default hbm_efficiency 0.7) with the host's dispatch as probed, and pred/measured - 1;\nno host: the "
          "same without the host term; preset: on planner.cluster('cpu', n).\n"
          "tok/s: 4 x 64 / median generate wall time. KV: key+value bytes the DynamicCache holds after generate "
          "(95 positions) per rank; pred: the\nplanner's KV cache per device (96 positions, pre-allocated). kv h: "
          "kv heads per rank's cache. peak: VmHWM growth over generate, largest rank.\nload: 1-minute load average "
          "before the probe - after the run (above 2: other processes shared the 2 cores).\nlinear floor: one "
          "pass of F.linear over the rank's linear weights (lin MiB) on a [4, in] input, median of 7: the decode "
          "step's matmuls alone.\nall-reduce: median of 50 all-reduces of [4, 512] fp32 over tp in the run (a "
          "decode step runs 2 per layer + the embedding's);\nafter mm: the same, each after a [4, 1536] x "
          "down_proj matmul (as in decode; only the all-reduce timed). probe: the\nmemory bandwidth per rank and the ring "
          "latency alpha cluster.probe fitted in the run (the planner's inputs). calib: the planner with\nthe bandwidth "
          "the linear floor reached and the all-reduce 'after mm' measured here as its inputs (hbm_efficiency 1); err: calib / "
          "ms/tok - 1.")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "generate.json"))
    ap.add_argument("rest", nargs="*")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker.split(","), args.repeats, args.rest[0])
    began = time.perf_counter()
    load_start = os.getloadavg()
    raw = {}
    for ranks, threads, names in LAUNCHES:
        raw.update(launch(ranks, threads, names, args.repeats))
    rows = [summarize(name, raw[name]) for name in RUNS]
    calibrated(rows)
    print_table(rows, args.repeats)
    reference = rows[0]["out"]
    equal = {r["run"]: r["out"] == reference for r in rows}
    print("token-for-token equal to hf: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in equal.items()))
    hf = rows[0]
    for r in rows[1:]:
        print(f"  {r['run']}: per-token {r['per_token_ms'] / hf['per_token_ms']:.2f}x hf's, TTFT "
              f"{r['ttft_ms'] / hf['ttft_ms']:.2f}x, tokens/s {r['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
    lat_ok = [r["run"] for r in rows[1:] if abs(r["per_token_error"]) <= LATENCY_WITHIN]
    kv_ok = [r["run"] for r in rows if abs(r["kv_error"]) <= KV_WITHIN]
    print(f"per-token latency within {LATENCY_WITHIN:.0%} of the planner's: {lat_ok or 'none'} of "
          f"{[r['run'] for r in rows[1:]]}; KV cache within {KV_WITHIN:.0%}: {kv_ok or 'none'}")
    import torch
    import transformers
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__, "cores": os.cpu_count(),
                   "model": {"hidden": HIDDEN, "ffn": FFN, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS,
                             "vocab": VOCAB, "std": STD, "dtype": "fp32"},
                   "prompt_lengths": LENGTHS, "padded_to": WIDTH, "new_tokens": NEW, "repeats": args.repeats,
                   "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(),
                   "bench_seconds": time.perf_counter() - began, "equal_to_hf": equal,
                   "targets": {"per_token_within": LATENCY_WITHIN, "kv_within": KV_WITHIN},
                   "runs": rows}, f, indent=1)
    print(f"({time.perf_counter() - began:.0f} s)")
    if not all(equal.values()):
        raise AssertionError(f"outputs differ from HF generate's: {equal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
