#include "monarch/runtime/fully_shard.h"

#include <algorithm>

#include "monarch/runtime/hierarchical_shard.h"
#include "monarch/runtime/replicas.h"
#include "autograd_hooks.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include <cmath>
#include <set>

namespace monarch {
namespace {

// Gives a storage `nbytes` of fresh memory, or none (0). Tensors viewing it keep their shape:
// autograd keeps views of a gathered unit's parameters (e.g. a linear's transposed weight) for
// backward; emptying the storage they share frees the memory anyway, and gathering into the
// same storage again makes those views valid before the unit's backward (as PyTorch FSDP
// frees and refills its flat parameter's storage).
void resize_storage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (nbytes == 0) {
    s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
  } else {
    TORCH_CHECK(s->allocator(), "monarch::FullyShard: storage without an allocator");
    s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  }
  s->set_nbytes(nbytes);
}

}  // namespace

FullyShardEngine::FullyShardEngine(std::vector<std::vector<at::Tensor>> units, Communicator& group,
                                   FullyShardOptions options, Materialize materialize, NodeGroups* nodes)
    : group_(group), options_(options), nodes_(nodes) {
  TORCH_CHECK(options_.zero_stage >= 1 && options_.zero_stage <= 3,
              "monarch::FullyShard: zero_stage must be 1, 2 or 3, got ", options_.zero_stage);
  TORCH_CHECK(options_.hierarchical || options_.inter_node_compression == WireCompression::none,
              "monarch::FullyShard: inter_node_compression='", planner::to_string(options_.inter_node_compression),
              "' rounds the hop between nodes of a hierarchical layout: it needs hierarchical (dp_reduction "
              "'hierarchical')");
  if (options_.hierarchical) {
    TORCH_CHECK(options_.zero_stage == 3, "monarch::FullyShard: the hierarchical (ZeRO++) layout shards parameters: "
                "it needs zero_stage 3, got ", options_.zero_stage);
    TORCH_CHECK(nodes_ != nullptr, "monarch::FullyShard: the hierarchical layout needs the group's node groups "
                "(DeviceMesh::node_groups)");
    const int64_t L = nodes_->intra->size(), M = nodes_->inter->size();
    // Group rank = node * L + local (DeviceMesh::node_groups numbers them so): the padded
    // layouts of the two hops rely on it.
    TORCH_CHECK(L * M == group_.size() && group_.group_rank() == nodes_->inter->group_rank() * L +
                nodes_->intra->group_rank(), "monarch::FullyShard: node groups of ", L, " rank(s) x ", M,
                " node(s) do not tile the group ", group_.name(), " (", group_.size(), " ranks) node by node");
  }
  TORCH_CHECK(!units.empty(), "monarch::FullyShard: no sharding units");
  std::vector<at::Tensor> all;
  std::set<const void*> seen;
  for (size_t u = 0; u < units.size(); ++u) {
    for (const auto& p : units[u]) {
      TORCH_CHECK(p.requires_grad() && p.is_floating_point(), "monarch::FullyShard: unit ", u,
                  " has a parameter that is not a floating-point tensor requiring grad");
      TORCH_CHECK(!options_.hierarchical || p.is_cpu() || p.is_meta(), "monarch::FullyShard: unit ", u,
                  " has a parameter on ", p.device(), ": the hierarchical layout runs on CPU (Gloo) tensors");
      TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "monarch::FullyShard: a parameter of unit ",
                  u, " appears twice (tied weights must be listed once, in the root unit)");
      all.push_back(p);
    }
  }
  // Same parameters split into different units would pair different gathers: name it.
  uint64_t unit_layout = 1469598103934665603ull;  // FNV-1a of the unit sizes
  for (const auto& unit : units) unit_layout = (unit_layout ^ static_cast<uint64_t>(unit.size() + 1)) * 1099511628211ull;
  check_same_options({{"zero_stage", static_cast<double>(options_.zero_stage)},
                      {"reshard_after_forward", options_.reshard_after_forward ? 1.0 : 0.0},
                      {"compute dtype (mixed_precision, as a ScalarType number)", static_cast<double>(options_.compute_dtype)},
                      {"gradient reduce dtype (reduce_dtype, as a ScalarType number)",
                       static_cast<double>(options_.effective_reduce_dtype())},
                      {"hierarchical (dp_reduction)", options_.hierarchical ? 1.0 : 0.0},
                      {"inter_node_compression (none 0, bf16 1, int8 2)",
                       static_cast<double>(options_.inter_node_compression)},
                      {"number of sharding units (units=)", static_cast<double>(units.size())},
                      {"parameters per sharding unit (units=; a hash)", static_cast<double>(unit_layout >> 12)}},
                     group_, "monarch::FullyShard");
  check_same_parameters(all, group_, "monarch::FullyShard");
  // Deferred: each rank's slice comes from its own initialization of the unit (one owner
  // per slice, so the ranks still describe one model); there is nothing to broadcast.
  if (options_.broadcast_from_root && !materialize) broadcast_from_root(all, group_);
  units_.resize(units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    if (!materialize) {
      init_unit(units_[u], std::move(units[u]));
      continue;
    }
    std::vector<at::Tensor> real = materialize(static_cast<int64_t>(u));
    TORCH_CHECK(real.size() == units[u].size(), "monarch::FullyShard: materialize(", u, ") returned ",
                real.size(), " tensors for a unit of ", units[u].size(), " parameters");
    for (size_t i = 0; i < real.size(); ++i) {
      TORCH_CHECK(real[i].sizes() == units[u][i].sizes() && !real[i].is_meta() && real[i].requires_grad(),
                  "monarch::FullyShard: materialize(", u, ") returned parameter ", i, " with shape ",
                  real[i].sizes(), real[i].is_meta() ? " on meta" : "",
                  real[i].requires_grad() ? "" : " not requiring grad", "; the unit holds ",
                  units[u][i].sizes());
    }
    init_unit(units_[u], std::move(real));
  }
  // Deferred stages 1-2: each rank initialized the whole units itself, but only its own rows
  // are the model's; the first forward gathers the owners' rows into every rank's copy.
  if (materialize && !sharded_parameters()) {
    for (auto& u : units_) u.shard_version = -1;
  }
  unit_grads_ready_.assign(units_.size(), false);
  next_reduce_ = num_units() - 1;
  callback_ = std::make_unique<detail::BackwardCallback>();
}

