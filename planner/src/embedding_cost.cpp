// Costs of one embedding table under one placement, per rank and per step (forward and
// backward). docs/cost_model.md, "Embedding tables", writes the formulas out.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "embedding_internal.h"
#include "monarch/planner/collectives.h"
#include "monarch/planner/embeddings.h"
#include "monarch/planner/errors.h"

namespace monarch::planner {

double embedding_optimizer_bytes_per_row(EmbeddingOptimizer o, int64_t dim) {
  switch (o) {
    case EmbeddingOptimizer::sgd: return 0;
    case EmbeddingOptimizer::rowwise_adagrad: return 4;  // one fp32 accumulator per row
    case EmbeddingOptimizer::adam: return 8.0 * static_cast<double>(dim);  // two fp32 moments
  }
  return 0;
}

namespace embedding_detail {

Link all_to_all_link(const Cluster& cluster, int64_t world) {
  if (!cluster.levels.empty()) return group_link(cluster, world, 1);  // the level all `world` ranks reach
  Link link;
  link.ranks = world;
  const bool one_node = world <= cluster.devices_per_node;
  link.inter_node = !one_node;
  link.level = one_node ? 0 : 1;
  link.bytes_per_s = one_node ? cluster.intra_node_bytes_per_s : cluster.inter_node_bytes_per_s;
  link.latency_s = one_node ? cluster.intra_node_latency_s : cluster.inter_node_latency_s;
  return link;
}

double comm_seconds(const RankBytes& r, const Cluster& cluster, int64_t world) {
  const Link link = all_to_all_link(cluster, world);
  // Links are full duplex: a rank's transfers take the larger of what it sends and receives.
  return std::max(r.sent, r.received) / link.bytes_per_s + r.latency_s;
}

double rank_seconds(const RankBytes& r, const Cluster& cluster, int64_t world) {
  return r.lookup_bytes / cluster.hbm_bytes_per_s + comm_seconds(r, cluster, world);
}

}  // namespace embedding_detail

using embedding_detail::RankBytes;
using embedding_detail::RankPattern;

namespace {

// The arithmetic of one table's per-rank bytes, split by where each term lands: a shard's own
// terms on its rank (`local`, then `comm`, each in shard order), and what every rank gets
// (`every_rank`, last). A rank's bytes are every_rank(comm(local({}))) over its shards.
class TableBytes {
 public:
  TableBytes(const EmbeddingTable& t, EmbeddingSharding sharding, const Cluster& cluster, const EmbeddingOptions& o)
      : t_(t), sharding_(sharding), o_(o), W_(o.world_size), B_(static_cast<double>(o.batch_per_rank)),
        G_(B_ * static_cast<double>(W_)), F_(static_cast<double>(t.features.size())), L_(t.pooling_factor),
        e_(t.bytes_per_element), pooled_(t.pooling != EmbeddingPooling::none),
        out_rows_per_sample_(F_ * (pooled_ ? 1.0 : L_)), ids_per_rank_(B_ * F_ * L_),
        input_per_rank_(ids_per_rank_ * kIdBytes + B_ * F_ * kLengthBytes), total_rows_(static_cast<double>(t.rows)),
        link_(embedding_detail::all_to_all_link(cluster, W_)) {}

  // The shard's storage and lookup traffic on its rank.
  void local(RankBytes& r, const EmbeddingShard& s) const {
    const double cols = static_cast<double>(s.cols);
    const double row_share = total_rows_ > 0 ? static_cast<double>(s.rows) / total_rows_ : 0.0;
    const double state = embedding_optimizer_bytes_per_row(o_.optimizer, s.cols);
    r.storage += static_cast<double>(s.rows) * (cols * e_ + state);
    // Ids this shard serves: its share of the rows (uniform ids) of the batch it serves:
    // the rank's own batch (data-parallel) or the whole global batch.
    const bool local_only = sharding_ == EmbeddingSharding::data_parallel;
    const double ids = (local_only ? ids_per_rank_ : G_ * F_ * L_) * (local_only ? 1.0 : row_share);
    const double outputs = (local_only ? B_ : G_) * out_rows_per_sample_;
    // Forward: read each id's row, write pooled rows. Backward: read output gradients,
    // read-modify-write each touched row and its optimizer state (a fused sparse update;
    // duplicates combined first, which only lowers this).
    // Column chunks under row-wise Adagrad handle whole rows of gradient (see below).
    const double grad_cols = sharding_ == EmbeddingSharding::column_wise &&
                                     o_.optimizer == EmbeddingOptimizer::rowwise_adagrad
                                 ? static_cast<double>(t_.dim)
                                 : cols;
    r.lookup_bytes += ids * cols * e_ + outputs * cols * e_                                     // forward
                      + outputs * grad_cols * 4 + ids * (2 * grad_cols * 4 + 2 * cols * e_ + 2 * state);  // backward
  }

