"""Pythonic front end of the C++ planner (``torch_monarch._C.planner``).

    from torch_monarch import planner
    g = planner.transformer(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
    p = planner.plan(g, planner.cluster("a100-80gb", 1024), planner.training(1536))
    print(planner.report(p)); planner.save(p, "plan.json")

Enum arguments accept their JSON / command-line names ("1f1b", "full", "bf16") or the
enum values. Planner errors keep the C++ message: ValidationError, FormatError and
InfeasibleError are ValueErrors (ValidationError has ``.field``); others RuntimeErrors.
"""

import os

try:
    from . import _C
except ImportError as e:  # pragma: no cover - only when the extension was not built
    raise ImportError(
        "torch_monarch._C is not built; install the package with "
        "`pip install --no-build-isolation .` (" + str(e) + ")"
    ) from e

_P = _C.planner

# The C++ types and functions, under their C++ names.
PlannerError = _P.PlannerError
ValidationError = _P.ValidationError
FormatError = _P.FormatError
InfeasibleError = _P.InfeasibleError

DType = _P.DType
LayerKind = _P.LayerKind
TpPattern = _P.TpPattern
ScheduleKind = _P.ScheduleKind
Recompute = _P.Recompute
AttentionKernel = _P.AttentionKernel
ActionType = _P.ActionType

TpDims = _P.TpDims
GemmSplit = _P.GemmSplit
Gemm = _P.Gemm
ActivationBytes = _P.ActivationBytes
MoeDims = _P.MoeDims
Layer = _P.Layer
MoeConfig = _P.MoeConfig
TransformerConfig = _P.TransformerConfig
ModelGraph = _P.ModelGraph
Cluster = _P.Cluster
LinkLevel = _P.LinkLevel
TrainingConfig = _P.TrainingConfig
Pins = _P.Pins
SearchOptions = _P.SearchOptions
Mesh = _P.Mesh
LayerPlacement = _P.LayerPlacement
MemoryBreakdown = _P.MemoryBreakdown
TimeBreakdown = _P.TimeBreakdown
Prediction = _P.Prediction
Alternative = _P.Alternative
Plan = _P.Plan
Action = _P.Action
Schedule = _P.Schedule
StageCosts = _P.StageCosts
SimulationResult = _P.SimulationResult
EmbeddingSharding = _P.EmbeddingSharding
EmbeddingOptimizer = _P.EmbeddingOptimizer
EmbeddingPooling = _P.EmbeddingPooling
EmbeddingTable = _P.EmbeddingTable
EmbeddingShard = _P.EmbeddingShard
EmbeddingPlacement = _P.EmbeddingPlacement
EmbeddingRankLoad = _P.EmbeddingRankLoad
EmbeddingOptions = _P.EmbeddingOptions
EmbeddingPlan = _P.EmbeddingPlan
ProfilePoint = _P.ProfilePoint
LayerProfile = _P.LayerProfile
LinkProfile = _P.LinkProfile
MeasuredProfile = _P.MeasuredProfile
InferenceConfig = _P.InferenceConfig
InferencePrediction = _P.InferencePrediction
InferencePlan = _P.InferencePlan
InferenceOptions = _P.InferenceOptions

PLAN_FORMAT_VERSION = _P.PLAN_FORMAT_VERSION

build_transformer = _P.build_transformer
restrict_cuts_to_blocks = _P.restrict_cuts_to_blocks
cluster_preset = _P.cluster_preset
cluster_preset_names = _P.cluster_preset_names
zero_overlap_pays = _P.zero_overlap_pays
search = _P.search
evaluate_layout = _P.evaluate_layout
validate = _P.validate
format_report = _P.format_report
format_bytes = _P.format_bytes
format_seconds = _P.format_seconds
make_schedule = _P.make_schedule
check_schedule = _P.check_schedule
simulate = _P.simulate
closed_form_bubble_fraction = _P.closed_form_bubble_fraction
tp_bytes_per_step = _P.tp_bytes_per_step
evaluate_embeddings = _P.evaluate_embeddings
format_embedding_report = _P.format_embedding_report
embedding_placement_loads = _P.embedding_placement_loads
evaluate_inference = _P.evaluate_inference
kv_cache_bytes_per_sequence = _P.kv_cache_bytes_per_sequence
bytes_per_step = _P.bytes_per_step  # (graph, plan) -> per pipeline rank {'dp', 'tp', 'pp', 'ends', 'total'}


