"""The one-call API: read the model, read the machine, plan, check, and lay the model out.

    plan = torch_monarch.plan(model, example_input, global_batch=512)              # offline or in a job
    model = torch_monarch.parallelize(model, example_input=x, global_batch=512)   # in a job
    model.plan.summary(); model.plan.save("plan.json")

Pins use the command line's names (``tp=2, pp=2, dp=1, zero_stage=3, micro_batch=2,
schedule="1f1b", virtual_stages=2, sequence_parallel=True``, and ``ep=2`` / ``cp=2``: experts
over ep ranks of dp x cp, the sequence over cp ranks). What the planner may choose
is limited to what the runtime can build (``runtime_training``): the one place both agree.
"""

import torch

from . import planner as _planner
from .graph import blocks_of, read_model

_PIN_NAMES = {"tp", "pp", "dp", "zero_stage", "zero", "micro_batch", "micro_batch_size", "schedule",
              "virtual_stages", "sequence_parallel", "recompute", "cp", "ep"}
_INT_PINS = ("tp", "pp", "dp", "zero_stage", "zero", "micro_batch", "micro_batch_size", "virtual_stages", "cp", "ep")


def _pins(pins):
    unknown = sorted(set(pins) - _PIN_NAMES)
    if unknown:
        raise TypeError(f"plan: unknown pin(s) {unknown}; pins are {sorted(_PIN_NAMES)}")
    for key, value in pins.items():
        if key in _INT_PINS and value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"plan: pin {key}={value!r} must be an int")
    out = dict(pins)
    if "zero_stage" in out:
        out["zero"] = out.pop("zero_stage")
    if "micro_batch_size" in out:
        out["micro_batch"] = out.pop("micro_batch_size")
    return out


def runtime_pins(model, pins, *, laid_out=False):
    """``pins`` with what the runtime cannot build here turned off: context parallelism
    (``cp=1``) for a model without attention ``context_parallel`` converts (Llama- or
    GPT-2-style modules), and, when ``laid_out`` (parallelize lays out this very model), expert
    parallelism (``ep=1``) for a model still on meta (expert_parallel splits materialized
    experts). A pinned value is left for the planner and runtime to accept or refuse."""
    out = dict(pins)
    from .context_parallel import convertible
    if out.get("cp") is None and not convertible(model):
        out["cp"] = 1
    if laid_out and out.get("ep") is None and any(p.is_meta for p in model.parameters()):
        out["ep"] = 1
    return out


def runtime_training(info, global_batch, dtype=None, pins=None, param_dtype=None,
                     cut_problem=None, compiled=False):
    """The TrainingConfig the planner searches under, restricted to what the runtime builds:
    recomputation (``full`` or ``selective``) only for models with blocks, sequence
    parallelism only when pinned, tensor parallelism only for models with split-able
    layers, pipelines only for models with blocks. Bytes per parameter follow the dtype:
    fp32 training with Adam keeps 4 (weights) + 4 (grads) + 8 (two moments); bf16/fp16
    mixed precision ZeRO's 2 + 2 + 12 (Rajbhandari et al. 2020, Sec. 3.1). The runtime's ZeRO
    engine keeps the gradients it accumulates and reduces, and the shards' reduced ones, in
    fp32 whatever the compute dtype: zero_grad_bytes = 4. Without ZeRO the gradients are the
    parameters' (``param_dtype``: the fp32 master weights under mixed precision,
    torch_monarch.mixed_precision): master_grad_bytes is their element size, and each forward
    casts them, its graph keeping the copies until its backward (weights_cast_per_forward). A
    pipeline stage keeps what it sends until the step ends (pipeline_sends_kept: the
    PipelineExecutor waits for its sends there). ``compiled``
    (blocks under torch.compile): neither the zero-bubble schedule nor selective
    recomputation, which run eagerly inside the blocks (torch_monarch.compile)."""
    pins = pins or {}
    dtype = _planner._enum(_planner.DType, dtype, "dtype") if dtype is not None else info.graph.layers[0].param_dtype
    t = _planner.training(global_batch, compute_dtype=dtype)
    if dtype == _planner.DType.fp32:
        t.param_bytes, t.grad_bytes, t.optimizer_bytes, t.activation_bytes = 4, 4, 8, 4
    t.zero_grad_bytes = 4  # fully_shard.cpp: unsharded and shard gradients in fp32
    # pipeline.cpp: a stage keeps what it sends (outputs, input gradients) until the step's end.
    t.pipeline_sends_kept = True
    if param_dtype is not None:
        t.master_grad_bytes = torch.empty((), dtype=param_dtype).element_size()
        # torch_monarch.mixed_precision casts the weights per forward; each forward's graph
        # keeps its copies until its backward (below ZeRO-3, which casts what it gathers).
        compute = {_planner.DType.fp32: torch.float32, _planner.DType.bf16: torch.bfloat16,
                   _planner.DType.fp16: torch.float16}.get(dtype)
        t.weights_cast_per_forward = compute is not None and compute != param_dtype
    # The runtime recomputes whole blocks or their attention cores (torch_monarch/recompute.py).
    t.allow_recompute = len(info.blocks) > 0
    t.recompute_modes = [_planner.Recompute.none, _planner.Recompute.selective, _planner.Recompute.full]
    t.allow_sequence_parallel = bool(pins.get("sequence_parallel"))
    # (A model still on meta is split by tp on meta; each rank materializes its shards.)
    t.allow_tensor_parallel = any(
        str(layer.tp).split(".")[-1] != "replicated" for layer in info.graph.layers)
    # Pipelines need blocks and a forward the stage cut can trace (``cut_problem`` says why not).
    t.allow_pipeline_parallel = len(info.blocks) > 1 and cut_problem is None
    t.schedules = [_planner.ScheduleKind.one_f_one_b, _planner.ScheduleKind.interleaved_1f1b,
                   _planner.ScheduleKind.zero_bubble_h1]  # zbv only when pinned (TrainingConfig.schedules)
    if compiled:  # the zero-bubble schedule's deferred linears do not trace (compile.check)
        t.schedules = [k for k in t.schedules if k != _planner.ScheduleKind.zero_bubble_h1]
        t.recompute_modes = [m for m in t.recompute_modes if m != _planner.Recompute.selective]
    return t


