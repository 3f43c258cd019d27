// Link levels (Cluster::levels, collectives.h group_link; docs/cost_model.md, "Link levels"):
// the representation and its two-level default, the costing rule (a group runs at the slowest
// level it crosses, bandwidth divided by that level's oversubscription), and what it changes
// in the search: tp across the compute trays of a GB200 NVL72 rack (inside its 72-GPU NVLink
// domain), and a 2:1 oversubscribed spine that moves the data-parallel group into a leaf. The
// numbers below are worked out by hand in the comments.
#include "catch_compat.h"

#include "monarch/planner/cluster.h"
#include "monarch/planner/collectives.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/moe_cost.h"
#include "monarch/planner/plan.h"
#include "monarch/planner/search.h"
#include "test_configs.h"

using namespace monarch::planner;

namespace {

// Nodes of 8 on NVLink (360 GB/s, 5 us), leaves of 64 devices (8 nodes) at 45 GB/s and 10 us,
// a spine at 45 GB/s and 20 us with a 2:1 taper.
Cluster three_levels(int64_t devices) {
  Cluster c = cluster_preset("h100-80gb", devices);
  set_levels(c, {{"nvlink", 8, 360e9, 5e-6, 1}, {"leaf", 64, 45e9, 1e-5, 1}, {"spine", 0, 45e9, 2e-5, 2}});
  return c;
}

}  // namespace

TEST_CASE("levels: the two-level fields are the default representation", "[cluster][levels]") {
  const Cluster two = cluster_preset("h100-80gb", 64);
  CHECK(two.levels.empty());
  const auto implied = link_levels(two);
  REQUIRE(implied.size() == 2);
  CHECK(implied[0] == LinkLevel{"node", 8, 360e9, 5e-6, 1});
  CHECK(implied[1] == LinkLevel{"network", 0, 45e9, 1e-5, 1});
  CHECK(innermost_level_devices(two) == 8);

  // set_levels keeps the two-level fields equal to the first two levels; validate checks it.
  Cluster c = three_levels(128);
  CHECK(c.intra_node_bytes_per_s == 360e9);
  CHECK(c.inter_node_bytes_per_s == 45e9);
  CHECK(c.inter_node_latency_s == 1e-5);
  CHECK_NOTHROW(validate(c));
  Cluster edited = c;
  edited.inter_node_bytes_per_s = 40e9;  // not through the levels
  CHECK_THROWS_WITH(validate(edited), Catch::Contains("cluster.inter_node_bytes_per_s"));

  const auto refused = [&](std::vector<LinkLevel> levels, const char* field) {
    Cluster bad = c;
    set_levels(bad, std::move(levels));
    CHECK_THROWS_WITH(validate(bad), Catch::Contains(field));
  };
  refused({{"nvlink", 8, 360e9, 5e-6, 1}}, "cluster.levels");                                      // one level
  refused({{"nvlink", 8, 360e9, 5e-6, 1}, {"net", 64, 45e9, 1e-5, 1}}, "levels[1].devices");      // last not 0
  refused({{"nvlink", 8, 360e9, 5e-6, 1}, {"leaf", 12, 45e9, 1e-5, 1}, {"spine", 0, 45e9, 1e-5, 1}},
          "levels[1].devices");                                                                   // 12 % 8
  refused({{"nvlink", 8, 360e9, 5e-6, 1}, {"net", 0, 45e9, 1e-5, 0.5}}, "levels[1].oversubscription");
  refused({{"nvlink", 8, 360e9, 5e-6, 1}, {"leaf", 64, 45e9, 1e-5, 1}, {"spine", 0, 0, 1e-5, 1}},
          "levels[2].bytes_per_s");
}

