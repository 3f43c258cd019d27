#include "catch_compat.h"

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

// ---- Hierarchical dp reduction (collectives.h, "Hierarchical (two-level) data-parallel
// collectives") ----------------------------------------------------------------------------

TEST_CASE("compression sizes per value", "[collectives][hierarchical]") {
  // Relative to fp32: bf16 halves, int8 is a quarter plus one fp32 scale per 256 values.
  CHECK(compressed_value_bytes(Compression::none, 4) == 4);
  CHECK(compressed_value_bytes(Compression::bf16, 4) / 4 == 0.5);
  CHECK(compressed_value_bytes(Compression::int8, 4) / 4 == 0.25 + 1.0 / 256);
  CHECK(compressed_bytes(1024, Compression::int8, 4) == 256 + 4);  // 256 values, one scale
  // Never larger than the values themselves: bf16 gradients gain nothing from bf16.
  CHECK(compressed_value_bytes(Compression::bf16, 2) == 2);
  CHECK(compressed_value_bytes(Compression::int8, 2) == 1.015625);
}

TEST_CASE("hierarchical all-reduce bytes: 2 nodes x 2 ranks", "[collectives][hierarchical]") {
  const double S = 1e9;
  // Reduce-scatter + all-gather inside the node: (L-1)/L S each; the fp32 shard S/2 all-reduced
  // across the 2 nodes: 2 (N-1)/N S/2 = S/2.
  const LevelBytes h = hierarchical_bytes_per_rank(Collective::all_reduce, S, 2, 2, Compression::none, 4);
  CHECK(h.intra == S);
  CHECK(h.inter == S / 2);
  // The flat ring over the 4 ranks: 2 (3/4) S = 1.5 S per rank, all of it limited by the
  // inter-node hop.
  CHECK(ring_bytes_per_rank(Collective::all_reduce, S, 4) == 1.5 * S);
  // Compressed: an all-gather of the 2 compressed shards, (N-1) C(S/2).
  CHECK(hierarchical_bytes_per_rank(Collective::all_reduce, S, 2, 2, Compression::bf16, 4).inter == S / 4);
  CHECK(hierarchical_bytes_per_rank(Collective::all_reduce, S, 2, 2, Compression::int8, 4).inter ==
        Approx(S / 2 * (0.25 + 1.0 / 256)).epsilon(1e-15));
  CHECK(hierarchical_bytes_per_rank(Collective::all_reduce, S, 2, 2, Compression::int8, 4).intra == S);
  // ZeRO's reduce-scatter and all-gather: (L-1)/L S inside, (N-1)/N S/L across.
  for (Collective c : {Collective::reduce_scatter, Collective::all_gather}) {
    const LevelBytes z = hierarchical_bytes_per_rank(c, S, 2, 2, Compression::none, 4);
    CHECK(z.intra == S / 2);
    CHECK(z.inter == S / 4);
  }
  // ZeRO++ with int8 (1 byte + one fp32 scale per 256 values, from fp32): the reduce-scatter
  // rounds only what crosses nodes; the all-gather moves the rounded shards on both hops.
  const double c = 0.25 + 1.0 / 256;
  const LevelBytes rs = hierarchical_bytes_per_rank(Collective::reduce_scatter, S, 2, 2, Compression::int8, 4);
  CHECK(rs.intra == S / 2);
  CHECK(rs.inter == Approx(S / 4 * c).epsilon(1e-15));
  const LevelBytes ag = hierarchical_bytes_per_rank(Collective::all_gather, S, 2, 2, Compression::int8, 4);
  CHECK(ag.intra == Approx(S / 2 * c).epsilon(1e-15));
  CHECK(ag.inter == Approx(S / 4 * c).epsilon(1e-15));
}

TEST_CASE("compression loses to the plain ring across many nodes", "[collectives][hierarchical]") {
  // Uncompressed the shard's all-reduce sends 2 (N-1)/N S/L; compressed all-gathers send
  // (N-1) C(S/L), which grows with N: int8 wins below N ~ 7.9, bf16 (from fp32) below 4.
  const double S = 1e9;
  auto inter = [&](int64_t nodes, Compression c) {
    return hierarchical_bytes_per_rank(Collective::all_reduce, S, 8, nodes, c, 4).inter;
  };
  CHECK(inter(4, Compression::int8) < inter(4, Compression::none));
  CHECK(inter(16, Compression::int8) > inter(16, Compression::none));
  CHECK(inter(2, Compression::bf16) < inter(2, Compression::none));
  CHECK(inter(8, Compression::bf16) > inter(8, Compression::none));
}

