#pragma once
// How a plan is applied to a model, once, for both frontends (torch_monarch.parallelize in
// Python, monarch::parallelize in C++).
//
// The order is fixed: tensor parallelism splits layers inside each block, the pipeline cut
// assigns blocks to stages, data parallelism (DDP-style replicas or ZeRO 1-3) wraps each
// local stage. Frontends do what only they can do with their module tree (swap modules for
// tensor-parallel ones, cut the tree into stage modules, install hooks) and hand this engine
// their local stages; the engine owns everything after that: which blocks go to which stage
// (from the plan), the micro-batch loop (gradient accumulation, data-parallel sync on the
// last micro-batch, or the pipeline schedule), replica and tied-weight synchronisation, the
// loss averaged over the global batch, and the whole-model state dict (assembled from
// pipeline and tensor-parallel slices, and sliced again on load).
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "monarch/planner/plan.h"
#include "monarch/runtime/data_parallel.h"
#include "monarch/runtime/fully_shard.h"
#include "monarch/runtime/device_mesh.h"
#include "monarch/runtime/pipeline.h"

namespace monarch {

// A plan resolved for one model (its block count) and one world.
struct Layout {
  planner::Mesh mesh;                 // pp, dp, tp (cp, ep)
  int64_t virtual_stages = 1;         // per pipeline rank (interleaved schedules; 2 under zbv)
  std::vector<int64_t> block_stage;   // stage of each block, in [0, pp * virtual_stages)
  planner::ScheduleKind schedule = planner::ScheduleKind::none;  // none when pp == 1
  int64_t micro_batches = 1;          // per optimizer step, per dp rank
  int64_t zero_stage = 0;             // 0: replicas (DDP), 1-3: ZeRO / FSDP
  bool sequence_parallel = false;
  int64_t bucket_bytes = 25 * 1024 * 1024;
  planner::Recompute recompute = planner::Recompute::none;
  // The dp gradient reduction (ZeRO 0): flat ring, or hierarchical across nodes with the
  // inter-node hop optionally compressed (hierarchical.h).
  planner::DpReduction dp_reduction = planner::DpReduction::flat;
  planner::Compression inter_node_compression = planner::Compression::none;
  bool zero_overlap = true;  // ZeRO 1-3: planner::Plan::zero_overlap (FullyShardOptions::overlap)
  int64_t num_stages() const { return mesh.pp * virtual_stages; }
  // The stages pipeline rank `pp_rank` runs, in order (planner::pipeline_rank_of_stage: s % pp,
  // or ZB-V's V); frontends build exactly these, and the state dict's owner follows it.
  std::vector<int64_t> stages_of(int64_t pp_rank) const;
  // The first and the last stage on one pipeline rank (ZB-V): a weight tied between them is
  // one parameter there, with nothing to exchange between the ends.
  bool ends_on_one_rank() const {
    return planner::pipeline_rank_of_stage(schedule, mesh.pp, 0) ==
           planner::pipeline_rank_of_stage(schedule, mesh.pp, num_stages() - 1);
  }
  std::string summary() const;
};

// Choices made by hand (no plan): unset fields take the defaults below.
struct LayoutPins {
  int64_t pp = 1, dp = 0 /* 0: world / (pp * cp * tp) */, tp = 1;
  int64_t cp = 1, ep = 1;  // planner::Mesh's context and expert parallelism
  int64_t virtual_stages = 1;
  std::vector<int64_t> block_stage;  // empty: as even as possible
  std::optional<planner::ScheduleKind> schedule;  // default 1f1b when pp > 1
  int64_t micro_batches = 1;
  int64_t zero_stage = 0;
  bool sequence_parallel = false;
  int64_t bucket_bytes = 25 * 1024 * 1024;
  planner::Recompute recompute = planner::Recompute::none;
  planner::DpReduction dp_reduction = planner::DpReduction::flat;
  planner::Compression inter_node_compression = planner::Compression::none;
  bool zero_overlap = true;
};

// The plan's layout for a model with `num_blocks` blocks on `world_size` ranks. Throws
// std::invalid_argument listing every difference (world size, block count, stage order).
// `block_names` (optional) makes the messages name the model's blocks.
Layout layout_from_plan(const planner::Plan& plan, int64_t num_blocks, int64_t world_size,
                        const std::vector<std::string>& block_names = {});
// The same, adding what does not fit to `problems` instead of throwing.
Layout layout_from_plan(const planner::Plan& plan, int64_t num_blocks, int64_t world_size,
                        const std::vector<std::string>& block_names, std::vector<std::string>& problems);
Layout layout_from_pins(const LayoutPins& pins, int64_t num_blocks, int64_t world_size,
                        const std::vector<std::string>& block_names = {});

// [0, 0, 1, 1, 1, ...]: blocks spread over stages as evenly as possible (earlier stages get
// the extra block). Throws when there are fewer blocks than stages.
std::vector<int64_t> even_block_stages(int64_t num_blocks, int64_t num_stages);
// Refuses an assignment that does not start at 0, goes backwards or leaves a stage empty.
void check_block_stages(const std::vector<int64_t>& block_stage, int64_t num_stages,
                        const std::vector<std::string>& block_names = {});

// How tensor parallelism split a tensor: along `dim`, part by part when `fused_parts` > 1.
struct TpSpec {
  int64_t dim = 0;
  int64_t fused_parts = 1;
};

// One entry of the whole model's state dict: its local shape (after tp), dtype, the first
// stage holding it, and how tp split it (if it did).
struct StateEntry {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  int64_t stage = 0;
  std::optional<TpSpec> tp;
  // A MoE layer's experts split over the mesh's ep group: this rank holds its ep rank's block
  // of dim 0 (experts [r * E / ep, (r + 1) * E / ep)).
  bool experts = false;
};

// A local stage as its frontend built it.
struct LocalStage {
  int64_t stage = 0;
  // Parameters of the unwrapped stage, each once (ZB-H1's weight pass differentiates them).
  std::vector<at::Tensor> parameters;
  // Set (here or with set_data_parallel) when the stage is wrapped in DDP-style data
  // parallelism: the engine turns its gradient sync off for all but the last micro-batch.
  DataParallelEngine* data_parallel = nullptr;
  // Set (set_fully_shard) when wrapped in ZeRO: under stages 1-2 gradients accumulate over
  // micro-batches and are reduced once per step, as with data parallelism; under any stage
  // the parameters get placeholders of their shapes before a zero-bubble weight pass
  // (FullyShardEngine::prepare_gradient_roots).
  FullyShardEngine* fully_shard = nullptr;
  // Engines of the same stage over another group (experts over the mesh's edp group): the
  // engine turns their sync on and off with the stage's own.
  std::vector<DataParallelEngine*> more_data_parallel;
  std::vector<FullyShardEngine*> more_fully_shard;
  bool accumulates() const { return fully_shard != nullptr && fully_shard->options().zero_stage < 3; }
  // Gradient sync on or off for every engine of the stage (ZeRO-3 engines stay on).
  void set_sync(bool sync);
};

class Composition {
 public:
  // forward(stage, mb, received): runs one local stage on micro-batch `mb` (stage 0 reads
  // its micro-batch itself and gets no `received`). loss(mb, outputs): the last stage's
  // outputs to that micro-batch's loss.
  using ForwardFn = AutogradStageWork::ForwardFn;
  using LossFn = AutogradStageWork::LossFn;

