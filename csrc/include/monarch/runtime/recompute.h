#pragma once
// Activation recomputation for the C++ frontend (Korthikanti et al. 2022, Sec. 5; Chen et al.
// 2016, "Training Deep Nets with Sublinear Memory Cost"): a piece of forward keeps only its
// inputs; its backward re-runs it (with the RNG state forward began with, so dropout masks
// match) and differentiates that.
//
// * recompute_full: a whole block, keeping only its input.
// * selective (SelectiveRecompute + monarch::attention_core, monarch/runtime/attention.h): the
//   attention core alone, keeping q, k and v, not the s x s scores, softmax and dropout mask.
//   LibTorch has no C++ counterpart of the Python frontend's dispatch mode, which finds the
//   core among a block's operators, so a C++ model computes its core with attention_core,
//   which recomputes itself while a SelectiveRecompute scope is open on its thread.
//
// Gradients of a block's parameters are handed back through the outer backward (the
// recomputed graph is differentiated with autograd::grad, which accumulates nothing), so the
// data-parallel and ZeRO engines' gradient hooks fire once, in the backward that runs them,
// exactly as without recomputation.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace monarch {

// `forward(input)` under grad mode: only `input` is kept for backward. `parameters` are the
// tensors `forward` reads that need gradients (the block's own). Without grad mode: a plain
// call.
at::Tensor recompute_full(const std::function<at::Tensor(const at::Tensor&)>& forward, const at::Tensor& input,
                          const std::vector<at::Tensor>& parameters);

// The same for a function of several inputs: only `inputs` are kept (each gets its gradient).
at::Tensor recompute(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& forward,
                     const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& parameters);

// While one is alive on a thread, monarch::attention_core calls on that thread under grad
// mode recompute their core in backward; it counts them, so the runtime can refuse a block
// that computed its attention some other way (selective would keep everything there). Scopes
// nest; the innermost counts.
class SelectiveRecompute {
 public:
  SelectiveRecompute();
  ~SelectiveRecompute();
  SelectiveRecompute(const SelectiveRecompute&) = delete;
  SelectiveRecompute& operator=(const SelectiveRecompute&) = delete;

  int64_t cores() const { return cores_; }  // attention_core calls recomputed in this scope
  // The innermost scope open on this thread, or null.
  static SelectiveRecompute* active();
  void count_core() { ++cores_; }

 private:
  SelectiveRecompute* outer_;
  int64_t cores_ = 0;
};

}  // namespace monarch