FullyShardEngine::~FullyShardEngine() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

int64_t FullyShardEngine::local_rows(const Unit& u, size_t i, int64_t r) const {
  return std::clamp<int64_t>(u.rows[i] - r * u.chunk_rows[i], 0, u.chunk_rows[i]);
}

// Rank r's slice of parameter i (its rows [r*c, r*c + l)) sits at r * shard_numel +
// shard_offsets[i] in the padded rank-major layout the collectives use. When every rank holds
// c whole rows, that is one strided copy; otherwise one copy per rank.
void FullyShardEngine::unpack(const Unit& u, size_t i, const at::Tensor& padded, const at::Tensor& whole) const {
  const int64_t n = group_.size(), c = u.chunk_rows[i], rn = u.row_numel[i];
  if (c * n == u.rows[i]) {
    whole.view({n, c * rn}).copy_(padded.view({n, u.shard_numel}).narrow(1, u.shard_offsets[i], c * rn));
    return;
  }
  for (int64_t r = 0; r < n; ++r) {
    const int64_t l = local_rows(u, i, r);
    if (l == 0) break;
    whole.narrow(0, r * c * rn, l * rn).copy_(padded.narrow(0, r * u.shard_numel + u.shard_offsets[i], l * rn));
  }
}

void FullyShardEngine::pack_add(const Unit& u, size_t i, const at::Tensor& padded, const at::Tensor& whole) const {
  const int64_t n = group_.size(), c = u.chunk_rows[i], rn = u.row_numel[i];
  if (c * n == u.rows[i]) {
    padded.view({n, u.shard_numel}).narrow(1, u.shard_offsets[i], c * rn).add_(whole.view({n, c * rn}));
    return;
  }
  for (int64_t r = 0; r < n; ++r) {
    const int64_t l = local_rows(u, i, r);
    if (l == 0) break;
    padded.narrow(0, r * u.shard_numel + u.shard_offsets[i], l * rn).add_(whole.narrow(0, r * c * rn, l * rn));
  }
}