// A group runs on the innermost level whose units hold it and at the slowest level it crosses
// up to there: min(bytes_per_s / oversubscription), max(latency).
//   tp=8 (ranks 0-7):            nvlink, 360 GB/s, 5 us
//   dp=8 of stride 8 (span 64):  leaf, min(360, 45) = 45 GB/s, 10 us
//   pp=2 of stride 64 (span 128): spine, min(360, 45, 45 / 2) = 22.5 GB/s, 20 us
// An all-reduce of 1 GB over the 2 pp ranks: 2 (n-1) = 2 steps x 20 us + 2 (1/2) 1 GB / 22.5
// GB/s = 40 us + 44.44 ms (Thakur et al. 2005's ring, collectives.h).
TEST_CASE("levels: a group is costed on the slowest level it crosses", "[collectives][levels]") {
  const Cluster c = three_levels(128);
  const Link tp = axis_link(c, 2, 8, 8, Axis::tp);
  CHECK(tp.level == 0);
  CHECK_FALSE(tp.inter_node);
  CHECK(tp.bytes_per_s == 360e9);
  const Link dp = axis_link(c, 2, 8, 8, Axis::dp);
  CHECK(dp.level == 1);
  CHECK(dp.inter_node);
  CHECK(dp.bytes_per_s == 45e9);
  CHECK(dp.latency_s == 1e-5);
  const Link pp = axis_link(c, 2, 8, 8, Axis::pp);
  CHECK(pp.level == 2);
  CHECK(pp.bytes_per_s == 22.5e9);
  CHECK(pp.latency_s == 2e-5);
  CHECK(collective_seconds(Collective::all_reduce, 1e9, pp) == Approx(40e-6 + 1e9 / 22.5e9));
  // The same dp group with the spine at 1:1 costs what the two-level cluster charges between
  // nodes: leaf and spine at 45 GB/s.
  const Cluster two = cluster_preset("h100-80gb", 128);
  CHECK(axis_link(two, 2, 8, 8, Axis::pp).bytes_per_s == 45e9);
  // A group larger than a leaf but in a cluster of one leaf stays on it.
  const Cluster small = three_levels(64);
  CHECK(axis_link(small, 1, 8, 8, Axis::dp).level == 1);

  // The hierarchical dp reduction: the node's ranks on NVLink, one rank per node across the
  // leaf or the spine, as far as the dp group reaches. dp=16 tp=1 within a leaf (span 16):
  // L = 8, N = 2 on the leaf. dp=128 (span 128): N = 16 over the spine at 22.5 GB/s.
  const DpGroup in_leaf = dp_group(c, 8, 16, 1, DpReduction::hierarchical);
  CHECK(in_leaf.split.ranks_per_node == 8);
  CHECK(in_leaf.intra.bytes_per_s == 360e9);
  CHECK(in_leaf.inter.bytes_per_s == 45e9);
  const DpGroup over_spine = dp_group(c, 1, 128, 1, DpReduction::hierarchical);
  CHECK(over_spine.inter.ranks == 16);
  CHECK(over_spine.inter.level == 2);
  CHECK(over_spine.inter.bytes_per_s == 22.5e9);
}

// Bit for bit: a cluster whose levels restate the two default ones (dgx-h100's leaf and spine
// at the node's network bandwidth, oversubscription 1) plans exactly as the two-level preset
// with the same numbers (h100-80gb), and a plan with levels survives JSON.
TEST_CASE("levels: restating the two levels changes no number, and plans keep levels in JSON", "[levels][search]") {
  const ModelGraph g = gpt3_175b();
  Cluster dgx = cluster_preset("dgx-h100", 1024);
  Cluster flat = cluster_preset("h100-80gb", 1024);
  dgx.name = flat.name = "same";
  const Plan a = search(g, dgx, global_batch(1536));
  const Plan b = search(g, flat, global_batch(1536));
  CHECK(a.summary() == b.summary());
  CHECK(a.prediction.step_time_s == b.prediction.step_time_s);
  CHECK(a.prediction.time == b.prediction.time);

  const Plan back = plan_from_json(to_json(a));
  CHECK(back.cluster == a.cluster);
  CHECK(back.cluster.levels.size() == 3);
  // A cluster without levels writes no "levels" field, so plans read by older code (and
  // old plans read by this one) are unchanged.
  CHECK(to_json(b).find("\"levels\"") == std::string::npos);
  CHECK(plan_from_json(to_json(b)).cluster.levels.empty());
}

