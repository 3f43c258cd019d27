#pragma once
// Embedding tables of recommendation models from C++, as torch_monarch.embeddings offers them
// in Python (TorchRec's EmbeddingBagCollection and its sharded twin):
//
//   monarch::EmbeddingBagCollection ebc({{"user", 100000, 64}, {"item", 50000, 64, {"item", "clicked"}}});
//   // one process: ebc->forward(batch) is [B, 64 + 64 + 64], a torch::nn module like any other
//   monarch::ShardOptions so;
//   so.batch_per_rank = 256;                       // what each rank brings to a step
//   so.optimizer.kind = planner::EmbeddingOptimizer::rowwise_adagrad;
//   auto tables = monarch::shard_embeddings(ebc, so);   // planned for this job, sharded
//   auto pooled = tables->forward(batch);               // this rank's batch; backward updates the rows
//
// shard_embeddings plans the tables with the planner (planner::plan_embeddings: table-, row-,
// column-, table-row-wise or data-parallel per table, by cost under the memory budget) unless
// given a plan, and hands them to the sharded engine (monarch/runtime/sharded_embeddings.h).
// The sharded tables are not parameters: their optimizer runs fused in backward on the rows a
// lookup touched, so a torch::optim optimizer takes the rest of the model (DataParallel around
// the whole model syncs only that).
#include <torch/nn/module.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/embedding.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "monarch/planner/cluster.h"
#include "monarch/planner/embeddings.h"
#include "monarch/runtime/device_mesh.h"
#include "monarch/runtime/sharded_embeddings.h"
#include "monarch/runtime/world.h"

namespace monarch {

// Samples [begin, end) of `batch` (each feature's lengths and ids; weights when present):
// a rank's share of a global batch.
JaggedBatch samples(const JaggedBatch& batch, int64_t begin, int64_t end);

struct EmbeddingBagConfig {
  std::string name;
  int64_t rows = 0;
  int64_t dim = 0;
  std::vector<std::string> features;  // default: one feature named like the table
  planner::EmbeddingPooling pooling = planner::EmbeddingPooling::sum;  // sum or mean
  double pooling_factor = 1.0;        // mean ids per sample per feature (for the planner)
};

// Tables as torch::nn::EmbeddingBag modules on one process: the unsharded model. forward:
// [B, sum of each feature's dim], the features in table order (each table's in its config's
// order), as the sharded collection returns them.
class EmbeddingBagCollectionImpl : public torch::nn::Module {
 public:
  explicit EmbeddingBagCollectionImpl(std::vector<EmbeddingBagConfig> tables);
  at::Tensor forward(const JaggedBatch& batch);
  std::vector<std::string> output_keys() const;
  const std::vector<EmbeddingBagConfig>& configs() const { return configs_; }
  // The tables as the planner reads them.
  std::vector<planner::EmbeddingTable> planner_tables() const;
  // Table `name`'s weight [rows, dim] (its parameter).
  at::Tensor& weight(const std::string& name);

 private:
  std::vector<EmbeddingBagConfig> configs_;
  torch::nn::ModuleDict tables_{nullptr};
};
TORCH_MODULE(EmbeddingBagCollection);

struct ShardOptions {
  int64_t batch_per_rank = 0;            // samples each rank brings to a step (required)
  EmbeddingOptimizerConfig optimizer;    // the fused optimizer and its learning rate
  std::optional<planner::EmbeddingPlan> plan;  // given: used as is (checked against the tables)
  std::optional<planner::Cluster> cluster;     // for planning; default: the "cpu" preset
  std::map<std::string, planner::EmbeddingSharding> pins;  // table -> sharding
  double memory_budget_bytes = 0;        // per rank; 0: the cluster's usable memory
  std::shared_ptr<World> world;          // default: World::init()
};

// The collection sharded over every rank. Not a parameter holder: see the header comment.
class ShardedEmbeddingBagCollectionImpl : public torch::nn::Module {
 public:
  ShardedEmbeddingBagCollectionImpl(std::vector<EmbeddingBagConfig> configs, planner::EmbeddingPlan plan,
                                    std::shared_ptr<World> world, const EmbeddingOptimizerConfig& optimizer);
  // This rank's batch (every rank calls it, with batches of the same size): [B, width].
  at::Tensor forward(const JaggedBatch& batch);
  std::vector<std::string> output_keys() const { return engine_->output_keys(); }
  // Table `name` whole, assembled from every rank's shards. Collective.
  at::Tensor full_table(const std::string& name) { return engine_->full_table(name); }
  const planner::EmbeddingPlan& plan() const { return engine_->plan(); }
  const std::vector<EmbeddingBagConfig>& configs() const { return configs_; }
  ShardedEmbeddingTables& engine() { return *engine_; }
  // `t` replaced by rank 0's values on every rank. Collective.
  void broadcast_from_first(at::Tensor& t);

 private:
  std::vector<EmbeddingBagConfig> configs_;
  std::shared_ptr<World> world_;
  std::unique_ptr<DeviceMesh> mesh_;  // one group over every rank, which the engine uses
  std::unique_ptr<ShardedEmbeddingTables> engine_;
};
TORCH_MODULE(ShardedEmbeddingBagCollection);

// Plans (unless options.plan) and shards `tables` over every rank of the job; every table
// starts from rank 0's values (each rank keeps its shards). Every rank must plan alike: the
// ranks compare their plans and refuse, naming the ranks, when they differ. A plan for other
// tables or another world size is refused listing every difference. Collective.
ShardedEmbeddingBagCollection shard_embeddings(EmbeddingBagCollection& tables, ShardOptions options);

}  // namespace monarch
