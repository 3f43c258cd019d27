#pragma once
// Fully-sharded data parallelism (ZeRO stages 1-3 / FSDP). Parameters are grouped into
// sharding units (e.g. one per transformer block); each rank owns a 1/N slice of every
// unit as an fp32 shard, and the optimizer (any torch.optim / torch::optim optimizer) steps
// on the shards. Frontends call before_forward / after_forward around each unit; gradient
// reduction runs from autograd hooks.
//
//   stage 1: full parameters and gradients on every rank, gradients all-reduced, optimizer
//            state sharded (Rajbhandari et al. 2020, P_os)
//   stage 2: + gradients reduce-scattered per unit as backward produces them, full gradients
//            dropped after backward (P_os+g)
//   stage 3: + parameters sharded: gathered before a unit's forward (the next unit is
//            prefetched), freed after it when reshard_after_forward, gathered again before
//            its backward (P_os+g+p; Zhao et al. 2023, PyTorch FSDP)
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "monarch/runtime/communicator.h"

namespace torch::autograd {
struct Node;
}

namespace monarch {

struct FullyShardOptions {
  int64_t zero_stage = 3;
  bool reshard_after_forward = true;  // stage 3; false keeps parameters until backward
  // Mixed precision: parameters are gathered and used in this dtype; shards, gradient
  // reduction and the optimizer stay fp32.
  at::ScalarType compute_dtype = at::kFloat;
  bool broadcast_from_root = true;
};

class FullyShardEngine {
 public:
  // units[0] is the root unit: its parameters stay gathered from its before_forward until
  // the end of backward (embeddings tied to the output head live there).
  //
  // Deferred initialization: with `materialize`, `units` may hold meta tensors (shapes only);
  // just before unit k is sharded, materialize(k) returns its parameters as real tensors (same
  // order and shapes), which the engine then owns like any other; with stage 3 the full unit
  // is freed once this rank's slice is taken, so no rank holds more than one whole unit.
  using Materialize = std::function<std::vector<at::Tensor>(int64_t unit)>;
  FullyShardEngine(std::vector<std::vector<at::Tensor>> units, Communicator& group,
                   FullyShardOptions options = {}, Materialize materialize = {});
  ~FullyShardEngine();
  FullyShardEngine(const FullyShardEngine&) = delete;
  FullyShardEngine& operator=(const FullyShardEngine&) = delete;

  // What the optimizer steps on: one fp32 shard per unit (ceil(unit elements / N)).
  std::vector<at::Tensor> shards() const;
  int64_t num_units() const { return static_cast<int64_t>(units_.size()); }
  const FullyShardOptions& options() const { return options_; }

  // Call before a unit's forward: gathers its parameters (stage 3) and prefetches the next
  // unit; for unit 0 also refreshes parameters after an optimizer step (stages 1-2).
  void before_forward(int64_t unit);
  // Call with the unit's outputs: arranges the re-gather before its backward and frees the
  // gathered parameters (stage 3 with reshard_after_forward).
  void after_forward(int64_t unit, const std::vector<at::Tensor>& outputs);
  // Gradient accumulation: with sync off, backward only adds each unit's gradient into its
  // flat buffer (kept between backwards); the next backward with sync on reduces the sum
  // once, so a step of m micro-batches moves the bytes of one. Stages 1-2 (stage 3 would keep
  // every unit's full gradient: it reduces every backward; set_sync(false) is refused).
  void set_sync(bool sync);
  bool sync() const { return sync_; }
  // Copies updated shards into the full parameters (stages 1-2; stage 3 gathers lazily).
  void sync_parameters();
  // Every parameter, whole and fp32, in unit order (for a full state dict).
  std::vector<at::Tensor> full_parameters();
  // The inverse, local: `values` holds every parameter whole, in full_parameters()' order
  // (an undefined tensor keeps that parameter); this rank copies the part of each that falls
  // in its shard. Parameters refresh from the shards before the next forward.
  void load_full_parameters(const std::vector<at::Tensor>& values);

 private:
  struct Unit {
    std::vector<at::Tensor> params;
    std::vector<int64_t> offsets;  // of each parameter in the flat unit
    std::vector<std::vector<int64_t>> shapes;  // parameters are empty while not gathered
    std::vector<int64_t> numels;
    int64_t numel = 0;             // real elements
    int64_t shard_numel = 0;       // ceil(numel / N)
    at::Tensor shard;              // fp32 master slice owned by this rank
    at::Tensor grad_flat;          // fp32 full-unit gradient buffer during backward
    at::Tensor full;               // gathered parameters (compute dtype) when gathered
    Handle gather;                 // prefetch in flight
    Handle reduce;                 // gradient reduction in flight
    at::Tensor reduced;            // its output
    size_t pending = 0;            // parameters whose gradient has not arrived
    bool gathered = false;
    bool backward_ready = false;   // re-gathered for this backward
    bool reduce_launched = false;  // its gradient reduction was started this backward
    int64_t shard_version = -1;    // shard's version when parameters were last synced
  };

  void init_unit(Unit& u, std::vector<at::Tensor> params);
  void start_gather(int64_t unit);
  void finish_gather(int64_t unit);
  void free_parameters(int64_t unit);
  void before_backward(int64_t unit);
  void on_gradient(int64_t unit, size_t index, const at::Tensor& grad);
  void reduce_unit(int64_t unit);
  void finish_unit(int64_t unit);
  void finish_backward();
  bool sharded_parameters() const { return options_.zero_stage >= 3; }

  std::vector<Unit> units_;
  Communicator& group_;
  FullyShardOptions options_;
  // Post hooks on the parameters' gradient accumulators (see on_gradient).
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  int64_t next_reduce_ = 0;  // reductions launch in unit order on every rank
  std::vector<bool> unit_grads_ready_;
  bool callback_queued_ = false;
  bool sync_ = true;
};

}  // namespace monarch
