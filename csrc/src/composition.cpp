#include "monarch/runtime/composition.h"

#include <algorithm>

#include <torch/csrc/autograd/autograd.h>

#include <set>
#include <sstream>
#include <stdexcept>

#include "monarch/planner/schedule.h"
#include "monarch/runtime/replicas.h"
#include "monarch/runtime/tensor_parallel.h"

namespace monarch {
namespace {

std::string block_name(const std::vector<std::string>& names, size_t i) {
  return i < names.size() ? names[i] : "block " + std::to_string(i);
}

std::string join(const std::vector<std::string>& items, const char* sep = "; ") {
  std::ostringstream out;
  for (size_t i = 0; i < items.size(); ++i) out << (i ? sep : "") << items[i];
  return out.str();
}

template <typename T>
std::string list(const std::vector<T>& v) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < v.size(); ++i) out << (i ? ", " : "") << v[i];
  out << "]";
  return out.str();
}

// Problems with a block-to-stage assignment, empty when it is usable.
std::vector<std::string> block_stage_problems(const std::vector<int64_t>& block_stage, int64_t num_stages,
                                              const std::vector<std::string>& names) {
  std::vector<std::string> out;
  if (block_stage.empty()) return {"the model has no blocks to cut between"};
  std::set<int64_t> used;
  for (size_t i = 0; i < block_stage.size(); ++i) {
    const int64_t s = block_stage[i];
    if (s < 0 || s >= num_stages) {
      out.push_back(block_name(names, i) + " is on stage " + std::to_string(s) + ", outside 0.." +
                    std::to_string(num_stages - 1));
    }
    if (i == 0 && s != 0) out.push_back("the first block (" + block_name(names, 0) + ") must be on stage 0");
    if (i > 0 && s < block_stage[i - 1]) {
      out.push_back(block_name(names, i) + " (stage " + std::to_string(s) + ") comes after " +
                    block_name(names, i - 1) + " (stage " + std::to_string(block_stage[i - 1]) +
                    "): stages may only be cut between consecutive blocks");
    }
    used.insert(s);
  }
  for (int64_t s = 0; s < num_stages; ++s) {
    if (!used.count(s)) out.push_back("stage " + std::to_string(s) + " holds no block");
  }
  return out;
}

}  // namespace

std::vector<int64_t> Layout::stages_of(int64_t pp_rank) const {
  std::vector<int64_t> out;
  for (int64_t s = 0; s < num_stages(); ++s) {
    if (planner::pipeline_rank_of_stage(schedule, mesh.pp, s) == pp_rank) out.push_back(s);
  }
  return out;
}

std::string Layout::summary() const {
  std::ostringstream out;
  out << planner::mesh_summary(mesh) << " zero=" << zero_stage
      << " micro_batches=" << micro_batches;
  if (mesh.pp > 1) out << " schedule=" << planner::to_string(schedule) << " v=" << virtual_stages;
  if (sequence_parallel) out << " sp";
  if (!zero_overlap && zero_stage > 0 && mesh.dp > 1) out << " overlap=off";
  return out.str();
}

std::vector<int64_t> even_block_stages(int64_t num_blocks, int64_t num_stages) {
  if (num_stages < 1 || num_blocks < num_stages) {
    throw std::invalid_argument("monarch: " + std::to_string(num_blocks) + " blocks cannot fill " +
                                std::to_string(num_stages) + " pipeline stages (legal stage counts: 1.." +
                                std::to_string(num_blocks) + ")");
  }
  std::vector<int64_t> out;
  const int64_t base = num_blocks / num_stages, extra = num_blocks % num_stages;
  for (int64_t s = 0; s < num_stages; ++s) {
    for (int64_t k = 0; k < base + (s < extra ? 1 : 0); ++k) out.push_back(s);
  }
  return out;
}

void check_block_stages(const std::vector<int64_t>& block_stage, int64_t num_stages,
                        const std::vector<std::string>& block_names) {
  auto problems = block_stage_problems(block_stage, num_stages, block_names);
  if (!problems.empty()) {
    throw std::invalid_argument("monarch: block-to-stage assignment " + list(block_stage) + " for " +
                                std::to_string(num_stages) + " stages: " + join(problems));
  }
}

Layout layout_from_plan(const planner::Plan& plan, int64_t num_blocks, int64_t world_size,
                        const std::vector<std::string>& block_names) {
  std::vector<std::string> problems;
  Layout l = layout_from_plan(plan, num_blocks, world_size, block_names, problems);
  if (!problems.empty()) {
    throw std::invalid_argument("monarch: the plan (" + plan.summary() + ") does not fit this model and job: " +
                                join(problems));
  }
  return l;
}

