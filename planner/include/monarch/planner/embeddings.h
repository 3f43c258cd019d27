#pragma once
// Embedding tables of recommendation models: how each table is sharded over the ranks, what
// that costs, and where the shards go. The dense part of the model is planned by search();
// this plans the tables (TorchRec's sharding types: Ivchenko et al. 2022, "TorchRec: a
// PyTorch Domain Library for Recommendation Systems", RecSys; Mudigere et al. 2022,
// "Software-Hardware Co-design for Fast and Scalable Training of Deep Learning
// Recommendation Models", ISCA). Formulas: docs/cost_model.md, "Embedding tables".
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "monarch/planner/cluster.h"

namespace monarch::planner {

enum class EmbeddingSharding {
  data_parallel,   // every rank holds the whole table; gradients all-reduced
  table_wise,      // the whole table on one rank
  row_wise,        // rows split evenly over every rank
  column_wise,     // columns split into chunks, each chunk on one rank
  table_row_wise,  // rows split over the ranks of one node
};
std::string to_string(EmbeddingSharding s);
EmbeddingSharding embedding_sharding_from_string(const std::string& name,
                                                 const std::string& field = "sharding");

enum class EmbeddingOptimizer { sgd, rowwise_adagrad, adam };
std::string to_string(EmbeddingOptimizer o);
EmbeddingOptimizer embedding_optimizer_from_string(const std::string& name,
                                                   const std::string& field = "optimizer");

enum class EmbeddingPooling { sum, mean, none };  // none: nn.Embedding (sequence features)
std::string to_string(EmbeddingPooling p);
EmbeddingPooling embedding_pooling_from_string(const std::string& name,
                                               const std::string& field = "pooling");

struct EmbeddingTable {
  std::string name;
  int64_t rows = 0;
  int64_t dim = 0;
  double bytes_per_element = 4;  // fp32 4, fp16/bf16 2, int8 rows 1 (+ a per-row scale)
  std::vector<std::string> features;  // the input features looking up this table
  double pooling_factor = 1;     // mean ids per sample per feature
  EmbeddingPooling pooling = EmbeddingPooling::sum;
  bool operator==(const EmbeddingTable& o) const;
};

// One piece of a table on one rank: rows [row_offset, row_offset + rows) and columns
// [col_offset, col_offset + cols).
struct EmbeddingShard {
  int64_t rank = 0;
  int64_t row_offset = 0, rows = 0;
  int64_t col_offset = 0, cols = 0;
  bool operator==(const EmbeddingShard& o) const;
};

struct EmbeddingPlacement {
  std::string table;
  EmbeddingSharding sharding = EmbeddingSharding::table_wise;
  std::vector<EmbeddingShard> shards;
  bool operator==(const EmbeddingPlacement& o) const;
};

// Per rank, per training step.
struct EmbeddingRankLoad {
  double storage_bytes = 0;  // peak: table shards, their optimizer state, and a data-parallel
                             // table's dense gradient during backward
  double lookup_s = 0;       // gathers, pooling, gradient scatter and sparse update
  double comm_s = 0;         // input and output all-to-alls, forward and backward; DP all-reduce
  double sent_bytes = 0;     // what the rank's communicator sends per step (its counters)
  double received_bytes = 0;
  double total_s() const { return lookup_s + comm_s; }
  bool operator==(const EmbeddingRankLoad& o) const;
};

struct EmbeddingOptions {
  int64_t world_size = 1;
  int64_t batch_per_rank = 1;        // samples each rank brings to a step
  EmbeddingOptimizer optimizer = EmbeddingOptimizer::sgd;
  double memory_budget_bytes = 0;    // per rank for the tables; 0: the cluster's usable memory
  int64_t column_chunk = 0;          // column-wise chunk width; 0: dim / 4 rounded to 4 (at least 4)
  std::map<std::string, EmbeddingSharding> pins;  // table name -> sharding
};

struct EmbeddingPlan {
  EmbeddingOptimizer optimizer = EmbeddingOptimizer::sgd;
  int64_t world_size = 1;
  int64_t batch_per_rank = 1;
  std::vector<EmbeddingTable> tables;
  std::vector<EmbeddingPlacement> placements;  // same order as tables
  std::vector<EmbeddingRankLoad> ranks;
  double max_rank_s = 0;      // the most loaded rank's time: the step's embedding time
  double lower_bound_s = 0;   // no placement of these tables can have a smaller max_rank_s
  bool operator==(const EmbeddingPlan& o) const;
};

// Bytes of optimizer state per row of `dim` elements (fp32 state).
double embedding_optimizer_bytes_per_row(EmbeddingOptimizer o, int64_t dim);

// Loads that `placement` of `table` puts on each rank (size world_size).
std::vector<EmbeddingRankLoad> embedding_placement_loads(const EmbeddingTable& table,
                                                         const EmbeddingPlacement& placement,
                                                         const Cluster& cluster,
                                                         const EmbeddingOptions& options);

// Chooses a sharding per table and places the shards: minimizes the most loaded rank's time
// under every rank's memory budget. Throws ValidationError naming the table for a bad table
// or pin (a pin the table cannot take, an unknown table), InfeasibleError when the tables do
// not fit.
EmbeddingPlan plan_embeddings(const std::vector<EmbeddingTable>& tables, const Cluster& cluster,
                              const EmbeddingOptions& options);

// Structure only (no cluster): tables valid and uniquely named, a feature looking up one table,
// each placement's shards in range, shaped as its sharding kind says (table- and data-
// parallel: the whole table; column-wise: every row; row splits: every column), covering the
// table exactly once (data-parallel: once per rank). Throws ValidationError naming the table.
void check_embedding_placements(const EmbeddingPlan& plan);

// Re-scores a plan (edited by hand or loaded): fills ranks, max_rank_s and lower_bound_s.
// Throws ValidationError naming the table and field when a placement is inconsistent (rows
// not covered exactly once, a rank out of range, over the memory budget).
EmbeddingPlan evaluate_embeddings(EmbeddingPlan plan, const Cluster& cluster, double memory_budget_bytes = 0);

std::string format_embedding_report(const EmbeddingPlan& plan);

// The "embeddings" section of a plan on its own (docs/plan_format.md). from_json throws
// FormatError for unparsable text, ValidationError naming the field path for a bad value.
std::string embeddings_to_json(const EmbeddingPlan& plan, int indent = 2);
EmbeddingPlan embeddings_from_json(const std::string& text);
// A table list as users write it: [{"name", "rows", "dim", optional "features" (default
// [name]), "pooling_factor" (1), "pooling" (sum), "dtype" (fp32) or "bytes_per_element"}], or
// an object with such a "tables" array (an embeddings section).
std::vector<EmbeddingTable> embedding_tables_from_json(const std::string& text);

}  // namespace monarch::planner
