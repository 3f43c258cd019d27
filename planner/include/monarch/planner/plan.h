#pragma once
// The Plan: the contract between the planner and the runtime. Everything the runtime does
// (mesh, sharding, stages, micro-batches, schedule, recompute, buckets) is read from here.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "monarch/planner/cluster.h"
#include "monarch/planner/embeddings.h"
#include "monarch/planner/inference.h"
#include "monarch/planner/model_graph.h"
#include "monarch/planner/schedule.h"
#include "monarch/planner/training_config.h"

namespace monarch::planner {

inline constexpr int64_t kPlanFormatVersion = 1;

struct Mesh {
  int64_t pp = 1, dp = 1, tp = 1;
  // Axis names from outermost to innermost: rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i
  // (tp innermost so tp groups stay inside a node, then cp). Written out so a plan is explicit
  // about it; validate() accepts only [pp, dp, tp], or [pp, dp, cp, tp] (needed when cp > 1),
  // the orders the cost model assumes.
  std::vector<std::string> order = {"pp", "dp", "tp"};
  // (After `order`, so Mesh{pp, dp, tp, order} still reads as it did.)
  // Context parallelism: the sequence split over cp ranks inside attention (ring exchange of
  // keys and values). A real axis between dp and tp; its ranks hold the same samples and the
  // same (replicated) parameters, so gradients are averaged over dp x cp.
  int64_t cp = 1;
  // Expert parallelism: a MoE layer's experts split over ep ranks. Not an axis of its own:
  // it divides dp x cp (the ranks that hold different tokens), taking the innermost ep of
  // them (see expert_groups below); each expert's weights are replicated (or ZeRO-sharded)
  // over the dp x cp / ep ranks left ("expert data parallel").
  int64_t ep = 1;
  int64_t world_size() const { return pp * dp * cp * tp; }
  // Ranks holding different tokens of one pipeline stage and tp coordinate: dp x cp.
  int64_t token_parallel() const { return dp * cp; }
  // Ranks each expert's weights are replicated over: dp x cp / ep.
  int64_t expert_data_parallel() const { return ep > 0 ? dp * cp / ep : 0; }
  bool operator==(const Mesh& o) const {
    return pp == o.pp && dp == o.dp && tp == o.tp && cp == o.cp && ep == o.ep && order == o.order;
  }
};

// The expert groups of a mesh, as global ranks: for each (pp, tp) coordinate, the dp x cp
// ranks flattened as f = dp_i * cp + cp_i; an ep group is the ranks with equal f / ep (ep
// consecutive f), an expert-data-parallel group the ranks with equal f % ep. Both the planner
// (which link an ep all-to-all crosses) and the runtime (DeviceMesh's "ep" and "edp" groups)
// use this one definition.
struct ExpertGroups {
  std::vector<std::vector<int64_t>> ep;   // each of size mesh.ep
  std::vector<std::vector<int64_t>> edp;  // each of size mesh.expert_data_parallel()
};
ExpertGroups expert_groups(const Mesh& mesh);
// "pp=2 dp=4 tp=8", with cp and ep when they are not 1.
std::string mesh_summary(const Mesh& mesh);

// One layer's placement.
struct LayerPlacement {
  std::string name;
  LayerKind kind = LayerKind::other;
  int64_t params = 0;
  int64_t stage = 0;  // virtual pipeline stage in [0, pp * virtual_stages)
  TpPattern tp = TpPattern::replicated;
  TpDims tp_dims;
  bool sharding_unit = false;  // FSDP/ZeRO-3 gathers and frees this layer as one unit
  bool operator==(const LayerPlacement& o) const;
};

struct MemoryBreakdown {  // bytes on the most loaded rank
  double params = 0, grads = 0, optimizer = 0, activations = 0, buffers = 0;
  double total() const { return params + grads + optimizer + activations + buffers; }
  bool operator==(const MemoryBreakdown& o) const;
};

struct TimeBreakdown {  // seconds per optimizer step
  double compute = 0;       // forward + backward + recompute on the bottleneck stage
  double recompute = 0;     // part of `compute` spent recomputing
  double tp_comm = 0;       // exposed tensor-parallel collectives
  double dp_comm = 0;       // exposed data-parallel / ZeRO collectives
  double pp_comm = 0;       // exposed pipeline send/recv
  double bubble = 0;        // pipeline idle time
  double optimizer = 0;     // optimizer step
  double total = 0;         // = step_time_s
  // (Last, so positional initializers of the fields above keep their meaning.)
  double ep_comm = 0;       // exposed MoE dispatch/combine all-to-alls
  double cp_comm = 0;       // exposed ring k/v exchange of context parallelism
  // The wait for the slowest node at every step: (straggler_factor - 1) x the rest of the
  // step (cost_model.h; Cluster::straggler_spread). Included in `total`.
  double stragglers = 0;
  bool operator==(const TimeBreakdown& o) const;
};

// One pipeline rank, as predicted: every dp x tp rank at the same pipeline position holds and
// does the same. For reports (report_html.h); the runtime reads none of it.
struct RankPrediction {
  MemoryBreakdown memory;
  double busy_s = 0;  // computing in the simulated step
  double idle_s = 0;  // waiting within the simulated step (bubble and transfers)
  // Bytes this rank sends per optimizer step on each mesh axis (traffic.h).
  double dp_bytes = 0, tp_bytes = 0, pp_bytes = 0, ends_bytes = 0;
  // The part of dp_bytes sent over the inter-node link: all of it when a flat dp group spans
  // nodes, none when it stays on one node, the cross-node hop under a hierarchical reduction.
  double dp_inter_node_bytes = 0;
  bool operator==(const RankPrediction& o) const;
};

struct Prediction {
  double step_time_s = 0;
  TimeBreakdown time;
  MemoryBreakdown memory;            // on the most loaded rank
  double memory_bytes_per_device = 0;  // = memory.total()
  double tokens_per_s = 0;
  double tflops_per_device = 0;  // Narayanan et al. F (with recompute) / (step time * devices)
  double mfu = 0;                // model FLOPs (no recompute) / (step time * devices * peak)
  double bubble_fraction = 0;    // from simulating the schedule
  // Where the per-layer times came from: "analytic" (FLOPs and peak rates) or
  // "profile: <source>" (times measured on the machine; estimator.h).
  std::string estimator = "analytic";
  // Per virtual stage, one micro-batch's durations as simulated (so a report can replay the
  // schedule), and per pipeline rank what it holds and sends. Empty in plans written before
  // these fields existed.
  std::vector<StageCosts> stages;
  std::vector<RankPrediction> ranks;
  bool operator==(const Prediction& o) const;
};

// A layout the search considered and did not pick, and why.
struct Alternative {
  std::string summary;  // e.g. "pp=12 dp=4 tp=8 zero=1 mbs=1 1f1b recompute=full"
  double step_time_s = 0;
  double memory_bytes_per_device = 0;
  std::string reason;   // e.g. "1.21x slower: bubble 9.1 s vs 2.3 s"
  bool operator==(const Alternative& o) const;
};

struct Plan {
  int64_t version = kPlanFormatVersion;
  // What the plan was made for: the runtime refuses a plan for another model or world.
  std::string model_name;
  int64_t model_params = 0;
  std::optional<TransformerConfig> transformer;
  Cluster cluster;
  TrainingConfig training;
  // The layout.
  Mesh mesh;
  int64_t zero_stage = 0;  // 0: replicated (DDP), 1: optimizer state, 2: + grads, 3: + params (FSDP)
  int64_t micro_batch_size = 1;
  int64_t num_micro_batches = 1;
  ScheduleKind schedule = ScheduleKind::none;
  int64_t virtual_stages = 1;
  Recompute recompute = Recompute::none;
  bool sequence_parallel = false;
  double dp_bucket_bytes = 25.0 * 1024 * 1024;
  // How the dp axis reduces (training_config.h): hierarchical needs the dp group to span
  // nodes with more than one of its ranks per node; compression needs hierarchical.
  DpReduction dp_reduction = DpReduction::flat;
  Compression inter_node_compression = Compression::none;
  // ZeRO 1-3: whether a unit's gradient reduce-scatter stays in flight while the next unit's
  // backward runs, or is waited for as it is launched (stage 3's parameter gathers prefetch
  // either way). Overlap holds one unit's unsharded gradients more (cost_model.cpp) and pays
  // only where communication and computation can run at once (Cluster::overlap_contention
  // < 1, zero_overlap_pays). Optional in JSON: plans written before it overlap.
  bool zero_overlap = true;
  std::vector<LayerPlacement> layers;
  // Embedding tables of a recommendation model, sharded over all the plan's ranks (absent for
  // models without them).
  std::optional<EmbeddingPlan> embeddings;
  // What the cost model expects.
  Prediction prediction;
  std::vector<Alternative> alternatives;
  // Set when the search preferred this layout over one predicted faster by less than the
  // cost model's stated error because it has fewer moving parts (search.h); empty otherwise.
  std::string tie_break;
  // Why the search chose this ep and cp (e.g. "ep=8: expert state needs it: ep=4 needs 95.1 GiB
  // per device, 78.0 GiB usable"), one line each; empty when neither was a choice.
  std::vector<std::string> choices;
  // Set for an inference plan (plan_inference, inference.h): what it serves (objective, batch,
  // prompt and new tokens), the batch per replica, decode micro-batches, and the prediction
  // (time to first token, per-token latency, tokens/s, KV cache). Absent in training plans.
  std::optional<InferencePlan> inference;

  int64_t num_stages() const { return mesh.pp * virtual_stages; }
  std::string summary() const;  // one line: mesh, zero, mbs, schedule, recompute
  bool operator==(const Plan& o) const;
};

// JSON (docs/plan_format.md). to_json output parses back to an equal Plan and re-serializes
// to identical text. from_json throws FormatError for unparsable text or an unknown
// version, ValidationError naming the field path for a bad value.
std::string to_json(const Plan& plan, int indent = 2);
Plan plan_from_json(const std::string& text);
Plan load_plan(const std::string& path);
void save_plan(const Plan& plan, const std::string& path);

// Consistency checks of a plan on its own: world = pp*dp*tp, batch = mbs * m * dp, stages
// contiguous and in range, tp divides every split layer's heads / kv heads / ffn / vocab,
// schedule constraints. Throws ValidationError with the field path.
void validate(const Plan& plan);
// Also checks the plan was made for `graph` (same layer names and parameter counts).
void validate(const Plan& plan, const ModelGraph& graph);

}  // namespace monarch::planner
