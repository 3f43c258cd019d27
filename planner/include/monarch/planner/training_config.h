#pragma once
// What is being trained and which techniques the search may use.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "monarch/planner/dtype.h"

namespace monarch::planner {

enum class ScheduleKind { none, gpipe, one_f_one_b, interleaved_1f1b, zero_bubble_h1, zero_bubble_v };
std::string to_string(ScheduleKind kind);
ScheduleKind schedule_from_string(const std::string& name, const std::string& field = "schedule");
// The zero-bubble schedules split each backward into B (input gradient) and W (weight
// gradient, deferred): ZB-H1 and ZB-V (Qi et al. 2023, 2024).
inline bool splits_backward(ScheduleKind kind) {
  return kind == ScheduleKind::zero_bubble_h1 || kind == ScheduleKind::zero_bubble_v;
}
// The pipeline rank that runs virtual stage `stage` of `ranks * v`. Round robin (stage s on
// rank s % ranks) for every schedule but ZB-V, whose two stages per rank form a V (Qi et al.
// 2024, "Pipeline Parallelism with Controllable Memory", Sec. 4): rank r runs stages r and
// 2 ranks - 1 - r, so the first and the last stage share rank 0 and the turn from stage
// ranks - 1 to stage ranks stays on the last rank.
inline int64_t pipeline_rank_of_stage(ScheduleKind kind, int64_t ranks, int64_t stage) {
  if (kind == ScheduleKind::zero_bubble_v && stage >= ranks) return 2 * ranks - 1 - stage;
  return stage % ranks;
}

// Activation recomputation (Korthikanti et al. 2022): none, selective (attention core
// only), full (each layer recomputed from its input during backward).
enum class Recompute { none, selective, full };
std::string to_string(Recompute r);
Recompute recompute_from_string(const std::string& name, const std::string& field = "recompute");

// How the data-parallel axis reduces gradients (collectives.h, DpGroup; docs/cost_model.md,
// "Hierarchical data-parallel reduction"). flat: one ring over the whole dp group.
// hierarchical: reduce-scatter among the group's ranks on one node, all-reduce of each 1/L
// shard across the nodes (ranks with the same local index), all-gather inside the node.
enum class DpReduction { flat, hierarchical };
std::string to_string(DpReduction r);
DpReduction dp_reduction_from_string(const std::string& name, const std::string& field = "dp_reduction");

// Lossy compression of the inter-node hop of a hierarchical all-reduce: none, bf16 (2 bytes
// per value), int8 (1 byte per value plus one fp32 scale per block of 256 values).
enum class Compression { none, bf16, int8 };
std::string to_string(Compression c);
Compression compression_from_string(const std::string& name,
                                    const std::string& field = "inter_node_compression");

// Choices a user fixes; unset ones are searched.
struct Pins {
  std::optional<int64_t> tp, pp, dp, zero_stage, micro_batch_size, virtual_stages;
  std::optional<ScheduleKind> schedule;
  std::optional<Recompute> recompute;
  std::optional<bool> sequence_parallel;
  std::optional<bool> zero_overlap;  // Plan::zero_overlap (ZeRO 1-3 with dp > 1)
  // Context parallelism (Mesh::cp; 1 turns it off) and expert parallelism (Mesh::ep).
  std::optional<int64_t> cp, ep;
  bool all_layout_pinned() const { return tp && pp && dp && zero_stage && micro_batch_size && schedule; }
};

struct TrainingConfig {
  int64_t global_batch = 0;  // samples (sequences) per optimizer step
  DType compute_dtype = DType::bf16;
  double param_bytes = 2;       // per parameter as the model holds it (ZeRO's Psi: 2 for fp16/bf16)
  double grad_bytes = 2;        // per parameter gradient
  // Per parameter, the gradients a ZeRO engine (stage >= 1) holds: the unsharded ones it
  // accumulates and reduces, and the shards' reduced ones. 0: grad_bytes (ZeRO's accounting,
  // Rajbhandari et al. 2020). torch_monarch's runtime accumulates them in fp32 whatever the
  // compute dtype (fully_shard.cpp), and its planning says 4 (torch_monarch.api).
  double zero_grad_bytes = 0;
  double zero_gradient_bytes() const { return zero_grad_bytes > 0 ? zero_grad_bytes : grad_bytes; }
  // Per parameter, the gradients a layout without ZeRO (stage 0) holds in memory: those of the
  // master weights when it computes in a narrower dtype (torch_monarch's mixed precision keeps
  // them in the parameters' fp32 and reduces in grad_bytes' dtype). 0: grad_bytes.
  double master_grad_bytes = 0;
  double replica_gradient_bytes() const { return master_grad_bytes > 0 ? master_grad_bytes : grad_bytes; }
  double optimizer_bytes = 12;  // ZeRO's K: fp32 master copy + Adam m and v = 12
  double activation_bytes = 2;  // bytes per activation element (Korthikanti assume 2)
  bool allow_tensor_parallel = true;
  bool allow_pipeline_parallel = true;
  bool allow_zero = true;
  bool allow_recompute = true;
  // Recomputation modes the search may use when allow_recompute (a runtime that implements
  // only some lists those; `none` is always a candidate).
  std::vector<Recompute> recompute_modes = {Recompute::none, Recompute::selective, Recompute::full};
  bool allow_sequence_parallel = true;
  // Schedules the search may use. GPipe is left out by default: it has 1F1B's bubble and
  // keeps all m micro-batches' activations instead of at most p, so it never wins; pin it
  // (or list it here) to score it. ZB-V is left out for now too, though it often wins: its
  // V puts two stages on each rank, which torch_monarch's generate() does not run yet, and a
  // trained model's layout is what it generates with.
  std::vector<ScheduleKind> schedules = {ScheduleKind::one_f_one_b, ScheduleKind::interleaved_1f1b,
                                         ScheduleKind::zero_bubble_h1};
  int64_t max_micro_batch_size = 64;
  double dp_bucket_bytes = 25.0 * 1024 * 1024;  // DDP's default bucket_cap_mb = 25
  // The search may reduce the dp axis hierarchically where the dp group spans nodes with more
  // than one of its ranks per node, when that is predicted faster (it changes no memory).
  bool allow_hierarchical_dp = true;
  // The lossy compression the search may use on the inter-node hop of a hierarchical
  // all-reduce (it then compares it with none and keeps the faster); none: never compressed.
  Compression inter_node_compression = Compression::none;
  // What a pipeline stage keeps of the tensors it sends (docs/cost_model.md, "Memory").
  // false: Megatron-LM's (deallocate_output_tensor: a stage's output is freed once sent, only
  // its autograd graph kept; sends waited as they complete). true: torch_monarch's runtime,
  // whose PipelineExecutor keeps every tensor it sends (outputs forward, input gradients back)
  // until it waits for the sends at the step's end.
  bool pipeline_sends_kept = false;
  // Mixed precision by casting per forward (torch_monarch.mixed_precision, layouts below
  // ZeRO-3): each forward casts the master weights to the compute dtype and its graph keeps
  // the copies (param_bytes per parameter) until that micro-batch's backward, so a stage with
  // k micro-batches in flight holds k copies, where the model state counts one. false: one copy
  // per step (Megatron-LM's bf16 model with fp32 main parameters).
  bool weights_cast_per_forward = false;
  bool operator==(const TrainingConfig& o) const;
};

void validate(const TrainingConfig& config);

}  // namespace monarch::planner
