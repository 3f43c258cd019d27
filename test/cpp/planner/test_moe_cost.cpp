// Tests planner/src/moe_cost.cpp and the expert parts of cost_model.cpp: all-to-all bytes and
// time per link level, grouped GEMM utilization, expert state divided by ep and ZeRO over
// dp x cp / ep, against numbers computed by hand.
#include "catch_compat.h"

#include <cstdint>

#include "monarch/planner/cluster.h"
#include "monarch/planner/cost_model.h"
#include "monarch/planner/moe_cost.h"
#include "monarch/planner/search.h"
#include "test_configs.h"

using namespace monarch::planner;

namespace {

// 8 devices per node, round numbers: NVLink 100 GB/s and 1 us, network 10 GB/s and 5 us.
Cluster round_cluster(int64_t devices) {
  Cluster c = cluster_preset("h100-80gb", devices);
  c.intra_node_bytes_per_s = 100e9;
  c.intra_node_latency_s = 1e-6;
  c.inter_node_bytes_per_s = 10e9;
  c.inter_node_latency_s = 5e-6;
  return c;
}

}  // namespace

TEST_CASE("all-to-all bytes: tokens x hidden x top_k x bytes x (ep-1)/ep x load factor", "[moe][cost]") {
  TransformerConfig c = mixtral_8x7b_config(4096);
  const ModelGraph g = build_transformer(c);
  const Layer& moe = g.layers[1];
  Layout l;
  l.micro_batch_size = 2;
  l.tp = 2;
  l.ep = 4;
  TrainingConfig t = global_batch(8);
  // Every tp rank dispatches all 2 x 4096 tokens (experts are whole per tp rank, as the runtime
  // runs them): 8192 tokens x 4096 x top-2 x 2 bytes, 3/4 of it to the other ep ranks.
  CHECK(moe_all_to_all_bytes(moe, t, l) == Approx(8192.0 * 4096 * 2 * 2 * 3 / 4));
  l.tp = 1;  // the same: tp does not divide the routed tokens
  CHECK(moe_all_to_all_bytes(moe, t, l) == Approx(8192.0 * 4096 * 2 * 2 * 3 / 4));
  l.tp = 2;
  l.cp = 2;  // half the tokens
  CHECK(moe_all_to_all_bytes(moe, t, l) == Approx(4096.0 * 4096 * 2 * 2 * 3 / 4));
  l.ep = 1;
  CHECK(moe_all_to_all_bytes(moe, t, l) == 0);
  CHECK(moe_all_to_all_bytes(g.layers[0], t, l) == 0);  // the embedding
  // Dropless with 1.25 imbalance: the busiest rank sends 1.25x; a capacity factor pads to it.
  c.moe.imbalance = 1.25;
  const ModelGraph skewed = build_transformer(c);
  l.cp = 1;
  l.ep = 4;
  CHECK(moe_all_to_all_bytes(skewed.layers[1], t, l) == Approx(1.25 * 8192.0 * 4096 * 2 * 2 * 3 / 4));
  c.moe.imbalance = 1.0;
  c.moe.capacity_factor = 2.0;
  CHECK(moe_all_to_all_bytes(build_transformer(c).layers[1], t, l) == Approx(2.0 * 8192.0 * 4096 * 2 * 2 * 3 / 4));
  // Four all-to-alls per step and layer (dispatch, combine, and their gradients), six with
  // full recompute.
  CHECK(moe_all_to_alls(Recompute::none).forward == 2);
  CHECK(moe_all_to_alls(Recompute::none).backward == 2);
  CHECK(moe_all_to_alls(Recompute::full).recompute == 2);
}

TEST_CASE("all-to-all time per link level", "[moe][cost]") {
  const Cluster c = round_cluster(64);
  const double bytes = 1e9;
  // ep = 8 inside a node: 7 steps of NVLink latency, every byte over NVLink.
  CHECK(all_to_all_seconds(bytes, 8, 1, c) == Approx(7 * 1e-6 + bytes / 100e9));
  CHECK(all_to_all_inter_node_bytes(bytes, 8, 1, c) == 0);
  // ep = 16 over two nodes: 7 of 15 peers on the node, 8 on the other; both links at once.
  CHECK(all_to_all_inter_node_bytes(bytes, 16, 1, c) == Approx(bytes * 8 / 15));
  CHECK(all_to_all_seconds(bytes, 16, 1, c) == Approx(15 * 5e-6 + bytes * 8 / 15 / 10e9));
  // ep = 4 with tp = 4: the group spans 16 ranks, 2 of its ranks per node: 2 of 3 peers away.
  CHECK(all_to_all_inter_node_bytes(bytes, 4, 4, c) == Approx(bytes * 2 / 3));
  CHECK(all_to_all_seconds(bytes, 4, 4, c) == Approx(3 * 5e-6 + bytes * 2 / 3 / 10e9));
  CHECK(all_to_all_seconds(bytes, 1, 1, c) == 0);
}