  // The shard's all-to-all terms: what every rank but its owner sends it and gets back
  // (added to `all_sent`, `all_received` for every shard; none for data-parallel), and the
  // owner's side (`comm`).
  bool has_totals() const { return sharding_ != EmbeddingSharding::data_parallel; }
  std::pair<double, double> total_terms(const EmbeddingShard& s) const {
    switch (sharding_) {
      case EmbeddingSharding::data_parallel: return {0.0, 0.0};
      case EmbeddingSharding::table_wise:
      case EmbeddingSharding::column_wise: {
        const auto [back, grads] = owner_rows(s);
        return {input_per_rank_ + grads, back};  // ids forward, gradients backward; rows forward
      }
      case EmbeddingSharding::row_wise:
      case EmbeddingSharding::table_row_wise: {
        const auto [in, rows_back] = row_terms(s);
        return {in + rows_back, rows_back};
      }
    }
    return {0.0, 0.0};
  }
  void comm(RankBytes& r, const EmbeddingShard& s) const {
    const double others = static_cast<double>(W_ - 1);
    switch (sharding_) {
      case EmbeddingSharding::data_parallel: return;
      case EmbeddingSharding::table_wise:
      case EmbeddingSharding::column_wise: {
        // What every rank but the owner sends and receives is added to all ranks (every_rank),
        // and taken back from the owner: O(shards + ranks).
        const auto [back, grads] = owner_rows(s);
        r.sent -= input_per_rank_ + grads;
        r.received -= back;
        r.received += others * (input_per_rank_ + grads);
        r.sent += others * back;
        return;
      }
      case EmbeddingSharding::row_wise:
      case EmbeddingSharding::table_row_wise: {
        const auto [in, rows_back] = row_terms(s);
        r.sent += others * rows_back - (in + rows_back);
        r.received += others * (in + rows_back) - rows_back;
        return;
      }
    }
  }

  void every_rank(RankBytes& r, double all_sent, double all_received) const {
    if (sharding_ == EmbeddingSharding::data_parallel) {
      // Dense gradient all-reduce of the whole table (TorchRec's data-parallel tables).
      // Plus which rows any rank touched (one fp32 flag per row, a max all-reduce), so the
      // lazy optimizers update the same rows everywhere.
      const double grad = total_rows_ * static_cast<double>(t_.dim) * e_ + total_rows_ * 4;
      const double bytes = ring_bytes_per_rank(Collective::all_reduce, grad, W_);
      // The dense gradient is zeroed, reduced and read once per step: three passes over the
      // table, and the flags.
      r.lookup_bytes += 3 * total_rows_ * static_cast<double>(t_.dim) * 4 + 3 * total_rows_ * 4;
      r.storage += total_rows_ * (static_cast<double>(t_.dim) * 4 + 4);  // the dense gradient and flags
      r.sent += bytes;
      r.received += bytes;
      r.latency_s += W_ > 1 ? 4 * static_cast<double>(W_ - 1) * link_.latency_s : 0.0;
      return;
    }
    r.sent += all_sent;
    r.received += all_received;
  }

 private:
  static constexpr double kIdBytes = 8, kLengthBytes = 4;  // int64 ids, int32 lengths