void FullyShardEngine::init_unit(Unit& u, std::vector<at::Tensor> params) {
  at::NoGradGuard no_grad;
  u.params = std::move(params);
  const int64_t n = group_.size(), rank = group_.group_rank();
  for (const auto& p : u.params) {
    u.offsets.push_back(u.numel);
    u.shapes.push_back(p.sizes().vec());
    u.numels.push_back(p.numel());
    u.numel += p.numel();
    const int64_t rows = p.dim() == 0 ? 1 : p.size(0);
    const int64_t row_numel = p.dim() == 0 ? 1 : p.numel() / std::max<int64_t>(rows, 1);
    const int64_t chunk = (rows + n - 1) / n;
    u.rows.push_back(rows);
    u.row_numel.push_back(p.dim() == 0 || rows > 0 ? row_numel : 0);
    u.chunk_rows.push_back(chunk);
    u.shard_offsets.push_back(u.shard_numel);
    u.shard_numel += chunk * u.row_numel.back();
  }
  // Stages 1-2: the whole parameters, in the compute dtype, one unit-wide tensor.
  if (!sharded_parameters()) {
    u.full = at::empty({u.numel}, at::TensorOptions().dtype(options_.compute_dtype));
    for (size_t i = 0; i < u.params.size(); ++i) {
      u.full.narrow(0, u.offsets[i], u.numels[i]).copy_(u.params[i].detach().reshape({-1}));
    }
  }
  // My rows of every parameter: the shard tensors the optimizer sees are views of them
  // (detached: leaves of their own that share the viewed storage and its version counter).
  // Packed in a flat shard of their own, or, when they are the parameters' own values
  // (shards_alias_parameters), where they sit in the whole unit.
  if (!shards_alias_parameters()) u.flat_shard = at::zeros({u.shard_numel}, at::kFloat);
  for (size_t i = 0; i < u.params.size(); ++i) {
    const int64_t l = local_rows(u, i, rank), rn = u.row_numel[i];
    auto mine = my_rows(u, i);
    if (u.flat_shard.defined() && l > 0) {
      mine.copy_(u.params[i].detach().reshape({-1}).narrow(0, rank * u.chunk_rows[i] * rn, l * rn));
    }
    std::vector<int64_t> shape = u.shapes[i];
    if (shape.empty()) shape.push_back(1);
    shape[0] = l;
    u.shards.push_back(mine.view(shape).detach().requires_grad_(true));
  }
  u.pending = u.params.size();
  // After each parameter's gradient accumulator, as DDP's reducer: the gradient seen is the
  // one the parameter's own hooks (registered before or after) produced, and the copy the
  // accumulator stored can be dropped at once. Taken while the parameter has its full shape:
  // the accumulator checks incoming gradients against the shape it was created with, and in
  // the compute dtype: changing a parameter's dtype later (set_data) would drop it.
  const int64_t unit = &u - units_.data();
  for (size_t i = 0; i < u.params.size(); ++i) {
    if (u.params[i].scalar_type() != options_.compute_dtype) {
      u.params[i].set_data(u.params[i].detach().to(options_.compute_dtype));
    }
    auto accumulator = torch::autograd::impl::grad_accumulator(u.params[i]);
    TORCH_CHECK(accumulator, "monarch::FullyShard: a parameter of unit ", unit, " is not a leaf tensor");
    hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<detail::AfterAccumulation>(
        [this, unit, i](const at::Tensor& g) { on_gradient(unit, i, g); })));
    accumulators_.push_back(std::move(accumulator));
  }
  if (sharded_parameters()) {
    // Parameters hold no storage until gathered.
    for (auto& p : u.params) p.set_data(at::empty({0}, p.options().dtype(options_.compute_dtype)));
  } else {
    for (size_t i = 0; i < u.params.size(); ++i) {
      u.params[i].set_data(u.full.narrow(0, u.offsets[i], u.numels[i]).view(u.shapes[i]));
    }
    u.gathered = true;
    u.shard_version = shard_storage(u)._version();
  }
}

at::Tensor FullyShardEngine::my_rows(const Unit& u, size_t i) const {
  const int64_t l = local_rows(u, i, group_.group_rank()), rn = u.row_numel[i];
  if (u.flat_shard.defined()) return u.flat_shard.narrow(0, u.shard_offsets[i], l * rn);
  if (l == 0) return u.full.narrow(0, 0, 0);  // past the parameter's rows (and maybe the unit's end)
  return u.full.narrow(0, u.offsets[i] + group_.group_rank() * u.chunk_rows[i] * rn, l * rn);
}

