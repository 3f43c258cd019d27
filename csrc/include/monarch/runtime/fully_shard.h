#pragma once
// Fully-sharded data parallelism (ZeRO stages 1-3 / FSDP). Parameters are grouped into
// sharding units (e.g. one per transformer block); each rank owns a 1/N slice of every
// unit in fp32. The slice is per parameter, along dim 0 (as PyTorch FSDP2 shards): rank r
// holds rows [r*c, (r+1)*c) of each parameter, c = ceil(rows / N), so the last ranks may hold
// fewer rows or none. Each parameter's slice is its own leaf tensor (a view of the unit's
// flat shard, which the collectives move, or under stages 1-2 in fp32 of the whole
// parameters themselves: no second copy), so the optimizer (any elementwise torch.optim /
// torch::optim optimizer) steps on tensors that keep the parameters' order, names and
// number of dimensions: parameter groups by name or by dim work as with the plain model.
// Frontends call before_forward / after_forward around each unit; gradient reduction runs
// from autograd hooks.
//
//   stage 1: full parameters and gradients on every rank through backward, gradients
//            reduce-scattered when it ends, optimizer state sharded (Rajbhandari et al.
//            2020, P_os)
//   stage 2: + gradients reduce-scattered per unit as backward produces them, full gradients
//            dropped after backward (P_os+g)
//   stage 3: + parameters sharded: gathered before a unit's forward (the next unit is
//            prefetched), freed after it when reshard_after_forward, gathered again before
//            its backward (P_os+g+p; Zhao et al. 2023, PyTorch FSDP)
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "monarch/runtime/communicator.h"
#include "monarch/runtime/hierarchical.h"

namespace torch::autograd {
struct Node;
}
namespace monarch::detail {
class BackwardCallback;
}

namespace monarch {

struct FullyShardOptions {
  int64_t zero_stage = 3;
  bool reshard_after_forward = true;  // stage 3; false keeps parameters until backward
  // Mixed precision: parameters are gathered and used in this dtype; shards, gradient
  // reduction and the optimizer stay fp32.
  at::ScalarType compute_dtype = at::kFloat;
  // Gradients go over the wire in this dtype (unset: the compute dtype, as FSDP's
  // MixedPrecision.reduce_dtype defaults to param_dtype); each rank's contributions are summed
  // in fp32 into its fp32 shard. bf16 halves the reduce-scatter's bytes, which is what the
  // planner assumes for bf16 training (its grad_bytes = 2).
  std::optional<at::ScalarType> reduce_dtype;
  at::ScalarType effective_reduce_dtype() const { return reduce_dtype.value_or(compute_dtype); }
  bool broadcast_from_root = true;
  // ZeRO++ (hierarchical_shard.h; stage 3, CPU tensors): the unit's gathers and gradient
  // reduce-scatters go in two hops over the group's node groups (given to the engine), the
  // backward re-gather stays inside the node (a secondary shard kept from the forward), and
  // the hop between nodes is rounded as inter_node_compression says (weights and gradients;
  // gradients with error feedback).
  bool hierarchical = false;
  WireCompression inter_node_compression = WireCompression::none;
  // Gradient reductions behind computation (planner::Plan::zero_overlap): a unit's
  // reduce-scatter stays in flight while the next unit's backward runs. Off: each is waited
  // for as it is launched, holding one unit's gradient buffer less; where communication
  // shares the cores that compute (Gloo with a rank per core), Gloo's reduce-scatter sums on
  // those cores and the overlap measured no faster (docs/cost_model.md). Stage 3's parameter
  // gathers prefetch the next unit either way.
  bool overlap = true;
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
  // `nodes`: the group split by node (DeviceMesh::node_groups), for options.hierarchical.
  FullyShardEngine(std::vector<std::vector<at::Tensor>> units, Communicator& group,
                   FullyShardOptions options = {}, Materialize materialize = {}, NodeGroups* nodes = nullptr);
  ~FullyShardEngine();
  FullyShardEngine(const FullyShardEngine&) = delete;
  FullyShardEngine& operator=(const FullyShardEngine&) = delete;

