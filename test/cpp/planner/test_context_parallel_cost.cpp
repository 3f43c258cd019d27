// Tests planner/src/context_parallel_cost.cpp and the cp parts of cost_model.cpp: ring k/v
// bytes, the exposed part of the ring, and FLOPs and activations divided by cp, against
// numbers computed by hand.
#include "catch_compat.h"

#include <cstdint>

#include "monarch/planner/cluster.h"
#include "monarch/planner/collectives.h"
#include "monarch/planner/context_parallel_cost.h"
#include "monarch/planner/cost_model.h"
#include "monarch/planner/search.h"
#include "test_configs.h"

using namespace monarch::planner;

namespace {

// Llama 3 8B's shapes (32 layers, hidden 4096, 32 heads, 8 kv heads, SwiGLU 14336).
TransformerConfig llama8b(int64_t seq) {
  TransformerConfig c = transformer_config(32, 4096, 32, seq, 128256);
  c.kv_heads = 8;
  c.ffn = 14336;
  c.gated_mlp = true;
  return c;
}

}  // namespace

TEST_CASE("ring step bytes: the local k and v chunk, 2 b s/cp kv_heads head_dim bytes / tp", "[cp][cost]") {
  const ModelGraph g = build_transformer(llama8b(131072));
  const Layer& block = g.layers[1];
  Layout l;
  l.cp = 16;
  const TrainingConfig t = global_batch(1);
  // 8192 tokens x (k and v: 2 x 8 heads x 128) x 2 bytes.
  CHECK(cp_ring_step_bytes(block, t, l, g.seq_len()) == Approx(8192.0 * 2 * 8 * 128 * 2));
  l.tp = 2;  // kv heads split over tp
  l.micro_batch_size = 2;
  CHECK(cp_ring_step_bytes(block, t, l, g.seq_len()) == Approx(8192.0 * 2 * 8 * 128 * 2));
  CHECK(cp_ring_step_bytes(g.layers[0], t, l, g.seq_len()) == 0);  // the embedding: no attention
  l.cp = 1;
  CHECK(cp_ring_step_bytes(block, t, l, g.seq_len()) == 0);
  // A step takes max(compute, comm): only comm beyond the block's compute shows.
  CHECK(ring_exposed_seconds(15, 2e-3, 1.5e-3) == Approx(15 * 0.5e-3));
  CHECK(ring_exposed_seconds(15, 1e-3, 2e-3) == 0);
}

TEST_CASE("cp divides FLOPs and activations; the ring shows beyond the attention it overlaps", "[cp][cost]") {
  const ModelGraph g = build_transformer(llama8b(32768));
  Cluster c = cluster_preset("h100-80gb", 16);
  c.sm_count = 0;  // no GEMM-shape effect: compute is FLOPs / rate
  // A slow ring link, so the exchange shows: 1 GB/s, 10 us.
  c.inter_node_bytes_per_s = 1e9;
  c.inter_node_latency_s = 10e-6;
  const TrainingConfig t = global_batch(16);
  Layout one;
  one.dp = 16;
  Layout two = one;
  two.dp = 8;
  two.cp = 2;
  const auto a = layer_costs(g, c, t, one);
  const auto b = layer_costs(g, c, t, two);
  const Layer& block = g.layers[1];
  CHECK(b[1].activation_bytes == Approx(a[1].activation_bytes / 2));
  CHECK(b[1].backward_compute_s == Approx(a[1].backward_compute_s / 2));
  CHECK(b[1].params == Approx(a[1].params));  // cp ranks hold the same weights
  // cp = 2 in one node: NVLink; the ring's one step sends 16384 tokens x 2048 x 2 bytes.
  const double bytes = 16384.0 * 2048 * 2;
  Link nvlink = axis_link(c, 1, 2, 1, Axis::dp);
  nvlink.ranks = 2;
  const double rate = c.peak_flops(DType::bf16) * c.matmul_efficiency;
  const double block_compute = block.attention_flops_per_sample / 2 / 2 / rate;  // one of cp x cp blocks
  const double fwd = ring_exposed_seconds(1, collective_seconds(Collective::send_recv, bytes, nvlink), block_compute);
  const double bwd = ring_exposed_seconds(1, collective_seconds(Collective::send_recv, 2 * bytes, nvlink),
                                          c.backward_forward_ratio * block_compute);
  CHECK(b[1].cp_comm_s == Approx(fwd + bwd));
  // At 32K the block's attention (4 x 16384^2 x 4096 / 4 FLOPs) hides the NVLink transfer.
  CHECK(b[1].cp_comm_s == 0);
  // cp = 16 over two nodes at 1 GB/s: each of 15 steps sends 2048 tokens' k and v (8 MiB) in
  // 8.4 ms, against 1/256 of the block's attention: most of it shows.
  Layout wide = one;
  wide.dp = 1;
  wide.cp = 16;
  const auto w = layer_costs(g, c, t, wide);
  Link net = axis_link(c, 1, 16, 1, Axis::dp);
  net.ranks = 2;
  CHECK(net.inter_node);
  const double step = 2048.0 * 2048 * 2;
  const double wide_block = block.attention_flops_per_sample / 16 / 16 / rate;
  CHECK(w[1].cp_comm_s == Approx(ring_exposed_seconds(15, collective_seconds(Collective::send_recv, step, net), wide_block) +
                                 ring_exposed_seconds(15, collective_seconds(Collective::send_recv, 2 * step, net),
                                                      c.backward_forward_ratio * wide_block)));
  CHECK(w[1].cp_comm_s > 0.1);
}

TEST_CASE("cp's gradients are reduced over dp x cp", "[cp][cost]") {
  // Same model, 16 ranks: dp 16 or dp 8 x cp 2 reduce the same gradients over the same 16
  // ranks (ZeRO-1 divides the optimizer state by dp x cp).
  const ModelGraph g = build_transformer(llama8b(16384));
  const Cluster c = cluster_preset("h100-80gb", 16);
  Pins p1 = layout_pins(1, 1, 16, 1, 1, ScheduleKind::none);
  p1.recompute = Recompute::none;
  Pins p2 = p1;
  p2.dp = 8;
  p2.cp = 2;
  const Plan a = evaluate_layout(g, c, global_batch(16), p1, true);
  const Plan b = evaluate_layout(g, c, global_batch(8), p2, true);
  CHECK(b.prediction.memory.optimizer == Approx(a.prediction.memory.optimizer));
  CHECK(b.prediction.memory.activations == Approx(a.prediction.memory.activations / 2));
  CHECK(b.mesh.order == std::vector<std::string>{"pp", "dp", "cp", "tp"});
}
