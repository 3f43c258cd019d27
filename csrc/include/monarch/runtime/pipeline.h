#pragma once
// Pipeline execution: runs this rank's action list from the planner's schedule (GPipe,
// 1F1B, interleaved 1F1B, ZB-H1; planner/schedule.h) with point-to-point activations and
// gradients over the mesh's `pp` group. The executor owns order and communication; what a
// forward or backward computes is the StageWork's business (autograd over the stage
// modules for training, or timed stand-ins in the bench).
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "monarch/planner/schedule.h"
#include "monarch/runtime/communicator.h"
#include "monarch/runtime/deferred_linear.h"

namespace monarch {

// The computation of this rank's virtual stages. Stage ids are global (0 .. num_stages-1).
class StageWork {
 public:
  virtual ~StageWork() = default;
  // Forward of micro-batch `mb`. `inputs`: the received activations (stage 0 gets none and
  // reads its micro-batch itself). Returns the activations for the next stage; on the last
  // stage, returns what it wants kept (usually the loss).
  virtual std::vector<at::Tensor> forward(int64_t stage, int64_t mb, std::vector<at::Tensor> inputs) = 0;
  // Full backward. `grads`: gradients of forward's outputs (empty on the last stage).
  // Returns the gradients of forward's `inputs` (empty for stage 0).
  virtual std::vector<at::Tensor> backward(int64_t stage, int64_t mb, std::vector<at::Tensor> grads) = 0;
  // Zero-bubble split: the inputs' gradients now, the weights' gradients later.
  virtual std::vector<at::Tensor> backward_input(int64_t stage, int64_t mb, std::vector<at::Tensor> grads) = 0;
  virtual void backward_weight(int64_t stage, int64_t mb) = 0;
};

// StageWork over autograd: `forward_fn(stage, mb, inputs)` runs the stage module; on the last
// stage `loss_fn(mb, outputs)` turns its outputs into the micro-batch loss, which is
// backpropagated scaled by `loss_scale` (1/m averages over micro-batches). `before_backward
// (stage, mb, last)` runs before each backward of a stage's micro-batch (`last`: its final
// one in this step; gradient synchronisation of data parallelism keys on it). ZB-H1's
// weight pass needs `stage_parameters(stage)`.
class AutogradStageWork : public StageWork {
 public:
  using ForwardFn = std::function<std::vector<at::Tensor>(int64_t, int64_t, const std::vector<at::Tensor>&)>;
  using LossFn = std::function<at::Tensor(int64_t, const std::vector<at::Tensor>&)>;
  using ParametersFn = std::function<std::vector<at::Tensor>(int64_t)>;
  using BackwardHook = std::function<void(int64_t, int64_t, bool)>;

  AutogradStageWork(int64_t num_stages, int64_t micro_batches, ForwardFn forward_fn, LossFn loss_fn,
                    double loss_scale, ParametersFn stage_parameters = {}, BackwardHook before_backward = {});

  std::vector<at::Tensor> forward(int64_t stage, int64_t mb, std::vector<at::Tensor> inputs) override;
  std::vector<at::Tensor> backward(int64_t stage, int64_t mb, std::vector<at::Tensor> grads) override;
  std::vector<at::Tensor> backward_input(int64_t stage, int64_t mb, std::vector<at::Tensor> grads) override;
  void backward_weight(int64_t stage, int64_t mb) override;

  // Unscaled micro-batch losses computed on this rank (last stage), in micro-batch order.
  const std::map<int64_t, double>& losses() const { return losses_; }

 private:
  struct Stash {
    std::vector<at::Tensor> inputs;   // leaves that require grad (received activations)
    std::vector<at::Tensor> outputs;  // or {scaled loss} on the last stage
    // Between backward_input and backward_weight: the parameters' gradients B computed
    // (every parameter not behind a deferred_linear) and what the deferred linears queued.
    std::vector<std::pair<at::Tensor, at::Tensor>> parameter_grads;
    std::shared_ptr<WeightGradSink> deferred;
  };
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> roots(Stash& s, const std::vector<at::Tensor>& grads) const;
  std::vector<at::Tensor> input_grads(const Stash& s) const;
  void note_backward(int64_t stage, int64_t mb);

  int64_t num_stages_, micro_batches_;
  ForwardFn forward_fn_;
  LossFn loss_fn_;
  double loss_scale_;
  ParametersFn stage_parameters_;
  BackwardHook before_backward_;
  std::map<std::pair<int64_t, int64_t>, Stash> stash_;
  std::map<int64_t, int64_t> backwards_done_;  // per stage, this step
  std::map<int64_t, double> losses_;
};

struct PipelineStepStats {
  std::vector<planner::Action> trace;  // compute actions as executed (F, B, Bi, W)
  double total_s = 0;                  // wall time of the step on this rank
  double compute_s = 0;                // inside StageWork calls
  double wait_s = 0;                   // blocked on receives and the final send completion
};

class PipelineExecutor {
 public:
  // Checks the schedule (planner::check_schedule), that it has one program per rank of the
  // `pp` group, and that every rank of the group holds the same schedule (one small
  // all-gather of its fingerprint) — so an inconsistent action list is refused on every
  // rank before any activation moves, instead of deadlocking.
  PipelineExecutor(planner::Schedule schedule, Communicator& pp_group);

  const planner::Schedule& schedule() const { return schedule_; }
  const std::vector<planner::Action>& program() const { return schedule_.per_rank[rank_]; }
  // Stages this rank runs, in order (planner::pipeline_rank_of_stage: rank + k * pp, or
  // ZB-V's rank and 2 pp - 1 - rank).
  std::vector<int64_t> local_stages() const;

  // Runs one step of this rank's program. `forward_only` runs only the forward actions and
  // their activation transfers (inference). Activation shapes are agreed once per stage
  // boundary per step (first micro-batch) and reused for the remaining micro-batches and
  // for the gradients.
  PipelineStepStats run(StageWork& work, bool forward_only = false);

  // One training step: run(work), then the mean of the last stage's micro-batch losses,
  // broadcast from the last pipeline rank so every pp rank returns it.
  double train_step(AutogradStageWork& work, PipelineStepStats* stats = nullptr);

 private:
  struct Meta {
    std::vector<at::ScalarType> dtypes;
    std::vector<std::vector<int64_t>> shapes;
    std::vector<bool> needs_grad;
  };
  int tag(int64_t stage, int64_t mb, int direction, int slot) const;
  void send_tensors(const std::vector<at::Tensor>& tensors, int peer, int64_t stage, int64_t mb,
                    int direction, bool with_meta);
  std::vector<at::Tensor> recv_tensors(int peer, int64_t stage, int64_t mb, int direction,
                                       bool with_meta, double& wait_s);

  planner::Schedule schedule_;
  Communicator& group_;
  int rank_;
  std::map<int64_t, Meta> meta_;  // per sending stage: shapes of its activations (kept across steps)
  // Per stage this rank sends from: the header words last sent. A step whose activations
  // look like the previous step's sends a one-word "same" header instead of the description.
  std::map<int64_t, std::vector<int64_t>> sent_header_;
  bool last_step_complete_ = true;
  int64_t step_ = 0;  // steps run, for the trace (trace.h)
  std::vector<std::pair<Handle, at::Tensor>> pending_sends_;
};

}  // namespace monarch
