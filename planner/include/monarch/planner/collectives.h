#pragma once
// Alpha-beta cost of collectives over the cluster's link levels (two by default: intra-node /
// inter-node; Cluster::levels).
#include <cstdint>
#include <string>

#include "monarch/planner/cluster.h"
#include "monarch/planner/training_config.h"

namespace monarch::planner {

enum class Collective { all_reduce, reduce_scatter, all_gather, broadcast, send_recv };
std::string to_string(Collective c);

// The links one process group runs over.
struct Link {
  int64_t ranks = 1;
  double bytes_per_s = 1;
  double latency_s = 0;
  // Beyond the innermost level (the node; the NVLink domain where Cluster::levels make it
  // larger): the group's traffic goes over the network.
  bool inter_node = false;
  int level = 0;  // index into link_levels(cluster) of the outermost level the group crosses
};

// Bytes each rank sends for a ring collective on a buffer of `bytes` (the full, unsharded
// size): all-reduce 2(n-1)/n S, reduce-scatter and all-gather (n-1)/n S, broadcast S
// (pipelined), send/recv S. Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective
// Communication Operations in MPICH".
double ring_bytes_per_rank(Collective c, double bytes, int64_t ranks);

// alpha-beta time: steps * latency + ring_bytes_per_rank / bandwidth, with 2(n-1) steps for
// all-reduce, n-1 for reduce-scatter / all-gather / broadcast, 1 for send/recv. 0 when n == 1.
double collective_seconds(Collective c, double bytes, const Link& link);

// The link of a group of `ranks` ranks `stride` apart, the groups tiling the ranks in blocks
// of span = ranks x stride consecutive ranks. Its level is the innermost one whose units hold
// every such block (span <= unit and unit a multiple of span, or the whole cluster in one
// unit); the outermost level holds any. It runs at the slowest of the levels it crosses, up to
// that one: min over them of bytes_per_s / oversubscription, and the largest latency
// (docs/cost_model.md, "Link levels"). Two-level clusters: one node's span on the intra-node
// link, anything larger on the inter-node link.
Link group_link(const Cluster& cluster, int64_t ranks, int64_t stride);

// Mesh axes, outermost first in the default rank order {pp, dp, tp}.
enum class Axis { pp, dp, tp };

// The link of one axis's groups: ranks of a group are `stride` apart, where stride is the
// product of the sizes of the axes inside it (group_link). A group whose members all sit on
// one node (one unit of the innermost level) uses the intra-node level; otherwise the level
// it reaches (each device's share of its node's NICs, since every group of the axis
// communicates at once).
Link axis_link(const Cluster& cluster, int64_t pp, int64_t dp, int64_t tp, Axis axis);

// ---- Hierarchical (two-level) data-parallel collectives -----------------------------------
//
// A group of L x N ranks, L on each of N nodes, reduces in three steps (the 2D / hierarchical
// all-reduce of Jia et al. 2018, "Highly Scalable Deep Learning Training System with
// Mixed-Precision: Training ImageNet in Four Minutes", Sec. 3.3; NCCL's and Horovod's
// hierarchical all-reduce do the same):
//   1. reduce-scatter among the L ranks of a node (intra-node link), each keeps 1/L;
//   2. all-reduce of that 1/L shard among the N ranks with the same local index, one per node
//      (inter-node link);
//   3. all-gather among the L ranks of the node (intra-node link).
// Per rank, on a buffer of S bytes, ring volumes (ring_bytes_per_rank):
//   intra: 2 (L-1)/L S          inter: 2 (N-1)/N S/L
// With compression the inter-node step cannot sum on the wire: each rank all-gathers the
// N compressed shards and sums locally, sending (N-1) C(S/L), where C is the compressed size.
// A reduce-scatter is steps 1-2 (reduce-scatter intra of S, reduce-scatter inter of S/L), an
// all-gather the reverse (all-gather inter of S/L, all-gather intra of S): intra (L-1)/L S,
// inter (N-1)/N S/L. Compression applies to all-reduces only (gradients); ZeRO's
// reduce-scatter and all-gather run uncompressed.

// Values per fp32 scale of the int8 compression (the runtime's quantizer block).
inline constexpr int64_t kInt8CompressionBlock = 256;

// Bytes one value takes on the wire: none keeps the element width, bf16 2, int8 1 plus one
// fp32 scale per 256-value block (1 + 4/256); never more than the element itself.
double compressed_value_bytes(Compression c, double element_bytes);
// `bytes` of elements `element_bytes` wide, compressed.
double compressed_bytes(double bytes, Compression c, double element_bytes);

// Bytes one rank sends on each link level.
struct LevelBytes {
  double intra = 0, inter = 0;
  double total() const { return intra + inter; }
};

// The decomposition's per-rank bytes for collective `c` (all_reduce, reduce_scatter or
// all_gather; others fall back to one flat ring over the inter-node link) on a buffer of
// `bytes`, L = ranks_per_node, N = nodes, elements `element_bytes` wide.
LevelBytes hierarchical_bytes_per_rank(Collective c, double bytes, int64_t ranks_per_node,
                                       int64_t nodes, Compression compression,
                                       double element_bytes = 4);

// alpha-beta time of the decomposition: the steps' collective_seconds on `intra` (L ranks)
// and `inter` (N ranks), one after the other. The compressed all-reduce's inter step is an
// all-gather of N compressed shards (N-1 steps). ZeRO++'s (Wang et al. 2023): the
// reduce-scatter rounds its inter step only; the all-gather moves the rounded shards on
// both steps (the runtime's hierarchical_shard.h).
double hierarchical_seconds(Collective c, double bytes, const Link& intra, const Link& inter,
                            Compression compression, double element_bytes = 4);

// How one dp group sits on the nodes (hosts: the runtime's hierarchical engines group the
// ranks of a host, LOCAL_WORLD_SIZE). dp ranks are tp apart (rank = ((pp_i dp) + dp_i) tp +
// tp_i): a group spanning dp * tp consecutive ranks. On one node: ranks_per_node = dp,
// nodes = 1. Across nodes with tp dividing devices_per_node and dp a multiple of
// devices_per_node / tp: ranks_per_node = devices_per_node / tp, nodes = dp / that. Otherwise
// (tp spanning nodes, or groups that do not tile the nodes): ranks_per_node = 1, nodes = dp.
// Each hop runs on the level its group reaches (group_link): on NVL72 the hop between nodes
// stays on NVLink while the dp group is inside one rack.
struct NodeSplit {
  int64_t ranks_per_node = 1;  // L
  int64_t nodes = 1;           // N
  // The hierarchical reduction differs from the flat one only across nodes with L > 1.
  bool hierarchical_possible() const { return nodes > 1 && ranks_per_node > 1; }
};
NodeSplit dp_node_split(const Cluster& cluster, int64_t pp, int64_t dp, int64_t tp);

// How one dp group's collectives run, as the plan says: the flat ring on the axis's link, or
// the hierarchical decomposition on the intra-node (L ranks) and inter-node (N ranks) links.
struct DpGroup {
  Link flat;                   // axis_link(..., Axis::dp)
  NodeSplit split;
  Link intra, inter;           // the two hops' links (ranks L, N): group_link of each hop's group
  DpReduction reduction = DpReduction::flat;
  Compression compression = Compression::none;
  bool hierarchical() const { return reduction == DpReduction::hierarchical && split.hierarchical_possible(); }
  // Time of collective `c` on `bytes` (elements element_bytes wide).
  double seconds(Collective c, double bytes, double element_bytes) const;
  // Bytes one rank sends, per link level: the flat ring's all on its link.
  LevelBytes bytes_per_rank(Collective c, double bytes, double element_bytes) const;
  // ZeRO++'s backward re-gather of `bytes` of parameters: the secondary shards kept from the
  // forward gather (rounded as it crossed nodes), all-gathered inside the node only. Flat:
  // the plain all-gather.
  double node_gather_seconds(double bytes, double element_bytes) const;
  LevelBytes node_gather_bytes_per_rank(double bytes, double element_bytes) const;
};
DpGroup dp_group(const Cluster& cluster, int64_t pp, int64_t dp, int64_t tp,
                 DpReduction reduction = DpReduction::flat,
                 Compression compression = Compression::none);

}  // namespace monarch::planner
