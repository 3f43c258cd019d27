// Mixture-of-Experts costs under expert parallelism. Formulas and sources: moe_cost.h and
// docs/cost_model.md ("Experts").
#include "monarch/planner/moe_cost.h"

#include <algorithm>
#include <cmath>

#include "monarch/planner/collectives.h"
#include "monarch/planner/cost_model.h"

namespace monarch::planner {

MoeAllToAlls moe_all_to_alls(Recompute recompute) {
  MoeAllToAlls a;
  if (recompute == Recompute::full) a.recompute = 2;
  return a;
}

double moe_all_to_all_bytes(const Layer& layer, const TrainingConfig& training, const Layout& layout) {
  if (layer.moe.experts <= 0 || layout.ep <= 1) return 0.0;
  const double act_scale = training.activation_bytes / bytes_of(layer.param_dtype);
  const double ep = static_cast<double>(layout.ep);
  // Every tp rank routes all of its tokens (the runtime keeps experts whole per tp rank, no
  // expert tensor parallelism): the tokens are the micro-batch's share of this cp rank.
  const double tokens_share = static_cast<double>(layout.micro_batch_size) / static_cast<double>(layout.cp);
  return act_scale * layer.moe.dispatch_bytes_per_sample * tokens_share * (ep - 1.0) / ep *
         layer.moe.load_factor();
}

namespace {

// Group ranks per unit of the innermost level (the node, or the NVLink domain where the
// cluster's levels make it larger) of a group of `ranks` ranks `stride` apart (consecutive
// blocks of stride): all of them when the group fits in a unit, else those in one unit's span.
int64_t group_ranks_per_node(int64_t ranks, int64_t stride, const Cluster& cluster) {
  const int64_t dpn = innermost_level_devices(cluster);
  if (ranks * stride <= dpn && dpn % (ranks * stride) == 0) return ranks;
  if (stride <= dpn && dpn % stride == 0) return std::min(ranks, dpn / stride);
  return 1;
}

}  // namespace

double all_to_all_inter_node_bytes(double bytes_per_rank, int64_t ranks, int64_t stride, const Cluster& cluster) {
  if (ranks <= 1 || bytes_per_rank <= 0) return 0.0;
  const int64_t local = group_ranks_per_node(ranks, stride, cluster);
  return bytes_per_rank * static_cast<double>(ranks - local) / static_cast<double>(ranks - 1);
}

double all_to_all_seconds(double bytes_per_rank, int64_t ranks, int64_t stride, const Cluster& cluster) {
  if (ranks <= 1 || bytes_per_rank <= 0) return 0.0;
  const double inter = all_to_all_inter_node_bytes(bytes_per_rank, ranks, stride, cluster);
  const double intra = bytes_per_rank - inter;
  const double steps = static_cast<double>(ranks - 1);
  if (cluster.levels.empty()) {
    const double latency = inter > 0 ? cluster.inter_node_latency_s : cluster.intra_node_latency_s;
    return steps * latency + std::max(intra / cluster.intra_node_bytes_per_s, inter / cluster.inter_node_bytes_per_s);
  }
  // Levels: the bytes leaving the innermost unit run on the group's link (the slowest level it
  // crosses, group_link), those inside it on the innermost level.
  const Link inner = group_link(cluster, 1, 1);
  const Link group = group_link(cluster, ranks, stride);
  const double latency = inter > 0 ? group.latency_s : inner.latency_s;
  return steps * latency + std::max(intra / inner.bytes_per_s, inter / group.bytes_per_s);
}

double grouped_gemm_utilization(double m, double n, double k, double groups, int64_t sm_count) {
  // As gemm_utilization (NVIDIA's Matrix Multiplication Background User's Guide: tile and wave
  // quantization, split-K for few tiles), with the tiles of every group in one launch.
  if (sm_count <= 0 || m <= 0 || n <= 0 || k <= 0 || groups <= 0) return 1.0;
  constexpr double kTile = 128;
  const double sms = static_cast<double>(sm_count);
  const double tiles = groups * std::ceil(m / kTile) * std::ceil(n / kTile);
  const double split_k = std::max(1.0, std::min(std::floor(sms / tiles), std::ceil(k / 512.0)));
  const double waves = std::ceil(tiles * split_k / sms);
  return (groups * m * n * split_k / (kTile * kTile)) / (waves * sms);
}

}  // namespace monarch::planner