Layout layout_from_plan(const planner::Plan& plan, int64_t num_blocks, int64_t world_size,
                        const std::vector<std::string>& block_names, std::vector<std::string>& problems) {
  if (plan.mesh.world_size() != world_size) {
    problems.push_back("the plan is for " + std::to_string(plan.mesh.world_size()) + " ranks (pp=" +
                       std::to_string(plan.mesh.pp) + " dp=" + std::to_string(plan.mesh.dp) + " tp=" +
                       std::to_string(plan.mesh.tp) + "), this job has " + std::to_string(world_size));
  }
  Layout l;
  l.mesh = plan.mesh;
  l.virtual_stages = plan.virtual_stages;
  l.schedule = plan.mesh.pp > 1 ? plan.schedule : planner::ScheduleKind::none;
  if (plan.mesh.pp > 1 && l.schedule == planner::ScheduleKind::none) {
    problems.push_back("pp=" + std::to_string(plan.mesh.pp) + " but schedule is none");
  }
  l.micro_batches = plan.num_micro_batches;
  l.zero_stage = plan.zero_stage;
  l.sequence_parallel = plan.sequence_parallel;
  l.bucket_bytes = static_cast<int64_t>(plan.dp_bucket_bytes);
  l.recompute = plan.recompute;
  l.dp_reduction = plan.dp_reduction;
  l.inter_node_compression = plan.inter_node_compression;
  l.zero_overlap = plan.zero_overlap;
  for (const auto& layer : plan.layers) {
    if (layer.kind == planner::LayerKind::block) l.block_stage.push_back(layer.stage);
  }
  if (static_cast<int64_t>(l.block_stage.size()) != num_blocks) {
    problems.push_back("the plan has " + std::to_string(l.block_stage.size()) + " blocks, the model " +
                       std::to_string(num_blocks));
  } else if (num_blocks > 0 || l.num_stages() > 1) {
    for (auto& p : block_stage_problems(l.block_stage, l.num_stages(), block_names)) problems.push_back(p);
  }
  return l;
}

Layout layout_from_pins(const LayoutPins& pins, int64_t num_blocks, int64_t world_size,
                        const std::vector<std::string>& block_names) {
  Layout l;
  if (pins.pp < 1 || pins.tp < 1 || pins.dp < 0 || world_size % (pins.pp * pins.tp) != 0) {
    throw std::invalid_argument("monarch: pp=" + std::to_string(pins.pp) + " x tp=" + std::to_string(pins.tp) +
                                " does not divide the world of " + std::to_string(world_size) + " ranks");
  }
  if (pins.cp < 1 || pins.ep < 1 || world_size % (pins.pp * pins.tp * pins.cp) != 0) {
    throw std::invalid_argument("monarch: pp=" + std::to_string(pins.pp) + " x cp=" + std::to_string(pins.cp) +
                                " x tp=" + std::to_string(pins.tp) + " does not divide the world of " +
                                std::to_string(world_size) + " ranks (and ep must be >= 1)");
  }
  l.mesh.pp = pins.pp;
  l.mesh.tp = pins.tp;
  l.mesh.cp = pins.cp;
  l.mesh.ep = pins.ep;
  if (pins.cp > 1) l.mesh.order = {"pp", "dp", "cp", "tp"};
  l.mesh.dp = pins.dp ? pins.dp : world_size / (pins.pp * pins.cp * pins.tp);
  if (l.mesh.world_size() != world_size) {
    throw std::invalid_argument("monarch: " + planner::mesh_summary(l.mesh) + " holds " +
                                std::to_string(l.mesh.world_size()) + " ranks, the world has " +
                                std::to_string(world_size) + " ranks");
  }
  if (l.mesh.token_parallel() % l.mesh.ep != 0) {
    throw std::invalid_argument("monarch: ep=" + std::to_string(l.mesh.ep) + " does not divide dp x cp = " +
                                std::to_string(l.mesh.token_parallel()));
  }
  l.virtual_stages = pins.virtual_stages;
  l.schedule = pins.pp > 1 ? pins.schedule.value_or(planner::ScheduleKind::one_f_one_b) : planner::ScheduleKind::none;
  // ZB-V always runs two stages per rank: asking for the schedule asks for them.
  if (l.schedule == planner::ScheduleKind::zero_bubble_v && l.virtual_stages == 1) l.virtual_stages = 2;
  l.micro_batches = pins.micro_batches;
  l.zero_stage = pins.zero_stage;
  l.sequence_parallel = pins.sequence_parallel;
  l.bucket_bytes = pins.bucket_bytes;
  l.recompute = pins.recompute;
  l.dp_reduction = pins.dp_reduction;
  l.inter_node_compression = pins.inter_node_compression;
  l.zero_overlap = pins.zero_overlap;
  if (l.micro_batches < 1 || l.zero_stage < 0 || l.zero_stage > 3 || l.virtual_stages < 1) {
    throw std::invalid_argument("monarch: micro_batches must be >= 1, zero_stage in 0..3, virtual_stages >= 1");
  }
  if (l.dp_reduction == planner::DpReduction::hierarchical && l.zero_stage != 0 && l.zero_stage != 3) {
    throw std::invalid_argument("monarch: dp_reduction=hierarchical is run by the data-parallel engine (zero_stage 0) "
                                "and by ZeRO-3 (ZeRO++); zero_stage is " + std::to_string(l.zero_stage));
  }
  if (l.inter_node_compression != planner::Compression::none && l.dp_reduction != planner::DpReduction::hierarchical) {
    throw std::invalid_argument("monarch: inter_node_compression=" + planner::to_string(l.inter_node_compression) +
                                " compresses the inter-node hop of dp_reduction=hierarchical; dp_reduction is flat");
  }
  if (num_blocks == 0 && l.num_stages() == 1 && pins.block_stage.empty()) return l;  // nothing to cut
  l.block_stage = pins.block_stage.empty() ? even_block_stages(num_blocks, l.num_stages()) : pins.block_stage;
  if (static_cast<int64_t>(l.block_stage.size()) != num_blocks) {
    throw std::invalid_argument("monarch: " + std::to_string(l.block_stage.size()) +
                                " stage assignments for " + std::to_string(num_blocks) + " blocks");
  }
  check_block_stages(l.block_stage, l.num_stages(), block_names);
  return l;
}