def model_graph(model, example_input, *, name=None, dtype=None, tp_plan=None):
    """(ModelInfo, planner ModelGraph) of ``model``; the graph only allows pipeline cuts the
    runtime can make."""
    info = read_model(model, example_input, name=name, tp_plan=tp_plan, dtype=dtype)
    # The runtime's rule (planner::restrict_cuts_to_blocks): cuts only between blocks.
    return info, _planner.restrict_cuts_to_blocks(info.graph)


def plan(model, example_input, global_batch=None, cluster=None, *, dtype=None, tp_plan=None, name=None,
         alternatives=5, profile=None, compile=False, mode="training", batch=None, prompt_len=None,
         max_new_tokens=None, latency_target=None, objective=None, **pins):
    """Plans ``model`` (any ``nn.Module``, on any device including ``meta``) for
    ``global_batch`` samples per step on ``cluster`` (a planner Cluster, e.g.
    ``torch_monarch.planner.cluster("a100-80gb", 1024)``; default: this job's machine,
    ``cluster.detect()``). ``profile``: per-layer times measured on the machine
    (``torch_monarch.profile.measure``, a MeasuredProfile or its JSON path) instead of the
    analytic model's. ``compile``: plan for blocks under torch.compile (parallelize's
    ``compile=``). Returns a Plan.

    ``mode="inference"`` plans generation instead (``planner.plan_inference``): ``batch``
    sequences per replica, ``prompt_len`` and ``max_new_tokens``; the lowest per-token latency,
    or (``latency_target`` in seconds, or ``objective="throughput"``) the most tokens/s under it;
    ``tp`` / ``pp`` may be pinned; ``global_batch`` is not used."""
    if mode == "inference":
        _, graph = model_graph(model, example_input, name=name, dtype=dtype, tp_plan=tp_plan)
        if cluster is None:
            from .cluster import detect
            cluster = detect()
        unknown = sorted(set(pins) - {"tp", "pp"})
        if unknown:
            raise ValueError(f"plan: {unknown[0]} is not an inference pin (tp and pp are)")
        if batch is None or prompt_len is None or max_new_tokens is None:
            raise ValueError("plan: mode='inference' needs batch=, prompt_len= and max_new_tokens=")
        return _planner.plan_inference(graph, cluster, batch=batch, prompt_len=prompt_len,
                                       max_new_tokens=max_new_tokens, latency_target=latency_target,
                                       objective=objective, alternatives=alternatives, **pins)
    if mode != "training":
        raise ValueError(f"plan: mode must be 'training' or 'inference', got {mode!r}")
    if global_batch is None:
        raise TypeError("plan: global_batch is required for mode='training'")
    pins = runtime_pins(model, _pins(pins))
    info, graph = model_graph(model, example_input, name=name, dtype=dtype, tp_plan=tp_plan)
    if cluster is None:
        from .cluster import detect
        cluster = detect()
    training = runtime_training(info, global_batch, dtype, pins, param_dtype=_param_dtype(model),
                                cut_problem=_cut_problem(model, info, pins, "plan"), compiled=compile not in (None, False))
    return _planner.plan(graph, cluster, training, alternatives=alternatives, profile=profile, **pins)


