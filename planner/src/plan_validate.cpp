// Consistency checks of a Plan (docs/plan_format.md, "Validation rules"). Each rule throws
// ValidationError naming the field path, with the numbers that broke it.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "monarch/planner/collectives.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/plan.h"

namespace monarch::planner {
namespace {

std::string str(int64_t v) { return std::to_string(v); }
std::string layer_path(size_t i) { return "layers[" + std::to_string(i) + "]"; }

void require_at_least(int64_t value, int64_t min, const std::string& field) {
  if (value < min) throw ValidationError(field, "must be >= " + str(min) + ", got " + str(value));
}

// a * b, or -1 if it overflows int64 (inputs are already known to be >= 1).
int64_t checked_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? -1 : r;
}

void check_version(const Plan& p) {
  if (p.version != kPlanFormatVersion) {
    throw ValidationError("version", "plan format version " + str(p.version) +
                                         " is not supported (this build reads version " +
                                         str(kPlanFormatVersion) + ")");
  }
}

void check_mesh(const Plan& p) {
  const Mesh& m = p.mesh;
  require_at_least(m.pp, 1, "mesh.pp");
  require_at_least(m.dp, 1, "mesh.dp");
  require_at_least(m.tp, 1, "mesh.tp");
  require_at_least(m.cp, 1, "mesh.cp");
  require_at_least(m.ep, 1, "mesh.ep");
  // The cost model (which link each axis uses) and the runtime's rank layout both assume
  // tp innermost, then cp, and pp outermost; another order would run a layout nobody costed.
  const std::vector<std::string> plain{"pp", "dp", "tp"}, with_cp{"pp", "dp", "cp", "tp"};
  if (m.order != with_cp && !(m.order == plain && m.cp == 1)) {
    std::string got;
    for (const auto& a : m.order) got += (got.empty() ? "" : ", ") + a;
    throw ValidationError("mesh.order", std::string(m.cp > 1 ? "cp=" + str(m.cp) + " needs [pp, dp, cp, tp]"
                                                             : "only [pp, dp, tp] or [pp, dp, cp, tp] is supported") +
                                            ", got [" + got + "]");
  }
  const int64_t world = checked_mul(checked_mul(checked_mul(m.pp, m.dp), m.cp), m.tp);
  if (world != p.cluster.world_size()) {
    const std::string product = world < 0 ? "overflows" : "= " + str(world);
    throw ValidationError("mesh", std::string(m.cp > 1 ? "pp*dp*cp*tp " : "pp*dp*tp ") + product +
                                      " does not equal the cluster's world size " +
                                      str(p.cluster.world_size()) + " (" + str(p.cluster.nodes) +
                                      " nodes x " + str(p.cluster.devices_per_node) +
                                      " devices)");
  }
  if (m.ep > 1 && (m.dp * m.cp) % m.ep != 0) {
    throw ValidationError("mesh.ep", "ep=" + str(m.ep) + " must divide dp*cp = " + str(m.dp) + "*" + str(m.cp) +
                                         " (experts are split over ranks that hold different tokens)");
  }
}

void check_batch(const Plan& p) {
  if (p.zero_stage < 0 || p.zero_stage > 3) {
    throw ValidationError("zero_stage", "must be 0, 1, 2 or 3, got " + str(p.zero_stage));
  }
  require_at_least(p.micro_batch_size, 1, "micro_batch_size");
  require_at_least(p.num_micro_batches, 1, "num_micro_batches");
  const int64_t batch =
      checked_mul(checked_mul(p.micro_batch_size, p.num_micro_batches), p.mesh.dp);
  if (batch != p.training.global_batch) {
    throw ValidationError(
        "num_micro_batches",
        "micro_batch_size * num_micro_batches * dp = " + str(p.micro_batch_size) + " * " +
            str(p.num_micro_batches) + " * " + str(p.mesh.dp) + " = " +
            (batch < 0 ? std::string("overflow") : str(batch)) +
            " does not equal training.global_batch = " + str(p.training.global_batch));
  }
}

void check_schedule(const Plan& p) {
  const std::string name = "'" + to_string(p.schedule) + "'";
  if (p.mesh.pp == 1 && p.schedule != ScheduleKind::none) {
    throw ValidationError("schedule", "pp=1 needs schedule 'none', got " + name);
  }
  if (p.mesh.pp > 1 && p.schedule == ScheduleKind::none) {
    throw ValidationError("schedule",
                          "pp=" + str(p.mesh.pp) + " needs a pipeline schedule, got 'none'");
  }
  require_at_least(p.virtual_stages, 1, "virtual_stages");
  const bool interleaved = p.schedule == ScheduleKind::interleaved_1f1b;
  if (p.schedule == ScheduleKind::zero_bubble_v) {
    if (p.virtual_stages != 2) {
      throw ValidationError("virtual_stages", "zbv runs two stages per rank (a V), so virtual_stages must be 2, got " +
                                                  str(p.virtual_stages));
    }
  } else if (!interleaved && p.virtual_stages != 1) {
    throw ValidationError("virtual_stages", str(p.virtual_stages) +
                                                " needs schedule 'interleaved_1f1b' or 'zbv', got " + name);
  }
  if (interleaved && p.virtual_stages < 2) {
    throw ValidationError("virtual_stages",
                          "interleaved_1f1b needs virtual_stages >= 2, got " +
                              str(p.virtual_stages));
  }
  if (interleaved && p.num_micro_batches % p.mesh.pp != 0) {
    throw ValidationError("num_micro_batches",
                          "interleaved_1f1b needs a multiple of pp=" + str(p.mesh.pp) + ", got " +
                              str(p.num_micro_batches));
  }
}

void check_options(const Plan& p) {
  if (p.sequence_parallel && p.mesh.tp <= 1) {
    throw ValidationError("sequence_parallel", "needs tp > 1, got tp=" + str(p.mesh.tp));
  }
  if (!(p.dp_bucket_bytes > 0) || !std::isfinite(p.dp_bucket_bytes)) {
    throw ValidationError("dp_bucket_bytes",
                          "must be a positive number of bytes, got " +
                              std::to_string(p.dp_bucket_bytes));
  }
  require_at_least(p.model_params, 0, "model.params");
}

// The hierarchical reduction needs a dp group on several nodes with several of its ranks on
// each (collectives.h, dp_node_split); compression is of its inter-node hop.
void check_dp_reduction(const Plan& p) {
  if (p.dp_reduction == DpReduction::hierarchical) {
    const NodeSplit split = dp_node_split(p.cluster, p.mesh.pp, p.mesh.dp, p.mesh.tp);
    if (!split.hierarchical_possible()) {
      const int64_t n = p.cluster.nodes;
      throw ValidationError(
          "dp_reduction",
          "hierarchical needs the dp group to span nodes with >1 rank per node; dp=" + str(p.mesh.dp) +
              " tp=" + str(p.mesh.tp) + " on " +
              (split.nodes == 1 ? std::string("1 node") : str(split.nodes) + " nodes") + " of " +
              str(p.cluster.devices_per_node) + " devices (" + str(split.ranks_per_node) +
              " dp rank" + (split.ranks_per_node == 1 ? "" : "s") + " per node; the cluster has " +
              str(n) + " node" + (n == 1 ? "" : "s") + ")");
    }
    // The runtime runs it in its data-parallel engine (ZeRO 0) and in ZeRO-3 (ZeRO++: two-hop
    // gathers and reduce-scatters, backward gathers inside the node); its ZeRO-1/2 engines run
    // flat collectives, so such a plan would not be run as written.
    if (p.zero_stage != 0 && p.zero_stage != 3) {
      throw ValidationError("dp_reduction", "hierarchical is run for zero_stage 0 (DataParallel) and 3 (ZeRO++) only; "
                                            "the plan has zero_stage " + str(p.zero_stage));
    }
  }
  if (p.inter_node_compression != Compression::none && p.dp_reduction != DpReduction::hierarchical) {
    throw ValidationError("inter_node_compression",
                          to_string(p.inter_node_compression) +
                              " compresses the inter-node hop of a hierarchical dp reduction; needs "
                              "dp_reduction hierarchical, got " + to_string(p.dp_reduction));
  }
}

// tp must divide `value` (0 = no constraint); `what` is "heads", `owner` names the layer.
void check_divides(int64_t tp, int64_t value, const std::string& what, const std::string& owner) {
  if (value > 0 && value % tp != 0) {
    throw ValidationError("mesh.tp", str(tp) + " does not divide " + what + "=" + str(value) +
                                         " (" + owner + ")");
  }
}

void check_layer(const Plan& p, size_t i) {
  const LayerPlacement& l = p.layers[i];
  const std::string path = layer_path(i);
  require_at_least(l.params, 0, path + ".params");
  require_at_least(l.tp_dims.heads, 0, path + ".tp_dims.heads");
  require_at_least(l.tp_dims.kv_heads, 0, path + ".tp_dims.kv_heads");
  require_at_least(l.tp_dims.ffn, 0, path + ".tp_dims.ffn");
  require_at_least(l.tp_dims.vocab, 0, path + ".tp_dims.vocab");
  if (l.tp == TpPattern::replicated) return;
  const std::string owner = "layer '" + l.name + "'";
  check_divides(p.mesh.tp, l.tp_dims.heads, "heads", owner);
  check_divides(p.mesh.tp, l.tp_dims.kv_heads, "kv_heads", owner);
  check_divides(p.mesh.tp, l.tp_dims.ffn, "ffn", owner);
  check_divides(p.mesh.tp, l.tp_dims.vocab, "vocab", owner);
}

// Stages are in range, non-decreasing along the layer list, and none is empty.
void check_stages(const Plan& p) {
  if (p.layers.empty()) throw ValidationError("layers", "a plan needs at least one layer");
  const int64_t stages = checked_mul(p.mesh.pp, p.virtual_stages);
  if (stages < 0 || stages > static_cast<int64_t>(p.layers.size())) {
    throw ValidationError("layers", "pp=" + str(p.mesh.pp) + " x virtual_stages=" +
                                        str(p.virtual_stages) + " stages need at least as many "
                                        "layers, the plan has " +
                                        std::to_string(p.layers.size()));
  }
  std::vector<bool> used(static_cast<size_t>(stages), false);
  for (size_t i = 0; i < p.layers.size(); ++i) {
    const int64_t s = p.layers[i].stage;
    if (s < 0 || s >= stages) {
      throw ValidationError(layer_path(i) + ".stage",
                            str(s) + " is outside [0, " + str(stages) + ") (pp=" +
                                str(p.mesh.pp) + " x virtual_stages=" + str(p.virtual_stages) +
                                ")");
    }
    if (i > 0 && s < p.layers[i - 1].stage) {
      throw ValidationError(layer_path(i) + ".stage",
                            str(s) + " comes after stage " + str(p.layers[i - 1].stage) +
                                " (stages must be non-decreasing along the layer list)");
    }
    used[static_cast<size_t>(s)] = true;
  }
  for (int64_t s = 0; s < stages; ++s) {
    if (!used[static_cast<size_t>(s)]) {
      throw ValidationError("layers", "stage " + str(s) + " has no layer");
    }
  }
  // The runtimes cut pipelines between blocks (the layers around them ride with the first
  // and last block): in a model made of blocks, every stage must hold one, the rule
  // parallelize applies (Composition's layout_from_plan) and search keeps (it cuts only
  // between blocks, ModelGraph::can_cut_before).
  std::vector<bool> has_block(static_cast<size_t>(stages), false);
  bool any_block = false;
  for (const auto& l : p.layers) {
    if (l.kind != LayerKind::block) continue;
    any_block = true;
    has_block[static_cast<size_t>(l.stage)] = true;
  }
  for (int64_t s = 0; any_block && s < stages; ++s) {
    if (!has_block[static_cast<size_t>(s)]) {
      throw ValidationError("layers", "stage " + str(s) + " holds no block (the runtime cuts the pipeline "
                                      "between blocks, so every stage needs one)");
    }
  }
}

void check_transformer(const Plan& p) {
  if (!p.transformer) return;
  const TransformerConfig& t = *p.transformer;
  const std::string owner = "transformer '" + t.name + "'";
  check_divides(p.mesh.tp, t.heads, "heads", owner);
  check_divides(p.mesh.tp, t.kv_heads > 0 ? t.kv_heads : t.heads, "kv_heads", owner);
  // Sequence parallelism splits the sequence over the tp ranks (Korthikanti et al. 2022).
  if (p.sequence_parallel && t.seq > 0 && t.seq % p.mesh.tp != 0) {
    throw ValidationError("sequence_parallel", "splits the sequence over tp=" + str(p.mesh.tp) +
                                                   ", which does not divide seq=" + str(t.seq) + " (" + owner + ")");
  }
}

// Layer names identify layers (the runtime matches them to the model): each appears once.
void check_layer_names(const Plan& p) {
  for (size_t i = 0; i < p.layers.size(); ++i) {
    if (p.layers[i].name.empty()) throw ValidationError(layer_path(i) + ".name", "must not be empty");
    for (size_t j = 0; j < i; ++j) {
      if (p.layers[j].name == p.layers[i].name) {
        throw ValidationError(layer_path(i) + ".name", "'" + p.layers[i].name + "' is also " + layer_path(j) +
                                                          "'s name (each layer appears once)");
      }
    }
  }
}

// model.params against the layers': at most their sum, and at least half of it (a weight
// shared by two layers, e.g. a tied embedding and head, is counted once in the model).
void check_param_total(const Plan& p) {
  int64_t sum = 0;
  for (const auto& l : p.layers) sum += l.params;
  if (p.model_params > sum || 2 * p.model_params < sum) {
    throw ValidationError("model.params", str(p.model_params) + " does not fit the layers, which hold " + str(sum) +
                                              " parameters (the model has at most that, and at least half of it "
                                              "when layers share weights)");
  }
}

void check_prediction(const Plan& p) {
  const Prediction& q = p.prediction;
  const std::pair<const char*, double> fields[] = {
      {"prediction.step_time_s", q.step_time_s},
      {"prediction.memory_bytes_per_device", q.memory_bytes_per_device},
      {"prediction.tokens_per_s", q.tokens_per_s},
      {"prediction.tflops_per_device", q.tflops_per_device},
      {"prediction.mfu", q.mfu},
      {"prediction.bubble_fraction", q.bubble_fraction},
      {"prediction.time.compute", q.time.compute},
      {"prediction.time.recompute", q.time.recompute},
      {"prediction.time.tp_comm", q.time.tp_comm},
      {"prediction.time.dp_comm", q.time.dp_comm},
      {"prediction.time.pp_comm", q.time.pp_comm},
      {"prediction.time.ep_comm", q.time.ep_comm},
      {"prediction.time.cp_comm", q.time.cp_comm},
      {"prediction.time.stragglers", q.time.stragglers},
      {"prediction.time.bubble", q.time.bubble},
      {"prediction.time.optimizer", q.time.optimizer},
      {"prediction.time.total", q.time.total},
      {"prediction.memory.params", q.memory.params},
      {"prediction.memory.grads", q.memory.grads},
      {"prediction.memory.optimizer", q.memory.optimizer},
      {"prediction.memory.activations", q.memory.activations},
      {"prediction.memory.buffers", q.memory.buffers},
  };
  auto check = [](const std::string& field, double value) {
    if (!std::isfinite(value) || value < 0) {
      throw ValidationError(field, "must be a finite number >= 0, got " + std::to_string(value));
    }
  };
  for (const auto& [field, value] : fields) check(field, value);
  // The optional details: one entry per virtual stage and per pipeline rank when present
  // (a report replays the schedule from them).
  if (!q.stages.empty() && static_cast<int64_t>(q.stages.size()) != p.num_stages()) {
    throw ValidationError("prediction.stages", "has " + str(static_cast<int64_t>(q.stages.size())) +
                                                   " entries for " + str(p.num_stages()) + " virtual stages");
  }
  for (size_t i = 0; i < q.stages.size(); ++i) {
    const std::string at = "prediction.stages[" + std::to_string(i) + "].";
    check(at + "forward_s", q.stages[i].forward_s);
    check(at + "backward_input_s", q.stages[i].backward_input_s);
    check(at + "backward_weight_s", q.stages[i].backward_weight_s);
    check(at + "p2p_s", q.stages[i].p2p_s);
  }
  if (!q.ranks.empty() && static_cast<int64_t>(q.ranks.size()) != p.mesh.pp) {
    throw ValidationError("prediction.ranks", "has " + str(static_cast<int64_t>(q.ranks.size())) +
                                                  " entries for pp=" + str(p.mesh.pp));
  }
  for (size_t i = 0; i < q.ranks.size(); ++i) {
    const std::string at = "prediction.ranks[" + std::to_string(i) + "].";
    const RankPrediction& r = q.ranks[i];
    for (const auto& [name, value] :
         {std::pair<const char*, double>{"memory.params", r.memory.params}, {"memory.grads", r.memory.grads},
          {"memory.optimizer", r.memory.optimizer}, {"memory.activations", r.memory.activations},
          {"memory.buffers", r.memory.buffers}, {"busy_s", r.busy_s}, {"idle_s", r.idle_s},
          {"bytes_sent.dp", r.dp_bytes}, {"bytes_sent.tp", r.tp_bytes}, {"bytes_sent.pp", r.pp_bytes},
          {"bytes_sent.ends", r.ends_bytes}, {"bytes_sent.dp_inter_node", r.dp_inter_node_bytes}}) {
      check(at + name, value);
    }
  }
}

// An inference plan: a valid ask, the layout's batch and micro-batches consistent with the
// mesh fields, nothing training-only, finite predictions.
void check_inference(const Plan& p) {
  const InferencePlan& inf = *p.inference;
  validate(inf.config);
  if (inf.batch_per_replica < inf.config.batch) {
    throw ValidationError("inference.batch_per_replica", "must be >= inference.batch (" + str(inf.config.batch) +
                                                             "), got " + str(inf.batch_per_replica));
  }
  if (inf.config.objective == InferenceObjective::latency && inf.batch_per_replica != inf.config.batch) {
    throw ValidationError("inference.batch_per_replica", "the latency objective serves exactly inference.batch (" +
                                                             str(inf.config.batch) + "), got " +
                                                             str(inf.batch_per_replica));
  }
  if (inf.decode_micro_batches != p.num_micro_batches ||
      inf.decode_micro_batches * p.micro_batch_size != inf.batch_per_replica) {
    throw ValidationError("inference.decode_micro_batches",
                          str(inf.decode_micro_batches) + " micro-batches of micro_batch_size " +
                              str(p.micro_batch_size) + " must hold batch_per_replica " +
                              str(inf.batch_per_replica) + " (and equal num_micro_batches " +
                              str(p.num_micro_batches) + ")");
  }
  if (inf.decode_micro_batches > std::max<int64_t>(p.mesh.pp, 1)) {
    throw ValidationError("inference.decode_micro_batches", "at most pp=" + str(p.mesh.pp) + ", got " +
                                                                str(inf.decode_micro_batches));
  }
  if (p.zero_stage != 0) throw ValidationError("zero_stage", "an inference plan has no optimizer state: must be 0");
  if (p.recompute != Recompute::none) throw ValidationError("recompute", "an inference plan recomputes nothing: must be none");
  if (p.sequence_parallel) throw ValidationError("sequence_parallel", "not used by an inference plan");
  if (p.mesh.cp != 1 || p.mesh.ep != 1) throw ValidationError("mesh", "an inference plan has cp = ep = 1");
  if (p.schedule != ScheduleKind::none && p.schedule != ScheduleKind::gpipe) {
    throw ValidationError("schedule", "an inference plan decodes forward only: none or gpipe, got '" +
                                          to_string(p.schedule) + "'");
  }
  const InferencePrediction& q = inf.prediction;
  const std::pair<const char*, double> fields[] = {
      {"ttft_s", q.ttft_s}, {"per_token_s", q.per_token_s}, {"tokens_per_s", q.tokens_per_s},
      {"request_s", q.request_s}, {"weights_bytes", q.weights_bytes}, {"kv_cache_bytes", q.kv_cache_bytes},
      {"activation_bytes", q.activation_bytes}, {"memory_bytes", q.memory_bytes},
      {"decode_weights_s", q.decode_weights_s}, {"decode_kv_s", q.decode_kv_s},
      {"decode_compute_s", q.decode_compute_s}, {"decode_tp_comm_s", q.decode_tp_comm_s},
      {"decode_pp_comm_s", q.decode_pp_comm_s}, {"prefill_compute_s", q.prefill_compute_s},
      {"prefill_tp_comm_s", q.prefill_tp_comm_s}, {"prefill_pp_comm_s", q.prefill_pp_comm_s}};
  for (const auto& [name, value] : fields) {
    if (!std::isfinite(value) || value < 0) {
      throw ValidationError(std::string("inference.prediction.") + name,
                            "must be a finite number >= 0, got " + std::to_string(value));
    }
  }
}

}  // namespace