// GPT-3 175B with a small global batch, 128 sequences (262K tokens: the start of GPT-3's batch
// ramp), on 16 GB200 NVL72 racks (1152 GPUs): each rack one NVLink domain of 72 over 18 compute
// trays (nodes) of 4.
//  * 128 sequences leave few micro-batches: dp x m x mbs = 128. With dp = 4, tp x pp = 288.
//  * tp = 8 spans 2 trays but stays on NVLink: one all-reduce of a sequence's activation
//    (2048 x 12288 bf16 = 50.3 MB; ring 2 x 7/8 x 50.3 MB = 88.1 MB) takes 88.1 MB / 720 GB/s
//    + 14 steps x 5 us = 122 + 70 = 192 us. Over the network (45 GB/s, 10 us) it would take
//    1.96 + 0.14 = 2.1 ms, 11x more.
//  * The pick is pp=36 dp=4 tp=8 with 32 micro-batches: 96 blocks over 36 stages, at most 3
//    per stage; 4 all-reduces per block and micro-batch (2 forward, 2 backward): tp comm =
//    32 x 3 x 4 x 192 us = 73.7 ms.
//  * Were NVLink to stop at the tray (the two-level cluster of nodes of 4, levels cleared), tp
//    could be at most 4: the best is then pp=72 dp=4 tp=4, whose slowest stage holds 2 blocks
//    of 4-way shards (0.5 block) against 3 of 8-way (0.375): compute 0.247 s vs 0.190 s, and a
//    72-stage pipeline over 32 micro-batches idles longer (bubble 0.196 s vs 0.137 s). It is
//    predicted 0.616 s a step against 0.486 s: tp across trays pays 21%.
TEST_CASE("levels: GPT-3 175B on GB200 NVL72 racks places tp across trays inside the NVLink domain",
          "[levels][presets][search]") {
  const ModelGraph g = gpt3_175b();
  const Cluster nvl = cluster_preset("gb200-nvl72", 1152);
  const Plan plan = search(g, nvl, global_batch(128));
  INFO(plan.summary() << " step " << plan.prediction.step_time_s << " tp " << plan.prediction.time.tp_comm);
  CHECK(plan.mesh.tp > nvl.devices_per_node);  // tp spans nodes
  CHECK(72 % plan.mesh.tp == 0);                // inside the NVLink domain
  const Link tp = axis_link(nvl, plan.mesh.pp, plan.mesh.dp, plan.mesh.tp, Axis::tp);
  CHECK(tp.level == 0);
  CHECK(tp.bytes_per_s == Approx(720e9));
  CHECK(plan.mesh.tp == 8);
  CHECK(plan.mesh.pp == 36);
  CHECK(plan.num_micro_batches == 32);
  CHECK(plan.prediction.time.tp_comm == Approx(32 * 3 * 4 * (88.1e6 / 720e9 + 14 * 5e-6)).epsilon(0.01));

  Cluster trays = nvl;  // NVLink inside the tray only
  trays.levels.clear();
  const Plan two_level = search(g, trays, global_batch(128));
  INFO(two_level.summary() << " step " << two_level.prediction.step_time_s);
  CHECK(two_level.mesh.tp <= 4);
  CHECK(plan.prediction.step_time_s < 0.85 * two_level.prediction.step_time_s);
}

// A 6.7B GPT (GPT-3 6.7B's shape: 32 layers, hidden 4096, 32 heads, 2048 tokens) with a 4M-token
// batch (2048 sequences) on 2048 H100s as DGX H100 SuperPOD: nodes of 8, leaves of 256 GPUs
// (32 nodes), a spine over 8 leaves. Flat data-parallel collectives (NCCL rings, as the
// calibration rows ran them: allow_hierarchical_dp = false).
//  * At 1:1 the pick is pp=4 dp=128 tp=4 ZeRO-1: the dp group spans dp x tp = 512 ranks, two
//    leaves, so it crosses the spine (at 45 GB/s, which costs nothing extra at 1:1).
//  * Its dp traffic: a stage holds 6.86e9 / 4 pp / 4 tp = 0.43e9 parameters, 0.86 GB of bf16
//    gradients to reduce-scatter and weights to all-gather over 128 ranks: 127/128 x 0.86 GB /
//    45 GB/s + 127 x 10 us = 20.2 ms each; the all-gather is exposed and the reduce-scatter
//    mostly hides behind the last backward: 34.9 ms exposed.
//  * At 2:1 the spine gives 22.5 GB/s: each of those collectives takes 39.1 ms, and the same
//    layout's exposed dp time about doubles (75.1 ms; the pipeline's sends cross the spine too).
//    That layout is predicted 0.333 s a step against 0.287 s at 1:1.
//  * The 2:1 pick keeps dp inside a leaf (dp x tp <= 256) and sends only the pipeline's
//    activations over the spine: pp=8 dp=64 tp=4, 0.313 s, 6% faster than keeping the 1:1 pick.
TEST_CASE("levels: a 2:1 oversubscribed spine slows dp across it and moves dp into a leaf", "[levels][search]") {
  const ModelGraph g = build_transformer(transformer_config(32, 4096, 32, 2048, 51200));
  TrainingConfig training = global_batch(2048);
  training.allow_hierarchical_dp = false;
  const Cluster full = cluster_preset("dgx-h100", 2048);
  Cluster tapered = full;
  std::vector<LinkLevel> levels = full.levels;
  levels.back().oversubscription = 2;
  set_levels(tapered, levels);

  const Plan at_1 = search(g, full, training);
  INFO("1:1 " << at_1.summary() << " step " << at_1.prediction.step_time_s << " dp " << at_1.prediction.time.dp_comm);
  CHECK(at_1.mesh.dp * at_1.mesh.tp > 256);  // dp crosses the spine
  CHECK(at_1.mesh.pp == 4);
  CHECK(at_1.mesh.dp == 128);
  CHECK(at_1.mesh.tp == 4);

  // The same layout on the tapered spine: dp's collectives at half the bandwidth.
  Pins same = layout_pins(at_1.mesh.tp, at_1.mesh.pp, at_1.mesh.dp, at_1.zero_stage, at_1.micro_batch_size,
                          at_1.schedule);
  same.virtual_stages = at_1.virtual_stages;
  const Plan kept = evaluate_layout(g, tapered, training, same);
  INFO("2:1, same layout: step " << kept.prediction.step_time_s << " dp " << kept.prediction.time.dp_comm);
  CHECK(kept.prediction.time.dp_comm > 1.9 * at_1.prediction.time.dp_comm);
  CHECK(kept.prediction.time.dp_comm == Approx(0.0751).epsilon(0.02));
  CHECK(at_1.prediction.time.dp_comm == Approx(0.0349).epsilon(0.02));
  CHECK(kept.prediction.step_time_s > at_1.prediction.step_time_s);

  const Plan at_2 = search(g, tapered, training);
  INFO("2:1 " << at_2.summary() << " step " << at_2.prediction.step_time_s << " dp " << at_2.prediction.time.dp_comm);
  CHECK(at_2.mesh.dp * at_2.mesh.tp <= 256);  // dp inside a leaf
  CHECK(at_2.mesh.pp == 8);
  CHECK(at_2.mesh.dp == 64);
  CHECK(at_2.mesh.tp == 4);
  CHECK(axis_link(tapered, at_2.mesh.pp, at_2.mesh.dp, at_2.mesh.tp, Axis::dp).level == 1);
  CHECK(at_2.prediction.step_time_s < 0.95 * kept.prediction.step_time_s);
}

