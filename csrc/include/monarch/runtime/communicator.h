#pragma once
// Collectives on flat buffers over one process group, asynchronous, with byte counters.
#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "monarch/runtime/compat.h"

namespace monarch {

enum class CollectiveKind { all_reduce, reduce_scatter, all_gather, broadcast, send, recv, all_to_all };
constexpr size_t kCollectiveKinds = 7;
std::string to_string(CollectiveKind kind);

// Bytes this rank sent, per collective kind, counted as the ring algorithm sends them
// (all-reduce 2(n-1)/n S, reduce-scatter / all-gather (n-1)/n S, broadcast / send S): the
// same volumes the planner's cost model uses, so predictions and runs compare directly.
class ByteCounters {
 public:
  void add(CollectiveKind kind, double bytes) {
    auto& slot = bytes_[static_cast<size_t>(kind)];
    double old = slot.load();
    while (!slot.compare_exchange_weak(old, old + bytes)) {
    }
  }
  double bytes(CollectiveKind kind) const { return bytes_[static_cast<size_t>(kind)].load(); }
  double total() const;
  void reset();

 private:
  std::array<std::atomic<double>, kCollectiveKinds> bytes_{};
};

// A collective in flight. Contract: until wait() returns, the input and output buffers
// belong to the collective (do not read the output, do not modify the input). wait()
// returns once the output holds the result, or throws an error naming the rank, the
// group and the collective (including a timeout when a peer died or never joined).
class Handle {
 public:
  Handle() = default;
  // `failure`: the group's failure latch (see Communicator): the first collective that fails
  // writes its error there; once set, wait() fails at once with it instead of waiting.
  Handle(compat::WorkPtr work, std::string what, std::function<void()> finish = {},
         std::shared_ptr<std::string> failure = {});
  void wait();
  bool done() const { return waited_ || !work_; }

 private:
  compat::WorkPtr work_;
  std::string what_;
  std::function<void()> finish_;
  std::shared_ptr<std::string> failure_;
  bool waited_ = false;
};

class Communicator {
 public:
  // `ranks`: the group's global ranks in group order; `rank`: this process's global rank.
  Communicator(compat::GlooPtr group, std::vector<int> ranks, int rank, std::string name);

  const std::string& name() const { return name_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  int group_rank() const { return group_rank_; }
  int global_rank() const { return ranks_[group_rank_]; }
  const std::vector<int>& ranks() const { return ranks_; }

  // Sum (or average) in place. bf16 buffers are summed in fp32 (see all_reduce_bf16).
  Handle all_reduce(at::Tensor buffer, bool average = false);
  // Element-wise maximum in place (fp32/fp64; e.g. the vocab-parallel softmax's row max).
  Handle all_reduce_max(at::Tensor buffer);
  // `input` holds size() equal chunks; `output` receives the sum of every rank's chunk
  // group_rank(). Gloo has no reduce-scatter in LibTorch 1.13: it runs as an all-to-all
  // plus a local sum, which sends the same (n-1)/n S bytes as a ring reduce-scatter.
  Handle reduce_scatter(at::Tensor output, at::Tensor input);
  // `output` (size() x input's numel) receives every rank's `input`, in group order.
  Handle all_gather(at::Tensor output, at::Tensor input);
  Handle broadcast(at::Tensor buffer, int root_group_rank);
  Handle send(at::Tensor buffer, int peer_group_rank, int tag = 0);
  Handle recv(at::Tensor buffer, int peer_group_rank, int tag = 0);
  // Equal splits: chunk j of `input` goes to rank j; chunk j of `output` comes from rank j.
  Handle all_to_all(at::Tensor output, at::Tensor input);
  void barrier();

  ByteCounters& counters() { return counters_; }
  const ByteCounters& counters() const { return counters_; }

  // After a collective fails (a peer died, a timeout, mismatched sizes) the group is in an
  // unknown state, as an aborted NCCL communicator is: every later collective on it, and
  // every wait on one in flight, fails at once with the first error (which names the rank,
  // the collective and the group), never with a misleading later one.
  bool failed() const { return !failure_->empty(); }
  const std::string& failure() const { return *failure_; }

 private:
  std::string describe(CollectiveKind kind, const at::Tensor& t) const;
  void check_usable() const;
  Handle make(compat::WorkPtr work, std::string what, std::function<void()> finish = {}) const {
    return Handle(std::move(work), std::move(what), std::move(finish), failure_);
  }
  Handle all_reduce_bf16(at::Tensor buffer, bool average);
  compat::GlooPtr group_;
  std::vector<int> ranks_;
  int group_rank_ = 0;
  std::string name_;
  ByteCounters counters_;
  std::shared_ptr<std::string> failure_ = std::make_shared<std::string>();
};

}  // namespace monarch