TEST_CASE("grouped GEMM utilization: the groups' tiles fill the waves together", "[moe][cost]") {
  // One group is the plain GEMM.
  CHECK(grouped_gemm_utilization(4096, 4096, 4096, 1, 132) == Approx(gemm_utilization(4096, 4096, 4096, 132)));
  // 8 experts of 256 x 2048 rows x cols: 8 x 2 x 16 = 256 tiles, split-K 1, 2 waves of 132:
  // 256 / 264 of the SMs busy.
  CHECK(grouped_gemm_utilization(256, 2048, 7168, 8, 132) == Approx(256.0 / 264.0));
  // A lone small expert (128 x 1024: 8 tiles, split-K 2) leaves most SMs idle: 16 / 132; eight
  // of them in one launch fill 128 of the 132.
  CHECK(gemm_utilization(128, 1024, 1024, 132) == Approx(16.0 / 132.0));
  CHECK(grouped_gemm_utilization(128, 1024, 1024, 8, 132) == Approx(128.0 / 132.0));
  CHECK(grouped_gemm_utilization(100, 100, 100, 4, 0) == 1.0);  // no SM count: no effect
}

TEST_CASE("expert state is 1/ep per rank with ZeRO over dp*cp/ep; the rest ZeRO over dp*cp", "[moe][cost][memory]") {
  Layout l;
  l.dp = 8;
  l.cp = 2;
  l.ep = 4;
  l.zero_stage = 1;
  TrainingConfig t = global_batch(8);
  // 10 parameters on the rank, 4 of them an ep rank's experts: 6 over 16 ranks, 4 over 4.
  const ModelStateBytes m = layout_model_state_bytes(10, 4, l, t, 2);
  CHECK(m.params == Approx(10 * 2.0));
  CHECK(m.grads == Approx(10 * 2.0));
  CHECK(m.optimizer == Approx(6 * 12.0 / 16 + 4 * 12.0 / 4));
  l.zero_stage = 3;
  const ModelStateBytes z3 = layout_model_state_bytes(10, 4, l, t, 2);
  CHECK(z3.total() == Approx(6 * 16.0 / 16 + 4 * 16.0 / 4));

  // Mixtral 8x7B on 16 H100s, dp 16, ep 8, ZeRO-1: the rank holds 1 of the 8 experts of each
  // layer, their optimizer state over the 2 ranks holding the same expert.
  const ModelGraph g = build_transformer(mixtral_8x7b_config(4096));
  const Cluster cluster = cluster_preset("h100-80gb", 16);
  Pins pins = layout_pins(1, 1, 16, 1, 1, ScheduleKind::none);
  pins.ep = 8;
  pins.recompute = Recompute::none;
  const Plan p = evaluate_layout(g, cluster, global_batch(16), pins, true);
  double experts = 0, total = 0;
  for (const auto& layer : g.layers) {
    experts += static_cast<double>(layer.moe.expert_params);
    total += static_cast<double>(layer.params);
  }
  const double held = total - experts + experts / 8;
  CHECK(p.prediction.memory.params == Approx(2.0 * held));
  CHECK(p.prediction.memory.optimizer == Approx(12.0 * ((total - experts) / 16 + experts / 8 / 2)));
  CHECK(p.mesh.ep == 8);
  // The step's all-to-alls: 32 layers x 4 per micro-batch, each 4096 tokens x 4096 x 2 x 2
  // bytes x 7/8, over NVLink (ep x tp = 8 fills one node).
  const double a2a = all_to_all_seconds(4096.0 * 4096 * 2 * 2 * 7 / 8, 8, 1, cluster);
  CHECK(p.prediction.time.ep_comm == Approx(32 * 4 * a2a));
}

