#pragma once
// Linear layers whose weight gradient can wait: the split of one backward into an
// input-gradient pass (B) and a weight-gradient pass (W) that zero-bubble pipeline schedules
// need (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 2: B computes dL/dx, W
// computes dL/dW = dL/dyᵀ x from what B kept). Autograd has no weight-only pass: without
// this, W replays the stage's whole backward (about 1.5x a backward in total).
//
// deferred_linear(x, w, b) is y = x wᵀ + b. Its backward always returns dL/dx; while a
// WeightGradSink is collecting, it queues (x, dL/dy) with w and b instead of computing their
// gradients, and the sink's owner computes them later (compute_weight_grads). With no sink
// collecting, it is an ordinary linear (gradients for w and b computed at once).
#include <ATen/ATen.h>

#include <mutex>
#include <utility>
#include <vector>

namespace monarch {

class WeightGradSink {
 public:
  struct Entry {
    at::Tensor weight, bias, input, grad_output;
  };
  // Collects while the returned scope lives. One sink collects at a time (the pipeline
  // executor's backward_input); a process-wide slot, not thread-local, because autograd may
  // run the backward on its own device threads.
  class Collecting {
   public:
    explicit Collecting(WeightGradSink& sink);
    ~Collecting();
    Collecting(const Collecting&) = delete;
    Collecting& operator=(const Collecting&) = delete;

   private:
    WeightGradSink* previous_;
  };
  // Called from deferred_linear's backward: queues into the collecting sink; false if none.
  static bool offer(Entry entry);
  bool empty() const { return entries_.empty(); }
  // dL/dw (and dL/db) of every queued entry, summed per tensor (a weight used twice gets one
  // sum), in fp32 accumulation of the entries' dtype; the queue is emptied.
  std::vector<std::pair<at::Tensor, at::Tensor>> compute_weight_grads();

 private:
  std::mutex mutex_;
  std::vector<Entry> entries_;
};

at::Tensor deferred_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias = {});

}  // namespace monarch
