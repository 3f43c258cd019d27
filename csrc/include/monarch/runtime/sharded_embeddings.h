#pragma once
// Embedding tables sharded as an EmbeddingPlan says (table-, row-, column-, table-row-wise or
// data-parallel), with the lookups of recommendation models: input distribution (ids and
// lengths to the ranks owning their rows, by all-to-all), local lookup and pooling, output
// distribution back to the batch's ranks, and backward by the reverse path ending in a fused
// sparse optimizer step on the touched rows (TorchRec's sharded EmbeddingBagCollection and
// FBGEMM's fused table-batched optimizers: Ivchenko et al. 2022; Mudigere et al. 2022).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "monarch/planner/embeddings.h"
#include "monarch/runtime/communicator.h"

namespace monarch {

// One rank's batch of sparse features in TorchRec's KeyedJaggedTensor layout: for feature
// keys[k] and sample i, the ids values[offset(k, i) : offset(k, i) + lengths[k * B + i]],
// feature-major. weights (optional): one per id, for weighted pooling.
struct JaggedBatch {
  std::vector<std::string> keys;
  at::Tensor values;   // int64 [total ids]
  at::Tensor lengths;  // int64 [keys.size() * batch_size]
  at::Tensor weights;  // float [total ids] or undefined
  int64_t batch_size() const;
};

// What a lookup returns: the pooled features (sum / mean tables) side by side, and each
// sequence feature's rows (pooling none: nn.Embedding), [its ids, dim], in output_keys() order.
struct EmbeddingLookup {
  at::Tensor pooled;                   // [B, sum of the pooled features' dims]
  std::vector<at::Tensor> sequences;   // one per sequence feature
};

struct EmbeddingOptimizerConfig {
  planner::EmbeddingOptimizer kind = planner::EmbeddingOptimizer::sgd;
  double lr = 0.01;
  double eps = 1e-8;            // row-wise Adagrad and Adam
  double beta1 = 0.9, beta2 = 0.999;  // Adam
};

class ShardedEmbeddingTables {
 public:
  // `group` spans every rank of the plan, in plan rank order. Each rank allocates only its
  // own shards, zero-initialized (load_table / init_uniform fill them).
  ShardedEmbeddingTables(planner::EmbeddingPlan plan, Communicator& group, EmbeddingOptimizerConfig optimizer);

  // Pooled embeddings of this rank's batch: [B, sum of the pooled features' dims], each
  // feature's columns in output_keys() order (forward_all also returns the sequence features'
  // rows). With grad mode on, the result is attached to
  // autograd: its backward sends the gradients to the shards' owners and applies the
  // optimizer there, once per lookup (a second lookup before the first one's backward is
  // refused). Collective: every rank calls it with a batch of the same size; a batch refused
  // on one rank (bad ids, missing features) makes every rank throw.
  at::Tensor forward(const JaggedBatch& batch);  // tables without sequence features
  EmbeddingLookup forward_all(const JaggedBatch& batch);

  const std::vector<std::string>& output_keys() const { return output_keys_; }
  std::vector<int64_t> output_dims() const;
  // The features of tables with pooling none, in output_keys() order: forward_all's sequences.
  std::vector<std::string> sequence_keys() const;

  // Copies this rank's slice of the whole table `full` [rows, dim] into its shards (a whole
  // state dict loaded into any sharding). Local: no communication.
  void load_table(const std::string& table, const at::Tensor& full);
  // Fills this rank's shards with U(-bound, bound) (bound <= 0: 1/sqrt(rows) of each table), a
  // generator seeded from `seed`, the table's index and the shard's offsets (values depend on
  // the sharding).
  void init_uniform(double bound, uint64_t seed);
  // The whole table assembled from every rank's shards (collective; every rank gets it).
  at::Tensor full_table(const std::string& table);

  // This rank's shards: "table/rows r0+n/cols c0+m" -> weight [n, m].
  std::map<std::string, at::Tensor> local_shards() const;
  // This rank's shards with their optimizer state, as the engine's own tensors (writing into
  // them changes the tables: a checkpoint loads through them). `state`: row-wise Adagrad's
  // accumulator [rows], Adam's moments [2, rows, cols], undefined for SGD.
  struct ShardView {
    std::string table;
    planner::EmbeddingShard where;
    at::Tensor weight;
    at::Tensor state;
  };
  std::vector<ShardView> shard_views();
  // Adam's step count (the same on every shard and rank: every lookup's backward advances it).
  int64_t adam_step() const { return shards_.empty() ? adam_step_ : shards_.front().adam_step; }
  void set_adam_step(int64_t step);
  int64_t local_bytes() const;
  const planner::EmbeddingPlan& plan() const { return plan_; }

  // Implementation, used by the autograd node.
  struct Step;
  void backward(Step& step, const at::Tensor& pooled_grad, const at::Tensor& sequence_grad);

 private:
  struct Shard {
    int64_t table = 0;          // index into plan_.tables
    planner::EmbeddingShard where;
    at::Tensor weight;          // [rows, cols] fp32
    at::Tensor state;           // row-wise Adagrad [rows]; Adam [2, rows, cols]
    int64_t adam_step = 0;
  };
  // What crosses the wire, in one order every rank derives from the plan: for each
  // destination rank, for each table, for each of its non-data-parallel shards on that rank,
  // for each of the table's features.
  struct Segment {
    int64_t table = 0;
    int64_t shard = 0;    // index into the table's placement shards
    int64_t feature = 0;  // index into output_keys_
  };
  std::vector<Segment> segments_to(int64_t rank) const;
  // First output column and width of the gradient a segment's owner gets back.
  std::pair<int64_t, int64_t> gradient_columns(const Segment& seg) const;
  Shard* local_shard(int64_t table, int64_t shard);
  void apply_optimizer(Shard& s, const at::Tensor& rows, const at::Tensor& grads);
  void check_batch(const JaggedBatch& batch) const;

  planner::EmbeddingPlan plan_;
  Communicator& group_;
  EmbeddingOptimizerConfig optimizer_;
  int64_t rank_ = 0, world_ = 1;
  std::vector<Shard> shards_;                        // this rank's
  std::vector<std::string> output_keys_;             // features, table order
  std::vector<int64_t> feature_table_;               // output key -> table index
  std::vector<int64_t> feature_offset_;              // output key -> first pooled column (-1: sequence)
  std::vector<bool> sequence_;                       // output key -> its table has pooling none
  int64_t output_width_ = 0;
  std::vector<std::vector<Segment>> segments_;       // per destination rank
  at::Tensor anchor_;                                // requires grad: connects outputs to autograd
  std::shared_ptr<int> pending_ = std::make_shared<int>(0);  // lookups whose backward has not run
  int64_t adam_step_ = 0;  // a rank without shards still counts steps (adam_step())
};

}  // namespace monarch
