#pragma once
// Internal: a post hook on a parameter's gradient accumulator (runs after AccumulateGrad,
// with the incoming gradient as autograd's hooks left it), as PyTorch DDP's reducer uses.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <functional>

namespace monarch::detail {

struct AfterAccumulation : torch::autograd::FunctionPostHook {
  // fn(incoming gradient)
  explicit AfterAccumulation(std::function<void(const at::Tensor&)> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    fn_(inputs.empty() ? at::Tensor() : inputs[0]);
    return outputs;
  }
  std::function<void(const at::Tensor&)> fn_;
};

}  // namespace monarch::detail
