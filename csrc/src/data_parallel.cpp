#include "monarch/runtime/data_parallel.h"

#include "monarch/runtime/replicas.h"
#include "monarch/runtime/shared_memory.h"
#include "autograd_hooks.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <functional>
#include <sstream>

namespace monarch {
namespace {

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

}  // namespace

DataParallelEngine::DataParallelEngine(std::vector<at::Tensor> params, std::vector<at::Tensor> buffers,
                                       Communicator& group, DataParallelOptions options, NodeGroups* nodes)
    : params_(std::move(params)), group_(group), options_(options), nodes_(nodes) {
  TORCH_CHECK(options_.bucket_bytes > 0, "monarch::DataParallel: bucket_bytes must be > 0");
  TORCH_CHECK(!options_.hierarchical || nodes_ != nullptr,
              "monarch::DataParallel: a hierarchical reduction needs the group's node groups (DeviceMesh::node_groups)");
  TORCH_CHECK(options_.hierarchical || options_.inter_node_compression == WireCompression::none,
              "monarch::DataParallel: inter_node_compression='", planner::to_string(options_.inter_node_compression),
              "' compresses the slow hop of a hierarchical reduction: it needs dp_reduction='hierarchical'");
  TORCH_CHECK(!(options_.reduce_dtype && options_.bf16_compression),
              "monarch::DataParallel: gradient_compression='bf16' and reduce_dtype both set the wire dtype; give one");
  TORCH_CHECK(!options_.reduce_dtype || at::isFloatingType(*options_.reduce_dtype),
              "monarch::DataParallel: reduce_dtype ", *options_.reduce_dtype, " is not a floating-point dtype");
  TORCH_CHECK(!(options_.hierarchical && options_.bf16_compression),
              "monarch::DataParallel: gradient_compression='bf16' compresses the flat all-reduce; with a hierarchical "
              "reduction use inter_node_compression='bf16' instead");
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(params_[i].requires_grad(), "monarch::DataParallel: parameter ", i,
                " does not require grad");
    TORCH_CHECK(params_[i].is_floating_point(), "monarch::DataParallel: parameter ", i,
                " is not floating point");
    TORCH_CHECK(!options_.hierarchical || params_[i].is_cpu(), "monarch::DataParallel: parameter ", i, " is on ",
                params_[i].device(), ": the hierarchical reduction runs on CPU (Gloo) tensors; use dp_reduction "
                "flat on CUDA for now");
  }
  check_same_parameters(params_, group_, "monarch::DataParallel");
  check_same_options({{"bucket_cap_mb", static_cast<double>(options_.bucket_bytes) / (1024.0 * 1024.0)},
                      {"gradient_compression (bf16)", options_.bf16_compression ? 1.0 : 0.0},
                      {"broadcast_from_rank0", options_.broadcast_from_root ? 1.0 : 0.0},
                      {"dp_reduction (hierarchical)", options_.hierarchical ? 1.0 : 0.0},
                      {"inter_node_compression (none 0, bf16 1, int8 2)",
                       static_cast<double>(options_.inter_node_compression)},
                      {"reduce_dtype (a ScalarType number, -1: the parameters')",
                       options_.reduce_dtype ? static_cast<double>(*options_.reduce_dtype) : -1.0}},
                     group_, "monarch::DataParallel");
  if (options_.broadcast_from_root) {
    std::vector<at::Tensor> state = params_;
    state.insert(state.end(), buffers.begin(), buffers.end());
    broadcast_from_root(state, group_);
  }
  build_buckets(options_.bucket_bytes);
  ready_.assign(params_.size(), false);
  callback_ = std::make_unique<detail::BackwardCallback>();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(accumulator, "monarch::DataParallel: parameter ", i, " is not a leaf tensor");
    hook_keys_.push_back(accumulator->add_post_hook(
        std::make_unique<detail::AfterAccumulation>([this, i](const at::Tensor&) { on_gradient(i); })));
    accumulators_.push_back(std::move(accumulator));
  }
}

