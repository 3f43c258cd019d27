#pragma once
// C++ frontend: pipeline training over the planner's schedule, the same executor
// torch_monarch.parallelize drives from Python. The caller builds its local stages (C++
// modules have no graph to cut automatically): one function per virtual stage this rank runs
// (executor().local_stages()), stage 0 receiving the micro-batch input.
#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "monarch/runtime/data_parallel.h"
#include "monarch/runtime/device_mesh.h"
#include "monarch/runtime/pipeline.h"

namespace monarch {

class PipelineParallel {
 public:
  using StageFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
  using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

  // `stages[s]` and `parameters[s]` for every local stage s. `data_parallel[s]` (optional)
  // is the engine averaging stage s's gradients over dp: it syncs on the stage's last
  // micro-batch only.
  PipelineParallel(planner::Schedule schedule, DeviceMesh& mesh, std::map<int64_t, StageFn> stages,
                   std::map<int64_t, std::vector<at::Tensor>> parameters,
                   std::map<int64_t, DataParallelEngine*> data_parallel = {})
      : executor_(std::move(schedule), mesh.group("pp")),
        stages_(std::move(stages)),
        parameters_(std::move(parameters)),
        data_parallel_(std::move(data_parallel)) {
    for (int64_t s : executor_.local_stages()) {
      TORCH_CHECK(stages_.count(s), "monarch: PipelineParallel: rank ", mesh.rank(), " runs stage ", s,
                  " but no function was given for it");
      TORCH_CHECK(parameters_.count(s), "monarch: PipelineParallel: rank ", mesh.rank(), " runs stage ", s,
                  " but no parameter list was given for it (ZB-H1's weight pass needs it)");
    }
  }

  // Forward and backward of the local batch in the schedule's micro-batches (split along
  // dim 0); returns the batch's mean loss on every pipeline rank.
  double train_step(const at::Tensor& inputs, const at::Tensor& targets, const LossFn& loss_fn) {
    const int64_t m = executor_.schedule().micro_batches;
    TORCH_CHECK(inputs.size(0) % m == 0, "monarch: a batch of ", inputs.size(0), " does not split into ", m,
                " micro-batches");
    auto xs = inputs.chunk(m, 0);
    auto ys = targets.chunk(m, 0);
    AutogradStageWork work(
        executor_.schedule().num_stages(), m,
        [&](int64_t stage, int64_t mb, const std::vector<at::Tensor>& in) {
          return stages_.at(stage)(stage == 0 ? std::vector<at::Tensor>{xs[mb]} : in);
        },
        [&](int64_t mb, const std::vector<at::Tensor>& out) {
          TORCH_CHECK(!out.empty(), "monarch: PipelineParallel: the last stage returned no output");
          return loss_fn(out[0], ys[mb]);
        },
        1.0 / static_cast<double>(m), [&](int64_t stage) { return parameters_.at(stage); },
        [&](int64_t stage, int64_t, bool is_last) {
          auto it = data_parallel_.find(stage);
          if (it != data_parallel_.end()) it->second->set_sync(is_last);
        });
    const double loss = executor_.train_step(work, &stats_);
    for (auto& [stage, engine] : data_parallel_) engine->set_sync(true);
    return loss;
  }

  PipelineExecutor& executor() { return executor_; }
  const PipelineStepStats& last_stats() const { return stats_; }

 private:
  PipelineExecutor executor_;
  std::map<int64_t, StageFn> stages_;
  std::map<int64_t, std::vector<at::Tensor>> parameters_;
  std::map<int64_t, DataParallelEngine*> data_parallel_;
  PipelineStepStats stats_;
};

}  // namespace monarch