Composition::Composition(Layout layout, std::shared_ptr<DeviceMesh> mesh, std::vector<LocalStage> stages,
                         std::vector<StateEntry> entries, std::vector<at::Tensor> tied,
                         std::vector<at::Tensor> tp_replicated)
    : layout_(std::move(layout)),
      mesh_(std::move(mesh)),
      stages_(std::move(stages)),
      entries_(std::move(entries)),
      tied_(std::move(tied)) {
  TORCH_CHECK(mesh_, "monarch: Composition needs a mesh");
  const auto& shape = mesh_->shape();
  TORCH_CHECK(shape.pp == layout_.mesh.pp && shape.dp == layout_.mesh.dp && shape.tp == layout_.mesh.tp,
              "monarch: the mesh (pp, dp, tp) = (", shape.pp, ", ", shape.dp, ", ", shape.tp,
              ") differs from the layout's (", layout_.mesh.pp, ", ", layout_.mesh.dp, ", ", layout_.mesh.tp, ")");
  for (size_t i = 0; i < entries_.size(); ++i) entry_index_.emplace(entries_[i].name, i);
  if (layout_.mesh.pp > 1) {
    auto schedule = planner::make_schedule(layout_.schedule, layout_.mesh.pp, layout_.micro_batches,
                                           layout_.virtual_stages);
    executor_ = std::make_unique<PipelineExecutor>(std::move(schedule), mesh_->group("pp"));
    const auto expected = executor_->local_stages();
    std::vector<int64_t> given;
    for (const auto& s : stages_) given.push_back(s.stage);
    TORCH_CHECK(given == expected, "monarch: rank ", mesh_->rank(), " runs stages ", list(expected),
                " under the schedule, the frontend built ", list(given));
  } else {
    TORCH_CHECK(stages_.size() == 1 && stages_[0].stage == 0,
                "monarch: without a pipeline a rank runs exactly stage 0; the frontend built ", stages_.size(),
                " stages");
  }
  // Copies that must stay equal start equal (dp replicas are the dp wrappers' business).
  if (layout_.mesh.tp > 1 && !tp_replicated.empty()) broadcast_from_root(tp_replicated, mesh_->group("tp"));
  if (!tied_.empty()) {
    TORCH_CHECK(layout_.mesh.pp > 1, "monarch: tied weights across stages need a pipeline");
    if (!layout_.ends_on_one_rank()) broadcast_from_root(tied_, mesh_->pipeline_ends_group());
    if (layout_.mesh.dp > 1) broadcast_from_root(tied_, mesh_->group("dp"));
  }
}

