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
  int64_t stages = 1;
};

struct Partition {
  std::vector<int64_t> stage_of_layer;
  double bottleneck_s = 0;  // slowest stage's time per micro-batch
};

// Splits the layer chain into `stages` contiguous non-empty stages minimizing the slowest
// stage's time subject to every stage's memory <= the limit. Exact for any in-flight
// profile and any allowed cuts: dp[k][j] = min over i of max(dp[k-1][i], time(i..j-1)),
// each minimum found by binary search over the suffix minima of dp[k-1] (O(stages * layers
// * log layers)). Layer times must be >= 0. Deterministic. Returns nullopt when no partition
// fits memory. Throws ValidationError when the per-layer or per-stage vectors have the
// wrong length, or stages x layers exceeds kMaxPartitionCells ("stages").
std::optional<Partition> partition_stages(const PartitionProblem& problem);

}  // namespace monarch::planner