  // `tied`: this rank's copies of weights shared by the first and the last stage, in an
  // order every rank agrees on (left out of the data-parallel wrappers: this engine averages
  // them over dp and sums them over the two ends). `tp_replicated`: parameters and buffers
  // tensor parallelism did not split (they start from tp rank 0's values). Collective: every
  // rank of the mesh constructs it, before wrapping its stages in data parallelism (ZeRO
  // takes its shards from the values the replicas agree on here).
  Composition(Layout layout, std::shared_ptr<DeviceMesh> mesh, std::vector<LocalStage> stages,
              std::vector<StateEntry> entries, std::vector<at::Tensor> tied = {},
              std::vector<at::Tensor> tp_replicated = {});

  // The DDP-style engine wrapping local stage `stage` (not owned).
  void set_data_parallel(int64_t stage, DataParallelEngine* engine);
  // The ZeRO engine wrapping local stage `stage` (not owned); stage 3 engines are left
  // syncing every micro-batch.
  void set_fully_shard(int64_t stage, FullyShardEngine* engine);
  // A further engine of local stage `stage` over another group (experts over edp).
  void add_data_parallel(int64_t stage, DataParallelEngine* engine);
  void add_fully_shard(int64_t stage, FullyShardEngine* engine);

  const Layout& layout() const { return layout_; }
  DeviceMesh& mesh() { return *mesh_; }
  const std::shared_ptr<DeviceMesh>& shared_mesh() const { return mesh_; }
  std::vector<int64_t> local_stages() const;
  PipelineExecutor* executor() { return executor_.get(); }
  const std::optional<PipelineStepStats>& last_stats() const { return stats_; }
  const std::vector<StateEntry>& entries() const { return entries_; }