at::Tensor FullyShardEngine::packed_shard(const Unit& u) const {
  if (u.flat_shard.defined()) return u.flat_shard;
  // One unit's rows at a time, for a collective: Psi / N of the unit, transient.
  auto packed = at::zeros({u.shard_numel}, at::kFloat);
  for (size_t i = 0; i < u.params.size(); ++i) {
    auto mine = my_rows(u, i);
    packed.narrow(0, u.shard_offsets[i], mine.numel()).copy_(mine);
  }
  return packed;
}

std::vector<at::Tensor> FullyShardEngine::shards() const {
  std::vector<at::Tensor> out;
  for (const auto& u : units_) out.insert(out.end(), u.shards.begin(), u.shards.end());
  return out;
}

void FullyShardEngine::start_gather(int64_t unit) {
  Unit& u = units_[unit];
  if (u.gathered || !u.gather.done()) return;
  if (u.numel == 0) {  // a unit without parameters (e.g. a root holding only blocks): no collective
    u.gathered = true;
    return;
  }
  const bool training = at::GradMode::is_enabled();  // the caller's mode, before the guard
  at::NoGradGuard no_grad;
  u.incoming = at::empty({u.shard_numel * group_.size()}, at::TensorOptions().dtype(options_.compute_dtype));
  if (!options_.hierarchical) {
    u.gather = group_.all_gather(u.incoming, u.flat_shard.to(options_.compute_dtype));  // stage 3: never aliased
    return;
  }
  // Off this thread, on the node groups' worker (every engine's collectives on those groups
  // in one order). A secondary shard gathered from these very shards makes it a gather inside
  // the node (the backward's); otherwise both hops, keeping the secondary when the unit is
  // freed after its forward and will be needed again in backward.
  NodeGroups* nodes = nodes_;
  const at::Tensor padded = u.incoming;
  const WireCompression compression = options_.inter_node_compression;
  const int64_t version = shard_storage(u)._version();
  if (u.secondary.defined() && u.secondary_version != version) u.secondary = at::Tensor();
  std::shared_future<void> done;
  if (u.secondary.defined()) {
    const at::Tensor secondary = std::move(u.secondary);
    u.secondary = at::Tensor();
    done = nodes->worker.submit([nodes, secondary, padded, compression] {
      at::NoGradGuard no_grad;
      gather_unit_from_secondary(*nodes, secondary, padded, compression);
    });
  } else {
    const bool keep = options_.reshard_after_forward && unit != 0 && training;
    auto arriving = std::make_shared<at::Tensor>();
    const at::Tensor shard = u.flat_shard;
    done = nodes->worker.submit([nodes, shard, padded, compression, keep, arriving] {
      at::NoGradGuard no_grad;
      at::Tensor secondary = gather_unit_two_hops(*nodes, shard, padded, compression);
      if (keep) *arriving = std::move(secondary);
    });
    u.arriving_secondary = std::move(arriving);
    u.secondary_version = version;
  }
  u.gather = Handle::completion([done] { done.get(); }, "fully_shard parameter gather of unit " + std::to_string(unit) +
                                " (two hops)");
}

void FullyShardEngine::finish_gather(int64_t unit) {
  Unit& u = units_[unit];
  if (u.gathered) return;
  start_gather(unit);
  u.gather.wait();
  u.gather = Handle();
  if (u.arriving_secondary) {
    u.secondary = std::move(*u.arriving_secondary);
    u.arriving_secondary.reset();
  }
  at::NoGradGuard no_grad;
  const size_t nbytes = static_cast<size_t>(u.numel) * c10::elementSize(options_.compute_dtype);
  if (!u.full.defined()) {
    u.full = at::empty({u.numel}, at::TensorOptions().dtype(options_.compute_dtype));
  } else {
    resize_storage(u.full, nbytes);  // refill the same storage
  }
  for (size_t i = 0; i < u.params.size(); ++i) {
    auto whole = u.full.narrow(0, u.offsets[i], u.numels[i]);
    unpack(u, i, u.incoming, whole);
    u.params[i].set_data(whole.view(u.shapes[i]));
  }
  u.incoming = at::Tensor();
  u.gathered = true;
}

