#include "monarch/runtime/recompute.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>

namespace monarch {
namespace {

// The generator a tensor on `device` draws from, and its state when forward began.
struct RngState {
  mutable at::Generator generator;  // a handle: restoring writes the shared generator
  at::Tensor state;

  static RngState of(const at::Device& device) {
    auto gen = at::globalContext().defaultGenerator(device.is_cpu() ? at::Device(at::kCPU) : device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    return {gen, gen.get_state()};
  }
  void restore() const {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  }
};

struct Block : torch::CustomClassHolder {
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::vector<RngState> rng;  // CPU, and the input's accelerator when it has one
};

struct Recompute : torch::autograd::Function<Recompute> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, at::TensorList parameters,
                            c10::intrusive_ptr<Block> block) {
    // The parameters are inputs so that autograd routes their gradients through this node
    // (and on to their accumulators); kept as the tensors themselves, not saved variables:
    // ZeRO-3 frees and gathers them again between forward and backward.
    ctx->saved_data["params"] = parameters.vec();
    block->rng.push_back(RngState::of(at::Device(at::kCPU)));
    if (!input.device().is_cpu()) block->rng.push_back(RngState::of(input.device()));
    ctx->save_for_backward({input});
    ctx->saved_data["block"] = c10::IValue::make_capsule(block);
    at::NoGradGuard no_grad;
    return block->forward(input);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "monarch recompute_full: backward with create_graph=True (double "
                "backward) is not supported: the re-run block's gradients are computed without a graph");
    auto block = c10::static_intrusive_pointer_cast<Block>(ctx->saved_data["block"].toCapsule());
    const at::Tensor input = ctx->get_saved_variables()[0].detach().requires_grad_(ctx->needs_input_grad(0));
    std::vector<RngState> now;
    for (const auto& r : block->rng) now.push_back(RngState::of(r.generator.device()));
    at::Tensor output;
    {
      for (const auto& r : block->rng) r.restore();
      at::AutoGradMode grad(true);
      output = block->forward(input);
      for (const auto& r : now) r.restore();  // the caller's random stream goes on undisturbed
    }
    std::vector<at::Tensor> wrt;
    std::vector<size_t> slot;  // position in the node's inputs of each tensor in `wrt`
    if (input.requires_grad()) {
      wrt.push_back(input);
      slot.push_back(0);
    }
    const auto& params = ctx->saved_data["params"].toTensorVector();
    for (size_t i = 0; i < params.size(); ++i) {
      if (ctx->needs_input_grad(1 + i)) {
        wrt.push_back(params[i]);
        slot.push_back(1 + i);
      }
    }
    torch::autograd::variable_list result(1 + params.size() + 1);
    if (wrt.empty() || !output.requires_grad()) return result;
    auto g = torch::autograd::grad({output}, wrt, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                   /*allow_unused=*/true);
    for (size_t k = 0; k < wrt.size(); ++k) result[slot[k]] = g[k];
    return result;
  }
};

}  // namespace

at::Tensor recompute_full(const std::function<at::Tensor(const at::Tensor&)>& forward, const at::Tensor& input,
                          const std::vector<at::Tensor>& parameters) {
  if (!at::GradMode::is_enabled()) return forward(input);
  auto block = c10::make_intrusive<Block>();
  block->forward = forward;
  return Recompute::apply(input, at::TensorList(parameters), block);  // a list: each a variable input
}

}  // namespace monarch
