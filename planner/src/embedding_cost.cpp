// Costs of one embedding table under one placement, per rank and per step (forward and
// backward). docs/cost_model.md, "Embedding tables", writes the formulas out.
#include <algorithm>
#include <cmath>

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
  Link link;
  link.ranks = world;
  const bool one_node = world <= cluster.devices_per_node;
  link.inter_node = !one_node;
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

std::vector<RankBytes> embedding_detail::embedding_rank_bytes(const EmbeddingTable& t, const EmbeddingPlacement& p,
                                            const Cluster& cluster, const EmbeddingOptions& o) {
  const int64_t W = o.world_size;
  std::vector<RankBytes> out(W);
  const double B = static_cast<double>(o.batch_per_rank);
  const double G = B * static_cast<double>(W);
  const double F = static_cast<double>(t.features.size());
  const double L = t.pooling_factor;
  const double e = t.bytes_per_element;
  const bool pooled = t.pooling != EmbeddingPooling::none;
  const double out_rows_per_sample = F * (pooled ? 1.0 : L);  // rows each sample gets back
  constexpr double kIdBytes = 8, kLengthBytes = 4;            // int64 ids, int32 lengths
  const double ids_per_rank = B * F * L;
  const double input_per_rank = ids_per_rank * kIdBytes + B * F * kLengthBytes;
  const double total_rows = static_cast<double>(t.rows);

  for (const EmbeddingShard& s : p.shards) {
    RankBytes& r = out[s.rank];
    const double cols = static_cast<double>(s.cols);
    const double row_share = total_rows > 0 ? static_cast<double>(s.rows) / total_rows : 0.0;
    const double state = embedding_optimizer_bytes_per_row(o.optimizer, s.cols);
    r.storage += static_cast<double>(s.rows) * (cols * e + state);
    // Ids this shard serves: its share of the rows (uniform ids) of the batch it serves:
    // the rank's own batch (data-parallel) or the whole global batch.
    const bool local_only = p.sharding == EmbeddingSharding::data_parallel;
    const double ids = (local_only ? ids_per_rank : G * F * L) * (local_only ? 1.0 : row_share);
    const double outputs = (local_only ? B : G) * out_rows_per_sample;
    // Forward: read each id's row, write pooled rows. Backward: read output gradients,
    // read-modify-write each touched row and its optimizer state (a fused sparse update;
    // duplicates combined first, which only lowers this).
    // Column chunks under row-wise Adagrad handle whole rows of gradient (see below).
    const double grad_cols = p.sharding == EmbeddingSharding::column_wise &&
                                     o.optimizer == EmbeddingOptimizer::rowwise_adagrad
                                 ? static_cast<double>(t.dim)
                                 : cols;
    r.lookup_bytes += ids * cols * e + outputs * cols * e                                     // forward
                      + outputs * grad_cols * 4 + ids * (2 * grad_cols * 4 + 2 * cols * e + 2 * state);  // backward
  }

  const Link link = all_to_all_link(cluster, W);
  switch (p.sharding) {
    case EmbeddingSharding::data_parallel: {
      // Dense gradient all-reduce of the whole table (TorchRec's data-parallel tables).
      // Plus which rows any rank touched (one fp32 flag per row, a max all-reduce), so the
      // lazy optimizers update the same rows everywhere.
      const double grad = total_rows * static_cast<double>(t.dim) * e + total_rows * 4;
      const double bytes = ring_bytes_per_rank(Collective::all_reduce, grad, W);
      for (auto& r : out) {
        // The dense gradient is zeroed, reduced and read once per step: three passes over the
        // table, and the flags.
        r.lookup_bytes += 3 * total_rows * static_cast<double>(t.dim) * 4 + 3 * total_rows * 4;
        r.storage += total_rows * (static_cast<double>(t.dim) * 4 + 4);  // the dense gradient and flags
        r.sent += bytes;
        r.received += bytes;
        r.latency_s += W > 1 ? 4 * static_cast<double>(W - 1) * link.latency_s : 0.0;
      }
      break;
    }
    case EmbeddingSharding::table_wise:
    case EmbeddingSharding::column_wise: {
      // Every rank sends its ids to each shard's owner, which sends each rank its columns of
      // the looked-up rows back (and receives their gradients in backward).
      // Column chunks under row-wise Adagrad get the whole row's gradient (the row's
      // accumulator is a mean over every column).
      const bool whole_rows = p.sharding == EmbeddingSharding::column_wise &&
                              o.optimizer == EmbeddingOptimizer::rowwise_adagrad;
      // What every rank but a shard's owner sends and receives is added once for all ranks,
      // and taken back from the owner: O(shards + ranks).
      double all_sent = 0, all_received = 0;
      for (const EmbeddingShard& s : p.shards) {
        const double back = B * out_rows_per_sample * static_cast<double>(s.cols) * e;
        const double grads = whole_rows ? B * out_rows_per_sample * static_cast<double>(t.dim) * e : back;
        all_sent += input_per_rank + grads;  // ids forward, gradients backward
        all_received += back;                // rows forward
        out[s.rank].sent -= input_per_rank + grads;
        out[s.rank].received -= back;
        const double others = static_cast<double>(W - 1);
        out[s.rank].received += others * (input_per_rank + grads);
        out[s.rank].sent += others * back;
      }
      for (auto& r : out) {
        r.sent += all_sent;
        r.received += all_received;
      }
      break;
    }
    case EmbeddingSharding::row_wise:
    case EmbeddingSharding::table_row_wise: {
      // Ids go to the rank owning their row (the rows' share); lengths go to every owner.
      // Sequence tables send each looked-up row back to its sample's rank. Pooled tables: each
      // owner holds partial sums for every sample, reduce-scattered to the batch's ranks
      // (Mudigere et al. 2022, Sec. 4): each owner sends each rank its samples' partial rows.
      // Table-row-wise does the same from the ranks of one node (the runtime has no
      // intra-node pre-reduction yet; docs/cost_model.md).
      double all_sent = 0, all_received = 0;
      const double others = static_cast<double>(W - 1);
      for (const EmbeddingShard& s : p.shards) {
        const double share = total_rows > 0 ? static_cast<double>(s.rows) / total_rows : 0.0;
        const double cols = static_cast<double>(s.cols);
        const double in = ids_per_rank * share * kIdBytes + B * F * kLengthBytes;
        const double rows_back = pooled ? B * F * cols * e : ids_per_rank * share * cols * e;
        all_sent += in + rows_back;
        all_received += rows_back;
        out[s.rank].sent += others * rows_back - (in + rows_back);
        out[s.rank].received += others * (in + rows_back) - rows_back;
      }
      for (auto& r : out) {
        r.sent += all_sent;
        r.received += all_received;
      }
      break;
    }
  }
  return out;
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