TEST_CASE("routed experts' compute grows with the load factor; grouped GEMMs fill the SMs", "[moe][cost]") {
  // Without GEMM shapes (sm_count 0), a dropless layer with 1.5x imbalance does 0.5x its
  // balanced routed FLOPs more on the busiest rank, plus the memory traffic of its larger
  // kept activations (written once, read once).
  Cluster c = cluster_preset("h100-80gb", 8);
  c.sm_count = 0;
  const TrainingConfig t = global_batch(8);
  Layout l;
  l.dp = 8;
  l.ep = 8;
  TransformerConfig cfg = mixtral_8x7b_config(4096);
  const ModelGraph even = build_transformer(cfg);
  cfg.moe.imbalance = 1.5;
  const ModelGraph skewed = build_transformer(cfg);
  const double rate = c.peak_flops(DType::bf16) * c.matmul_efficiency;
  const double extra_flops = 0.5 * even.layers[1].moe.routed_flops_per_sample;
  const double extra_bytes = layer_activation_bytes(skewed.layers[1], 1, 1, false, Recompute::none) -
                             layer_activation_bytes(even.layers[1], 1, 1, false, Recompute::none);
  const auto a = layer_costs(even, c, t, l);
  const auto b = layer_costs(skewed, c, t, l);
  CHECK(b[1].backward_compute_s / c.backward_forward_ratio - a[1].backward_compute_s / c.backward_forward_ratio ==
        Approx(extra_flops / rate + 2 * extra_bytes / c.hbm_bytes_per_s));
  // With SM counts, ep changes only the experts' GEMM shapes here (one node, same FLOPs):
  // ep 8 gives each rank one expert of 8 x 4096 x 2 / 8 = 8192 rows, ep 1 eight of 1024 rows
  // in one grouped launch; both are large enough to fill the SMs, so the time barely moves.
  Cluster sms = cluster_preset("h100-80gb", 8);
  Layout one = l;
  one.ep = 1;
  const auto e8 = layer_costs(even, sms, t, l);
  const auto e1 = layer_costs(even, sms, t, one);
  CHECK(e8[1].backward_compute_s == Approx(e1[1].backward_compute_s).epsilon(0.02));
  // Expert parameters on the rank: 1/ep of the experts.
  CHECK(e8[1].expert_params == Approx(static_cast<double>(even.layers[1].moe.expert_params) / 8));
  CHECK(e1[1].params - e8[1].params == Approx(static_cast<double>(even.layers[1].moe.expert_params) * 7 / 8));
}

TEST_CASE("tp does not split the routed experts: they are whole on every tp rank, as the runtime runs them",
          "[moe][cost]") {
  // torch_monarch.expert_parallel keeps each ep rank's experts whole and every tp rank routes
  // all of its tokens (no expert tensor parallelism): tp divides the attention, the shared
  // experts and the router's neighbours, never the routed experts' weights, FLOPs or rows.
  Cluster c = cluster_preset("h100-80gb", 8);
  c.sm_count = 0;
  const TrainingConfig t = global_batch(8);
  const ModelGraph g = build_transformer(mixtral_8x7b_config(4096));
  const Layer& moe = g.layers[1];
  Layout tp1;
  tp1.dp = 4;
  tp1.ep = 4;
  Layout tp2 = tp1;
  tp2.tp = 2;
  const auto a = layer_costs(g, c, t, tp1);
  const auto b = layer_costs(g, c, t, tp2);
  const double experts = static_cast<double>(moe.moe.expert_params);
  CHECK(a[1].expert_params == Approx(experts / 4));
  CHECK(b[1].expert_params == Approx(experts / 4));
  // The rest of the block halves with tp.
  CHECK(b[1].params - b[1].expert_params == Approx((a[1].params - a[1].expert_params) / 2));
  // Forward: the routed FLOPs stay whole, the rest halves (no GEMM shapes: FLOPs at one rate).
  const double rate = c.peak_flops(DType::bf16) * c.matmul_efficiency;
  const double other = (moe.forward_flops_per_sample - moe.moe.routed_flops_per_sample) / rate;
  const double ratio = c.backward_forward_ratio;
  CHECK(a[1].backward_compute_s / ratio - b[1].backward_compute_s / ratio ==
        Approx(other / 2 + (layer_activation_bytes(moe, 1, 1, false, Recompute::none) -
                            layer_activation_bytes(moe, 1, 2, false, Recompute::none)) *
                               2 / c.hbm_bytes_per_s)
            .epsilon(1e-6));
  // The routed rows' activations do not shrink with tp.
  CHECK(layer_activation_bytes(moe, 1, 2, false, Recompute::none) >
        layer_activation_bytes(moe, 1, 1, false, Recompute::none) / 2);
}
