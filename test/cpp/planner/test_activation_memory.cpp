// Activation memory as kernels and runtimes keep it (docs/cost_model.md, "Activations as
// kept"): fused vs eager ops, dropout, the loss, backward transients, and the walk of each
// rank's action list (true in-flight counts per virtual stage, sends kept, weights cast per
// forward).
#include "catch_compat.h"

#include <string>
#include <vector>

#include "monarch/planner/cost_model.h"
#include "monarch/planner/model_graph.h"
#include "monarch/planner/plan.h"
#include "monarch/planner/schedule.h"
#include "monarch/planner/search.h"
#include "test_configs.h"

using namespace monarch::planner;

namespace {

// A small Llama: s 16, h 64, 4 query / 2 key-value heads (q 64, kv 32 wide), SwiGLU 96, V 100, bf16.
constexpr double s = 16, h = 64, q = 64, kv = 32, f = 96, v = 100, heads = 4, act = 2;

TransformerConfig tiny_llama(bool fused, bool dropout) {
  TransformerConfig c = transformer_config(2, 64, 4, 16, 100);
  c.kv_heads = 2;
  c.ffn = 96;
  c.gated_mlp = true;
  c.fused_kernels = fused;
  c.dropout = dropout;
  return c;
}

}  // namespace

TEST_CASE("a block keeps what fused kernels keep, or what eager ops keep", "[model_graph][memory]") {
  // Fused (Megatron-LM, Transformer Engine), no dropout: the norms' inputs and outputs (4 sh),
  // FlashAttention's Q, K, V (GQA: kv wide), O and fp32 log-sum-exp, SwiGLU's gate|up and the
  // down projection's input (3 ffn-wide).
  const ModelGraph fused = build_transformer(tiny_llama(true, false));
  const ActivationBytes& a = fused.layers.at(1).activations;
  CHECK(a.replicated == 4 * act * s * h);
  CHECK(a.tp_sharded == act * s * (2 * q + 2 * kv) + 3 * act * s * f + 4 * heads * s);
  CHECK(a.attention_scores == 0);
  // Backward: the SwiGLU's gradients, 2 ffn-wide beyond the product it freed.
  CHECK(a.backward_transient == 2 * act * s * f);
  // Eager (Hugging Face's Llama): each RMSNorm also keeps x * rsqrt(mean x^2), the SwiGLU
  // also silu(gate).
  const ActivationBytes& e = build_transformer(tiny_llama(false, false)).layers.at(1).activations;
  CHECK(e.replicated - a.replicated == 2 * act * s * h);
  CHECK(e.tp_sharded - a.tp_sharded == act * s * f);
  CHECK(e.backward_transient == a.backward_transient);
  // Dropout: two 1-byte masks per block and one on the embedding.
  const ModelGraph masked = build_transformer(tiny_llama(true, true));
  CHECK(masked.layers.at(1).activations.replicated - a.replicated == 2 * s * h);
  CHECK(masked.layers.at(0).activations.replicated == s * h);
  CHECK(fused.layers.at(0).activations.replicated == 0);
  // The loss keeps its fp32 softmax, not the logits (read once: traffic, not memory); its
  // backward: Megatron's in-place gradient cast to bf16, or eager cross entropy's two fp32
  // gradients.
  const ActivationBytes& head = fused.layers.back().activations;
  CHECK(head.tp_sharded == 4 * s * v);
  CHECK(head.read_once == act * s * v);
  CHECK(head.backward_transient == act * s * v);
  CHECK(build_transformer(tiny_llama(false, false)).layers.back().activations.backward_transient == 2 * 4 * s * v);
}