  // What the optimizer steps on: this rank's fp32 rows of every parameter, unit by unit in
  // the order the units listed them (a scalar counts as one row; a parameter this rank holds
  // no rows of is an empty tensor, so every rank lists the same parameters).
  std::vector<at::Tensor> shards() const;
  // Elements of one rank's flat shard of a unit (the collectives' size per rank).
  int64_t shard_numel(int64_t unit) const { return units_.at(unit).shard_numel; }
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
  // Before gradients are handed to parameters directly (a zero-bubble schedule's weight pass
  // makes the parameters autograd roots): under stage 3 a parameter whose unit is not
  // gathered holds an empty tensor, and gradient accumulation needs its shape, so it gets a
  // placeholder of that shape (one element broadcast: no memory) until its next gather.
  void prepare_gradient_roots();
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
    std::vector<int64_t> offsets;  // of each parameter in the gathered (unpadded) unit
    std::vector<std::vector<int64_t>> shapes;  // parameters are empty while not gathered
    std::vector<int64_t> numels;
    std::vector<int64_t> rows;           // dim 0 (1 for a scalar)
    std::vector<int64_t> row_numel;      // elements per row
    std::vector<int64_t> chunk_rows;     // ceil(rows / N): rows of each rank's slice
    std::vector<int64_t> shard_offsets;  // of each parameter's slice in a rank's flat shard
    int64_t numel = 0;             // real elements
    int64_t shard_numel = 0;       // sum of chunk_rows * row_numel: one rank's flat shard
    // fp32, this rank's slices packed (padding stays zero); undefined when the shards alias
    // the full parameters (shards_alias_parameters), whose storage then holds them.
    at::Tensor flat_shard;
    std::vector<at::Tensor> shards;  // per parameter: leaf views of shard_storage (its version counter)
    // Gradient in the padded rank-major layout: made when the unit's last gradient arrives
    // (in the reduce dtype when it is reduced at once, fp32 while micro-batches accumulate),
    // kept until its reduction ends.
    at::Tensor grad_flat;
    // Each parameter's gradient as autograd made it, held until the unit's last one arrives
    // (FSDP2 holds them the same way): a buffer for the whole unit from its first gradient
    // would be alive while most of the unit's activations still are.
    std::vector<at::Tensor> held_grads;
    at::Tensor full;               // gathered parameters (compute dtype) when gathered
    at::Tensor incoming;           // all-gather output (padded rank-major) while in flight
    Handle gather;                 // prefetch in flight
    Handle reduce;                 // gradient reduction in flight
    at::Tensor reduced;            // its output
    size_t pending = 0;            // parameters whose gradient has not arrived
    bool gathered = false;
    bool backward_ready = false;   // re-gathered for this backward
    bool reduce_launched = false;  // its gradient reduction was started this backward
    int64_t shard_version = -1;    // shard_storage's version when parameters were last synced
    // Hierarchical (ZeRO++): this rank's node-local part of the unit as the forward gather
    // brought it, kept for the backward's re-gather inside the node (consumed by it), and
    // the shards' version it was gathered from (a step or a load since makes it stale).
    at::Tensor secondary;
    int64_t secondary_version = -1;
    std::shared_ptr<at::Tensor> arriving_secondary;  // written by the gather in flight
    ErrorFeedback grad_feedback;  // residuals of the compressed gradient chunks sent to other nodes
  };

  // Rows of parameter i that rank r holds.
  int64_t local_rows(const Unit& u, size_t i, int64_t r) const;
  // Padded rank-major layout (N x shard_numel) <-> parameter i's whole flat elements.
  void unpack(const Unit& u, size_t i, const at::Tensor& padded, const at::Tensor& whole) const;
  void pack_add(const Unit& u, size_t i, const at::Tensor& padded, const at::Tensor& whole) const;

  void init_unit(Unit& u, std::vector<at::Tensor> params);
  void start_gather(int64_t unit);
  void finish_gather(int64_t unit);
  void free_parameters(int64_t unit);
  void before_backward(int64_t unit);
  void on_gradient(int64_t unit, size_t index, const at::Tensor& grad);
  // Packs the held gradients into grad_flat (made if missing), freeing each as it goes.
  void pack_held_gradients(Unit& u);
  void reduce_unit(int64_t unit);
  void finish_unit(int64_t unit);
  void finish_backward();
  void recover_if_abandoned();
  void drop_secondaries();
  bool sharded_parameters() const { return options_.zero_stage >= 3; }
  // Stages 1-2 computing in fp32: the whole parameters stay on every rank in fp32, so this
  // rank's rows of them are the optimizer's shards themselves (views), not a second fp32
  // copy of Psi / N: the optimizer steps on them in place and the refresh gathers the other
  // ranks' rows around them. (Under mixed precision the fp32 shards are the master weights
  // and the parameters a bf16 copy: two tensors.)
  bool shards_alias_parameters() const { return !sharded_parameters() && options_.compute_dtype == at::kFloat; }
  // The tensor whose version counter the shards share: the flat shard, or the full unit.
  const at::Tensor& shard_storage(const Unit& u) const { return u.flat_shard.defined() ? u.flat_shard : u.full; }
  // This rank's rows of parameter i, flat (a view of shard_storage).
  at::Tensor my_rows(const Unit& u, size_t i) const;
  // This rank's rows of the unit packed as the collectives lay them out (the flat shard, or
  // a transient packed copy when the shards alias the parameters).
  at::Tensor packed_shard(const Unit& u) const;

  std::vector<Unit> units_;
  Communicator& group_;
  FullyShardOptions options_;
  NodeGroups* nodes_ = nullptr;  // options_.hierarchical
  // Post hooks on the parameters' gradient accumulators (see on_gradient).
  std::vector<compat::NodePtr> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  int64_t next_reduce_ = 0;  // reductions launch in unit order on every rank
  std::vector<bool> unit_grads_ready_;
  std::unique_ptr<detail::BackwardCallback> callback_;
  bool sync_ = true;
};

}  // namespace monarch