void Composition::set_data_parallel(int64_t stage, DataParallelEngine* engine) {
  for (auto& s : stages_) {
    if (s.stage == stage) {
      s.data_parallel = engine;
      return;
    }
  }
  TORCH_CHECK(false, "monarch: rank ", mesh_->rank(), " does not run stage ", stage);
}

void Composition::set_fully_shard(int64_t stage, FullyShardEngine* engine) {
  for (auto& s : stages_) {
    if (s.stage == stage) {
      s.fully_shard = engine;
      return;
    }
  }
  TORCH_CHECK(false, "monarch: rank ", mesh_->rank(), " does not run stage ", stage);
}

void Composition::add_data_parallel(int64_t stage, DataParallelEngine* engine) {
  for (auto& s : stages_) {
    if (s.stage == stage) {
      s.more_data_parallel.push_back(engine);
      return;
    }
  }
  TORCH_CHECK(false, "monarch: rank ", mesh_->rank(), " does not run stage ", stage);
}

void Composition::add_fully_shard(int64_t stage, FullyShardEngine* engine) {
  for (auto& s : stages_) {
    if (s.stage == stage) {
      s.more_fully_shard.push_back(engine);
      return;
    }
  }
  TORCH_CHECK(false, "monarch: rank ", mesh_->rank(), " does not run stage ", stage);
}

void LocalStage::set_sync(bool sync) {
  if (data_parallel) data_parallel->set_sync(sync);
  if (accumulates()) fully_shard->set_sync(sync);
  for (auto* e : more_data_parallel) e->set_sync(sync);
  for (auto* e : more_fully_shard) {
    if (e->options().zero_stage < 3) e->set_sync(sync);
  }
}

std::vector<int64_t> Composition::local_stages() const {
  std::vector<int64_t> out;
  for (const auto& s : stages_) out.push_back(s.stage);
  return out;
}

void Composition::set_sync(bool sync) {
  for (auto& s : stages_) s.set_sync(sync);
}

double Composition::sample_weight(int64_t samples) {
  if (samples < 0 || layout_.mesh.dp == 1) return 1.0;
  auto t = at::full({1}, static_cast<double>(samples), at::kDouble);
  mesh_->group("dp").all_reduce(t).wait();
  const double all = t.item<double>();
  TORCH_CHECK(all > 0, "monarch: train_step: the dp ranks hold no samples together");
  return static_cast<double>(samples) * static_cast<double>(layout_.mesh.dp) / all;
}

double Composition::train_step(const ForwardFn& forward, const LossFn& loss, int64_t samples) {
  advance_steps();
  const int64_t m = layout_.micro_batches;
  // Each rank's loss is the mean over its samples; scaled by n_r * dp / N, the dp average of
  // gradients and losses becomes the mean over the global batch's N samples, also when the
  // ranks hold different numbers (the last batch of an epoch).
  const double weight = sample_weight(samples);
  double total = 0;
  if (!executor_) {
    // Gradient accumulation: data parallelism syncs on the last micro-batch only.
    try {
      for (int64_t k = 0; k < m; ++k) {
        set_sync(k == m - 1);
        auto out = forward(0, k, {});
        at::Tensor l = loss(k, out);
        TORCH_CHECK(l.defined() && l.numel() == 1, "monarch: the loss of micro-batch ", k,
                    " is not a single value");
        at::Tensor scaled = l * (weight / static_cast<double>(m));
        torch::autograd::backward({scaled});
        total += scaled.item<double>();
      }
    } catch (...) {
      set_sync(true);
      throw;
    }
    set_sync(true);
    stats_.reset();
  } else {
    AutogradStageWork work(
        layout_.num_stages(), m, forward, loss, weight / static_cast<double>(m),
        [this](int64_t stage) {
          for (const auto& s : stages_) {
            if (s.stage == stage) return s.parameters;
          }
          return std::vector<at::Tensor>{};
        },
        [this](int64_t stage, int64_t, bool is_last) {
          for (auto& s : stages_) {
            if (s.stage != stage) continue;
            s.set_sync(is_last);
            if (s.fully_shard) s.fully_shard->prepare_gradient_roots();  // ZB-H1's W hands gradients to freed parameters
            for (auto* e : s.more_fully_shard) e->prepare_gradient_roots();
          }
        });
    PipelineStepStats stats;
    try {
      // The mean of this replica's micro-batch losses, sent along pp; weighted as the
      // gradients are, so the dp average is the global batch's mean.
      total = executor_->train_step(work, &stats) * weight;
    } catch (...) {
      set_sync(true);
      throw;
    }
    set_sync(true);
    stats_ = std::move(stats);
    if (!tied_.empty()) {
      // Both copies of a weight tied between the ends take the same optimizer step.
      sync_tied_gradients(tied_, layout_.mesh.dp > 1 ? &mesh_->group("dp") : nullptr,
                          layout_.ends_on_one_rank() ? nullptr : &mesh_->pipeline_ends_group());
    }
  }
  return global_mean(total);
}

