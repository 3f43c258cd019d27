#include <catch2/catch.hpp>

#include "monarch/planner/collectives.h"

using namespace monarch::planner;

TEST_CASE("ring volumes per rank", "[collectives]") {
  const double S = 1e9;
  CHECK(ring_bytes_per_rank(Collective::all_reduce, S, 8) == Approx(2.0 * 7 / 8 * S));
  CHECK(ring_bytes_per_rank(Collective::reduce_scatter, S, 8) == Approx(7.0 / 8 * S));
  CHECK(ring_bytes_per_rank(Collective::all_gather, S, 4) == Approx(3.0 / 4 * S));
  CHECK(ring_bytes_per_rank(Collective::all_reduce, S, 1) == 0);
  // reduce-scatter + all-gather = all-reduce (ZeRO's "same volume as DP" argument).
  CHECK(ring_bytes_per_rank(Collective::reduce_scatter, S, 16) + ring_bytes_per_rank(Collective::all_gather, S, 16) ==
        Approx(ring_bytes_per_rank(Collective::all_reduce, S, 16)));
}

TEST_CASE("alpha-beta time", "[collectives]") {
  Link link{4, 100e9, 1e-5, false};
  // 2(n-1) steps of latency + 2(n-1)/n S / B.
  CHECK(collective_seconds(Collective::all_reduce, 1e9, link) == Approx(6 * 1e-5 + 1.5e9 / 100e9));
  CHECK(collective_seconds(Collective::all_gather, 1e9, link) == Approx(3 * 1e-5 + 0.75e9 / 100e9));
  CHECK(collective_seconds(Collective::send_recv, 1e6, link) == Approx(1e-5 + 1e6 / 100e9));
  link.ranks = 1;
  CHECK(collective_seconds(Collective::all_reduce, 1e9, link) == 0);
}

TEST_CASE("axis links follow the rank order pp, dp, tp", "[collectives]") {
  const Cluster c = cluster_preset("a100-80gb", 64);  // 8 nodes x 8
  // tp=8 fills a node: tp intra, dp and pp cross nodes.
  CHECK_FALSE(axis_link(c, 2, 4, 8, Axis::tp).inter_node);
  CHECK(axis_link(c, 2, 4, 8, Axis::dp).inter_node);
  CHECK(axis_link(c, 2, 4, 8, Axis::pp).inter_node);
  CHECK(axis_link(c, 2, 4, 8, Axis::dp).bytes_per_s == c.inter_node_bytes_per_s);
  // tp=2, dp=4: a dp group spans 8 consecutive ranks = one node.
  CHECK_FALSE(axis_link(c, 8, 4, 2, Axis::dp).inter_node);
  CHECK(axis_link(c, 8, 4, 2, Axis::dp).bytes_per_s == c.intra_node_bytes_per_s);
  CHECK(axis_link(c, 8, 4, 2, Axis::dp).ranks == 4);
  // tp=2, dp=8: 16 ranks, two nodes.
  CHECK(axis_link(c, 4, 8, 2, Axis::dp).inter_node);
}