def _enum(enum_type, value, field):
    """`value` as `enum_type`: None stays None, strings are parsed (ValueError names `field`)."""
    if value is None or isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        return enum_type.from_string(value, field)
    raise TypeError(f"{field}: expected str or {enum_type.__name__}, got {type(value).__name__}")


def _set_fields(obj, overrides, enums, what):
    for key, value in overrides.items():
        if not hasattr(obj, key) or callable(getattr(obj, key)):
            raise TypeError(f"{what}: unknown field '{key}'")
        if key in enums:
            enum_type = enums[key]
            if isinstance(value, (list, tuple)):
                value = [_enum(enum_type, v, f"{key}[{i}]") for i, v in enumerate(value)]
            else:
                value = _enum(enum_type, value, key)
        try:
            setattr(obj, key, value)
        except TypeError:
            raise TypeError(f"{what}.{key}: expected {type(getattr(obj, key)).__name__}, got "
                            f"{type(value).__name__} {value!r}") from None
    return obj


def transformer(layers, hidden, heads, seq, vocab, *, kv_heads=None, ffn=None, gated_mlp=False,
                tied_embeddings=False, dtype="bf16", attention="flash", name="transformer",
                head_dim=None, attention_params=None, moe=None, fused_kernels=True, dropout=True):
    """ModelGraph of a decoder-only transformer (embedding, blocks, final norm, LM head).
    ``attention``: ``flash`` (no s x s scores kept) or ``materialized``. ``fused_kernels``: the
    activations fused kernels keep (Megatron-LM / Transformer Engine), or eager PyTorch ops'
    (False); ``dropout``: the model has dropout (False: Llama-style, no masks kept;
    docs/cost_model.md, "Memory"). ``head_dim``: per-head
    width when heads x head_dim is not ``hidden``; ``attention_params``: attention weights per
    layer when not the q/k/v/o shapes' (e.g. MLA); ``moe``: a MoeConfig or a dict of its fields
    (experts, top_k, expert_ffn, shared_experts, first_dense_layers, every, capacity_factor,
    imbalance), e.g. ``moe=dict(experts=8, top_k=2)`` for Mixtral."""
    config = TransformerConfig(
        name=name, layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab,
        kv_heads=kv_heads or 0, ffn=ffn or 0, gated_mlp=gated_mlp,
        tied_embeddings=tied_embeddings, dtype=_enum(DType, dtype, "dtype"),
        attention=_enum(AttentionKernel, attention, "attention"),
        head_dim=head_dim or 0, attention_params=attention_params or 0,
        fused_kernels=bool(fused_kernels), dropout=bool(dropout))
    if moe is not None:
        if isinstance(moe, dict):
            m = MoeConfig()
            _set_fields(m, moe, {}, "transformer.moe")
            moe = m
        config.moe = moe
    return build_transformer(config)


def link_level(name, devices, bytes_per_s, latency_s, oversubscription=1.0):
    """One LinkLevel: ``devices`` per unit (cumulative, 0 on the outermost level), achieved
    ``bytes_per_s`` per device, ``latency_s`` per message, ``oversubscription`` (>= 1) of the
    links up into it."""
    return LinkLevel(name=name, devices=devices, bytes_per_s=float(bytes_per_s), latency_s=float(latency_s),
                     oversubscription=float(oversubscription))


def cluster(name, devices, **overrides):
    """A preset cluster (see ``cluster_preset_names()``), optionally with fields overridden.
    ``levels``: a list of LinkLevel or of dicts of its fields (innermost first); it sets the
    two-level fields from its first two levels."""
    c = cluster_preset(name, devices)
    if "levels" in overrides:
        overrides = dict(overrides)
        overrides["levels"] = [link_level(**l) if isinstance(l, dict) else l for l in overrides["levels"]]
    if overrides:
        _set_fields(c, overrides, {}, "cluster")
        validate(c)
    return c