  // Table- and column-wise: every rank sends its ids to each shard's owner, which sends each
  // rank its columns of the looked-up rows back (and receives their gradients in backward).
  // Column chunks under row-wise Adagrad get the whole row's gradient (the row's
  // accumulator is a mean over every column).
  std::pair<double, double> owner_rows(const EmbeddingShard& s) const {
    const bool whole_rows = sharding_ == EmbeddingSharding::column_wise &&
                            o_.optimizer == EmbeddingOptimizer::rowwise_adagrad;
    const double back = B_ * out_rows_per_sample_ * static_cast<double>(s.cols) * e_;
    const double grads = whole_rows ? B_ * out_rows_per_sample_ * static_cast<double>(t_.dim) * e_ : back;
    return {back, grads};
  }
  // Row splits: ids go to the rank owning their row (the rows' share); lengths go to every
  // owner. Sequence tables send each looked-up row back to its sample's rank. Pooled tables:
  // each owner holds partial sums for every sample, reduce-scattered to the batch's ranks
  // (Mudigere et al. 2022, Sec. 4): each owner sends each rank its samples' partial rows.
  // Table-row-wise does the same from the ranks of one node (the runtime has no intra-node
  // pre-reduction yet; docs/cost_model.md).
  std::pair<double, double> row_terms(const EmbeddingShard& s) const {
    const double share = total_rows_ > 0 ? static_cast<double>(s.rows) / total_rows_ : 0.0;
    const double cols = static_cast<double>(s.cols);
    const double in = ids_per_rank_ * share * kIdBytes + B_ * F_ * kLengthBytes;
    const double rows_back = pooled_ ? B_ * F_ * cols * e_ : ids_per_rank_ * share * cols * e_;
    return {in, rows_back};
  }

  const EmbeddingTable& t_;
  const EmbeddingSharding sharding_;
  const EmbeddingOptions& o_;
  const int64_t W_;
  const double B_, G_, F_, L_, e_;
  const bool pooled_;
  const double out_rows_per_sample_;  // rows each sample gets back
  const double ids_per_rank_, input_per_rank_, total_rows_;
  const Link link_;
};

// Where the runs cover more ranks than `rest`, the longest run's value becomes the rest (fewer
// ranks listed: a row split over every rank is one run and its last block).
void normalize(RankPattern& p, int64_t world) {
  int64_t covered = 0;
  size_t longest = p.runs.size();
  for (size_t i = 0; i < p.runs.size(); ++i) {
    const int64_t len = p.runs[i].hi - p.runs[i].lo;
    covered += len;
    if (longest == p.runs.size() || len > p.runs[longest].hi - p.runs[longest].lo) longest = i;
  }
  if (longest == p.runs.size() || p.runs[longest].hi - p.runs[longest].lo <= world - covered) return;
  std::vector<RankPattern::Run> runs;
  int64_t at = 0;
  for (size_t i = 0; i < p.runs.size(); ++i) {
    if (at < p.runs[i].lo) runs.push_back({at, p.runs[i].lo, p.rest});
    if (i != longest) runs.push_back(p.runs[i]);
    at = p.runs[i].hi;
  }
  if (at < world) runs.push_back({at, world, p.rest});
  p.rest = p.runs[longest].value;
  p.runs = std::move(runs);
}

// The pattern of the shards shard_at(0 .. n-1), as embedding_rank_bytes adds them up.
template <class ShardAt>
RankPattern build_pattern(const TableBytes& tb, int64_t world, int64_t n, const ShardAt& shard_at) {
  double all_sent = 0, all_received = 0;
  bool increasing = true;
  int64_t previous = -1;
  bool have = false;
  int64_t rows = 0, cols = 0;
  std::pair<double, double> terms;
  for (int64_t i = 0; i < n; ++i) {
    const EmbeddingShard s = shard_at(i);
    if (!have || s.rows != rows || s.cols != cols) {  // a run of one shape: its terms once
      terms = tb.total_terms(s);
      have = true;
      rows = s.rows;
      cols = s.cols;
    }
    if (tb.has_totals()) {  // shard by shard, in order
      all_sent += terms.first;
      all_received += terms.second;
    }
    increasing = increasing && s.rank > previous;
    previous = s.rank;
  }
  RankPattern p;
  tb.every_rank(p.rest, all_sent, all_received);
  auto push = [&](int64_t rank, const RankBytes& v) {
    if (!p.runs.empty() && p.runs.back().hi == rank && embedding_detail::same_bits(p.runs.back().value, v)) {
      ++p.runs.back().hi;
    } else {
      p.runs.push_back({rank, rank + 1, v});
    }
  };
  if (increasing) {
    // One shard per rank: shards of one shape give one value, computed once per run of them.
    have = false;
    RankBytes value;
    for (int64_t i = 0; i < n; ++i) {
      const EmbeddingShard s = shard_at(i);
      if (!have || s.rows != rows || s.cols != cols) {
        value = RankBytes{};
        tb.local(value, s);
        tb.comm(value, s);
        tb.every_rank(value, all_sent, all_received);
        have = true;
        rows = s.rows;
        cols = s.cols;
      }
      push(s.rank, value);
    }
  } else {
    // Several shards on a rank, or out of rank order: each rank's shards in their order.
    std::vector<int64_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return shard_at(a).rank < shard_at(b).rank; });
    for (size_t a = 0; a < order.size();) {
      const int64_t rank = shard_at(order[a]).rank;
      size_t b = a;
      while (b < order.size() && shard_at(order[b]).rank == rank) ++b;
      RankBytes value;
      for (size_t k = a; k < b; ++k) tb.local(value, shard_at(order[k]));
      for (size_t k = a; k < b; ++k) tb.comm(value, shard_at(order[k]));
      tb.every_rank(value, all_sent, all_received);
      push(rank, value);
      a = b;
    }
  }
  normalize(p, world);
  return p;
}

}  // namespace

