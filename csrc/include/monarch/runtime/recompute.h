#pragma once
// Full activation recomputation for the C++ frontend (Korthikanti et al. 2022, Sec. 5; Chen et
// al. 2016, "Training Deep Nets with Sublinear Memory Cost"): a block keeps only its input in
// forward; its backward re-runs the block's forward (with the RNG state forward began with, so
// dropout masks match) and differentiates that.
//
// Gradients of the block's parameters are handed back through the outer backward (the
// recomputed graph is differentiated with autograd::grad, which accumulates nothing), so the
// data-parallel and ZeRO engines' gradient hooks fire once, in the backward that runs them,
// exactly as without recomputation.
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace monarch {

// `forward(input)` under grad mode: only `input` is kept for backward. `parameters` are the
// tensors `forward` reads that need gradients (the block's own). Without grad mode: a plain
// call.
at::Tensor recompute_full(const std::function<at::Tensor(const at::Tensor&)>& forward, const at::Tensor& input,
                          const std::vector<at::Tensor>& parameters);

}  // namespace monarch