def training(global_batch, **overrides):
    """TrainingConfig for `global_batch` sequences per step; keywords override fields."""
    t = TrainingConfig()
    _set_fields(t, {"global_batch": global_batch, **overrides},
                {"compute_dtype": DType, "schedules": ScheduleKind}, "training")
    validate(t)
    return t


def pins(*, tp=None, pp=None, dp=None, zero=None, micro_batch=None, schedule=None,
         recompute=None, sequence_parallel=None, virtual_stages=None, cp=None, ep=None):
    """Pins from keywords; None leaves a choice to the search. A value of the wrong type is
    a TypeError naming the pin (``pins.tp: expected an integer, got str '2'``). ``cp``:
    context parallelism (1 turns it off), ``ep``: expert parallelism."""
    for field, value in (("tp", tp), ("pp", pp), ("dp", dp), ("zero", zero), ("micro_batch", micro_batch),
                         ("virtual_stages", virtual_stages), ("cp", cp), ("ep", ep)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"pins.{field}: expected an integer, got {type(value).__name__} {value!r}")
    if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
        raise TypeError(f"pins.sequence_parallel: expected a bool, got {type(sequence_parallel).__name__} "
                        f"{sequence_parallel!r}")
    return Pins(tp=tp, pp=pp, dp=dp, zero_stage=zero, micro_batch_size=micro_batch,
                schedule=_enum(ScheduleKind, schedule, "schedule"),
                recompute=_enum(Recompute, recompute, "recompute"),
                sequence_parallel=sequence_parallel, virtual_stages=virtual_stages, cp=cp, ep=ep)


_BYTES_OF_DTYPE = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}


def embedding_table(name, rows, dim, *, features=None, pooling_factor=1.0, pooling="sum", dtype="fp32"):
    """EmbeddingTable: ``rows`` x ``dim`` in ``dtype`` (fp32, fp16, bf16, int8), looked up by
    ``features`` (default: one feature named like the table), ``pooling_factor`` ids per
    sample per feature on average; ``pooling`` sum / mean (EmbeddingBag) or none (Embedding)."""
    if dtype not in _BYTES_OF_DTYPE:
        raise ValueError(f"embeddings.tables.{name}.dtype: unknown '{dtype}' (fp32, fp16, bf16, int8)")
    return EmbeddingTable(name=name, rows=rows, dim=dim, bytes_per_element=float(_BYTES_OF_DTYPE[dtype]),
                          features=list(features) if features is not None else [name],
                          pooling_factor=float(pooling_factor), pooling=_enum(EmbeddingPooling, pooling, "pooling"))


def plan_embeddings(tables, cluster, *, world_size, batch_per_rank, optimizer="sgd", pins=None,
                    memory_budget_bytes=0.0, column_chunk=0):
    """Shards `tables` over `world_size` ranks: each table's sharding (data_parallel,
    table_wise, row_wise, column_wise, table_row_wise) and where its shards go, keeping the
    most loaded rank's time lowest under each rank's memory (`memory_budget_bytes`, default
    the cluster's usable memory). ``pins``: {table name: sharding}."""
    o = EmbeddingOptions(world_size=world_size, batch_per_rank=batch_per_rank,
                         optimizer=_enum(EmbeddingOptimizer, optimizer, "optimizer"),
                         memory_budget_bytes=float(memory_budget_bytes), column_chunk=column_chunk)
    o.pins = {name: _enum(EmbeddingSharding, s, f"embeddings.pins.{name}") for name, s in (pins or {}).items()}
    return _P.plan_embeddings(list(tables), cluster, o)


def _training(training_or_batch):
    if isinstance(training_or_batch, int):
        return training(training_or_batch)
    return training_or_batch


def _profile(profile):
    if profile is None or isinstance(profile, MeasuredProfile):
        return profile
    if isinstance(profile, (str, os.PathLike)):
        return load_profile(profile)
    raise TypeError(f"profile: expected a MeasuredProfile or a path, got {type(profile).__name__}")


