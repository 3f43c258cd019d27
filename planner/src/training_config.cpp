#include "monarch/planner/training_config.h"

#include "monarch/planner/errors.h"

namespace monarch::planner {
namespace {

void require(bool ok, const char* field, const std::string& message) {
  if (!ok) throw ValidationError(std::string("training.") + field, message);
}

}  // namespace

void validate(const TrainingConfig& t) {
  require(t.global_batch >= 1, "global_batch", "must be >= 1, got " + std::to_string(t.global_batch));
  require(t.param_bytes > 0, "param_bytes", "must be > 0");
  require(t.grad_bytes > 0, "grad_bytes", "must be > 0");
  require(t.zero_grad_bytes >= 0, "zero_grad_bytes", "must be >= 0 (0: grad_bytes)");
  require(t.master_grad_bytes >= 0, "master_grad_bytes", "must be >= 0 (0: grad_bytes)");
  require(t.optimizer_bytes >= 0, "optimizer_bytes", "must be >= 0");
  require(t.activation_bytes > 0, "activation_bytes", "must be > 0");
  require(t.max_micro_batch_size >= 1, "max_micro_batch_size", "must be >= 1");
  require(t.dp_bucket_bytes > 0, "dp_bucket_bytes", "must be > 0");
  require(!t.schedules.empty(), "schedules", "must list at least one schedule");
}

}  // namespace monarch::planner