DataParallelEngine::~DataParallelEngine() {
  // The worker's jobs use the buckets' error feedback: let queued ones finish first.
  for (auto& b : buckets_) {
    if (b.reduced.valid()) b.reduced.wait();
  }
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

// Buckets are filled in reverse registration order: gradients of the last layers arrive
// first in backward (as in PyTorch DDP, Li et al. 2020 Sec. 3.2.3). One dtype per bucket.
void DataParallelEngine::build_buckets(int64_t bucket_bytes) {
  slots_.assign(params_.size(), Slot{0, 0});
  std::vector<int64_t> bytes;
  for (size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    const bool fits = !buckets_.empty() &&
                      params_[buckets_.back().params.front()].scalar_type() == p.scalar_type() &&
                      bytes.back() + nbytes(p) <= bucket_bytes;
    if (!fits) {
      buckets_.emplace_back();
      bytes.push_back(0);
    }
    Bucket& b = buckets_.back();
    slots_[k] = Slot{buckets_.size() - 1, bytes.back() / static_cast<int64_t>(p.element_size())};
    b.params.push_back(k);
    bytes.back() += nbytes(p);
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    const auto& first = params_[b.params.front()];
    int64_t numel = bytes[i] / static_cast<int64_t>(first.element_size());
    // The hierarchical reduce-scatter takes equal chunks: pad with zeros (they stay zero).
    if (options_.hierarchical) {
      const int64_t local = nodes_->intra->size();
      numel = (numel + local - 1) / local * local;
    }
    // A bf16 bucket (reduce_dtype) is all-reduced as equal chunks per rank (Communicator::
    // all_reduce_bf16): padded to a multiple of the group, it is sent as it is, not copied.
    if (!options_.hierarchical && options_.reduce_dtype == at::kBFloat16) {
      numel = (numel + group_.size() - 1) / group_.size() * group_.size();
    }
    // Hierarchical on a node of several ranks: the bucket is this rank's slot of a buffer
    // the node's ranks share (collective over the node; none where shared memory is missing).
    // On the worker: another engine on the same node groups may still have jobs there.
    if (options_.hierarchical) {
      NodeGroups* nodes = nodes_;
      const at::ScalarType dtype = options_.reduce_dtype.value_or(first.scalar_type());
      std::shared_ptr<NodeSharedBuffer> shared;
      nodes_->worker.submit([nodes, numel, dtype, &shared] { shared = NodeSharedBuffer::create(*nodes->intra, numel, dtype); }).get();
      b.shared = std::move(shared);
    }
    b.flat = b.shared ? b.shared->mine()
                      : at::zeros({numel}, first.options().requires_grad(false).dtype(
                                               options_.reduce_dtype.value_or(first.scalar_type())));
    if (options_.bf16_compression) {
      b.error = at::zeros_like(b.flat);
      b.wire = at::empty(b.flat.sizes(), b.flat.options().dtype(at::kBFloat16));
    }
    b.pending = b.params.size();
  }
}

std::vector<int64_t> DataParallelEngine::bucket_sizes_bytes() const {
  std::vector<int64_t> out;
  for (const auto& b : buckets_) out.push_back(nbytes(b.flat));
  return out;
}

void DataParallelEngine::on_gradient(size_t index) {
  recover_if_abandoned();
  if (!sync_) return;  // no_sync: autograd accumulates into .grad as usual
  callback_->queue([this] { finish_backward(); });
  TORCH_CHECK(!ready_[index], "monarch::DataParallel: parameter ", index,
              " received two gradients in one backward (reentrant backward is not supported)");
  at::NoGradGuard no_grad;
  const Slot& s = slots_[index];
  Bucket& b = buckets_[s.bucket];
  const at::Tensor& p = params_[index];
  auto view = b.flat.narrow(0, s.offset, p.numel()).view(p.sizes());
  // .grad after accumulation: what no_sync steps accumulated plus this backward's.
  view.copy_(p.grad());
  ready_[index] = true;
  if (--b.pending == 0) launch_ready_buckets();
}

// Launch in bucket order only, so every rank issues the same collectives in the same order
// even when gradients become ready in different orders.
void DataParallelEngine::launch_ready_buckets() {
  Communicator::Phase phase(group_, "DataParallel backward (gradient all-reduce)");
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    Bucket& b = buckets_[next_launch_];
    if (options_.hierarchical) {
      // Off this thread, in bucket order (the worker is shared by every engine on the group).
      NodeGroups* nodes = nodes_;
      at::Tensor flat = b.flat;
      ErrorFeedback* feedback = &b.feedback;
      const NodeSharedBuffer* shared = b.shared.get();
      const WireCompression compression = options_.inter_node_compression;
      b.reduced = nodes_->worker.submit([nodes, flat, feedback, shared, compression] {
        at::NoGradGuard no_grad;
        hierarchical_all_reduce(*nodes->intra, *nodes->inter, flat, compression, *feedback, nodes->scratch, shared);
      });
    } else if (options_.bf16_compression) {
      auto corrected = b.flat + b.error;
      b.wire.copy_(corrected);
      b.error.copy_(corrected - b.wire.to(corrected.scalar_type()));
      b.handle = group_.all_reduce(b.wire);
    } else {
      b.handle = group_.all_reduce(b.flat);
    }
    ++next_launch_;
  }
}

