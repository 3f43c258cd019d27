#include "monarch/runtime/replicas.h"

#include <optional>
#include <sstream>

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
  Communicator::Phase phase(group, "the check that every rank wraps the same model");
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

void check_same_options(const std::vector<std::pair<std::string, double>>& options, Communicator& group,
                        const char* who) {
  if (group.size() == 1 || options.empty()) return;
  const int64_t k = static_cast<int64_t>(options.size());
  auto mine = at::empty({k}, at::kDouble);
  for (int64_t i = 0; i < k; ++i) mine[i] = options[i].second;
  auto all = at::empty({group.size() * k}, at::kDouble);
  Communicator::Phase phase(group, "the check that every rank passes the same options");
  group.all_gather(all, mine).wait();
  auto view = all.view({group.size(), k});
  std::ostringstream msg;
  for (int64_t i = 0; i < k; ++i) {
    bool same = true;
    for (int r = 1; r < group.size(); ++r) same = same && view[r][i].item<double>() == view[0][i].item<double>();
    if (same) continue;
    msg << "\n  " << options[i].first << ":";
    for (int r = 0; r < group.size(); ++r) msg << (r ? "," : "") << " rank " << group.ranks()[r] << " " << view[r][i].item<double>();
  }
  TORCH_CHECK(msg.str().empty(), who, ": the ranks of group '", group.name(), "' were given different options:",
              msg.str(), "\nEvery rank must pass the same options.");
}

void broadcast_from_root(const std::vector<at::Tensor>& tensors, Communicator& group) {
  at::NoGradGuard no_grad;
  std::vector<Handle> pending;
  Communicator::Phase phase(group, "the broadcast of rank 0's initial weights");
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) pending.push_back(group.broadcast(t.detach(), 0));
  }
  for (auto& h : pending) h.wait();
}

void sync_tied_gradients(const std::vector<at::Tensor>& params, Communicator* dp, Communicator* ends) {
  at::NoGradGuard no_grad;
  std::optional<Communicator::Phase> dp_phase, ends_phase;
  if (dp != nullptr) dp_phase.emplace(*dp, "the tied-weight gradient sync");
  if (ends != nullptr) ends_phase.emplace(*ends, "the tied-weight gradient sync");
  for (auto p : params) {
    if (!p.grad().defined()) {
      p.mutable_grad() = at::zeros_like(p);
    } else if (!p.grad().is_contiguous()) {
      p.mutable_grad() = p.grad().contiguous();
    }
    auto g = p.grad();
    if (dp != nullptr) dp->all_reduce(g, /*average=*/true).wait();
    if (ends != nullptr) ends->all_reduce(g).wait();
  }
}

}  // namespace monarch
