#include "monarch/planner/collectives.h"

#include <algorithm>

namespace monarch::planner {

std::string to_string(Collective c) {
  switch (c) {
    case Collective::all_reduce: return "all_reduce";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_gather: return "all_gather";
    case Collective::broadcast: return "broadcast";
    case Collective::send_recv: return "send_recv";
  }
  return "?";
}

double ring_bytes_per_rank(Collective c, double bytes, int64_t ranks) {
  if (ranks <= 1) return 0;
  const double n = static_cast<double>(ranks);
  switch (c) {
    case Collective::all_reduce: return 2 * (n - 1) / n * bytes;
    case Collective::reduce_scatter:
    case Collective::all_gather: return (n - 1) / n * bytes;
    case Collective::broadcast:
    case Collective::send_recv: return bytes;
  }
  return 0;
}

namespace {
double ring_steps(Collective c, int64_t ranks) {
  const double n = static_cast<double>(ranks);
  switch (c) {
    case Collective::all_reduce: return 2 * (n - 1);
    case Collective::reduce_scatter:
    case Collective::all_gather:
    case Collective::broadcast: return n - 1;
    case Collective::send_recv: return 1;
  }
  return 0;
}
}  // namespace

double collective_seconds(Collective c, double bytes, const Link& link) {
  if (link.ranks <= 1 || bytes <= 0) return 0;
  return ring_steps(c, link.ranks) * link.latency_s +
         ring_bytes_per_rank(c, bytes, link.ranks) / link.bytes_per_s;
}

Link group_link(const Cluster& cluster, int64_t ranks, int64_t stride) {
  Link link;
  link.ranks = ranks;
  const int64_t span = stride * ranks;  // ranks covered by one group, first to last + 1
  if (cluster.levels.empty()) {         // the two default levels
    const bool one_node = span <= cluster.devices_per_node && cluster.devices_per_node % span == 0;
    link.inter_node = !one_node;
    link.level = one_node ? 0 : 1;
    link.bytes_per_s = one_node ? cluster.intra_node_bytes_per_s : cluster.inter_node_bytes_per_s;
    link.latency_s = one_node ? cluster.intra_node_latency_s : cluster.inter_node_latency_s;
    return link;
  }
  // Levels crossed up to the first whose units hold the group: the slowest bandwidth (after
  // oversubscription) and the largest latency among them.
  const int64_t world = cluster.world_size();
  const size_t n = cluster.levels.size();
  double bytes_per_s = 0, latency_s = 0;
  for (size_t k = 0; k < n; ++k) {
    const LinkLevel& l = cluster.levels[k];
    const double bw = l.bytes_per_s / l.oversubscription;
    bytes_per_s = k == 0 ? bw : std::min(bytes_per_s, bw);
    latency_s = std::max(latency_s, l.latency_s);
    const bool holds = l.devices <= 0 || world <= l.devices || (span <= l.devices && l.devices % span == 0);
    if (holds || k + 1 == n) {
      link.level = static_cast<int>(k);
      break;
    }
  }
  link.inter_node = link.level > 0;
  link.bytes_per_s = bytes_per_s;
  link.latency_s = latency_s;
  return link;
}

Link axis_link(const Cluster& cluster, int64_t pp, int64_t dp, int64_t tp, Axis axis) {
  switch (axis) {
    case Axis::tp: return group_link(cluster, tp, 1);
    case Axis::dp: return group_link(cluster, dp, tp);
    case Axis::pp: return group_link(cluster, pp, tp * dp);
  }
  return group_link(cluster, 1, 1);
}

double compressed_value_bytes(Compression c, double element_bytes) {
  switch (c) {
    case Compression::none: return element_bytes;
    case Compression::bf16: return std::min(element_bytes, 2.0);
    case Compression::int8: return std::min(element_bytes, 1.0 + 4.0 / static_cast<double>(kInt8CompressionBlock));
  }
  return element_bytes;
}

double compressed_bytes(double bytes, Compression c, double element_bytes) {
  if (element_bytes <= 0) return bytes;
  return bytes / element_bytes * compressed_value_bytes(c, element_bytes);
}

LevelBytes hierarchical_bytes_per_rank(Collective c, double bytes, int64_t ranks_per_node,
                                       int64_t nodes, Compression compression,
                                       double element_bytes) {
  LevelBytes b;
  const int64_t L = std::max<int64_t>(ranks_per_node, 1), N = std::max<int64_t>(nodes, 1);
  const double shard = bytes / static_cast<double>(L);
  switch (c) {
    case Collective::all_reduce:
      b.intra = ring_bytes_per_rank(Collective::reduce_scatter, bytes, L) +
                ring_bytes_per_rank(Collective::all_gather, bytes, L);
      if (compression == Compression::none) {
        b.inter = ring_bytes_per_rank(Collective::all_reduce, shard, N);
      } else {  // all-gather of the N compressed shards: (N-1) C(S/L)
        const double compressed = compressed_bytes(shard, compression, element_bytes);
        b.inter = ring_bytes_per_rank(Collective::all_gather, compressed * static_cast<double>(N), N);
      }
      break;
    // ZeRO++ (hierarchical_shard.h): the reduce-scatter rounds only what crosses nodes; the
    // gather rounds each shard once and moves the rounded shards on both hops.
    case Collective::reduce_scatter:
      b.intra = ring_bytes_per_rank(c, bytes, L);
      b.inter = ring_bytes_per_rank(c, compressed_bytes(shard, compression, element_bytes), N);
      break;
    case Collective::all_gather: {
      const double wire = compressed_bytes(bytes, compression, element_bytes);
      b.intra = ring_bytes_per_rank(c, wire, L);
      b.inter = ring_bytes_per_rank(c, wire / static_cast<double>(L), N);
      break;
    }
    case Collective::broadcast:
    case Collective::send_recv:
      b.inter = ring_bytes_per_rank(c, bytes, L * N);
      break;
  }
  return b;
}

double hierarchical_seconds(Collective c, double bytes, const Link& intra, const Link& inter,
                            Compression compression, double element_bytes) {
  if (bytes <= 0) return 0;
  const double shard = bytes / static_cast<double>(std::max<int64_t>(intra.ranks, 1));
  switch (c) {
    case Collective::all_reduce: {
      double across = 0;
      if (compression == Compression::none) {
        across = collective_seconds(Collective::all_reduce, shard, inter);
      } else {
        const double compressed = compressed_bytes(shard, compression, element_bytes);
        across = collective_seconds(Collective::all_gather, compressed * static_cast<double>(inter.ranks), inter);
      }
      return collective_seconds(Collective::reduce_scatter, bytes, intra) + across +
             collective_seconds(Collective::all_gather, bytes, intra);
    }
    case Collective::reduce_scatter:
      return collective_seconds(c, bytes, intra) +
             collective_seconds(c, compressed_bytes(shard, compression, element_bytes), inter);
    case Collective::all_gather: {
      const double wire = compressed_bytes(bytes, compression, element_bytes);
      return collective_seconds(c, wire / static_cast<double>(std::max<int64_t>(intra.ranks, 1)), inter) +
             collective_seconds(c, wire, intra);
    }
    case Collective::broadcast:
    case Collective::send_recv: {
      Link flat = inter;
      flat.ranks = intra.ranks * inter.ranks;
      return collective_seconds(c, bytes, flat);
    }
  }
  return 0;
}

NodeSplit dp_node_split(const Cluster& cluster, int64_t pp, int64_t dp, int64_t tp) {
  NodeSplit s;
  const int64_t per_node = cluster.devices_per_node;
  if (dp <= 1) return s;
  const int64_t span = dp * tp;
  if (span <= per_node && per_node % span == 0) {  // the group is on one node
    s.ranks_per_node = dp;
    return s;
  }
  if (tp >= 1 && per_node % tp == 0 && dp % (per_node / tp) == 0) {
    s.ranks_per_node = per_node / tp;
    s.nodes = dp / s.ranks_per_node;
    return s;
  }
  s.nodes = dp;  // tp spans nodes, or the groups do not tile the nodes: every rank on its own
  return s;
}

namespace {
// A hop between nodes that stays inside the innermost level (NVLink across an NVL72 rack's
// trays) is not network traffic.
LevelBytes on_links(LevelBytes b, const Link& inter) {
  if (!inter.inter_node) {
    b.intra += b.inter;
    b.inter = 0;
  }
  return b;
}
}  // namespace

double DpGroup::seconds(Collective c, double bytes, double element_bytes) const {
  if (!hierarchical()) return collective_seconds(c, bytes, flat);
  return hierarchical_seconds(c, bytes, intra, inter, compression, element_bytes);
}

double DpGroup::node_gather_seconds(double bytes, double element_bytes) const {
  if (!hierarchical()) return seconds(Collective::all_gather, bytes, element_bytes);
  return collective_seconds(Collective::all_gather, compressed_bytes(bytes, compression, element_bytes), intra);
}

LevelBytes DpGroup::node_gather_bytes_per_rank(double bytes, double element_bytes) const {
  if (!hierarchical()) return bytes_per_rank(Collective::all_gather, bytes, element_bytes);
  LevelBytes b;
  b.intra = ring_bytes_per_rank(Collective::all_gather, compressed_bytes(bytes, compression, element_bytes),
                                split.ranks_per_node);
  return b;
}

LevelBytes DpGroup::bytes_per_rank(Collective c, double bytes, double element_bytes) const {
  if (hierarchical()) {
    return on_links(hierarchical_bytes_per_rank(c, bytes, split.ranks_per_node, split.nodes, compression,
                                                element_bytes),
                    inter);
  }
  LevelBytes b;
  (flat.inter_node ? b.inter : b.intra) = ring_bytes_per_rank(c, bytes, flat.ranks);
  return b;
}

DpGroup dp_group(const Cluster& cluster, int64_t pp, int64_t dp, int64_t tp,
                 DpReduction reduction, Compression compression) {
  DpGroup g;
  g.flat = axis_link(cluster, pp, dp, tp, Axis::dp);
  g.split = dp_node_split(cluster, pp, dp, tp);
  g.reduction = reduction;
  g.compression = compression;
  if (cluster.levels.empty()) {  // two levels: the node's ranks, then one rank per node
    g.intra.ranks = g.split.ranks_per_node;
    g.intra.bytes_per_s = cluster.intra_node_bytes_per_s;
    g.intra.latency_s = cluster.intra_node_latency_s;
    g.intra.inter_node = false;
    g.inter.ranks = g.split.nodes;
    g.inter.bytes_per_s = cluster.inter_node_bytes_per_s;
    g.inter.latency_s = cluster.inter_node_latency_s;
    g.inter.inter_node = true;
    g.inter.level = 1;
    return g;
  }
  // The L ranks of a node are tp apart; the N ranks with one local index are L tp apart.
  const int64_t stride = std::max<int64_t>(tp, 1);
  g.intra = group_link(cluster, g.split.ranks_per_node, stride);
  g.inter = group_link(cluster, g.split.nodes, stride * g.split.ranks_per_node);
  return g;
}

}  // namespace monarch::planner
