#include "monarch/runtime/deferred_linear.h"

#include <atomic>
#include <map>

#include <torch/csrc/autograd/custom_function.h>

namespace monarch {
namespace {

std::atomic<WeightGradSink*> collecting{nullptr};

// Rows of dL/dy and x flattened over the leading dims: dL/dw = dyᵀ x, dL/db = sum of dy.
std::pair<at::Tensor, at::Tensor> weight_grads(const WeightGradSink::Entry& e) {
  auto dy = e.grad_output.reshape({-1, e.grad_output.size(-1)});
  auto x = e.input.reshape({-1, e.input.size(-1)});
  at::Tensor dw = e.weight.requires_grad() ? dy.t().mm(x) : at::Tensor();
  at::Tensor db = e.bias.defined() && e.bias.requires_grad() ? dy.sum(0) : at::Tensor();
  return {dw, db};
}

struct DeferredLinear : torch::autograd::Function<DeferredLinear> {
  // `bias` is an empty placeholder when `has_bias` is false (autograd functions take no
  // undefined tensors).
  // The weight and bias are kept as the parameters themselves (saved_data), not as saved
  // variables: under non-reentrant checkpointing a saved variable comes back as a new tensor
  // tied to the parameter only weakly, and W must hand its gradient to the parameter itself.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias, bool has_bias) {
    const bool weight_grads = weight.requires_grad() || (has_bias && bias.requires_grad());
    ctx->save_for_backward({weight_grads ? input : at::Tensor()});
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["bias"] = has_bias ? bias : at::Tensor();
    return has_bias ? at::linear(input, weight, bias) : at::linear(input, weight);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor weight = ctx->saved_data["weight"].toTensor();
    const at::Tensor bias = ctx->saved_data["bias"].isTensor() ? ctx->saved_data["bias"].toTensor() : at::Tensor();
    const at::Tensor& dy = grads[0];
    at::Tensor dx = ctx->needs_input_grad(0) ? dy.matmul(weight) : at::Tensor();
    if (!input.defined()) return {dx, at::Tensor(), at::Tensor(), at::Tensor()};  // frozen weight and bias
    WeightGradSink::Entry e{weight, bias, input, dy};
    // Deferred only for leaf parameters (a weight computed from others, e.g. weight norm,
    // needs its graph, which B frees).
    const bool leaves = weight.is_leaf() && (!bias.defined() || bias.is_leaf());
    if (leaves && WeightGradSink::offer(e)) return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
    auto [dw, db] = weight_grads(e);
    return {dx, ctx->needs_input_grad(1) ? dw : at::Tensor(), ctx->needs_input_grad(2) ? db : at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

WeightGradSink::Collecting::Collecting(WeightGradSink& sink) : previous_(collecting.exchange(&sink)) {}
WeightGradSink::Collecting::~Collecting() { collecting.store(previous_); }

bool WeightGradSink::offer(Entry entry) {
  WeightGradSink* sink = collecting.load();
  if (sink == nullptr) return false;
  std::lock_guard<std::mutex> lock(sink->mutex_);
  // Detached: W computes plain tensors and hands them to autograd as leaf gradients.
  entry.input = entry.input.detach();
  entry.grad_output = entry.grad_output.detach();
  sink->entries_.push_back(std::move(entry));
  return true;
}

std::vector<std::pair<at::Tensor, at::Tensor>> WeightGradSink::compute_weight_grads() {
  std::vector<Entry> entries;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    entries.swap(entries_);
  }
  at::NoGradGuard no_grad;
  std::map<const void*, size_t> index;
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  auto add = [&](const at::Tensor& t, const at::Tensor& g) {
    if (!t.defined() || !g.defined()) return;
    auto [it, fresh] = index.emplace(t.unsafeGetTensorImpl(), out.size());
    if (fresh) {
      out.emplace_back(t, g);
    } else {
      out[it->second].second = out[it->second].second + g;
    }
  };
  for (const auto& e : entries) {
    auto [dw, db] = weight_grads(e);
    add(e.weight, dw);
    add(e.bias, db);
  }
  return out;
}

at::Tensor deferred_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  if (bias.defined()) return DeferredLinear::apply(input, weight, bias, true);
  return DeferredLinear::apply(input, weight, at::empty({0}, weight.options().requires_grad(false)), false);
}

}  // namespace monarch
