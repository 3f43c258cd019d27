// Plan <-> JSON (docs/plan_format.md). Writing keeps a fixed key order (ordered_json) so
// plans diff well; reading is strict: every field required (except model.transformer),
// unknown keys refused, types checked, and errors name the field path.
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "monarch/planner/errors.h"
#include "embedding_json.h"
#include "json_fields.h"
#include "monarch/planner/collectives.h"
#include "monarch/planner/embeddings.h"
#include "monarch/planner/plan.h"

namespace monarch::planner {
namespace {

using json_detail::as_array;
using json_detail::as_integer;
using json_detail::as_number;
using json_detail::as_string;
using json_detail::element;
using json_detail::Fields;
using json_detail::Json;
using json_detail::type_name;

// ---------------------------------------------------------------- writing

Json transformer_to_json(const TransformerConfig& t) {
  Json j;
  j["layers"] = t.layers;
  j["hidden"] = t.hidden;
  j["heads"] = t.heads;
  j["kv_heads"] = t.kv_heads;
  j["ffn"] = t.ffn;
  j["gated_mlp"] = t.gated_mlp;
  j["seq"] = t.seq;
  j["vocab"] = t.vocab;
  j["tied_embeddings"] = t.tied_embeddings;
  j["dtype"] = to_string(t.dtype);
  j["attention"] = to_string(t.attention);
  j["name"] = t.name;
  // Written only when used: plans of dense models with the usual head width read as before.
  if (t.head_dim != 0) j["head_dim"] = t.head_dim;
  if (t.attention_params != 0) j["attention_params"] = t.attention_params;
  // Written only when not the default (fused kernels, dropout): older plans read the same.
  if (!t.fused_kernels) j["fused_kernels"] = false;
  if (!t.dropout) j["dropout"] = false;
  if (t.moe.experts != 0) {
    Json m;
    m["experts"] = t.moe.experts;
    m["top_k"] = t.moe.top_k;
    m["expert_ffn"] = t.moe.expert_ffn;
    m["shared_experts"] = t.moe.shared_experts;
    m["first_dense_layers"] = t.moe.first_dense_layers;
    m["every"] = t.moe.every;
    m["capacity_factor"] = t.moe.capacity_factor;
    m["imbalance"] = t.moe.imbalance;
    j["moe"] = m;
  }
  return j;
}

Json model_to_json(const Plan& p) {
  Json j;
  j["name"] = p.model_name;
  j["params"] = p.model_params;
  if (p.transformer) j["transformer"] = transformer_to_json(*p.transformer);
  return j;
}

Json cluster_to_json(const Cluster& c) {
  Json j;
  j["name"] = c.name;
  j["nodes"] = c.nodes;
  j["devices_per_node"] = c.devices_per_node;
  j["device_memory_bytes"] = c.device_memory_bytes;
  j["memory_reserved_bytes"] = c.memory_reserved_bytes;
  j["peak_flops_fp32"] = c.peak_flops_fp32;
  j["peak_flops_tf32"] = c.peak_flops_tf32;
  j["peak_flops_bf16"] = c.peak_flops_bf16;
  j["peak_flops_fp8"] = c.peak_flops_fp8;
  j["matmul_efficiency"] = c.matmul_efficiency;
  j["hbm_bytes_per_s"] = c.hbm_bytes_per_s;
  j["backward_forward_ratio"] = c.backward_forward_ratio;
  j["cores_per_node"] = c.cores_per_node;
  j["sm_count"] = c.sm_count;
  j["overlap_contention"] = c.overlap_contention;
  if (c.straggler_spread != 0) j["straggler_spread"] = c.straggler_spread;
  j["intra_node_bytes_per_s"] = c.intra_node_bytes_per_s;
  j["intra_node_latency_s"] = c.intra_node_latency_s;
  j["inter_node_bytes_per_s"] = c.inter_node_bytes_per_s;
  j["inter_node_latency_s"] = c.inter_node_latency_s;
  if (!c.levels.empty()) {  // optional: written only for clusters described by levels
    Json levels = Json::array();
    for (const LinkLevel& l : c.levels) {
      Json level;
      level["name"] = l.name;
      level["devices"] = l.devices;
      level["bytes_per_s"] = l.bytes_per_s;
      level["latency_s"] = l.latency_s;
      level["oversubscription"] = l.oversubscription;
      levels.push_back(level);
    }
    j["levels"] = levels;
  }
  return j;
}

Json training_to_json(const TrainingConfig& t) {
  Json j;
  j["global_batch"] = t.global_batch;
  j["compute_dtype"] = to_string(t.compute_dtype);
  j["param_bytes"] = t.param_bytes;
  j["grad_bytes"] = t.grad_bytes;
  j["zero_grad_bytes"] = t.zero_grad_bytes;
  j["master_grad_bytes"] = t.master_grad_bytes;
  j["optimizer_bytes"] = t.optimizer_bytes;
  j["activation_bytes"] = t.activation_bytes;
  j["allow_tensor_parallel"] = t.allow_tensor_parallel;
  j["allow_pipeline_parallel"] = t.allow_pipeline_parallel;
  j["allow_zero"] = t.allow_zero;
  j["allow_recompute"] = t.allow_recompute;
  Json modes = Json::array();
  for (Recompute r : t.recompute_modes) modes.push_back(to_string(r));
  j["recompute_modes"] = modes;
  j["allow_sequence_parallel"] = t.allow_sequence_parallel;
  Json schedules = Json::array();
  for (ScheduleKind s : t.schedules) schedules.push_back(to_string(s));
  j["schedules"] = schedules;
  j["max_micro_batch_size"] = t.max_micro_batch_size;
  j["dp_bucket_bytes"] = t.dp_bucket_bytes;
  j["allow_hierarchical_dp"] = t.allow_hierarchical_dp;
  j["inter_node_compression"] = to_string(t.inter_node_compression);
  if (t.pipeline_sends_kept) j["pipeline_sends_kept"] = true;  // optional: false
  if (t.weights_cast_per_forward) j["weights_cast_per_forward"] = true;  // optional: false
  return j;
}

Json mesh_to_json(const Mesh& m) {
  Json j;
  j["pp"] = m.pp;
  j["dp"] = m.dp;
  j["tp"] = m.tp;
  // Written only when used, so plans without them read as before (and older builds that
  // do not know them refuse a plan that needs them).
  if (m.cp != 1) j["cp"] = m.cp;
  if (m.ep != 1) j["ep"] = m.ep;
  j["order"] = m.order;
  return j;
}

Json layer_to_json(const LayerPlacement& l) {
  Json j;
  j["name"] = l.name;
  j["kind"] = to_string(l.kind);
  j["params"] = l.params;
  j["stage"] = l.stage;
  j["tp"] = to_string(l.tp);
  Json dims;
  dims["heads"] = l.tp_dims.heads;
  dims["kv_heads"] = l.tp_dims.kv_heads;
  dims["ffn"] = l.tp_dims.ffn;
  dims["vocab"] = l.tp_dims.vocab;
  j["tp_dims"] = dims;
  j["sharding_unit"] = l.sharding_unit;
  return j;
}

Json memory_to_json(const MemoryBreakdown& m) {
  Json j;
  j["params"] = m.params;
  j["grads"] = m.grads;
  j["optimizer"] = m.optimizer;
  j["activations"] = m.activations;
  j["buffers"] = m.buffers;
  return j;
}

Json prediction_to_json(const Prediction& p) {
  Json j;
  j["step_time_s"] = p.step_time_s;
  j["tflops_per_device"] = p.tflops_per_device;
  j["mfu"] = p.mfu;
  j["memory_bytes_per_device"] = p.memory_bytes_per_device;
  j["tokens_per_s"] = p.tokens_per_s;
  j["bubble_fraction"] = p.bubble_fraction;
  j["estimator"] = p.estimator;
  j["memory"] = memory_to_json(p.memory);
  Json time;
  time["compute"] = p.time.compute;
  time["recompute"] = p.time.recompute;
  time["tp_comm"] = p.time.tp_comm;
  time["dp_comm"] = p.time.dp_comm;
  time["pp_comm"] = p.time.pp_comm;
  // Only when used: plans without experts or context parallelism read as before.
  if (p.time.ep_comm != 0) time["ep_comm"] = p.time.ep_comm;
  if (p.time.cp_comm != 0) time["cp_comm"] = p.time.cp_comm;
  if (p.time.stragglers != 0) time["stragglers"] = p.time.stragglers;
  time["bubble"] = p.time.bubble;
  time["optimizer"] = p.time.optimizer;
  time["total"] = p.time.total;
  j["time"] = time;
  if (!p.stages.empty()) {
    Json stages = Json::array();
    for (const StageCosts& c : p.stages) {
      Json st;
      st["forward_s"] = c.forward_s;
      st["backward_input_s"] = c.backward_input_s;
      st["backward_weight_s"] = c.backward_weight_s;
      st["p2p_s"] = c.p2p_s;
      stages.push_back(st);
    }
    j["stages"] = stages;
  }
  if (!p.ranks.empty()) {
    Json ranks = Json::array();
    for (const RankPrediction& r : p.ranks) {
      Json rj;
      rj["memory"] = memory_to_json(r.memory);
      rj["busy_s"] = r.busy_s;
      rj["idle_s"] = r.idle_s;
      Json bytes;
      bytes["dp"] = r.dp_bytes;
      bytes["tp"] = r.tp_bytes;
      bytes["pp"] = r.pp_bytes;
      bytes["ends"] = r.ends_bytes;
      bytes["dp_inter_node"] = r.dp_inter_node_bytes;
      rj["bytes_sent"] = bytes;
      ranks.push_back(rj);
    }
    j["ranks"] = ranks;
  }
  return j;
}

Json alternative_to_json(const Alternative& a) {
  Json j;
  j["summary"] = a.summary;
  j["step_time_s"] = a.step_time_s;
  j["memory_bytes_per_device"] = a.memory_bytes_per_device;
  j["reason"] = a.reason;
  return j;
}

// The inference section (docs/plan_format.md): the ask, the layout's own choices, the prediction.
Json inference_to_json(const InferencePlan& inf) {
  const InferenceConfig& c = inf.config;
  Json j;
  j["objective"] = to_string(c.objective);
  j["batch"] = c.batch;
  j["prompt_len"] = c.prompt_len;
  j["max_new_tokens"] = c.max_new_tokens;
  j["latency_target_s"] = c.latency_target_s;
  j["max_batch"] = c.max_batch;
  j["weight_bytes"] = c.weight_bytes;
  j["kv_bytes"] = c.kv_bytes;
  j["hbm_efficiency"] = c.hbm_efficiency;
  j["host_seconds_per_op"] = c.host_seconds_per_op;
  j["ops_per_block"] = c.ops_per_block;
  j["host_seconds_per_step"] = c.host_seconds_per_step;
  j["host_overlaps_device"] = c.host_overlaps_device;
  j["batch_per_replica"] = inf.batch_per_replica;
  j["decode_micro_batches"] = inf.decode_micro_batches;
  const InferencePrediction& p = inf.prediction;
  Json q;
  q["ttft_s"] = p.ttft_s;
  q["per_token_s"] = p.per_token_s;
  q["tokens_per_s"] = p.tokens_per_s;
  q["request_s"] = p.request_s;
  q["weights_bytes"] = p.weights_bytes;
  q["kv_cache_bytes"] = p.kv_cache_bytes;
  q["activation_bytes"] = p.activation_bytes;
  q["memory_bytes"] = p.memory_bytes;
  q["decode_weights_s"] = p.decode_weights_s;
  q["decode_kv_s"] = p.decode_kv_s;
  q["decode_compute_s"] = p.decode_compute_s;
  q["decode_tp_comm_s"] = p.decode_tp_comm_s;
  q["decode_pp_comm_s"] = p.decode_pp_comm_s;
  q["decode_host_s"] = p.decode_host_s;
  q["prefill_compute_s"] = p.prefill_compute_s;
  q["prefill_tp_comm_s"] = p.prefill_tp_comm_s;
  q["prefill_pp_comm_s"] = p.prefill_pp_comm_s;
  j["prediction"] = q;
  return j;
}

Json plan_to_json_value(const Plan& p) {
  Json j;
  j["version"] = p.version;
  j["model"] = model_to_json(p);
  j["cluster"] = cluster_to_json(p.cluster);
  j["training"] = training_to_json(p.training);
  j["mesh"] = mesh_to_json(p.mesh);
  j["zero_stage"] = p.zero_stage;
  j["micro_batch_size"] = p.micro_batch_size;
  j["num_micro_batches"] = p.num_micro_batches;
  j["schedule"] = to_string(p.schedule);
  j["virtual_stages"] = p.virtual_stages;
  j["recompute"] = to_string(p.recompute);
  j["sequence_parallel"] = p.sequence_parallel;
  j["dp_bucket_bytes"] = p.dp_bucket_bytes;
  j["dp_reduction"] = to_string(p.dp_reduction);
  j["inter_node_compression"] = to_string(p.inter_node_compression);
  j["zero_overlap"] = p.zero_overlap;
  Json layers = Json::array();
  for (const auto& l : p.layers) layers.push_back(layer_to_json(l));
  j["layers"] = layers;
  if (p.embeddings) j["embeddings"] = json_detail::embeddings_to_json_value(*p.embeddings);
  if (p.inference) j["inference"] = inference_to_json(*p.inference);  // only inference plans
  j["prediction"] = prediction_to_json(p.prediction);
  Json alternatives = Json::array();
  for (const auto& a : p.alternatives) alternatives.push_back(alternative_to_json(a));
  j["alternatives"] = alternatives;
  if (!p.tie_break.empty()) j["tie_break"] = p.tie_break;
  if (!p.choices.empty()) j["choices"] = p.choices;
  return j;
}

// ---------------------------------------------------------------- reading

TransformerConfig transformer_from_json(const Fields& f) {
  TransformerConfig t;
  t.layers = f.integer("layers");
  t.hidden = f.integer("hidden");
  t.heads = f.integer("heads");
  t.kv_heads = f.integer("kv_heads");
  t.ffn = f.integer("ffn");
  t.gated_mlp = f.boolean("gated_mlp");
  t.seq = f.integer("seq");
  t.vocab = f.integer("vocab");
  t.tied_embeddings = f.boolean("tied_embeddings");
  t.dtype = dtype_from_string(f.string("dtype"), f.path("dtype"));
  // Optional: plans written before it was a choice costed materialized scores.
  t.attention = f.has("attention") ? attention_kernel_from_string(f.string("attention"), f.path("attention"))
                                   : AttentionKernel::materialized;
  t.name = f.string("name");
  // Optional (plans of dense models, and those written before MoE, have none).
  if (f.has("head_dim")) t.head_dim = f.integer("head_dim");
  if (f.has("attention_params")) t.attention_params = f.integer("attention_params");
  // Optional (written only when false): plans written before them kept what both mean.
  if (f.has("fused_kernels")) t.fused_kernels = f.boolean("fused_kernels");
  if (f.has("dropout")) t.dropout = f.boolean("dropout");
  if (f.has("moe")) {
    const Fields m = f.object("moe", {"experts", "top_k", "expert_ffn", "shared_experts", "first_dense_layers",
                                      "every", "capacity_factor", "imbalance"});
    t.moe.experts = m.integer("experts");
    t.moe.top_k = m.integer("top_k");
    t.moe.expert_ffn = m.integer("expert_ffn");
    t.moe.shared_experts = m.integer("shared_experts");
    t.moe.first_dense_layers = m.integer("first_dense_layers");
    t.moe.every = m.integer("every");
    t.moe.capacity_factor = m.number("capacity_factor");
    t.moe.imbalance = m.number("imbalance");
  }
  return t;
}

void model_from_json(const Fields& f, Plan& p) {
  p.model_name = f.string("name");
  p.model_params = f.integer("params");
  if (f.has("transformer")) {
    p.transformer = transformer_from_json(
        f.object("transformer", {"layers", "hidden", "heads", "kv_heads", "ffn", "gated_mlp",
                                 "seq", "vocab", "tied_embeddings", "dtype", "attention", "name",
                                 "head_dim", "attention_params", "moe", "fused_kernels", "dropout"}));
  }
}

Cluster cluster_from_json(const Fields& f) {
  Cluster c;
  c.name = f.string("name");
  c.nodes = f.integer("nodes");
  c.devices_per_node = f.integer("devices_per_node");
  c.device_memory_bytes = f.number("device_memory_bytes");
  c.memory_reserved_bytes = f.number("memory_reserved_bytes");
  c.peak_flops_fp32 = f.number("peak_flops_fp32");
  c.peak_flops_tf32 = f.number("peak_flops_tf32");
  c.peak_flops_bf16 = f.number("peak_flops_bf16");
  c.peak_flops_fp8 = f.number("peak_flops_fp8");
  c.matmul_efficiency = f.number("matmul_efficiency");
  c.hbm_bytes_per_s = f.number("hbm_bytes_per_s");
  if (f.has("backward_forward_ratio")) c.backward_forward_ratio = f.number("backward_forward_ratio");  // optional: 2
  if (f.has("cores_per_node")) c.cores_per_node = f.number("cores_per_node");  // optional: 0
  if (f.has("sm_count")) c.sm_count = f.integer("sm_count");  // optional: 0, no wave quantization
  if (f.has("overlap_contention")) c.overlap_contention = f.number("overlap_contention");  // optional: 0
  if (f.has("straggler_spread")) c.straggler_spread = f.number("straggler_spread");  // optional: 0
  c.intra_node_bytes_per_s = f.number("intra_node_bytes_per_s");
  c.intra_node_latency_s = f.number("intra_node_latency_s");
  c.inter_node_bytes_per_s = f.number("inter_node_bytes_per_s");
  c.inter_node_latency_s = f.number("inter_node_latency_s");
  if (f.has("levels")) {  // optional: plans without it are costed on the two levels above
    const Json& levels = f.array("levels");
    for (size_t i = 0; i < levels.size(); ++i) {
      const Fields l(levels[i], element(f.path("levels"), i),
                     {"name", "devices", "bytes_per_s", "latency_s", "oversubscription"});
      LinkLevel level;
      level.name = l.string("name");
      level.devices = l.integer("devices");
      level.bytes_per_s = l.number("bytes_per_s");
      level.latency_s = l.number("latency_s");
      if (l.has("oversubscription")) level.oversubscription = l.number("oversubscription");  // optional: 1
      c.levels.push_back(level);
    }
  }
  return c;
}

TrainingConfig training_from_json(const Fields& f) {
  TrainingConfig t;
  t.global_batch = f.integer("global_batch");
  t.compute_dtype = dtype_from_string(f.string("compute_dtype"), f.path("compute_dtype"));
  t.param_bytes = f.number("param_bytes");
  t.grad_bytes = f.number("grad_bytes");
  if (f.has("zero_grad_bytes")) t.zero_grad_bytes = f.number("zero_grad_bytes");  // optional: 0
  if (f.has("master_grad_bytes")) t.master_grad_bytes = f.number("master_grad_bytes");  // optional: 0
  t.optimizer_bytes = f.number("optimizer_bytes");
  t.activation_bytes = f.number("activation_bytes");
  t.allow_tensor_parallel = f.boolean("allow_tensor_parallel");
  t.allow_pipeline_parallel = f.boolean("allow_pipeline_parallel");
  t.allow_zero = f.boolean("allow_zero");
  t.allow_recompute = f.boolean("allow_recompute");
  t.allow_sequence_parallel = f.boolean("allow_sequence_parallel");
  if (f.has("recompute_modes")) {  // optional: plans written before it allowed every mode
    const Json& modes = f.array("recompute_modes");
    t.recompute_modes.clear();
    for (size_t i = 0; i < modes.size(); ++i) {
      const std::string path = element(f.path("recompute_modes"), i);
      t.recompute_modes.push_back(recompute_from_string(as_string(modes[i], path), path));
    }
  }
  const Json& schedules = f.array("schedules");
  t.schedules.clear();
  for (size_t i = 0; i < schedules.size(); ++i) {
    const std::string path = element(f.path("schedules"), i);
    t.schedules.push_back(schedule_from_string(as_string(schedules[i], path), path));
  }
  t.max_micro_batch_size = f.integer("max_micro_batch_size");
  t.dp_bucket_bytes = f.number("dp_bucket_bytes");
  // Optional: plans written before these options existed allowed hierarchical reduction
  // (the default) and no compression.
  if (f.has("allow_hierarchical_dp")) t.allow_hierarchical_dp = f.boolean("allow_hierarchical_dp");
  if (f.has("inter_node_compression")) {
    t.inter_node_compression =
        compression_from_string(f.string("inter_node_compression"), f.path("inter_node_compression"));
  }
  if (f.has("pipeline_sends_kept")) t.pipeline_sends_kept = f.boolean("pipeline_sends_kept");  // optional: false
  if (f.has("weights_cast_per_forward")) {  // optional: false
    t.weights_cast_per_forward = f.boolean("weights_cast_per_forward");
  }
  return t;
}

Mesh mesh_from_json(const Fields& f) {
  Mesh m;
  m.pp = f.integer("pp");
  m.dp = f.integer("dp");
  m.tp = f.integer("tp");
  if (f.has("cp")) m.cp = f.integer("cp");
  if (f.has("ep")) m.ep = f.integer("ep");
  const Json& order = f.array("order");
  m.order.clear();
  for (size_t i = 0; i < order.size(); ++i) {
    m.order.push_back(as_string(order[i], element(f.path("order"), i)));
  }
  return m;
}

LayerPlacement layer_from_json(const Fields& f) {
  LayerPlacement l;
  l.name = f.string("name");
  l.kind = layer_kind_from_string(f.string("kind"), f.path("kind"));
  l.params = f.integer("params");
  l.stage = f.integer("stage");
  l.tp = tp_pattern_from_string(f.string("tp"), f.path("tp"));
  const Fields dims = f.object("tp_dims", {"heads", "kv_heads", "ffn", "vocab"});
  l.tp_dims.heads = dims.integer("heads");
  l.tp_dims.kv_heads = dims.integer("kv_heads");
  l.tp_dims.ffn = dims.integer("ffn");
  l.tp_dims.vocab = dims.integer("vocab");
  l.sharding_unit = f.boolean("sharding_unit");
  return l;
}

MemoryBreakdown memory_from_json(const Fields& f, const char* key) {
  const Fields mem = f.object(key, {"params", "grads", "optimizer", "activations", "buffers"});
  MemoryBreakdown m;
  m.params = mem.number("params");
  m.grads = mem.number("grads");
  m.optimizer = mem.number("optimizer");
  m.activations = mem.number("activations");
  m.buffers = mem.number("buffers");
  return m;
}

Prediction prediction_from_json(const Fields& f) {
  Prediction p;
  p.step_time_s = f.number("step_time_s");
  p.tflops_per_device = f.number("tflops_per_device");
  p.mfu = f.number("mfu");
  p.memory_bytes_per_device = f.number("memory_bytes_per_device");
  p.tokens_per_s = f.number("tokens_per_s");
  p.bubble_fraction = f.number("bubble_fraction");
  if (f.has("estimator")) p.estimator = f.string("estimator");  // absent in plans before it existed
  p.memory = memory_from_json(f, "memory");
  const Fields time = f.object("time", {"compute", "recompute", "tp_comm", "dp_comm", "pp_comm",
                                        "ep_comm", "cp_comm", "stragglers", "bubble", "optimizer", "total"});
  p.time.compute = time.number("compute");
  p.time.recompute = time.number("recompute");
  p.time.tp_comm = time.number("tp_comm");
  p.time.dp_comm = time.number("dp_comm");
  p.time.pp_comm = time.number("pp_comm");
  if (time.has("ep_comm")) p.time.ep_comm = time.number("ep_comm");
  if (time.has("cp_comm")) p.time.cp_comm = time.number("cp_comm");
  if (time.has("stragglers")) p.time.stragglers = time.number("stragglers");  // absent before scale effects
  p.time.bubble = time.number("bubble");
  p.time.optimizer = time.number("optimizer");
  p.time.total = time.number("total");
  // Optional: plans written before the per-stage and per-rank details existed lack them.
  if (f.has("stages")) {
    const Json& stages = f.array("stages");
    for (size_t i = 0; i < stages.size(); ++i) {
      const Fields st(stages[i], element(f.path("stages"), i),
                      {"forward_s", "backward_input_s", "backward_weight_s", "p2p_s"});
      p.stages.push_back({st.number("forward_s"), st.number("backward_input_s"),
                          st.number("backward_weight_s"), st.number("p2p_s")});
    }
  }
  if (f.has("ranks")) {
    const Json& ranks = f.array("ranks");
    for (size_t i = 0; i < ranks.size(); ++i) {
      const Fields rf(ranks[i], element(f.path("ranks"), i), {"memory", "busy_s", "idle_s", "bytes_sent"});
      RankPrediction r;
      r.memory = memory_from_json(rf, "memory");
      r.busy_s = rf.number("busy_s");
      r.idle_s = rf.number("idle_s");
      const Fields bytes = rf.object("bytes_sent", {"dp", "tp", "pp", "ends", "dp_inter_node"});
      r.dp_bytes = bytes.number("dp");
      r.tp_bytes = bytes.number("tp");
      r.pp_bytes = bytes.number("pp");
      r.ends_bytes = bytes.number("ends");
      // Optional: absent in plans written before it existed (filled in by plan_from_value).
      r.dp_inter_node_bytes = bytes.has("dp_inter_node") ? bytes.number("dp_inter_node")
                                                         : std::numeric_limits<double>::quiet_NaN();
      p.ranks.push_back(r);
    }
  }
  return p;
}

Alternative alternative_from_json(const Fields& f) {
  Alternative a;
  a.summary = f.string("summary");
  a.step_time_s = f.number("step_time_s");
  a.memory_bytes_per_device = f.number("memory_bytes_per_device");
  a.reason = f.string("reason");
  return a;
}

// The version is checked before anything else: a future format may differ everywhere.
int64_t check_version(const Json& root) {
  const std::string supported =
      "(this build reads version " + std::to_string(kPlanFormatVersion) + ")";
  if (!root.contains("version")) {
    throw FormatError("version: missing required field " + supported);
  }
  const Json& v = root.at("version");
  if (!v.is_number_integer()) {
    throw FormatError("version: expected integer, got " + type_name(v) + " " + supported);
  }
  if (v.get<int64_t>() != kPlanFormatVersion) {
    throw FormatError("version: plan format version " + v.dump() + " is not supported " +
                      supported);
  }
  return kPlanFormatVersion;
}

// What follows nlohmann's "[json.exception.<kind>.<id>] " prefix (and "parse error at ").
std::string error_detail(const char* what) {
  std::string detail = what;
  const size_t bracket = detail.find("] ");
  if (detail.rfind("[json.exception.", 0) == 0 && bracket != std::string::npos) {
    detail = detail.substr(bracket + 2);
  }
  const std::string marker = "parse error at ";
  if (detail.rfind(marker, 0) == 0) detail = detail.substr(marker.size());
  return detail;
}

// nlohmann's DOM builder, except that every error the parser reports becomes a FormatError
// with its byte position: a number too large for a double ("1e400") is reported as
// out_of_range, whose exception carries no position, but the SAX callback receives it.
class PositionedDomParser : public nlohmann::detail::json_sax_dom_parser<Json> {
 public:
  using json_sax_dom_parser::json_sax_dom_parser;
  // A key twice in one object: JSON parsers keep one of them silently (nlohmann the last),
  // so a hand-edited plan would not say what its reader sees. Refused, by name.
  bool start_object(std::size_t n) {
    keys_.emplace_back();
    return json_sax_dom_parser::start_object(n);
  }
  bool key(string_t& k) {
    if (!keys_.empty() && !keys_.back().insert(k).second) {
      throw FormatError("plan JSON: key '" + k + "' appears twice in one object (only one would be read)");
    }
    return json_sax_dom_parser::key(k);
  }
  bool end_object() {
    if (!keys_.empty()) keys_.pop_back();
    return json_sax_dom_parser::end_object();
  }
  template <class Exception>
  bool parse_error(std::size_t byte, const std::string& /*token*/, const Exception& e) {
    throw FormatError("plan JSON: parse error at byte " + std::to_string(byte) + ": " +
                      error_detail(e.what()));
  }