void FullyShardEngine::free_parameters(int64_t unit) {
  Unit& u = units_[unit];
  if (!u.gathered) return;
  // Parameters hold nothing until gathered again (shapes are kept in the unit); the gathered
  // storage is emptied, not dropped, so autograd's saved views of it are refilled by the
  // next gather.
  for (auto& p : u.params) p.set_data(at::empty({0}, p.options()));
  if (u.full.defined()) resize_storage(u.full, 0);  // a unit without parameters has none
  u.gathered = false;
}

void FullyShardEngine::prepare_gradient_roots() {
  if (!sharded_parameters()) return;
  at::NoGradGuard no_grad;
  for (auto& u : units_) {
    if (u.gathered) continue;
    for (size_t i = 0; i < u.params.size(); ++i) {
      at::Tensor& p = u.params[i];
      if (p.sizes().vec() == u.shapes[i]) continue;
      p.set_data(at::zeros({1}, p.options()).expand(u.shapes[i]));
    }
  }
}

void FullyShardEngine::sync_parameters() {
  if (sharded_parameters()) return;
  at::NoGradGuard no_grad;
  Communicator::Phase phase(group_, "fully_shard parameter refresh (after a step or a load)");
  // Unit by unit with one gather in flight behind the one being unpacked (with overlap off,
  // each waited for as issued): the padded outputs of at most two units exist at a time, not
  // a second copy of the whole model.
  struct InFlight {
    int64_t unit;
    at::Tensor padded;
    Handle handle;
  };
  std::vector<InFlight> flight;
  auto finish = [&](InFlight& g) {
    g.handle.wait();
    Unit& u = units_[g.unit];
    for (size_t i = 0; i < u.params.size(); ++i) unpack(u, i, g.padded, u.full.narrow(0, u.offsets[i], u.numels[i]));
    u.shard_version = shard_storage(u)._version();  // aliased: after the unpack, which wrote my rows too
  };
  for (int64_t k = 0; k < num_units(); ++k) {
    Unit& u = units_[k];
    if (u.numel == 0 || shard_storage(u)._version() == u.shard_version) continue;
    // In the compute dtype: what the parameters hold (bf16 training moves half the bytes).
    auto padded = at::empty({u.shard_numel * group_.size()}, at::TensorOptions().dtype(options_.compute_dtype));
    Handle h = group_.all_gather(padded, packed_shard(u).to(options_.compute_dtype));
    flight.push_back({k, padded, std::move(h)});
    if (flight.size() == (options_.overlap ? 2u : 1u)) {
      finish(flight.front());
      flight.erase(flight.begin());
    }
  }
  for (auto& g : flight) finish(g);
}

void FullyShardEngine::before_forward(int64_t unit) {
  TORCH_CHECK(unit >= 0 && unit < num_units(), "monarch::FullyShard: no unit ", unit);
  if (unit == 0) {
    recover_if_abandoned();
    if (at::GradMode::is_enabled()) group_.advance_step();  // evaluation is not a training step
  }
  Communicator::Phase phase(group_, "fully_shard forward");
  if (!sharded_parameters()) {
    if (unit == 0) sync_parameters();
    return;
  }
  finish_gather(unit);
  if (unit + 1 < num_units()) start_gather(unit + 1);  // prefetch the next unit
}

void FullyShardEngine::after_forward(int64_t unit, const std::vector<at::Tensor>& outputs) {
  if (!sharded_parameters() || !at::GradMode::is_enabled()) {
    // Without autograd nothing needs the unit again this step, the root included (it ends
    // the forward): freed, so the next forward gathers what a load or an optimizer step
    // wrote into the shards meanwhile.
    if (sharded_parameters()) free_parameters(unit);
    return;
  }
  units_[unit].backward_ready = false;
  for (const auto& out : outputs) {
    if (out.defined() && out.requires_grad()) {
      out.register_hook([this, unit](const at::Tensor&) { before_backward(unit); });
    }
  }
  // The root unit stays gathered through backward (its weights, e.g. a tied embedding,
  // are used again at the end of forward).
  if (unit != 0 && options_.reshard_after_forward) free_parameters(unit);
}