void Composition::predict(const ForwardFn& forward) {
  advance_steps();
  if (!executor_) {
    for (int64_t k = 0; k < layout_.micro_batches; ++k) forward(0, k, {});
    return;
  }
  AutogradStageWork work(layout_.num_stages(), layout_.micro_batches, forward, nullptr, 1.0);
  stats_ = executor_->run(work, /*forward_only=*/true);
}

std::vector<Communicator*> Composition::groups() {
  // Each group once (dp_cp is dp without cp; edp is dp_cp with ep 1).
  std::vector<std::string> names{"pp", "dp", "tp"};
  if (layout_.mesh.cp > 1) names.insert(names.end(), {"cp", "dp_cp"});
  if (layout_.mesh.ep > 1) names.insert(names.end(), {"ep", "edp"});
  std::vector<Communicator*> out;
  for (const auto& name : names) {
    Communicator* g = &mesh_->group(name);
    if (std::find(out.begin(), out.end(), g) == out.end()) out.push_back(g);
  }
  return out;
}

void Composition::advance_steps() {
  for (Communicator* g : groups()) g->advance_step();
  if (mesh_->has_pipeline_ends_group() && layout_.mesh.pp > 2) mesh_->pipeline_ends_group().advance_step();
}

void Composition::expect_all(const std::string& what) {
  for (Communicator* g : groups()) g->expect_all(what);
}

double Composition::global_mean(double value) {
  // Over every rank holding other tokens: dp x cp (each cp rank's loss is its chunks' mean).
  if (layout_.mesh.token_parallel() == 1) return value;
  auto t = at::full({1}, value, at::kDouble);
  mesh_->group("dp_cp").all_reduce(t, /*average=*/true).wait();
  return t.item<double>();
}

std::vector<at::Tensor> Composition::micro_batches(const at::Tensor& batch, const std::string& what) const {
  const int64_t m = layout_.micro_batches;
  if (batch.dim() == 0 || batch.size(0) % m != 0) {  // bad input: std::invalid_argument (Python: ValueError)
    throw std::invalid_argument("monarch: the local batch of " + std::to_string(batch.dim() ? batch.size(0) : 0) +
                                " " + what + " does not split into " + std::to_string(m) + " micro-batches");
  }
  return batch.chunk(m, 0);
}

at::Tensor Composition::local_batch(const at::Tensor& global) const {
  const int64_t dp = layout_.mesh.dp;
  if (global.dim() == 0 || global.size(0) % dp != 0) {
    throw std::invalid_argument("monarch: local_batch: a batch of " +
                                std::to_string(global.dim() ? global.size(0) : 0) + " does not split over dp=" +
                                std::to_string(dp));
  }
  return global.chunk(dp, 0)[mesh_->coordinate("dp")];
}