 private:
  std::vector<std::set<std::string>> keys_;
};

Json parse_text(const std::string& text) {
  Json root;
  PositionedDomParser sax(root);
  try {
    Json::sax_parse(text, &sax);
  } catch (const Json::exception& e) {  // anything the DOM builder itself throws
    throw FormatError(std::string("plan JSON: ") + error_detail(e.what()));
  }
  return root;
}

InferencePlan inference_from_json(const Fields& f) {
  InferencePlan inf;
  InferenceConfig& c = inf.config;
  c.objective = inference_objective_from_string(f.string("objective"), f.path("objective"));
  c.batch = f.integer("batch");
  c.prompt_len = f.integer("prompt_len");
  c.max_new_tokens = f.integer("max_new_tokens");
  c.latency_target_s = f.number("latency_target_s");
  c.max_batch = f.integer("max_batch");
  c.weight_bytes = f.number("weight_bytes");
  c.kv_bytes = f.number("kv_bytes");
  c.hbm_efficiency = f.number("hbm_efficiency");
  // Optional (plans written before the host dispatch term: none).
  if (f.has("host_seconds_per_op")) c.host_seconds_per_op = f.number("host_seconds_per_op");
  if (f.has("ops_per_block")) c.ops_per_block = f.number("ops_per_block");
  if (f.has("host_seconds_per_step")) c.host_seconds_per_step = f.number("host_seconds_per_step");
  if (f.has("host_overlaps_device")) c.host_overlaps_device = f.boolean("host_overlaps_device");
  inf.batch_per_replica = f.integer("batch_per_replica");
  inf.decode_micro_batches = f.integer("decode_micro_batches");
  const Fields q = f.object("prediction", {"ttft_s", "per_token_s", "tokens_per_s", "request_s", "weights_bytes",
                                           "kv_cache_bytes", "activation_bytes", "memory_bytes", "decode_weights_s",
                                           "decode_kv_s", "decode_compute_s", "decode_tp_comm_s", "decode_pp_comm_s",
                                           "prefill_compute_s", "prefill_tp_comm_s", "prefill_pp_comm_s",
                                           "decode_host_s"});
  InferencePrediction& p = inf.prediction;
  p.ttft_s = q.number("ttft_s");
  p.per_token_s = q.number("per_token_s");
  p.tokens_per_s = q.number("tokens_per_s");
  p.request_s = q.number("request_s");
  p.weights_bytes = q.number("weights_bytes");
  p.kv_cache_bytes = q.number("kv_cache_bytes");
  p.activation_bytes = q.number("activation_bytes");
  p.memory_bytes = q.number("memory_bytes");
  p.decode_weights_s = q.number("decode_weights_s");
  p.decode_kv_s = q.number("decode_kv_s");
  p.decode_compute_s = q.number("decode_compute_s");
  p.decode_tp_comm_s = q.number("decode_tp_comm_s");
  p.decode_pp_comm_s = q.number("decode_pp_comm_s");
  p.prefill_compute_s = q.number("prefill_compute_s");
  p.prefill_tp_comm_s = q.number("prefill_tp_comm_s");
  p.prefill_pp_comm_s = q.number("prefill_pp_comm_s");
  if (q.has("decode_host_s")) p.decode_host_s = q.number("decode_host_s");
  return inf;
}

Plan plan_from_value(const Json& root) {
  if (!root.is_object()) {
    throw FormatError("plan JSON: expected an object at the top level, got " + type_name(root));
  }
  Plan p;
  p.version = check_version(root);
  const Fields f(root, "",
                 {"version", "model", "cluster", "training", "mesh", "zero_stage",
                  "micro_batch_size", "num_micro_batches", "schedule", "virtual_stages",
                  "recompute", "sequence_parallel", "dp_bucket_bytes", "dp_reduction",
                  "inter_node_compression", "zero_overlap", "layers", "embeddings", "inference",
                  "prediction", "alternatives", "tie_break", "choices"});
  model_from_json(f.object("model", {"name", "params", "transformer"}), p);
  p.cluster = cluster_from_json(f.object(
      "cluster", {"name", "nodes", "devices_per_node", "device_memory_bytes",
                  "memory_reserved_bytes", "peak_flops_fp32", "peak_flops_tf32",
                  "peak_flops_bf16", "peak_flops_fp8", "matmul_efficiency", "hbm_bytes_per_s",
                  "backward_forward_ratio", "cores_per_node", "sm_count", "overlap_contention", "straggler_spread", "intra_node_bytes_per_s", "intra_node_latency_s", "inter_node_bytes_per_s",
                  "inter_node_latency_s", "levels"}));
  p.training = training_from_json(f.object(
      "training", {"global_batch", "compute_dtype", "param_bytes", "grad_bytes", "zero_grad_bytes", "master_grad_bytes",
                   "optimizer_bytes", "activation_bytes", "allow_tensor_parallel",
                   "allow_pipeline_parallel", "allow_zero", "allow_recompute", "recompute_modes",
                   "allow_sequence_parallel", "schedules", "max_micro_batch_size",
                   "dp_bucket_bytes", "allow_hierarchical_dp", "inter_node_compression",
                   "pipeline_sends_kept", "weights_cast_per_forward"}));
  p.mesh = mesh_from_json(f.object("mesh", {"pp", "dp", "tp", "cp", "ep", "order"}));
  p.zero_stage = f.integer("zero_stage");
  p.micro_batch_size = f.integer("micro_batch_size");
  p.num_micro_batches = f.integer("num_micro_batches");
  p.schedule = schedule_from_string(f.string("schedule"), f.path("schedule"));
  p.virtual_stages = f.integer("virtual_stages");
  p.recompute = recompute_from_string(f.string("recompute"), f.path("recompute"));
  p.sequence_parallel = f.boolean("sequence_parallel");
  p.dp_bucket_bytes = f.number("dp_bucket_bytes");
  // Optional: plans written before they existed reduce flat, uncompressed.
  if (f.has("dp_reduction")) p.dp_reduction = dp_reduction_from_string(f.string("dp_reduction"), f.path("dp_reduction"));
  if (f.has("inter_node_compression")) {
    p.inter_node_compression =
        compression_from_string(f.string("inter_node_compression"), f.path("inter_node_compression"));
  }
  if (f.has("zero_overlap")) p.zero_overlap = f.boolean("zero_overlap");  // optional: overlapped before
  const Json& layers = f.array("layers");
  for (size_t i = 0; i < layers.size(); ++i) {
    p.layers.push_back(layer_from_json(Fields(
        layers[i], element("layers", i),
        {"name", "kind", "params", "stage", "tp", "tp_dims", "sharding_unit"})));
  }
  if (f.has("embeddings")) {  // optional: models without embedding tables
    p.embeddings = json_detail::embeddings_from_fields(f.object("embeddings", json_detail::kEmbeddingKeys));
  }
  if (f.has("inference")) {  // optional: inference plans only
    p.inference = inference_from_json(f.object(
        "inference", {"objective", "batch", "prompt_len", "max_new_tokens", "latency_target_s", "max_batch",
                      "weight_bytes", "kv_bytes", "hbm_efficiency", "host_seconds_per_op", "ops_per_block",
                      "host_seconds_per_step", "host_overlaps_device", "batch_per_replica",
                      "decode_micro_batches", "prediction"}));
  }
  p.prediction = prediction_from_json(f.object(
      "prediction", {"step_time_s", "tflops_per_device", "mfu", "memory_bytes_per_device",
                     "tokens_per_s", "bubble_fraction", "estimator", "memory", "time", "stages",
                     "ranks"}));
  // Plans written before ranks carried dp_inter_node reduced flat: all of dp crosses nodes
  // when the dp group spans them.
  const bool dp_inter = axis_link(p.cluster, p.mesh.pp, p.mesh.dp, p.mesh.tp, Axis::dp).inter_node;
  for (RankPrediction& r : p.prediction.ranks) {
    if (std::isnan(r.dp_inter_node_bytes)) r.dp_inter_node_bytes = dp_inter ? r.dp_bytes : 0.0;
  }
  const Json& alternatives = f.array("alternatives");
  for (size_t i = 0; i < alternatives.size(); ++i) {
    p.alternatives.push_back(alternative_from_json(
        Fields(alternatives[i], element("alternatives", i),
               {"summary", "step_time_s", "memory_bytes_per_device", "reason"})));
  }
  if (f.has("tie_break")) p.tie_break = f.string("tie_break");
  if (f.has("choices")) {
    const Json& choices = f.array("choices");
    for (size_t i = 0; i < choices.size(); ++i) {
      const std::string path = f.path("choices") + "[" + std::to_string(i) + "]";
      if (!choices[i].is_string()) throw ValidationError(path, "must be a string");
      p.choices.push_back(choices[i].get<std::string>());
    }
  }
  return p;
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

}  // namespace

std::string to_json(const Plan& plan, int indent) {
  try {
    return plan_to_json_value(plan).dump(indent);
  } catch (const Json::type_error& e) {  // a string that is not valid UTF-8
    throw FormatError(std::string("plan JSON: cannot write plan: ") + e.what());
  }
}

Plan plan_from_json(const std::string& text) {
  Plan plan = plan_from_value(parse_text(text));
  validate(plan);
  return plan;
}

Plan load_plan(const std::string& path) {
  errno = 0;
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) throw FormatError("cannot read plan file '" + path + "': " + std::strerror(errno));
  std::string text;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f.get())) > 0) text.append(buf, n);
  if (std::ferror(f.get())) {  // e.g. the path is a directory
    throw FormatError("cannot read plan file '" + path + "': " + std::strerror(errno));
  }
  return plan_from_json(text);
}

void save_plan(const Plan& plan, const std::string& path) {
  validate(plan);  // never write what load_plan would refuse
  const std::string text = to_json(plan) + "\n";
  errno = 0;
  File f(std::fopen(path.c_str(), "wb"));
  if (!f) throw PlannerError("cannot write plan file '" + path + "': " + std::strerror(errno));
  const bool written = std::fwrite(text.data(), 1, text.size(), f.get()) == text.size();
  const bool closed = std::fclose(f.release()) == 0;  // flush errors show up here
  if (!written || !closed) {
    throw PlannerError("cannot write plan file '" + path + "': " + std::strerror(errno));
  }
}

}  // namespace monarch::planner