TEST_CASE("materialized attention keeps the softmax, repeated K and V in eager PyTorch", "[model_graph][memory]") {
  TransformerConfig c = tiny_llama(false, false);
  c.attention = AttentionKernel::materialized;
  const ActivationBytes& e = build_transformer(c).layers.at(1).activations;
  // No dropout: the softmax output only; K and V repeated to every query head (repeat_kv).
  CHECK(e.attention_scores == act * heads * s * s);
  CHECK(e.tp_sharded == act * s * 4 * q + 4 * act * s * f);
  c.dropout = true;
  // With dropout, Korthikanti et al.'s 5 a s^2 (softmax 2, mask 1, dropout output 2).
  CHECK(build_transformer(c).layers.at(1).activations.attention_scores == (2 * act + 1) * heads * s * s);
  c.fused_kernels = true;
  const ActivationBytes& fused = build_transformer(c).layers.at(1).activations;
  CHECK(fused.tp_sharded == act * s * (2 * q + 2 * kv) + 3 * act * s * f);
}

TEST_CASE("each virtual stage counts its own micro-batches in flight", "[cost_model][memory]") {
  // pp 2, v 2, m 4. Rank 1 runs F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 F2.1 B0.1 F3.1 B1.1 F2.3 B2.3
  // F3.3 B3.3 B2.1 B3.1: stage 3 (the last chunk, with the head) holds one micro-batch at a
  // time, stage 1 up to two. The rank's peak of 3 spread evenly over its chunks overcounts.
  const Schedule sch = make_schedule(ScheduleKind::interleaved_1f1b, 2, 4, 2);
  const std::vector<double> kept = {1, 1, 1, 10}, none(4, 0.0);
  CHECK(peak_activation_bytes(sch.per_rank[1], kept, none, none, none) == 12);  // 2 x 1 + 10
  CHECK(3.0 / 2 * (1 + 10) == 16.5);                                             // the even spread
  CHECK(peak_activation_bytes(sch.per_rank[0], kept, none, none, none) == 5);    // F0.0 F1.0 F0.2 F1.2 F2.0
  // A stage's workspace is live while its backward runs: at B0.3, on top of 12.
  CHECK(peak_activation_bytes(sch.per_rank[1], kept, {0, 0, 0, 5}, none, none) == 17);
}

TEST_CASE("what a pipeline stage sends is kept to the step's end when the runtime keeps it", "[cost_model][memory]") {
  // 1F1B, pp 2, m 4. Rank 0: F0 F1 B0 F2 B1 F3 B2 B3 with 1 byte kept per micro-batch: 2 at
  // most; with every output (0.5) kept until the step ends, 2 in flight and 4 sent: 4.
  const Schedule sch = make_schedule(ScheduleKind::one_f_one_b, 2, 4, 1);
  const std::vector<double> kept = {1, 1}, none(2, 0.0);
  CHECK(peak_activation_bytes(sch.per_rank[0], kept, none, none, none) == 2);
  CHECK(peak_activation_bytes(sch.per_rank[0], kept, none, {0.5, 0}, none) == 4);
  // Rank 1 sends its input's gradient back (0.25) after each backward: the last forward finds
  // 3 of them held beside its micro-batch.
  CHECK(peak_activation_bytes(sch.per_rank[1], kept, none, none, {0, 0.25}) == 1.75);
}

TEST_CASE("the runtime's pipeline keeps its sends and per-forward weight copies: predicted", "[cost_model][memory]") {
  const ModelGraph g = build_transformer(tiny_llama(false, false));
  Pins pins = layout_pins(1, 2, 1, 0, 2, ScheduleKind::one_f_one_b);
  pins.recompute = Recompute::none;
  TrainingConfig t = global_batch(8);  // 4 micro-batches of 2
  const Plan megatron = evaluate_layout(g, cluster_preset("cpu", 2), t, pins, true);
  t.pipeline_sends_kept = true;
  const Plan sends = evaluate_layout(g, cluster_preset("cpu", 2), t, pins, true);
  // Rank 0 (embedding, block 0; 2 in flight at most): its 4 outputs stay until the step ends.
  const double output = stage_p2p_bytes(g, t, layout_of(sends), 1);
  REQUIRE(sends.layers.at(1).stage == 0);
  REQUIRE(sends.layers.at(2).stage == 1);
  CHECK(sends.prediction.ranks[0].memory.activations ==
        Approx(megatron.prediction.ranks[0].memory.activations + 4 * output));
  // Casting the weights per forward: each micro-batch in flight beyond the first keeps its
  // own copy of the block's weights (the embedding's backward reads no weight).
  t.weights_cast_per_forward = true;
  const Plan copies = evaluate_layout(g, cluster_preset("cpu", 2), t, pins, true);
  const double block = static_cast<double>(g.layers.at(1).params) * t.param_bytes;
  CHECK(copies.prediction.ranks[0].memory.activations ==
        Approx(sends.prediction.ranks[0].memory.activations + block));
  // ZeRO-3 casts what it gathers: no copies per forward.
  pins.dp = 1;
  pins.zero_stage = 3;
  CHECK(evaluate_layout(g, cluster_preset("cpu", 2), t, pins, true).prediction.ranks[0].memory.activations ==
        Approx(sends.prediction.ranks[0].memory.activations));
}