def _cut_problem(model, info, pins, who):
    """Why the runtime could not cut ``model`` into pipeline stages (None when it can, or when
    it has no blocks to cut between): it is then planned without pipelines, and a pinned
    ``pp`` > 1 is refused with the reason."""
    from .pipeline import trace_problem
    from .pipeline_hooks import cut_problem
    from .sharded import _default_units
    problem = trace_problem(model) if len(info.blocks) > 1 else None
    if problem is not None:
        # Where torch.fx cannot trace the forward, stages are cut by module hooks instead.
        hooks = cut_problem(model, _default_units(model), info)
        problem = None if hooks is None else f"{problem}; and cutting by module hooks: {hooks}"
    if problem is not None and (pins.get("pp") or 1) > 1:
        raise ValueError(f"{who}: pp={pins['pp']} is pinned, but {type(model).__name__} cannot be cut into "
                         f"pipeline stages: {problem}")
    return problem


def check_plan(plan, model, example_input=None, *, info=None, world_size=None, tp_plan=None):
    """Every difference between ``plan`` and what this model and world are, in one
    ValueError (nothing is created before it): world size, layer names, kinds and parameter
    counts, heads / widths tp must divide, and stage cuts the runtime cannot make."""
    problems = []
    if world_size is not None and plan.mesh.world_size() != world_size:
        cp = f" cp={plan.mesh.cp}" if plan.mesh.cp > 1 else ""
        problems.append(f"world size: the plan is for {plan.mesh.world_size()} ranks "
                        f"(pp={plan.mesh.pp} dp={plan.mesh.dp}{cp} tp={plan.mesh.tp}), the job has {world_size}")
    if info is None and example_input is not None:
        info = read_model(model, example_input, tp_plan=tp_plan)
    if info is not None:
        problems += _layer_differences(plan, info)
    else:
        blocks = len(blocks_of(model))
        planned = sum(1 for layer in plan.layers if str(layer.kind).endswith("block"))
        if blocks != planned:
            problems.append(f"blocks: the plan has {planned}, the model has {blocks}")
    problems += _tp_problems(plan)
    problems += _ep_problems(plan, model, info)
    problems += _cp_problems(plan, model, info)
    problems += _stage_problems(plan, info)
    problems += _runtime_problems(plan)
    problems += _dtype_problems(plan)
    if len(problems) > 20:
        problems = problems[:20] + [f"... and {len(problems) - 20} more"]
    if problems:
        raise ValueError(f"parallelize: the plan does not fit this model / job ({len(problems)} difference"
                         f"{'s' if len(problems) != 1 else ''}):\n  - " + "\n  - ".join(problems))


def _layer_differences(plan, info):
    out = []
    planned = [(layer.name, str(layer.kind).split(".")[-1], layer.params) for layer in plan.layers]
    actual = [(layer.name, str(layer.kind).split(".")[-1], layer.params) for layer in info.graph.layers]
    if plan.model_params != info.graph.total_params():
        out.append(f"parameters: the plan's model has {plan.model_params:,}, this model {info.graph.total_params():,}")
    if len(planned) != len(actual):
        out.append(f"layers: the plan has {len(planned)}, the model has {len(actual)}")
    planned_names = {n for n, _, _ in planned}
    actual_names = {n for n, _, _ in actual}
    missing = [n for n, _, _ in actual if n not in planned_names]
    extra = [n for n, _, _ in planned if n not in actual_names]
    if missing:
        out.append(f"layers of the model missing from the plan: {_few(missing)}")
    if extra:
        out.append(f"layers in the plan the model does not have: {_few(extra)}")
    by_name = {n: (k, p) for n, k, p in actual}
    for n, k, p in planned:
        if n in by_name:
            ak, ap = by_name[n]
            if ak != k:
                out.append(f"layer {n}: kind {k} in the plan, {ak} in the model")
            if ap != p:
                out.append(f"layer {n}: {p:,} parameters in the plan, {ap:,} in the model")
    order = [n for n, _, _ in planned if n in by_name]
    if order != [n for n, _, _ in actual if n in planned_names]:
        out.append("layer order: the plan's layers run in another order than the model's")
    return out


