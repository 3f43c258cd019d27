#pragma once
// Pipeline stage boundaries by dynamic programming over per-layer costs.
#include <cstdint>
#include <optional>
#include <vector>

namespace monarch::planner {

// Most stages x layers a partition may have: the dynamic program keeps two tables of that
// many entries (16 bytes each, 256 MiB at the limit).
inline constexpr int64_t kMaxPartitionCells = int64_t{1} << 24;

struct PartitionProblem {
  std::vector<double> layer_time_s;          // per layer, one micro-batch, forward + backward
  std::vector<double> layer_state_bytes;     // per layer: parameters, gradients, optimizer state
  std::vector<double> layer_activation_bytes;  // per layer, one micro-batch
  std::vector<bool> cut_allowed;             // cut_allowed[i]: a stage may start at layer i
  std::vector<double> stage_in_flight;       // per stage: micro-batches alive at once
  double stage_fixed_bytes = 0;              // per stage: buffers, recompute workspace
  double stage_memory_limit_bytes = 0;
  // Per stage, when not empty: its own limit in place of stage_memory_limit_bytes (a rank's
  // interleaved chunks share its memory in proportion to what each is expected to keep).
  std::vector<double> stage_memory_limits_bytes;
  int64_t stages = 1;
};

struct Partition {
  std::vector<int64_t> stage_of_layer;
  double bottleneck_s = 0;  // slowest stage's time per micro-batch
};

// Splits the layer chain into `stages` contiguous non-empty stages minimizing the slowest
// stage's time subject to every stage's memory <= its limit. Exact for any in-flight
// profile and any allowed cuts: dp[k][j] = min over i of max(dp[k-1][i], time(i..j-1)),
// each minimum found by binary search over the suffix minima of dp[k-1] (O(stages * layers
// * log layers)). Layer times must be >= 0. Deterministic. Returns nullopt when no partition
// fits memory. Throws ValidationError when the per-layer or per-stage vectors have the
// wrong length, or stages x layers exceeds kMaxPartitionCells ("stages").
std::optional<Partition> partition_stages(const PartitionProblem& problem);

// A necessary condition for partition_stages to find a partition, in O(layers): filling each
// stage in turn with as many layers as its memory allows places every layer. (Not sufficient:
// it ignores cut_allowed and that every stage needs a layer.) Throws as partition_stages does.
bool memory_may_admit_partition(const PartitionProblem& problem);

}  // namespace monarch::planner