void validate(const Plan& plan) {
  check_version(plan);
  validate(plan.cluster);
  validate(plan.training);
  require_peak_flops(plan.cluster, plan.training.compute_dtype);
  check_mesh(plan);
  check_batch(plan);
  check_schedule(plan);
  check_options(plan);
  check_dp_reduction(plan);
  check_stages(plan);
  check_layer_names(plan);
  for (size_t i = 0; i < plan.layers.size(); ++i) check_layer(plan, i);
  check_param_total(plan);
  check_transformer(plan);
  check_prediction(plan);
  if (plan.inference) check_inference(plan);
  if (plan.embeddings) {
    // The tables are sharded over every rank of the plan; evaluate_embeddings checks each
    // placement covers its table exactly once and fits the device memory.
    if (plan.embeddings->world_size != plan.mesh.world_size()) {
      throw ValidationError("embeddings.world_size", std::to_string(plan.embeddings->world_size) +
                                                         ", but the mesh has " +
                                                         std::to_string(plan.mesh.world_size()) + " ranks");
    }
    evaluate_embeddings(*plan.embeddings, plan.cluster);
  }
}

void validate(const Plan& plan, const ModelGraph& graph) {
  validate(plan);
  validate(graph);
  if (plan.layers.size() != graph.layers.size()) {
    throw ValidationError("layers", "plan has " + std::to_string(plan.layers.size()) +
                                        " layers, the model has " +
                                        std::to_string(graph.layers.size()));
  }
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const LayerPlacement& mine = plan.layers[i];
    const Layer& theirs = graph.layers[i];
    if (mine.name != theirs.name) {
      throw ValidationError(layer_path(i) + ".name",
                            "plan has '" + mine.name + "', the model has '" + theirs.name + "'");
    }
    if (mine.params != theirs.params) {
      throw ValidationError(layer_path(i) + ".params", "plan has " + str(mine.params) +
                                                           ", the model has " +
                                                           str(theirs.params) + " (layer '" +
                                                           mine.name + "')");
    }
  }
  if (plan.model_params != graph.total_params()) {
    throw ValidationError("model.params", "plan has " + str(plan.model_params) +
                                              ", the model has " + str(graph.total_params()));
  }
  // Expert parallelism splits every MoE layer's experts evenly; a plan using it needs some.
  bool moe = false;
  for (size_t i = 0; i < graph.layers.size(); ++i) {
    const int64_t experts = graph.layers[i].moe.experts;
    moe = moe || experts > 0;
    if (experts > 0 && experts % plan.mesh.ep != 0) {
      throw ValidationError("mesh.ep", "ep=" + str(plan.mesh.ep) + " does not divide the " + str(experts) +
                                           " experts of layer '" + graph.layers[i].name + "'");
    }
  }
  if (plan.mesh.ep > 1 && !moe) {
    throw ValidationError("mesh.ep", "ep=" + str(plan.mesh.ep) + " needs a model with MoE layers");
  }
  // Context parallelism's load-balanced chunks: 2 cp equal parts of the sequence.
  const int64_t seq = graph.seq_len();
  if (plan.mesh.cp > 1 && seq > 0 && seq % (2 * plan.mesh.cp) != 0) {
    throw ValidationError("mesh.cp", "cp=" + str(plan.mesh.cp) + " needs the sequence (" + str(seq) +
                                         ") to split into 2 x cp equal chunks");
  }
}

}  // namespace monarch::planner
