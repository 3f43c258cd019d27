#include "monarch/planner/collectives.h"

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

Link axis_link(const Cluster& cluster, int64_t pp, int64_t dp, int64_t tp, Axis axis) {
  int64_t size = 1, stride = 1;
  switch (axis) {
    case Axis::tp: size = tp; stride = 1; break;
    case Axis::dp: size = dp; stride = tp; break;
    case Axis::pp: size = pp; stride = tp * dp; break;
  }
  Link link;
  link.ranks = size;
  const int64_t span = stride * size;  // ranks covered by one group, first to last + 1
  const bool one_node = span <= cluster.devices_per_node && cluster.devices_per_node % span == 0;
  link.inter_node = !one_node;
  link.bytes_per_s = one_node ? cluster.intra_node_bytes_per_s : cluster.inter_node_bytes_per_s;
  link.latency_s = one_node ? cluster.intra_node_latency_s : cluster.inter_node_latency_s;
  return link;
}

}  // namespace monarch::planner