def plan(graph, cluster, training, *, tp=None, pp=None, dp=None, zero=None, micro_batch=None,
         schedule=None, recompute=None, sequence_parallel=None, virtual_stages=None,
         alternatives=5, profile=None, tie_tolerance=None, cp=None, ep=None):
    """Searches for the fastest layout that fits memory; keywords pin choices.

    `training` is a TrainingConfig or a global batch size. ``profile``: a MeasuredProfile (or
    the path of its JSON) whose measured per-layer times and links replace the analytic
    model's (``torch_monarch.profile.measure``). ``tie_tolerance``: layouts predicted within
    this fraction of the fastest count as tied and the one with the fewest moving parts wins
    (default 0.05; 0 always takes the fastest). Raises ValidationError for an impossible pin
    and InfeasibleError when nothing fits (both ValueErrors).
    """
    options = SearchOptions()
    options.pins = pins(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=micro_batch,
                        schedule=schedule, recompute=recompute,
                        sequence_parallel=sequence_parallel, virtual_stages=virtual_stages, cp=cp, ep=ep)
    options.alternatives = alternatives
    if tie_tolerance is not None:
        options.tie_tolerance = float(tie_tolerance)
    profile = _profile(profile)
    if profile is not None:
        return _P.search_with_profile(graph, cluster, _training(training), options, profile)
    return search(graph, cluster, _training(training), options)


def plan_inference(graph, cluster, *, batch, prompt_len, max_new_tokens, objective=None,
                   latency_target=None, max_batch=None, tp=None, pp=None, alternatives=5,
                   hbm_efficiency=None, weight_bytes=None, kv_bytes=None, tie_tolerance=None,
                   host_seconds_per_op=None, ops_per_block=None, host_overlaps_device=None,
                   host_seconds_per_step=None):
    """Plans generation (docs/cost_model.md, "Inference"): tp x pp with dp = world / (tp pp)
    replicas, for the lowest per-token latency at `batch` sequences per replica
    (``objective="latency"``, the default without a target) or the most tokens/s with
    per-token latency under ``latency_target`` seconds (``objective="throughput"``, the default
    with one; the batch per replica grows up to ``max_batch``, default 256). ``tp`` / ``pp``
    pin; ``tie_tolerance`` (default 0.03): layouts this close to the best are tied (latency
    then takes the fewest devices per replica). The plan's ``inference.prediction`` has ``ttft_s``, ``per_token_s``,
    ``tokens_per_s``, ``kv_cache_bytes``, ``weights_bytes``; ``choices`` says why.
    ``host_seconds_per_op`` x ``ops_per_block`` is an eager decoder block's host dispatch,
    ``host_seconds_per_step`` the decode loop's own host work per step (0: none, compiled).
    ``host_overlaps_device`` defaults to False on CPU ranks (``cluster.cores_per_node`` > 0, as
    ``cluster.detect`` sets it: host dispatch and compute add) and True otherwise (a GPU runs
    behind its host).
    InfeasibleError (a ValueError) names the memory when nothing fits.
    """
    config = InferenceConfig()
    config.batch = int(batch)
    config.prompt_len = int(prompt_len)
    config.max_new_tokens = int(max_new_tokens)
    if latency_target is not None:
        config.latency_target_s = float(latency_target)
    if objective is None:
        objective = "throughput" if latency_target or max_batch else "latency"
    config.objective = objective
    if max_batch is not None:
        config.max_batch = int(max_batch)
    if hbm_efficiency is not None:
        config.hbm_efficiency = float(hbm_efficiency)
    if host_seconds_per_op is not None:  # eager host dispatch per operator (0: compiled, host out of the loop)
        config.host_seconds_per_op = float(host_seconds_per_op)
    if ops_per_block is not None:
        config.ops_per_block = float(ops_per_block)
    if host_seconds_per_step is not None:  # the loop's own host work per decode step
        config.host_seconds_per_step = float(host_seconds_per_step)
    if host_overlaps_device is None:
        # CPU ranks (the cluster's devices share its cores: cluster.detect says how many)
        # dispatch and compute on the same threads; a GPU runs behind its host.
        host_overlaps_device = not getattr(cluster, "cores_per_node", 0) > 0
    config.host_overlaps_device = bool(host_overlaps_device)
    if weight_bytes is not None:
        config.weight_bytes = float(weight_bytes)
    if kv_bytes is not None:
        config.kv_bytes = float(kv_bytes)
    options = InferenceOptions()
    options.tp = 0 if tp is None else int(tp)
    options.pp = 0 if pp is None else int(pp)
    options.alternatives = int(alternatives)
    if tie_tolerance is not None:
        options.tie_tolerance = float(tie_tolerance)
    return _P.plan_inference(graph, cluster, config, options)


