#pragma once
// Internal: a post hook on a parameter's gradient accumulator (runs after AccumulateGrad,
// with the incoming gradient as autograd's hooks left it), as PyTorch DDP's reducer uses.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <torch/csrc/autograd/engine.h>

#include <functional>
#include <memory>

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

// The end-of-backward callback an engine queues on the backward it joined, and whether that
// backward was abandoned. Autograd runs the callbacks of a backward that finished; one that
// raised (a user's hook, an out-of-memory, a failed collective) is destroyed with its
// callbacks unrun. The queued callback holds a token: once the token is gone but the
// callback never ran, the engine's per-backward state is stale and must be reset before the
// next backward or forward (instead of failing later with "received two gradients").
class BackwardCallback {
 public:
  // Queues `finish` on the running backward unless already queued for it.
  void queue(std::function<void()> finish) {
    if (queued_) return;
    queued_ = true;
    auto token = std::make_shared<char>(0);
    token_ = token;
    torch::autograd::Engine::get_default_engine().queue_callback(
        [finish = std::move(finish), token] { finish(); });
  }
  // finish() ran (or the state was reset): the next backward queues again.
  void done() { queued_ = false; }
  bool queued() const { return queued_; }
  // A backward queued the callback, then ended without running it.
  bool abandoned() const { return queued_ && token_.expired(); }

 private:
  bool queued_ = false;
  std::weak_ptr<char> token_;
};

}  // namespace monarch::detail
