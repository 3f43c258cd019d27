#pragma once
// A torch::optim optimizer's per-parameter state and group hyper-parameters under the keys
// Python's torch.optim uses (Adam / AdamW: step, exp_avg, exp_avg_sq, max_exp_avg_sq; SGD:
// momentum_buffer; Adagrad: step, sum; RMSprop: step, square_avg, momentum_buffer, grad_avg),
// so a checkpoint written by either frontend loads into the other (docs/checkpoints.md).
// Step counts are stored as Python keeps them: 0-dim float32 tensors.
#include <torch/optim/optimizer.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace monarch::checkpoint_detail {

struct StateValue {
  std::string key;
  at::Tensor value;
  bool like_param = false;  // shaped like its parameter (sliced as it is); else one value
};

// The optimizer's state of parameter `p` (empty before its first step). Throws naming the
// optimizer for a type whose state is not known here (LBFGS, a user's own).
std::vector<StateValue> optimizer_state(torch::optim::Optimizer& optimizer, const at::Tensor& p);

// The state `values` describe (key -> tensor, keys as optimizer_state gives them; tensors
// shaped like the parameter for the moments, 0-dim for the step) for this optimizer's type,
// ready to be put in optimizer.state() under the parameter's TensorImpl. Throws naming the
// parameter `name` for a key this optimizer does not keep or one it needs that is missing.
std::unique_ptr<torch::optim::OptimizerParamState> make_optimizer_state(torch::optim::Optimizer& optimizer,
                                                                        const std::map<std::string, at::Tensor>& values,
                                                                        const std::string& name);

// A group's hyper-parameters under Python's names (lr, betas, eps, weight_decay, ...).
nlohmann::json group_hyperparameters(const torch::optim::OptimizerOptions& options);
// Sets those of `saved` this optimizer type has (a Python group's foreach, fused, ... are
// not C++ options: ignored).
void set_group_hyperparameters(torch::optim::OptimizerOptions& options, const nlohmann::json& saved);

}  // namespace monarch::checkpoint_detail
