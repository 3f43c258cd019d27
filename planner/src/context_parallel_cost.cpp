// Context parallelism's ring k/v exchange. Formulas and sources: context_parallel_cost.h and
// docs/cost_model.md ("Context parallelism").
#include "monarch/planner/context_parallel_cost.h"

#include <algorithm>

#include "monarch/planner/cost_model.h"

namespace monarch::planner {

double cp_ring_step_bytes(const Layer& layer, const TrainingConfig& training, const Layout& layout, int64_t seq) {
  if (layout.cp <= 1 || layer.kv_elements_per_token <= 0 || seq <= 0) return 0.0;
  const double tokens = static_cast<double>(layout.micro_batch_size) * static_cast<double>(seq) /
                        static_cast<double>(layout.cp);
  const double tp = layer.tp == TpPattern::replicated ? 1.0 : static_cast<double>(layout.tp);
  return training.activation_bytes * layer.kv_elements_per_token * tokens / tp;
}

double ring_exposed_seconds(int64_t steps, double comm_step_s, double compute_step_s) {
  return static_cast<double>(std::max<int64_t>(steps, 0)) * std::max(0.0, comm_step_s - compute_step_s);
}

}  // namespace monarch::planner
