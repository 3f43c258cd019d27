#pragma once
#include <optional>
// Data-parallel engine (DDP-like): gradients averaged over a group, bucketed and launched
// from autograd hooks while backward still runs. Works on plain parameter tensors, so the
// Python and C++ frontends drive the same object.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace torch::autograd {
struct Node;
}
namespace monarch::detail {
class BackwardCallback;
}

#include "monarch/runtime/communicator.h"
#include "monarch/runtime/hierarchical.h"

namespace monarch {

struct DataParallelOptions {
  int64_t bucket_bytes = 25 * 1024 * 1024;  // the Plan's dp_bucket_bytes (DDP: 25 MB)
  bool broadcast_from_root = true;          // every rank starts from rank 0's weights
  // Opt-in: all-reduce gradients in bf16 (half the bytes) with error feedback: the rounding
  // error of each step is added back before the next one is rounded (Seide et al. 2014,
  // "1-bit SGD"; Karimireddy et al. 2019, "Error feedback fixes SignSGD").
  bool bf16_compression = false;
  // The Plan's dp_reduction = hierarchical: each bucket is reduced inside the node, across
  // nodes, then gathered inside the node (hierarchical.h), on the node groups' worker thread
  // while backward goes on; the constructor then needs the group's NodeGroups.
  bool hierarchical = false;
  // The Plan's inter_node_compression: the slow hop only, with error feedback (hierarchical).
  WireCompression inter_node_compression = WireCompression::none;
  // The dtype the buckets hold and the all-reduce moves (unset: the parameters'): a bf16 plan
  // over fp32 master weights reduces in bf16 (the planner's grad_bytes = 2, as FSDP's
  // reduce_dtype defaults to its param_dtype); .grad stays in the parameters' dtype and the
  // average is taken there. No error feedback: that is bf16_compression's opt-in.
  std::optional<at::ScalarType> reduce_dtype;
};

class DataParallelEngine {
 public:
  // `params` in registration order (module.parameters()); `buffers` are broadcast too.
  // Refuses (on every rank) parameters whose count or shapes differ across the group.
  // `nodes`: `group` split by node (DeviceMesh::node_groups), needed when options.hierarchical.
  DataParallelEngine(std::vector<at::Tensor> params, std::vector<at::Tensor> buffers,
                     Communicator& group, DataParallelOptions options = {}, NodeGroups* nodes = nullptr);
  ~DataParallelEngine();
  DataParallelEngine(const DataParallelEngine&) = delete;
  DataParallelEngine& operator=(const DataParallelEngine&) = delete;

  // With sync off (no_sync), backward only accumulates local gradients; the next backward
  // with sync on averages the accumulated sum, as DDP does.
  void set_sync(bool sync) { sync_ = sync; }
  // Call at the start of each forward: counts it in the group's step (see Communicator), so
  // a rank that gave up a step after a local error is named at its next collective.
  void before_forward() { group_.advance_step(); }
  bool sync() const { return sync_; }
  const Communicator& group() const { return group_; }
  Communicator& group() { return group_; }
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  // Bytes of each bucket in launch order (tests, logs).
  std::vector<int64_t> bucket_sizes_bytes() const;

 private:
  struct Slot {
    size_t bucket;
    int64_t offset;
  };
  struct Bucket {
    std::vector<size_t> params;  // indices into params_
    at::Tensor flat;             // gradients, packed
    at::Tensor error;            // error feedback (bf16 compression)
    at::Tensor wire;             // what goes over the wire (bf16 compression)
    size_t pending = 0;
    Handle handle;
    std::shared_future<void> reduced;  // hierarchical: the worker's job
    ErrorFeedback feedback;            // hierarchical with a compressed slow hop
    std::shared_ptr<NodeSharedBuffer> shared;  // hierarchical: the node's shared slots (flat is ours)
  };

  void build_buckets(int64_t bucket_bytes);
  void on_gradient(size_t index);
  void launch_ready_buckets();
  void finish_backward();
  void reset_backward_state();
  // A backward that raised left buckets half filled (see detail::BackwardCallback): wait for
  // the reductions it launched (every rank that failed at the same point launched the same
  // ones), drop the partial results, and rethrow a collective's failure if there was one.
  void recover_if_abandoned();
  // Waits for bucket b's reduction, whichever path launched it.
  void wait_bucket(Bucket& b);

  std::vector<at::Tensor> params_;
  Communicator& group_;
  DataParallelOptions options_;
  NodeGroups* nodes_ = nullptr;
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  std::vector<bool> ready_;
  // Hooks run after each parameter's gradient accumulator (as DDP's reducer): they see the
  // gradient after any tensor hooks a user registered changed it, whenever registered.
  std::vector<compat::NodePtr> accumulators_;  // held: the tensor holds them weakly
  std::vector<uintptr_t> hook_keys_;
  size_t next_launch_ = 0;
  std::unique_ptr<detail::BackwardCallback> callback_;
  bool sync_ = true;
};

}  // namespace monarch