TEST_CASE("plan JSON carries the memory choices only when not the default, and reads them back", "[plan_json][memory]") {
  Pins pins = layout_pins(1, 2, 1, 0, 2, ScheduleKind::one_f_one_b);
  pins.recompute = Recompute::none;
  const Plan plain = evaluate_layout(build_transformer(tiny_llama(true, true)), cluster_preset("cpu", 2),
                                     global_batch(8), pins, true);
  const std::string text = to_json(plain);
  for (const char* key : {"fused_kernels", "dropout", "pipeline_sends_kept", "weights_cast_per_forward"}) {
    INFO(key);
    CHECK(text.find(std::string("\"") + key + "\"") == std::string::npos);
  }
  TrainingConfig t = global_batch(8);
  t.pipeline_sends_kept = true;
  t.weights_cast_per_forward = true;
  const Plan runtime = evaluate_layout(build_transformer(tiny_llama(false, false)), cluster_preset("cpu", 2), t, pins,
                                       true);
  const std::string written = to_json(runtime);
  CHECK(written.find("\"fused_kernels\": false") != std::string::npos);
  CHECK(written.find("\"dropout\": false") != std::string::npos);
  CHECK(written.find("\"pipeline_sends_kept\": true") != std::string::npos);
  CHECK(written.find("\"weights_cast_per_forward\": true") != std::string::npos);
  const Plan back = plan_from_json(written);
  CHECK(back == runtime);
  CHECK(!back.transformer->fused_kernels);
  CHECK(back.training.weights_cast_per_forward);
}

TEST_CASE("with one stage per rank the walk peaks at the simulated peak count plus the workspace", "[cost_model][memory]") {
  // predict() takes this shortcut for v = 1 without kept sends: check it equals the walk for
  // every schedule generated with one stage per rank.
  int checked = 0;
  for (ScheduleKind kind : {ScheduleKind::none, ScheduleKind::gpipe, ScheduleKind::one_f_one_b,
                            ScheduleKind::zero_bubble_h1}) {
    for (int64_t p = 1; p <= 6; ++p) {
      if ((kind == ScheduleKind::none) != (p == 1)) continue;
      for (int64_t m = 1; m <= 12; ++m) {
        const Schedule sch = make_schedule(kind, p, m, 1);
        std::vector<StageCosts> costs(static_cast<size_t>(p));
        for (auto& c : costs) c.forward_s = c.backward_input_s = c.backward_weight_s = 1;
        const SimulationResult sim = simulate(sch, costs);
        for (int64_t r = 0; r < p; ++r) {
          std::vector<double> kept(static_cast<size_t>(p), 0.0), workspace = kept;
          kept[r] = 3;
          workspace[r] = 5;
          INFO(to_string(kind) << " p " << p << " m " << m << " rank " << r);
          CHECK(peak_activation_bytes(sch.per_rank[r], kept, workspace, std::vector<double>(p, 0.0),
                                      std::vector<double>(p, 0.0)) == sim.peak_in_flight[r] * 3.0 + 5);
          ++checked;
        }
      }
    }
  }
  CHECK(checked > 200);
}