void FullyShardEngine::before_backward(int64_t unit) {
  Unit& u = units_[unit];
  // A hook on another of its outputs may fire after this backward already reduced the unit
  // (Hugging Face T5's cross-attention position bias is a leaf made inside the first decoder
  // block, its gradient complete only after the blocks that read it): gathering it again
  // would leave it gathered (nothing frees it) and the next forward on pre-step parameters.
  if (u.backward_ready || unit_grads_ready_[unit]) return;
  u.backward_ready = true;
  Communicator::Phase phase(group_, "fully_shard backward (re-gather)");
  finish_gather(unit);
  if (unit > 0) start_gather(unit - 1);  // backward runs the units in reverse
}

void FullyShardEngine::on_gradient(int64_t unit, size_t index, const at::Tensor& grad) {
  recover_if_abandoned();
  callback_->queue([this] { finish_backward(); });
  at::NoGradGuard no_grad;
  Unit& u = units_[unit];
  if (grad.defined()) {
    if (u.grad_flat.defined()) {  // accumulating over micro-batches: into the existing buffer
      pack_add(u, index, u.grad_flat, grad.reshape({-1}).to(u.grad_flat.scalar_type()));
    } else {
      if (u.held_grads.empty()) u.held_grads.resize(u.params.size());
      at::Tensor& held = u.held_grads[index];
      held = held.defined() ? held + grad : grad;
    }
  }
  // The parameter's .grad stays empty: the optimizer reads the reduced rows from the
  // shards' .grad.
  u.params[index].mutable_grad() = at::Tensor();
  if (--u.pending == 0) {
    pack_held_gradients(u);
    // Every operation that read the unit's parameters has run its backward (an accumulator
    // runs after all of its parameter's uses): the gathered parameters can go now.
    if (sharded_parameters() && unit != 0) free_parameters(unit);
    if (!sync_) return;  // accumulating: the sum is reduced by the next synced backward
    unit_grads_ready_[unit] = true;
    if (options_.zero_stage == 1) return;  // stage 1 keeps whole gradients until backward ends
    while (next_reduce_ >= 0 && unit_grads_ready_[next_reduce_]) reduce_unit(next_reduce_--);
  }
}

void FullyShardEngine::pack_held_gradients(Unit& u) {
  if (!u.grad_flat.defined()) {
    // Reduced at once: packed straight in the wire dtype (each element gets one value, so
    // rounding before or after packing is the same). Accumulating: fp32, where the
    // micro-batches add up.
    const auto dtype = sync_ ? options_.effective_reduce_dtype() : at::kFloat;
    u.grad_flat = at::zeros({u.shard_numel * group_.size()}, dtype);
  }
  for (size_t i = 0; i < u.held_grads.size(); ++i) {
    if (!u.held_grads[i].defined()) continue;
    pack_add(u, i, u.grad_flat, u.held_grads[i].reshape({-1}).to(u.grad_flat.scalar_type()));
    u.held_grads[i] = at::Tensor();
  }
  u.held_grads.clear();
}

// Reduce-scatter of the unit's gradient into this rank's slice: stages 2-3 as the unit's
// backward ends, stage 1 for every unit when the backward ends (Rajbhandari et al. 2020,
// Sec. 5: P_os keeps whole gradients through backward; either way the step moves the bytes
// of one all-reduce with the parameters' all-gather).
void FullyShardEngine::reduce_unit(int64_t unit) {
  Unit& u = units_[unit];
  if (u.numel == 0) {  // nothing to reduce; Gloo would divide by the zero element count
    u.reduce = Handle();
  } else {
    u.reduced = at::empty({u.shard_numel}, at::kFloat);
    Communicator::Phase phase(group_, "fully_shard backward (gradient reduce-scatter)");
    // Micro-batches accumulate in fp32 and are rounded to the reduce dtype only for the wire
    // (a gradient reduced at once was packed in it); the sum of the ranks' parts lands in fp32.
    const auto wire_dtype = options_.effective_reduce_dtype();
    if (wire_dtype != at::kFloat) u.grad_flat = u.grad_flat.to(wire_dtype);
    if (options_.hierarchical) {
      NodeGroups* nodes = nodes_;
      const at::Tensor grads = u.grad_flat, out = u.reduced;
      const WireCompression compression = options_.inter_node_compression;
      ErrorFeedback* feedback = &u.grad_feedback;
      auto done = nodes->worker.submit([nodes, grads, out, compression, feedback] {
        at::NoGradGuard no_grad;
        reduce_scatter_unit_two_hops(*nodes, grads, out, compression, *feedback);
      });
      u.reduce = Handle::completion([done] { done.get(); }, "fully_shard gradient reduce-scatter of unit " +
                                    std::to_string(unit) + " (two hops)");
    } else {
      u.reduce = group_.reduce_scatter(u.reduced, u.grad_flat);
    }
  }
  u.reduce_launched = true;
  // One reduction in flight behind this one: the unit launched before (the next one up)
  // finishes now, so at most two units' full gradient buffers (and, under stage 3, their
  // gathered parameters) are alive at once during backward.
  if (unit + 1 < num_units() && units_[unit + 1].reduce_launched) finish_unit(unit + 1);
  if (!options_.overlap) finish_unit(unit);  // waited for here: one gradient buffer at a time
}