def _runtime_problems(plan):
    """Plan fields the runtime cannot carry out: refused, never silently ignored."""
    from .recompute import check_mode
    try:
        check_mode(plan.recompute)
    except ValueError as e:
        return [str(e)]
    return []


_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _param_dtype(model):
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def torch_dtype(dtype):
    """A compute dtype as the planner names it ("bf16", DType.bf16) or as torch does
    (torch.bfloat16): the torch dtype; ValueError for one the runtime does not compute in."""
    if isinstance(dtype, torch.dtype) and dtype in _TORCH_DTYPES.values():
        return dtype
    compute = _TORCH_DTYPES.get(str(dtype).split(".")[-1])
    if compute is None:
        raise ValueError(f"dtype={dtype!r} is not a dtype the runtime computes in (fp32, tf32, bf16, fp16, or "
                         "torch.float32 / bfloat16 / float16)")
    return compute


def mixed_precision_for(compute, model):
    """The dtype the runtime computes in when ``compute`` differs from the model's parameters
    (they stay the master weights; hybrid.ParallelModel casts per forward, ZeRO per gathered
    unit); None when they agree."""
    return None if compute == _param_dtype(model) else compute


def mixed_precision_of(plan, model):
    """mixed_precision_for the plan's compute dtype."""
    compute = _TORCH_DTYPES.get(str(plan.training.compute_dtype).split(".")[-1])
    return None if compute is None else mixed_precision_for(compute, model)


def _dtype_problems(plan):
    """The plan's compute dtype is one the runtime computes in (every layout casts to it when
    the parameters hold another), or refused, naming the field."""
    name = str(plan.training.compute_dtype).split(".")[-1]
    if name not in _TORCH_DTYPES:
        return [f"training.compute_dtype: {name} is not a dtype the runtime computes in (fp32, tf32, bf16, fp16)"]
    return []


def _few(names, limit=6):
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _tp_problems(plan):
    out = []
    tp = plan.mesh.tp
    if tp <= 1:
        return out
    for layer in plan.layers:
        if str(layer.tp).endswith("replicated"):
            continue
        d = layer.tp_dims
        for field in ("heads", "kv_heads", "ffn", "vocab"):
            value = getattr(d, field)
            if value and value % tp:
                out.append(f"layer {layer.name}: tp={tp} does not divide {field}={value}")
    return out


def _ep_problems(plan, model, info):
    """Expert parallelism splits every experts module's experts evenly over ep ranks
    (torch_monarch.experts): ep must divide each one's count, and a plan with ep > 1 needs
    some. Each problem names the graph layer holding the module (or the module)."""
    from .experts import is_experts_module
    ep = plan.mesh.ep
    if ep <= 1:
        return []
    layers = [layer.name for layer in (info.graph.layers if info is not None else plan.layers)]
    out, found = [], False
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        found = True
        experts = module.gate_up_proj.shape[0]
        if experts % ep:
            layer = next((n for n in layers if name == n or name.startswith(n + ".")), None)
            where = f"layer {layer}" if layer else "module"
            out.append(f"{where}: ep={ep} does not divide its {experts} experts ({name})")
    if not found:
        out.append(f"mesh.ep: ep={ep} needs experts modules (gate_up_proj [experts, 2 * ffn, hidden] and "
                   f"down_proj [experts, hidden, ffn]); {type(model).__name__} has none")
    return out


def _cp_problems(plan, model, info):
    """Context parallelism needs attention context_parallel converts and a sequence of 2 x cp
    equal chunks."""
    cp = plan.mesh.cp
    if cp <= 1:
        return []
    out = []
    if not _cp_convertible(model):
        out.append(f"mesh.cp: cp={cp} needs attention context_parallel converts (Llama-style q/k/v/o_proj with "
                   f"rotary_emb and head_dim, or GPT-2-style c_attn); {type(model).__name__} has none")
    if info is not None and info.seq and info.seq % (2 * cp):
        out.append(f"mesh.cp: cp={cp} needs the sequence ({info.seq}) to split into 2 x cp equal chunks")
    return out


