#pragma once
// Alpha-beta cost of collectives over a two-level (intra-node / inter-node) network.
#include <cstdint>
#include <string>

#include "monarch/planner/cluster.h"

namespace monarch::planner {

enum class Collective { all_reduce, reduce_scatter, all_gather, broadcast, send_recv };
std::string to_string(Collective c);

// The links one process group runs over.
struct Link {
  int64_t ranks = 1;
  double bytes_per_s = 1;
  double latency_s = 0;
  bool inter_node = false;
};

// Bytes each rank sends for a ring collective on a buffer of `bytes` (the full, unsharded
// size): all-reduce 2(n-1)/n S, reduce-scatter and all-gather (n-1)/n S, broadcast S
// (pipelined), send/recv S. Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective
// Communication Operations in MPICH".
double ring_bytes_per_rank(Collective c, double bytes, int64_t ranks);

// alpha-beta time: steps * latency + ring_bytes_per_rank / bandwidth, with 2(n-1) steps for
// all-reduce, n-1 for reduce-scatter / all-gather / broadcast, 1 for send/recv. 0 when n == 1.
double collective_seconds(Collective c, double bytes, const Link& link);

// Mesh axes, outermost first in the default rank order {pp, dp, tp}.
enum class Axis { pp, dp, tp };

// The link of one axis's groups: ranks of a group are `stride` apart, where stride is the
// product of the sizes of the axes inside it. A group whose members all sit on one node
// uses the intra-node level; otherwise the inter-node level (each device's share of its
// node's NICs, since every group of the axis communicates at once).
Link axis_link(const Cluster& cluster, int64_t pp, int64_t dp, int64_t tp, Axis axis);

}  // namespace monarch::planner