// Expert all-to-alls and the hierarchical dp reduction inside an NVL72 rack stay on NVLink
// across its trays; with NVLink stopping at the tray they go over the network.
//   ep = 8 (ranks 0-7, two trays): 7 steps x 5 us + B / 720 GB/s on NVL72.
//   Trays only: 4 of the 7 peers are on the other tray: 7 x 10 us + max(3/7 B / 720, 4/7 B / 45).
TEST_CASE("levels: all-to-alls and hierarchical dp inside the NVL72 domain stay on NVLink", "[levels][moe]") {
  const Cluster nvl = cluster_preset("gb200-nvl72", 144);
  Cluster trays = nvl;
  trays.levels.clear();
  const double bytes = 1e9;
  CHECK(all_to_all_inter_node_bytes(bytes, 8, 1, nvl) == 0);
  CHECK(all_to_all_seconds(bytes, 8, 1, nvl) == Approx(7 * 5e-6 + bytes / 720e9));
  CHECK(all_to_all_inter_node_bytes(bytes, 8, 1, trays) == Approx(bytes * 4 / 7));
  CHECK(all_to_all_seconds(bytes, 8, 1, trays) == Approx(7 * 1e-5 + bytes * 4 / 7 / 45e9));
  // ep = 144 over both racks: the bytes to the other rack (72 of 143 peers) at 45 GB/s.
  CHECK(all_to_all_inter_node_bytes(bytes, 144, 1, nvl) == Approx(bytes * 72 / 143));

  // dp = 36 with tp = 2 (one rack): the runtime's hierarchical reduction groups a tray's 2 dp
  // ranks, then 18 ranks across trays, still on NVLink: no byte leaves the rack.
  const DpGroup in_rack = dp_group(nvl, 2, 36, 2, DpReduction::hierarchical);
  CHECK(in_rack.split.ranks_per_node == 2);
  CHECK(in_rack.split.nodes == 18);
  CHECK(in_rack.inter.bytes_per_s == Approx(720e9));
  CHECK(in_rack.bytes_per_rank(Collective::all_reduce, bytes, 2).inter == 0);
  const DpGroup across = dp_group(nvl, 1, 72, 2, DpReduction::hierarchical);
  CHECK(across.inter.bytes_per_s == Approx(45e9));
  CHECK(across.bytes_per_rank(Collective::all_reduce, bytes, 2).inter > 0);
}