RankPattern embedding_detail::embedding_rank_pattern(const EmbeddingTable& t, const EmbeddingPlacement& p,
                                                     const Cluster& cluster, const EmbeddingOptions& o) {
  const TableBytes tb(t, p.sharding, cluster, o);
  return build_pattern(tb, o.world_size, static_cast<int64_t>(p.shards.size()),
                       [&](int64_t i) -> const EmbeddingShard& { return p.shards[static_cast<size_t>(i)]; });
}

RankPattern embedding_detail::embedding_data_parallel_pattern(const EmbeddingTable& t, const Cluster& cluster,
                                                              const EmbeddingOptions& o) {
  // Every rank holds the whole table, and a data-parallel shard's bytes do not depend on the
  // others: every rank gets what the shard on rank 0 gives it.
  const TableBytes tb(t, EmbeddingSharding::data_parallel, cluster, o);
  const RankPattern one = build_pattern(tb, o.world_size, 1, [&](int64_t) { return EmbeddingShard{0, 0, t.rows, 0, t.dim}; });
  RankPattern p;
  p.rest = one.at(0);
  return p;
}

RankPattern embedding_detail::embedding_row_split_pattern(const EmbeddingTable& t, EmbeddingSharding sharding,
                                                          int64_t first, int64_t n, const Cluster& cluster,
                                                          const EmbeddingOptions& o) {
  const TableBytes tb(t, sharding, cluster, o);
  const int64_t block = (t.rows + n - 1) / n;  // block row sharding: rank i owns [i b, (i+1) b)
  const int64_t shards = std::min(n, (t.rows + block - 1) / block);
  return build_pattern(tb, o.world_size, shards, [&](int64_t i) {
    const int64_t begin = i * block, end = std::min(t.rows, begin + block);
    return EmbeddingShard{first + i, begin, end - begin, 0, t.dim};
  });
}

std::vector<RankBytes> embedding_detail::embedding_rank_bytes(const EmbeddingTable& t, const EmbeddingPlacement& p,
                                                              const Cluster& cluster, const EmbeddingOptions& o) {
  return embedding_rank_pattern(t, p, cluster, o).expand(o.world_size);
}

std::vector<EmbeddingRankLoad> embedding_placement_loads(const EmbeddingTable& table,
                                                         const EmbeddingPlacement& placement,
                                                         const Cluster& cluster,
                                                         const EmbeddingOptions& options) {
  const auto bytes = embedding_detail::embedding_rank_bytes(table, placement, cluster, options);
  std::vector<EmbeddingRankLoad> out(bytes.size());
  for (size_t r = 0; r < bytes.size(); ++r) {
    out[r].storage_bytes = bytes[r].storage;
    out[r].lookup_s = bytes[r].lookup_bytes / cluster.hbm_bytes_per_s;
    out[r].comm_s = embedding_detail::comm_seconds(bytes[r], cluster, options.world_size);
    out[r].sent_bytes = bytes[r].sent;
    out[r].received_bytes = bytes[r].received;
  }
  return out;
}

}  // namespace monarch::planner