void FullyShardEngine::finish_unit(int64_t k) {
  at::NoGradGuard no_grad;
  Unit& u = units_[k];
  if (!u.reduce_launched) return;
  u.reduce.wait();
  const at::Tensor mine = u.numel == 0 ? at::zeros({0}, at::kFloat) : u.reduced.div_(static_cast<double>(group_.size()));
  // Each parameter's rows of the reduced gradient into its shard's .grad (accumulated when
  // the caller kept last step's, as .grad always is). A fresh .grad shares the reduced
  // buffer's storage, as FSDP2's sharded gradients do: no copy, no allocation per parameter;
  // the buffer lives while any of them does (zero_grad(set_to_none=True) frees it). Set on a
  // tensor of its own rather than viewed: autograd would call a view's detach_() an error
  // (libtorch's Optimizer::zero_grad detaches every .grad, whether it then resets or zeroes it).
  for (size_t i = 0; i < u.shards.size(); ++i) {
    at::Tensor& shard = u.shards[i];
    auto part = mine.narrow(0, u.shard_offsets[i], shard.numel()).view(shard.sizes());
    if (shard.grad().defined()) {
      shard.mutable_grad().add_(part);
    } else {
      at::Tensor grad = at::empty({0}, part.options());
      grad.set_(part.storage(), part.storage_offset(), part.sizes(), part.strides());
      shard.mutable_grad() = grad;
    }
  }
  u.grad_flat = at::Tensor();
  u.reduced = at::Tensor();
  u.reduce = Handle();
  u.reduce_launched = false;
  u.pending = u.params.size();
  u.backward_ready = false;  // the next backward (another micro-batch's) gathers it again
  if (sharded_parameters() && k != 0) free_parameters(k);
}

void FullyShardEngine::set_sync(bool sync) {
  TORCH_CHECK(sync || !sharded_parameters(), "monarch::FullyShard: gradient accumulation without sync "
              "(no_sync) is for ZeRO stages 1-2; stage 3 reduces every backward");
  sync_ = sync;
}

void FullyShardEngine::finish_backward() {
  at::NoGradGuard no_grad;
  if (!sync_) {  // gradients stay in the units' flat buffers until a synced backward
    for (auto& u : units_) {
      if (!u.held_grads.empty()) pack_held_gradients(u);  // a unit with unused parameters
      u.pending = u.params.size();
      u.backward_ready = false;
    }
    callback_->done();
    return;
  }
  // Units with parameters that got no gradient (unused) still take part, with zeros.
  for (int64_t k = 0; k < num_units(); ++k) {
    Unit& u = units_[k];
    if (!unit_grads_ready_[k]) {
      pack_held_gradients(u);
      unit_grads_ready_[k] = true;
    }
  }
  while (next_reduce_ >= 0) reduce_unit(next_reduce_--);
  for (int64_t k = num_units() - 1; k >= 0; --k) finish_unit(k);
  if (sharded_parameters()) free_parameters(0);
  drop_secondaries();  // a unit whose backward did not re-gather (it kept its parameters)
  std::fill(unit_grads_ready_.begin(), unit_grads_ready_.end(), false);
  next_reduce_ = num_units() - 1;
  callback_->done();
}