void DataParallelEngine::finish_backward() {
  at::NoGradGuard no_grad;
  // Parameters that got no gradient this backward (unused branches) contribute zeros, or
  // what no_sync steps accumulated, so every rank still runs every bucket's collective.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ready_[i]) continue;
    const Slot& s = slots_[i];
    Bucket& b = buckets_[s.bucket];
    const auto& p = params_[i];
    auto view = b.flat.narrow(0, s.offset, p.numel()).view(p.sizes());
    if (p.grad().defined()) view.copy_(p.grad()); else view.zero_();
    ready_[i] = true;
    --b.pending;
  }
  launch_ready_buckets();
  const double n = static_cast<double>(group_.size());
  for (auto& b : buckets_) {
    wait_bucket(b);  // on failure the state stays: the next backward or forward resets it
    if (options_.bf16_compression) b.flat.copy_(b.wire);
    // A bucket in another dtype than the parameters' (reduce_dtype): the sum comes back into
    // .grad and is averaged there, in the parameters' precision.
    const bool widen = b.flat.scalar_type() != params_[b.params.front()].scalar_type();
    if (!widen) b.flat.div_(n);
    for (size_t k : b.params) {
      auto& p = params_[k];
      const Slot& s = slots_[k];
      auto averaged = b.flat.narrow(0, s.offset, p.numel()).view(p.sizes());
      if (p.grad().defined()) {
        p.mutable_grad().copy_(averaged);
      } else {
        p.mutable_grad() = averaged.to(p.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      }
      if (widen) p.mutable_grad().div_(n);
    }
  }
  reset_backward_state();
}

void DataParallelEngine::wait_bucket(Bucket& b) {
  if (b.reduced.valid()) {
    b.reduced.get();  // rethrows the worker's error
  } else {
    b.handle.wait();
  }
}

void DataParallelEngine::reset_backward_state() {
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.handle = Handle();
    b.reduced = {};
  }
  std::fill(ready_.begin(), ready_.end(), false);
  next_launch_ = 0;
  callback_->done();
}

void DataParallelEngine::recover_if_abandoned() {
  if (!callback_->abandoned()) return;
  std::string error;
  for (size_t i = 0; i < next_launch_; ++i) {
    try {
      wait_bucket(buckets_[i]);
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
    }
  }
  reset_backward_state();
  TORCH_CHECK(error.empty(), "monarch::DataParallel: the previous backward failed and so did its reductions: ", error);
  TORCH_CHECK(!group_.failed(), "monarch::DataParallel: ", group_.failure());
  if (nodes_ != nullptr) {
    for (const Communicator* g : {nodes_->intra.get(), nodes_->inter.get()}) {
      TORCH_CHECK(!g->failed(), "monarch::DataParallel: ", g->failure());
    }
  }
}

}  // namespace monarch