TEST_CASE("hierarchical all-reduce time", "[collectives][hierarchical]") {
  const Link intra{2, 200e9, 1e-6, false}, inter{2, 25e9, 1e-5, true};
  const double S = 1e9;
  // Intra reduce-scatter and all-gather: 1 step and S/2 each; inter all-reduce of S/2: 2 steps, S/2.
  const double within = 1e-6 + 0.5e9 / 200e9;
  CHECK(hierarchical_seconds(Collective::all_reduce, S, intra, inter, Compression::none, 4) ==
        Approx(2 * within + 2e-5 + 0.5e9 / 25e9).epsilon(1e-12));
  // bf16: all-gather of 2 x 0.25e9 compressed bytes: 1 step, 0.25e9 sent.
  CHECK(hierarchical_seconds(Collective::all_reduce, S, intra, inter, Compression::bf16, 4) ==
        Approx(2 * within + 1e-5 + 0.25e9 / 25e9).epsilon(1e-12));
  // ZeRO++'s reduce-scatter: S/2 inside at fp32, then S/4 across, in bf16 S/8.
  CHECK(hierarchical_seconds(Collective::reduce_scatter, S, intra, inter, Compression::bf16, 4) ==
        Approx(within + 1e-5 + 0.125e9 / 25e9).epsilon(1e-12));
  // Its all-gather in bf16: the S/4 shard across as S/8, then S/2 inside as S/4.
  CHECK(hierarchical_seconds(Collective::all_gather, S, intra, inter, Compression::bf16, 4) ==
        Approx(1e-6 + 0.25e9 / 200e9 + 1e-5 + 0.125e9 / 25e9).epsilon(1e-12));
  // Against the flat ring over the 4 ranks on the inter-node link: 6 steps, 1.5 S.
  const Link flat{4, 25e9, 1e-5, true};
  CHECK(collective_seconds(Collective::all_reduce, S, flat) == Approx(6e-5 + 1.5e9 / 25e9));
  CHECK(hierarchical_seconds(Collective::all_reduce, S, intra, inter, Compression::none, 4) <
        collective_seconds(Collective::all_reduce, S, flat) / 2);  // 2.4x faster
  CHECK(hierarchical_seconds(Collective::all_reduce, 0, intra, inter, Compression::none, 4) == 0);
}

TEST_CASE("a dp group's split over the nodes", "[collectives][hierarchical]") {
  const Cluster c = cluster_preset("a100-80gb", 64);  // 8 nodes x 8
  // dp ranks are tp apart: tp=2 leaves 4 dp ranks per node.
  NodeSplit s = dp_node_split(c, 2, 16, 2);
  CHECK(s.ranks_per_node == 4);
  CHECK(s.nodes == 4);
  CHECK(s.hierarchical_possible());
  // tp=8 fills the node: one dp rank per node, nothing to reduce inside it.
  s = dp_node_split(c, 1, 8, 8);
  CHECK(s.ranks_per_node == 1);
  CHECK(s.nodes == 8);
  CHECK_FALSE(s.hierarchical_possible());
  // A dp group inside one node.
  s = dp_node_split(c, 8, 4, 2);
  CHECK(s.ranks_per_node == 4);
  CHECK(s.nodes == 1);
  CHECK_FALSE(s.hierarchical_possible());
  s = dp_node_split(c, 1, 64, 1);
  CHECK(s.ranks_per_node == 8);
  CHECK(s.nodes == 8);

  // DpGroup: flat unless asked for and possible; bytes per level.
  const DpGroup flat = dp_group(c, 1, 64, 1);
  const DpGroup hier = dp_group(c, 1, 64, 1, DpReduction::hierarchical, Compression::none);
  CHECK_FALSE(flat.hierarchical());
  CHECK(hier.hierarchical());
  CHECK(hier.intra.ranks == 8);
  CHECK(hier.inter.ranks == 8);
  CHECK(hier.inter.bytes_per_s == c.inter_node_bytes_per_s);
  CHECK(hier.intra.bytes_per_s == c.intra_node_bytes_per_s);
  const LevelBytes fb = flat.bytes_per_rank(Collective::all_reduce, 1e9, 2);
  CHECK(fb.intra == 0);
  CHECK(fb.inter == ring_bytes_per_rank(Collective::all_reduce, 1e9, 64));
  const LevelBytes hb = hier.bytes_per_rank(Collective::all_reduce, 1e9, 2);
  CHECK(hb.intra == Approx(2.0 * 7 / 8 * 1e9));
  CHECK(hb.inter == Approx(2.0 * 7 / 8 * 1e9 / 8));
  CHECK(hier.seconds(Collective::all_reduce, 1e9, 2) < flat.seconds(Collective::all_reduce, 1e9, 2));
  // Asked for where impossible (tp=8: one dp rank per node): the flat ring.
  const DpGroup impossible = dp_group(c, 1, 8, 8, DpReduction::hierarchical, Compression::int8);
  CHECK_FALSE(impossible.hierarchical());
  CHECK(impossible.seconds(Collective::all_reduce, 1e9, 2) ==
        collective_seconds(Collective::all_reduce, 1e9, axis_link(c, 1, 8, 8, Axis::dp)));
}