std::vector<std::pair<std::string, at::Tensor>> Composition::full_state_dict(
    const std::map<std::string, at::Tensor>& local) {
  const int pp_rank = mesh_->coordinate("pp");
  const int64_t pp = layout_.mesh.pp, tp = layout_.mesh.tp;
  Communicator::Phase pp_phase(mesh_->group("pp"), "state_dict() (assembling the whole model)");
  Communicator::Phase tp_phase(mesh_->group("tp"), "state_dict() (assembling the whole model)");
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.reserve(entries_.size());
  for (const auto& e : entries_) {
    const int owner = static_cast<int>(planner::pipeline_rank_of_stage(layout_.schedule, pp, e.stage));
    at::Tensor t;
    if (owner == pp_rank) {
      auto it = local.find(e.name);
      TORCH_CHECK(it != local.end(), "monarch: state dict: stage ", e.stage, " holds ", e.name,
                  " but this rank's stages did not report it");
      t = it->second.detach().contiguous().clone();
    } else {
      t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    }
    if (pp > 1) mesh_->group("pp").broadcast(t, owner).wait();
    if (e.tp && tp > 1) {
      std::vector<int64_t> stacked_shape{tp};
      stacked_shape.insert(stacked_shape.end(), t.sizes().begin(), t.sizes().end());
      auto stacked = at::empty(stacked_shape, t.options());
      mesh_->group("tp").all_gather(stacked, t).wait();
      t = tp::unshard_tensor(stacked.unbind(0), e.tp->dim, e.tp->fused_parts);
    }
    if (e.experts && layout_.mesh.ep > 1) {
      // Every ep rank's block of experts, in ep-rank order along dim 0.
      auto& ep = mesh_->group("ep");
      Communicator::Phase ep_phase(ep, "state_dict() (assembling the whole model)");
      std::vector<int64_t> stacked_shape{ep.size()};
      stacked_shape.insert(stacked_shape.end(), t.sizes().begin(), t.sizes().end());
      auto stacked = at::empty(stacked_shape, t.options());
      ep.all_gather(stacked, t.contiguous()).wait();
      t = at::cat(stacked.unbind(0), 0);
    }
    out.emplace_back(e.name, t);
  }
  return out;
}

std::map<std::string, at::Tensor> Composition::local_slices(const std::map<std::string, at::Tensor>& full,
                                                            const std::vector<std::string>& names) const {
  const int64_t tp = layout_.mesh.tp;
  const int tp_rank = mesh_->coordinate("tp");
  std::map<std::string, at::Tensor> out;
  std::vector<std::string> problems;
  for (const auto& name : names) {
    auto it = full.find(name);
    if (it == full.end()) continue;  // the caller decides about missing keys
    auto e = entry_index_.find(name);
    if (e == entry_index_.end()) {
      problems.push_back(name + " is not an entry of this model");
      continue;
    }
    const auto& entry = entries_[e->second];
    at::Tensor value = it->second.detach();
    if (entry.tp && tp > 1) {
      const int64_t dim = entry.tp->dim < 0 ? entry.tp->dim + value.dim() : entry.tp->dim;
      if (dim < 0 || dim >= value.dim() || value.size(dim) % (tp * entry.tp->fused_parts) != 0) {
        // What the model holds whole: this rank's slice, times tp along the split dim.
        std::vector<int64_t> whole = entry.shape;
        const int64_t d = entry.tp->dim < 0 ? entry.tp->dim + static_cast<int64_t>(whole.size()) : entry.tp->dim;
        if (d >= 0 && d < static_cast<int64_t>(whole.size())) whole[d] *= tp;
        problems.push_back(name + " has shape " + list(value.sizes().vec()) + ", the model holds " + list(whole) +
                           " (split over tp=" + std::to_string(tp) + " along dim " + std::to_string(entry.tp->dim) +
                           ": " + list(entry.shape) + " per rank)");
        continue;
      }
      value = tp::shard_tensor(value, entry.tp->dim, tp_rank, tp, entry.tp->fused_parts, name);
    }
    if (entry.experts && layout_.mesh.ep > 1) {
      const int64_t ep = layout_.mesh.ep;
      if (value.dim() == 0 || value.size(0) % ep != 0) {
        problems.push_back(name + " has shape " + list(value.sizes().vec()) + ": its " +
                           (value.dim() ? std::to_string(value.size(0)) : std::string("no")) +
                           " experts do not split over ep=" + std::to_string(ep));
        continue;
      }
      value = value.chunk(ep, 0)[mesh_->group("ep").group_rank()];
    }
    if (value.sizes().vec() != entry.shape) {
      problems.push_back(name + " has shape " + list(it->second.sizes().vec()) + ", this rank holds " +
                         list(entry.shape) + (entry.tp && tp > 1 ? " (its tp slice)" : ""));
      continue;
    }
    out.emplace(name, value);
  }
  TORCH_CHECK(problems.empty(), "monarch: load_state_dict: ", join(problems));
  return out;
}

std::pair<std::vector<std::string>, std::vector<std::string>> Composition::compare_keys(
    const std::vector<std::string>& keys) const {
  std::set<std::string> given(keys.begin(), keys.end());
  std::vector<std::string> missing, unexpected;
  for (const auto& e : entries_) {
    if (!given.count(e.name)) missing.push_back(e.name);
  }
  for (const auto& k : keys) {
    if (!entry_index_.count(k)) unexpected.push_back(k);
  }
  return {missing, unexpected};
}

}  // namespace monarch
