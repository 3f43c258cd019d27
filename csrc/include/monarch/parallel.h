#pragma once
// C++ frontend: data-parallel and fully-sharded wrappers over torch::nn::Module. They drive
// the same engines as the Python frontend (torch_monarch.DataParallel / fully_shard).
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "monarch/runtime/data_parallel.h"
#include "monarch/runtime/fully_shard.h"

namespace monarch {

// DDP-like: construct after the model, before the optimizer; train as usual.
class DataParallel {
 public:
  DataParallel(std::shared_ptr<torch::nn::Module> module, Communicator& group,
               DataParallelOptions options = {})
      : module_(std::move(module)),
        engine_(module_->parameters(), module_->buffers(), group, options) {}

  // Gradient accumulation: backward inside the scope only accumulates locally.
  class NoSync {
   public:
    explicit NoSync(DataParallelEngine& e) : engine_(e) { engine_.set_sync(false); }
    ~NoSync() { engine_.set_sync(true); }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DataParallelEngine& engine_;
  };
  NoSync no_sync() { return NoSync(engine_); }
  // Call at the start of each training forward (C++ modules have no forward hooks): counts
  // the step in the group's collective fingerprints, so a rank that gave up a step after a
  // local error is named at its next collective instead of pairing with the others' earlier
  // step.
  void begin_forward() { engine_.before_forward(); }
  DataParallelEngine& engine() { return engine_; }
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  DataParallelEngine engine_;
};

// FSDP / ZeRO: `units` are submodules of `module` sharded as one piece each (e.g. the
// transformer blocks); the rest of the parameters form the root unit 0. The optimizer must
// be built over shards(). C++ modules have no forward hooks, so the model runs each unit
// through run_unit() and the whole forward inside forward_scope().
class FullyShard {
 public:
  // `nodes`: the group split by node (DeviceMesh::node_groups) for options.hierarchical (ZeRO++).
  FullyShard(std::shared_ptr<torch::nn::Module> module,
             const std::vector<std::shared_ptr<torch::nn::Module>>& units, Communicator& group,
             FullyShardOptions options = {}, NodeGroups* nodes = nullptr)
      : module_(std::move(module)),
        engine_(split_units(*module_, units, names_), group, options, FullyShardEngine::Materialize{}, nodes) {}

  // What the optimizer steps on: this rank's rows of every parameter (see FullyShardEngine),
  // and the same under the parameters' names (for parameter groups).
  std::vector<at::Tensor> shards() const { return engine_.shards(); }
  std::vector<std::pair<std::string, at::Tensor>> named_shards() const {
    auto shards = engine_.shards();
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (size_t i = 0; i < shards.size(); ++i) out.emplace_back(names_[i], shards[i]);
    return out;
  }
  FullyShardEngine& engine() { return engine_; }

  // Runs unit `i` (1-based over `units`; 0 is the root) around `forward`.
  at::Tensor run_unit(int64_t i, const std::function<at::Tensor()>& forward) {
    engine_.before_forward(i);
    at::Tensor out = forward();
    engine_.after_forward(i, {out});
    return out;
  }
  // The root unit's scope: call at the start of the model's forward and pass its output.
  void begin_forward() { engine_.before_forward(0); }
  at::Tensor end_forward(const at::Tensor& output) {
    engine_.after_forward(0, {output});
    return output;
  }

  // Full, fp32, unsharded parameters by name: loads into the unwrapped model.
  std::vector<std::pair<std::string, at::Tensor>> state_dict() {
    auto params = engine_.full_parameters();
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (size_t i = 0; i < params.size(); ++i) out.emplace_back(names_[i], params[i]);
    return out;
  }

 private:
  // Unit 0: parameters of no unit, or of more than one (shared between units: gathered
  // throughout); unit i: the i-th unit's. Names follow the same order.
  static std::vector<std::vector<at::Tensor>> split_units(
      torch::nn::Module& root, const std::vector<std::shared_ptr<torch::nn::Module>>& units,
      std::vector<std::string>& names) {
    std::set<const void*> in_unit;
    for (const auto& u : units) {
      for (const auto& p : u->parameters()) in_unit.insert(p.unsafeGetTensorImpl());
    }
    std::vector<std::vector<at::Tensor>> out(units.size() + 1);
    std::vector<std::vector<std::string>> unit_names(units.size() + 1);
    for (const auto& item : root.named_parameters()) {
      const void* impl = item.value().unsafeGetTensorImpl();
      size_t unit = 0, holders = 0;
      for (size_t k = 0; k < units.size() && in_unit.count(impl); ++k) {
        for (const auto& p : units[k]->parameters()) {
          if (p.unsafeGetTensorImpl() == impl) {
            unit = k + 1;
            ++holders;
            break;
          }
        }
      }
      if (holders > 1) unit = 0;
      out[unit].push_back(item.value());
      unit_names[unit].push_back(item.key());
    }
    for (const auto& n : unit_names) names.insert(names.end(), n.begin(), n.end());
    return out;
  }

  std::shared_ptr<torch::nn::Module> module_;
  std::vector<std::string> names_;
  FullyShardEngine engine_;
};

}  // namespace monarch
