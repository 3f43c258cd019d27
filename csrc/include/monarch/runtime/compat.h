#pragma once
// The one place where LibTorch version differences live. Supported: torch 2.9 through 2.14
// (checked at configure time, CMakeLists.txt).
#include <torch/version.h>

#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace monarch::compat {

using Work = c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;
// A process group's backend (Gloo here; see gloo_group.h for how one is made). Only c10d's
// Backend interface is used outside gloo_group.cpp, so no other file needs gloo's headers.
using BackendPtr = c10::intrusive_ptr<c10d::Backend>;

// An owning pointer to an autograd Node (a parameter's gradient accumulator): a
// std::shared_ptr up to torch 2.12, a c10::intrusive_ptr from 2.13.
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// The state a torch::optim optimizer keeps for `param`: keyed by the parameter's TensorImpl
// address as a string before torch 2.10, by the address itself since.
template <class Optimizer>
auto& optimizer_state(Optimizer& optimizer, const at::Tensor& param) {
  using Key = typename std::decay_t<decltype(optimizer.state())>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;
    key << param.unsafeGetTensorImpl();
    return *optimizer.state().at(key.str());
  } else {
    return *optimizer.state().at(param.unsafeGetTensorImpl());
  }
}

}  // namespace monarch::compat
