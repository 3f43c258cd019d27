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

class Estimator;  // estimator.h

struct SearchOptions {
  Pins pins;
  int64_t alternatives = 5;        // how many runners-up to keep in Plan::alternatives
  SearchStats* stats = nullptr;    // filled in when set
  // Per-layer times: the analytic model when null, or a measured profile (estimator.h). Not
  // owned; must outlive the call.
  const Estimator* estimator = nullptr;
  // Layouts predicted within this fraction of the fastest count as tied: the cost model
  // cannot tell them apart (its calibration error, docs/cost_model.md). Among tied layouts
  // the one with the fewest moving parts wins (less traffic on the slowest link, then fewer
  // parallel dimensions, then fewer extras: virtual stages, ZeRO-3, recomputation), and the
  // plan's tie_break says so. 0: always the fastest.
  double tie_tolerance = 0.05;
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
                     bool allow_over_memory = false, const Estimator* estimator = nullptr);

}  // namespace monarch::planner
