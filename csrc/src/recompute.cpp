#include "monarch/runtime/recompute.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
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

// Autocast as forward ran under it: the re-run in backward computes in the same dtypes (as
// torch.utils.checkpoint restores it), whatever the backward thread's state.
struct AutocastState {
  bool gpu = false, cpu = false;
  at::ScalarType gpu_dtype = at::kHalf, cpu_dtype = at::kBFloat16;

  static AutocastState now() {
    return {at::autocast::is_enabled(), at::autocast::is_cpu_enabled(), at::autocast::get_autocast_gpu_dtype(),
            at::autocast::get_autocast_cpu_dtype()};
  }
  void apply() const {
    at::autocast::set_enabled(gpu);
    at::autocast::set_cpu_enabled(cpu);
    at::autocast::set_autocast_gpu_dtype(gpu_dtype);
    at::autocast::set_autocast_cpu_dtype(cpu_dtype);
  }
};

struct Block : torch::CustomClassHolder {
  std::function<at::Tensor(const std::vector<at::Tensor>&)> forward;
  size_t num_inputs = 0;      // the function's tensors: the inputs, then the parameters
  std::vector<RngState> rng;  // CPU, and the inputs' accelerator when they have one
  AutocastState autocast;
};

thread_local SelectiveRecompute* active_scope = nullptr;

struct Recompute : torch::autograd::Function<Recompute> {
  // `tensors`: the inputs (saved), then the parameters. The parameters are inputs of the node
  // so that autograd routes their gradients through it (and on to their accumulators); they
  // are kept as the tensors themselves, not saved variables: ZeRO-3 frees and gathers them
  // again between forward and backward.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList tensors,
                            c10::intrusive_ptr<Block> block) {
    const std::vector<at::Tensor> all = tensors.vec();
    const std::vector<at::Tensor> inputs(all.begin(), all.begin() + block->num_inputs);
    ctx->saved_data["params"] = std::vector<at::Tensor>(all.begin() + block->num_inputs, all.end());
    block->rng.push_back(RngState::of(at::Device(at::kCPU)));
    block->autocast = AutocastState::now();
    for (const auto& t : inputs) {
      if (!t.device().is_cpu()) {
        block->rng.push_back(RngState::of(t.device()));
        break;
      }
    }
    ctx->save_for_backward(inputs);
    ctx->saved_data["block"] = c10::IValue::make_capsule(block);
    at::NoGradGuard no_grad;
    return block->forward(inputs);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "monarch recompute: backward with create_graph=True (double "
                "backward) is not supported: the re-run block's gradients are computed without a graph");
    auto block = c10::static_intrusive_pointer_cast<Block>(ctx->saved_data["block"].toCapsule());
    const size_t n = block->num_inputs;
    const torch::autograd::variable_list saved = ctx->get_saved_variables();  // unpacked: a new list each call
    std::vector<at::Tensor> inputs;
    for (size_t i = 0; i < n; ++i) inputs.push_back(saved[i].detach().requires_grad_(ctx->needs_input_grad(i)));
    std::vector<RngState> now;
    for (const auto& r : block->rng) now.push_back(RngState::of(r.generator.device()));
    at::Tensor output;
    {
      const AutocastState autocast = AutocastState::now();
      for (const auto& r : block->rng) r.restore();
      block->autocast.apply();
      at::AutoGradMode grad(true);
      try {
        output = block->forward(inputs);
      } catch (...) {
        autocast.apply();
        throw;
      }
      autocast.apply();
      for (const auto& r : now) r.restore();  // the caller's random stream goes on undisturbed
    }
    std::vector<at::Tensor> wrt;
    std::vector<size_t> slot;  // position in the node's inputs of each tensor in `wrt`
    for (size_t i = 0; i < n; ++i) {
      if (inputs[i].requires_grad()) {
        wrt.push_back(inputs[i]);
        slot.push_back(i);
      }
    }
    const auto& params = ctx->saved_data["params"].toTensorVector();
    for (size_t i = 0; i < params.size(); ++i) {
      if (ctx->needs_input_grad(n + i)) {
        wrt.push_back(params[i]);
        slot.push_back(n + i);
      }
    }
    torch::autograd::variable_list result(n + params.size() + 1);
    if (wrt.empty() || !output.requires_grad()) return result;
    auto g = torch::autograd::grad({output}, wrt, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                   /*allow_unused=*/true);
    for (size_t k = 0; k < wrt.size(); ++k) result[slot[k]] = g[k];
    return result;
  }
};

}  // namespace

at::Tensor recompute(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& forward,
                     const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& parameters) {
  if (!at::GradMode::is_enabled()) return forward(inputs);
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].defined(), "monarch::recompute: input ", i, " is undefined (every input is kept for backward)");
  }
  auto block = c10::make_intrusive<Block>();
  block->forward = forward;
  block->num_inputs = inputs.size();
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), parameters.begin(), parameters.end());
  return Recompute::apply(at::TensorList(all), block);  // a list: each a variable input
}

at::Tensor recompute_full(const std::function<at::Tensor(const at::Tensor&)>& forward, const at::Tensor& input,
                          const std::vector<at::Tensor>& parameters) {
  if (!at::GradMode::is_enabled()) return forward(input);
  return recompute([forward](const std::vector<at::Tensor>& in) { return forward(in[0]); }, {input}, parameters);
}

SelectiveRecompute::SelectiveRecompute() : outer_(active_scope) { active_scope = this; }
SelectiveRecompute::~SelectiveRecompute() { active_scope = outer_; }
SelectiveRecompute* SelectiveRecompute::active() { return active_scope; }

}  // namespace monarch