  // Forward and backward of this dp rank's batch in the layout's micro-batches; gradients
  // synchronised (dp, tied weights). Returns the global batch's mean loss on every rank.
  // `samples`: this rank's batch size. Given, the ranks may hold different numbers (one
  // scalar all-reduce finds the total) and losses and gradients are the mean over all of
  // the global batch's samples, as one process would compute it, provided `loss` returns
  // the mean over its micro-batch's samples (a loss that averages over tokens, e.g. with
  // ignore_index, is weighted by samples all the same). -1: the ranks hold equal batches.
  double train_step(const ForwardFn& forward, const LossFn& loss, int64_t samples = -1);
  // Forward only through the pipeline (inference); `forward` keeps what it needs.
  void predict(const ForwardFn& forward);

  // Splits a tensor of this dp rank's batch into the layout's micro-batches (dim 0).
  std::vector<at::Tensor> micro_batches(const at::Tensor& batch, const std::string& what = "inputs") const;
  // This dp rank's share of a global-batch tensor (dim 0). Ranks of one replica agree.
  at::Tensor local_batch(const at::Tensor& global) const;

  // The whole model's state dict on every rank, in entries() order, under the original
  // names and shapes: each entry comes from the pipeline rank holding its stage and is
  // all-gathered along tp if tp split it. `local`: this rank's stages' entries (whole
  // along dp). Collective.
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict(
      const std::map<std::string, at::Tensor>& local);
  // Before an operation every rank must call (a state dict): waits, at most
  // Communicator::entry_timeout(), for every rank of this rank's pp, dp and tp groups to
  // call it too, and otherwise throws saying so (see Communicator::expect_all).
  void expect_all(const std::string& what);
  // The slices of `full` this rank keeps for `names` (its stages' entries): cut along tp as
  // each entry's TpSpec says. Throws naming every missing key and wrong shape (after the cut).
  std::map<std::string, at::Tensor> local_slices(const std::map<std::string, at::Tensor>& full,
                                                 const std::vector<std::string>& names) const;
  // Names of entries() missing from `keys`, and keys that are not entries.
  std::pair<std::vector<std::string>, std::vector<std::string>> compare_keys(
      const std::vector<std::string>& keys) const;

 private:
  double global_mean(double value);
  // Counts a train step or predict in every group's step (see Communicator::advance_step).
  void advance_steps();
  // The mesh's groups a step uses, each once: pp, dp, tp, and cp, dp_cp, ep, edp when used.
  std::vector<Communicator*> groups();
  double sample_weight(int64_t samples);
  void set_sync(bool sync);
  Layout layout_;
  std::shared_ptr<DeviceMesh> mesh_;
  std::vector<LocalStage> stages_;
  std::vector<StateEntry> entries_;
  std::map<std::string, size_t> entry_index_;
  std::vector<at::Tensor> tied_;
  std::unique_ptr<PipelineExecutor> executor_;
  std::optional<PipelineStepStats> stats_;
};

}  // namespace monarch
