#include "monarch/runtime/replicas.h"

#include <c10/util/Exception.h>

namespace monarch {

void check_same_parameters(const std::vector<at::Tensor>& params, Communicator& group, const char* who) {
  int64_t elements = 0;
  uint64_t hash = 1469598103934665603ULL;
  for (const auto& p : params) {
    elements += p.numel();
    for (int64_t d : p.sizes()) hash = (hash ^ static_cast<uint64_t>(d)) * 1099511628211ULL;
    hash = (hash ^ static_cast<uint64_t>(p.scalar_type())) * 1099511628211ULL;
  }
  const int64_t count = static_cast<int64_t>(params.size());
  auto mine = at::tensor({count, elements, static_cast<int64_t>(hash >> 1)}, at::kLong);
  auto all = at::empty({group.size() * 3}, at::kLong);
  group.all_gather(all, mine).wait();
  auto view = all.view({group.size(), 3});
  for (int r = 0; r < group.size(); ++r) {
    if (view[r].equal(mine)) continue;
    const int64_t their_count = view[r][0].item<int64_t>();
    const int64_t their_elements = view[r][1].item<int64_t>();
    TORCH_CHECK(false, who, ": rank ", group.global_rank(), " wraps ", count, " parameters (", elements,
                " elements) but rank ", group.ranks()[r], " wraps ", their_count, " parameters (",
                their_elements, " elements)",
                their_count == count && their_elements == elements ? " of different shapes" : "",
                ": every rank must wrap the same model");
  }
}

void broadcast_from_root(const std::vector<at::Tensor>& tensors, Communicator& group) {
  at::NoGradGuard no_grad;
  std::vector<Handle> pending;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) pending.push_back(group.broadcast(t.detach(), 0));
  }
  for (auto& h : pending) h.wait();
}

void sync_tied_gradients(const std::vector<at::Tensor>& params, Communicator* dp, Communicator& ends) {
  at::NoGradGuard no_grad;
  for (auto p : params) {
    if (!p.grad().defined()) {
      p.mutable_grad() = at::zeros_like(p);
    } else if (!p.grad().is_contiguous()) {
      p.mutable_grad() = p.grad().contiguous();
    }
    auto g = p.grad();
    if (dp != nullptr) dp->all_reduce(g, /*average=*/true).wait();
    ends.all_reduce(g).wait();
  }
}

}  // namespace monarch
