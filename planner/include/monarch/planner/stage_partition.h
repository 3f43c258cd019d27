#pragma once
// Pipeline stage boundaries by dynamic programming over per-layer costs.
#include <cstdint>
#include <optional>
#include <vector>

namespace monarch::planner {

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
// stage's time subject to every stage's memory <= the limit. Exact: dp[k][j] = min over i of
// max(dp[k-1][i], time(i..j-1)); since dp[k-1][.] is non-decreasing and the segment time is
// non-increasing in i, the best i is found by binary search when every cut is allowed
// (O(stages * layers * log layers)), by a scan otherwise. Deterministic: ties go to the
// earliest cut. Returns nullopt when no partition fits memory.
std::optional<Partition> partition_stages(const PartitionProblem& problem);

}  // namespace monarch::planner