def _stage_problems(plan, info):
    """The runtime cuts pipelines between blocks only (``pipeline.split_model``)."""
    if plan.num_stages() <= 1:
        return []
    rows = [(layer.name, int(layer.stage), str(layer.kind).endswith("block")) for layer in plan.layers]
    block_rows = [i for i, (_, _, is_block) in enumerate(rows) if is_block]
    if not block_rows:
        return ["stages: the plan cuts a pipeline but the model has no blocks to cut between"]
    first, last = rows[block_rows[0]][1], rows[block_rows[-1]][1]
    out = []
    for i, (name, stage, is_block) in enumerate(rows):
        if i < block_rows[0] and stage != first:
            out.append(f"stage cut: {name} runs before the first block, so it must share its stage {first} "
                       f"(the plan puts it on stage {stage}); the runtime cuts only between blocks")
        elif i > block_rows[-1] and stage != last:
            out.append(f"stage cut: {name} runs after the last block, so it must share its stage {last} "
                       f"(the plan puts it on stage {stage}); the runtime cuts only between blocks")
    return out


# -- broadcast of a plan from rank 0 -----------------------------------------------------------

def _broadcast_text(group, text, root=0):
    length = torch.tensor([len(text.encode()) if text is not None else 0], dtype=torch.int64)
    group.broadcast(length, root).wait()
    buf = torch.zeros(int(length.item()), dtype=torch.uint8)
    if text is not None:
        buf.copy_(torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8))
    group.broadcast(buf, root).wait()
    return bytes(buf.tolist()).decode()


def plan_for_job(model, example_input, global_batch, *, world, cluster=None, dtype=None, tp_plan=None,
                 probe_links=True, profile=None, compile=None, inference=None, **pins):
    """Plans on rank 0 and broadcasts, so every rank runs the same plan. Collective.
    ``compile``: the blocks will run compiled (torch_monarch.compile). ``inference``: plan
    generation instead (``planner.plan_inference``'s keywords: batch, prompt_len,
    max_new_tokens, latency_target, objective; pins tp and pp only)."""
    from . import _runtime
    from .cluster import detect, probe
    if "recompute" in pins:
        from .recompute import check_mode
        check_mode(pins["recompute"])
    from .log import get as get_log, progress
    with progress("api", "reading the model on the meta device"):
        info, graph = model_graph(model, example_input, dtype=dtype, tp_plan=tp_plan)
    cut_problem = _cut_problem(model, info, pins, "parallelize")
    # Computing in another dtype than the parameters' is mixed precision: every layout runs it
    # (master weights in the parameters' dtype, torch_monarch.mixed_precision).
    param = _param_dtype(model)
    everyone = _runtime.DeviceMesh(world, pp=1, dp=world.size, tp=1).group("dp")
    if cluster is None:
        with progress("cluster", "detecting the machine (matmul rate, memory)"):
            cluster = detect(world_size=world.size)
        if probe_links and world.size > 1:
            with progress("cluster", "probing the links", ranks=world.size):
                cluster = probe(cluster, world)
    if inference is not None:
        unknown = sorted(set(pins) - {"tp", "pp"})
        if unknown:
            raise ValueError(f"parallelize: {unknown[0]} is not an inference pin (tp and pp are)")
        if cut_problem is not None:
            if pins.get("pp", 1) > 1:
                raise ValueError(f"parallelize: pp={pins['pp']} needs the model cut into stages: {cut_problem}")
            pins = {**pins, "pp": 1}  # the runtime could not cut it: no pipeline
    text, error = None, ""
    if world.rank == 0 and inference is not None:
        try:
            with progress("api", "planning generation", layers=len(graph), devices=world.size):
                p = _planner.plan_inference(graph, cluster, alternatives=0, **inference, **pins)
            get_log("api").info("inference plan: %s", p.summary())
            text = _planner.dumps(p)
        except (ValueError, RuntimeError, TypeError) as e:
            text = "\0" + f"{type(e).__name__}: {e}"
    elif world.rank == 0:
        try:
            training = runtime_training(info, global_batch, dtype, _pins(pins), param_dtype=param,
                                        cut_problem=cut_problem, compiled=compile not in (None, False))
            with progress("api", "planning", layers=len(graph), devices=world.size):
                p = _planner.plan(graph, cluster, training, profile=profile,
                                  **runtime_pins(model, _pins(pins), laid_out=True))
            get_log("api").info("plan: %s, predicted step %.4f s", p.summary(), p.prediction.step_time_s)
            text = _planner.dumps(p)
        except (ValueError, RuntimeError, TypeError) as e:
            error = f"{type(e).__name__}: {e}"
            text = "\0" + error
    text = _broadcast_text(everyone, text)
    if text.startswith("\0"):
        raise ValueError(f"parallelize: rank 0 could not plan: {text[1:]}")
    return _planner.loads(text), info