def evaluate(graph, cluster, training, *, tp, pp, dp, zero, micro_batch, schedule,
             recompute=None, sequence_parallel=None, virtual_stages=None,
             allow_over_memory=False, profile=None, cp=None, ep=None):
    """Scores one fully pinned layout (recompute / sequence parallel searched unless given),
    with the analytic model or a measured ``profile``."""
    p = pins(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=micro_batch, schedule=schedule,
             recompute=recompute, sequence_parallel=sequence_parallel,
             virtual_stages=virtual_stages, cp=cp, ep=ep)
    profile = _profile(profile)
    if profile is not None:
        return _P.evaluate_layout_with_profile(graph, cluster, _training(training), p, allow_over_memory, profile)
    return evaluate_layout(graph, cluster, _training(training), p, allow_over_memory)


def load_profile(path):
    """Reads a measured profile's JSON (docs/plan_format.md, "Measured profiles")."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"profile file {path!r} does not exist")
    return _P.load_profile(path)


def save_profile(profile, path):
    """Writes a measured profile as JSON (refused, nothing written, if it is invalid)."""
    _P.validate_profile(profile)
    text = _P.profile_to_json(profile)
    with open(os.fspath(path), "w") as f:
        f.write(text + "\n")


def schedule(kind, ranks, micro_batches, virtual_stages=1):
    """Per-rank action lists of a pipeline schedule ("gpipe", "1f1b", "interleaved_1f1b", ...)."""
    return make_schedule(_enum(ScheduleKind, kind, "kind"), ranks, micro_batches, virtual_stages)


def report(plan, path=None, *, trace=None, trace_step=-1):
    """Without ``path``: the multi-line text summary of a plan (what ``monarch-plan show``
    prints). With ``path``: writes the plan as one self-contained HTML page (what
    ``monarch-plan report`` writes: mesh, pipeline timeline, memory per rank, step time and
    traffic, alternatives) and returns ``path``; ``trace`` is a run's measured trace
    (``model.trace(path)``), drawn under the predicted timeline."""
    if path is None:
        if trace is not None:
            raise ValueError("report: a trace is drawn only in the HTML report (give a path)")
        return format_report(plan)
    plan.save_html_report(os.fspath(path), None if trace is None else os.fspath(trace), trace_step)
    return path


def diff(a, b):
    """What differs between two plans, as text (``monarch-plan diff``)."""
    return _P.diff_plans(a, b)


def loads(text):
    """Plan from JSON text."""
    return Plan.from_json(text)


def dumps(plan, indent=2):
    """JSON text of a plan."""
    return plan.to_json(indent)


def load(path):
    """Reads a plan JSON file (FileNotFoundError if missing; FormatError / ValidationError,
    both ValueErrors, if it is not a valid plan, a binary file included), as monarch-plan."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"plan file {path!r} does not exist")
    return _P.load_plan(path)


def save(plan, path):
    """Writes a plan as JSON, exactly as ``monarch-plan`` does; a plan that ``load`` would
    refuse is refused here (ValidationError) and nothing is written."""
    _P.save_plan(plan, os.fspath(path))


# Conveniences on the Plan type itself: plan.save(path), plan.report(), Plan.load(path).
Plan.save = lambda self, path: save(self, path)
Plan.report = lambda self, path=None, **kwargs: report(self, path, **kwargs)
Plan.diff = lambda self, other: diff(self, other)
Plan.load = staticmethod(load)