void FullyShardEngine::drop_secondaries() {
  for (auto& u : units_) u.secondary = at::Tensor();
}

// A backward that raised (see detail::BackwardCallback): wait for the collectives it left in
// flight (ranks that failed at the same point started the same ones), then back to the state
// between steps: no gradient buffers, stage 3's units freed, counters reset. The shards'
// .grad may hold some units' reduced gradients, as a failed plain backward leaves partial
// .grad: zero them before the next step.
void FullyShardEngine::recover_if_abandoned() {
  if (!callback_->abandoned()) return;
  at::NoGradGuard no_grad;
  std::string error;
  auto settle = [&error](Handle& h) {
    try {
      h.wait();
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
    }
    h = Handle();
  };
  for (int64_t k = 0; k < num_units(); ++k) {
    Unit& u = units_[k];
    settle(u.gather);
    u.incoming = at::Tensor();
    u.arriving_secondary.reset();
    u.secondary = at::Tensor();
    settle(u.reduce);
    u.reduced = at::Tensor();
    u.grad_flat = at::Tensor();
    u.held_grads.clear();
    u.reduce_launched = false;
    u.pending = u.params.size();
    u.backward_ready = false;
    if (sharded_parameters()) free_parameters(k);
  }
  std::fill(unit_grads_ready_.begin(), unit_grads_ready_.end(), false);
  next_reduce_ = num_units() - 1;
  callback_->done();
  TORCH_CHECK(error.empty(), "monarch::FullyShard: the previous backward failed and so did its collectives: ", error);
  TORCH_CHECK(!group_.failed(), "monarch::FullyShard: ", group_.failure());
}

std::vector<at::Tensor> FullyShardEngine::full_parameters() {
  at::NoGradGuard no_grad;
  // The usual "save on rank 0" pattern would otherwise pair rank 0's gathers with whatever
  // the other ranks do next (or wait out the timeout if they wait elsewhere).
  group_.expect_all("state_dict()");
  Communicator::Phase phase(group_, "state_dict() (gathering the shards)");
  std::vector<at::Tensor> out;
  for (auto& u : units_) {
    if (u.numel == 0) continue;  // no parameters, no collective
    auto padded = at::empty({u.shard_numel * group_.size()}, at::kFloat);
    group_.all_gather(padded, packed_shard(u)).wait();
    for (size_t i = 0; i < u.params.size(); ++i) {
      auto whole = at::empty({u.numels[i]}, at::kFloat);
      unpack(u, i, padded, whole);
      out.push_back(whole.view(u.shapes[i]));
    }
  }
  return out;
}

void FullyShardEngine::load_full_parameters(const std::vector<at::Tensor>& values) {
  at::NoGradGuard no_grad;
  size_t count = 0;
  for (const auto& u : units_) count += u.numel == 0 ? 0 : u.params.size();
  TORCH_CHECK(values.size() == count, "monarch: fully_shard: load_full_parameters got ", values.size(),
              " tensors for ", count, " parameters");
  size_t k = 0;
  const int64_t rank = group_.group_rank();
  for (auto& u : units_) {
    if (u.numel == 0) continue;
    bool given = false;
    for (size_t i = 0; i < u.params.size(); ++i, ++k) {
      const at::Tensor& v = values[k];
      if (!v.defined()) continue;
      given = true;
      TORCH_CHECK(v.sizes().vec() == u.shapes[i], "monarch: fully_shard: load_full_parameters: parameter ", k,
                  " has shape ", v.sizes(), ", the unit holds ", at::IntArrayRef(u.shapes[i]));
      // My rows; the copy into the shards' storage (whose version counter the parameters
      // watch) makes them refresh before the next forward.
      const int64_t l = local_rows(u, i, rank), rn = u.row_numel[i];
      if (l == 0) continue;
      my_rows(u, i).copy_(v.detach().reshape(-1).narrow(0, rank * u.chunk_rows[i] * rn, l * rn));
    }
    // Every rank marks the unit changed, also one holding none of the loaded rows: whether
    // a unit is re-gathered must be the same decision on all of them (sync_parameters).
    if (given) torch::autograd::impl::bump_version(shard_storage(u));
    if (given && sharded_parameters()) free_parameters(&u - units_.data());
    if (given) u.secondary = at::Tensor();
  }
}

}  // namespace monarch
