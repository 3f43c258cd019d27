#pragma once
// Hybrid-parallel search: factorize the world into (pp, dp, tp), pick ZeRO stage,
// micro-batch size, schedule, recompute, and stage boundaries; prune by memory; rank by
// predicted step time. Deterministic: every rank computes the same plan.
#include <cstdint>

#include "monarch/planner/plan.h"

namespace monarch::planner {

// How much work a search did (for reports and benchmarks).
struct SearchStats {
  int64_t considered = 0;   // layouts enumerated
  int64_t pruned = 0;       // skipped by the step-time lower bound
  int64_t over_memory = 0;  // no stage split fits in device memory
  int64_t scored = 0;       // fully predicted (schedule simulated)
};

struct SearchOptions {
  Pins pins;
  int64_t alternatives = 5;        // how many runners-up to keep in Plan::alternatives
  SearchStats* stats = nullptr;    // filled in when set
};

// Returns the fastest layout that fits memory. Throws InfeasibleError naming the failed
// constraint and the smallest memory need found when nothing fits, ValidationError when a
// pin is impossible (e.g. "pins.tp: 3 does not divide heads=32").
Plan search(const ModelGraph& graph, const Cluster& cluster, const TrainingConfig& training,
            const SearchOptions& options = {});

// Scores one fully pinned layout (tp, pp, dp, zero, micro-batch size, schedule; recompute
// and sequence parallel searched unless pinned too). Same as `search` with every pin set:
// the result's prediction is what the planner expects of that layout. Unlike `search`, a
// layout that does not fit memory is still returned (prediction.memory says by how much)
// when `allow_over_memory` is true.
Plan evaluate_layout(const ModelGraph& graph, const Cluster& cluster,
                     const TrainingConfig& training, const Pins& pins,
                     bool allow_over_memory = false);

}  // namespace monarch::planner
