// Cost model against published worked examples (docs/cost_model.md).
#include <algorithm>
#include "catch_compat.h"
#include <set>

#include "monarch/planner/collectives.h"
#include "monarch/planner/cost_model.h"
#include "monarch/planner/model_graph.h"
#include "monarch/planner/plan.h"
#include "monarch/planner/search.h"
#include "test_configs.h"

using namespace monarch::planner;
using Catch::Matchers::WithinRel;

namespace {

TransformerConfig gpt3() {
  TransformerConfig c;
  c.name = "gpt3-175b";
  c.layers = 96;
  c.hidden = 12288;
  c.heads = 96;
  c.seq = 2048;
  c.vocab = 51200;
  return c;
}

const Layer& first_block(const ModelGraph& g) { return g.layers.at(1); }

// A plan for `g` on pp x 1 x tp devices of `cluster`: the layers before `cut` on stage 0,
// the rest on stage 1 (or everything on stage 0 when pp = 1).
Plan two_stage_plan(const ModelGraph& g, const Cluster& cluster, int64_t tp, size_t cut,
                    bool sequence_parallel) {
  Plan plan;
  plan.model_name = g.name;
  plan.model_params = g.total_params();
  plan.transformer = g.transformer;
  plan.cluster = cluster;
  plan.training.global_batch = 8;
  plan.mesh = {2, 1, tp};
  plan.micro_batch_size = 2;
  plan.num_micro_batches = 4;
  plan.schedule = ScheduleKind::one_f_one_b;
  plan.sequence_parallel = sequence_parallel;
  for (size_t i = 0; i < g.layers.size(); ++i) {
    LayerPlacement lp;
    lp.name = g.layers[i].name;
    lp.kind = g.layers[i].kind;
    lp.params = g.layers[i].params;
    lp.tp = tp > 1 ? g.layers[i].tp : TpPattern::replicated;
    lp.tp_dims = g.layers[i].tp_dims;
    lp.stage = i < cut ? 0 : 1;
    plan.layers.push_back(lp);
  }
  validate(plan, g);
  return plan;
}

}  // namespace

TEST_CASE("ZeRO paper, Fig. 1: 7.5B parameters on 64-way data parallelism", "[cost_model][zero]") {
  // Rajbhandari et al. 2020: (2 + 2 + K) * Psi with K = 12, Psi = 7.5B, Nd = 64:
  // 120 GB baseline, 31.4 GB (P_os), 16.6 GB (P_os+g), 1.9 GB (P_os+g+p).
  const double psi = 7.5e9;
  const double gb = 1e9;
  CHECK(zero_model_state_bytes(psi, 64, 0).total() / gb == Approx(120.0).epsilon(1e-12));
  CHECK(zero_model_state_bytes(psi, 64, 1).total() / gb == Approx(31.4).margin(0.05));
  CHECK(zero_model_state_bytes(psi, 64, 2).total() / gb == Approx(16.6).margin(0.05));
  CHECK(zero_model_state_bytes(psi, 64, 3).total() / gb == Approx(1.9).margin(0.05));
  // Exact values behind the rounded ones.
  CHECK(zero_model_state_bytes(psi, 64, 1).total() == Approx(psi * (4 + 12.0 / 64)));
  CHECK(zero_model_state_bytes(psi, 64, 2).total() == Approx(psi * (2 + 14.0 / 64)));
  CHECK(zero_model_state_bytes(psi, 64, 3).total() == Approx(psi * 16.0 / 64));
  // Which parts are divided at each stage.
  const auto s2 = zero_model_state_bytes(psi, 64, 2);
  CHECK(s2.params == Approx(2 * psi));
  CHECK(s2.grads == Approx(2 * psi / 64));
  CHECK(s2.optimizer == Approx(12 * psi / 64));
  // One rank: nothing to divide.
  CHECK(zero_model_state_bytes(psi, 1, 3).total() == Approx(16 * psi));
}

TEST_CASE("Megatron FLOPs formula (Narayanan et al. 2021)", "[cost_model][flops]") {
  // F = 96 B s l h^2 (1 + s/6h + V/16lh), checked by hand for GPT-3 175B at B = 1536:
  // 96*1536*2048*96*12288^2 = 4377498837804122112; times (1 + 2048/73728 + 51200/18874368).
  const double f = narayanan_flops_per_iteration(1536, 2048, 96, 12288, 51200);
  CHECK_THAT(f, WithinRel(4377498837804122112.0 * (1 + 2048.0 / 73728 + 51200.0 / 18874368), 1e-12));
  CHECK_THAT(f, WithinRel(4.5108e18, 1e-4));

  // The per-layer sum of the built graph is the same formula: blocks 4 passes, logits 3.
  for (const auto& [layers, hidden, heads, seq, vocab] :
       std::vector<std::tuple<int, int, int, int, int>>{
           {96, 12288, 96, 2048, 51200}, {128, 25600, 160, 2048, 51200}, {4, 256, 8, 128, 1000}}) {
    TransformerConfig c = transformer_config(layers, hidden, heads, seq, vocab);
    const ModelGraph g = build_transformer(c);
    CHECK_THAT(narayanan_flops_per_step(g, 8), WithinRel(narayanan_flops_per_iteration(8, seq, layers, hidden, vocab), 1e-12));
    // Model FLOPs (no recompute): 72 B s l h^2 (1 + s/6h) + 6 B s h V (Korthikanti et al.).
    const double s = seq, l = layers, h = hidden, V = vocab;
    CHECK_THAT(model_flops_per_step(g, 8), WithinRel(72.0 * 8 * s * l * h * h * (1 + s / (6 * h)) + 6.0 * 8 * s * h * V, 1e-12));
  }
}

TEST_CASE("GPT-3 parameter count matches Narayanan et al.'s P formula", "[cost_model][params]") {
  // P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) counts biases and learned position
  // embeddings, which the builder leaves out (13h -> 4h per layer, no s*h): 0.1% apart.
  TransformerConfig c = gpt3();
  c.tied_embeddings = true;
  const ModelGraph g = build_transformer(c);
  const double l = 96, h = 12288, V = 51200, s = 2048;
  const double paper = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h));
  CHECK_THAT(static_cast<double>(g.total_params()), WithinRel(paper, 2e-3));
  CHECK(paper / 1e9 == Approx(174.6).margin(0.1));
}

TEST_CASE("Korthikanti et al. 2022 activation formulas", "[cost_model][activations]") {
  TransformerConfig c = gpt3();
  c.attention = AttentionKernel::materialized;  // the paper's Megatron kept the scores
  const ModelGraph g = build_transformer(c);
  const Layer& block = first_block(g);
  const double s = 2048, h = 12288, a = 96;
  for (int64_t b : {1, 4}) {
    for (int64_t t : {1, 2, 8}) {
      for (bool sp : {false, true}) {
        if (sp && t == 1) continue;
        for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full}) {
          INFO("b=" << b << " t=" << t << " sp=" << sp << " recompute=" << to_string(r));
          CHECK_THAT(layer_activation_bytes(block, b, t, sp, r),
                     WithinRel(korthikanti_layer_activation_bytes(s, b, h, a, t, sp, r), 1e-12));
        }
      }
    }
  }
  // The paper's closed forms, written out (Table 2 of the paper), b = 1:
  const double sbh = s * h;
  CHECK(korthikanti_layer_activation_bytes(s, 1, h, a, 1, false, Recompute::none) ==
        Approx(sbh * (34 + 5 * a * s / h)));
  CHECK(korthikanti_layer_activation_bytes(s, 1, h, a, 8, false, Recompute::none) ==
        Approx(sbh * (10 + 24.0 / 8 + 5 * a * s / (h * 8))));
  CHECK(korthikanti_layer_activation_bytes(s, 1, h, a, 8, true, Recompute::none) ==
        Approx(sbh / 8 * (34 + 5 * a * s / h)));
  CHECK(korthikanti_layer_activation_bytes(s, 1, h, a, 8, true, Recompute::selective) ==
        Approx(34 * sbh / 8));
  CHECK(korthikanti_layer_activation_bytes(s, 1, h, a, 8, false, Recompute::full) == Approx(2 * sbh));
  // By hand: 34 * 2048 * 12288 / 8 bytes with tp 8, sequence parallel, selective recompute.
  CHECK(layer_activation_bytes(block, 1, 8, true, Recompute::selective) == 106954752.0);
}

TEST_CASE("FlashAttention keeps no s x s scores: the same FLOPs, selective recompute has nothing to drop",
          "[cost_model][activations]") {
  TransformerConfig c = gpt3();
  c.attention = AttentionKernel::materialized;
  const Layer materialized = first_block(build_transformer(c));
  c.attention = AttentionKernel::flash;
  const Layer flash = first_block(build_transformer(c));
  const double s = 2048, h = 12288, a = 96;
  CHECK(flash.forward_flops_per_sample == materialized.forward_flops_per_sample);
  CHECK(flash.activations.attention_scores == 0);
  // 34 sbh and one fp32 log-sum-exp per head and row: with flash, no recompute keeps what
  // selective would, and selective has nothing to rebuild (no recompute time).
  CHECK(layer_activation_bytes(flash, 1, 1, false, Recompute::none) == Approx(s * h * 34 + 4 * a * s));
  CHECK(layer_activation_bytes(flash, 1, 1, false, Recompute::selective) ==
        layer_activation_bytes(flash, 1, 1, false, Recompute::none));
  ModelGraph g = build_transformer(c);
  const Cluster cluster = cluster_preset("h100-80gb", 8);
  TrainingConfig t;
  t.global_batch = 8;
  Layout l;
  l.recompute = Recompute::selective;
  CHECK(layer_costs(g, cluster, t, l)[1].recompute_s == 0);
  // Flash is what a TransformerConfig means unless it says otherwise.
  CHECK(TransformerConfig{}.attention == AttentionKernel::flash);
}

TEST_CASE("grouped KV heads and gated MLP change activations and FLOPs as expected", "[cost_model]") {
  TransformerConfig c;  // Llama-2 70B-like block
  c.layers = 2; c.hidden = 8192; c.heads = 64; c.kv_heads = 8; c.ffn = 28672; c.gated_mlp = true;
  c.seq = 4096; c.vocab = 32000;
  const ModelGraph g = build_transformer(c);
  const Layer& block = first_block(g);
  const double h = 8192, kv = h / 8, f = 28672, s = 4096;
  CHECK(block.params == static_cast<int64_t>(2 * h * h + 2 * h * kv + 3 * h * f + 4 * h));
  CHECK(block.forward_flops_per_sample == Approx(2 * s * (2 * h * h + 2 * h * kv + 3 * h * f) + 4 * s * s * h));
  // tp-sharded activations: Q and attention output (2sh each) + K, V (2s*kv each) + 3 gated
  // tensors + flash attention's fp32 log-sum-exp per head and row.
  CHECK(block.activations.tp_sharded == Approx(2 * s * (2 * h + 2 * kv) + 3 * 2 * s * f + 4 * 64 * s));
}

TEST_CASE("layer costs: recompute adds forward work, tp divides it", "[cost_model]") {
  TransformerConfig c = gpt3();
  c.attention = AttentionKernel::materialized;  // scores kept: what selective re-runs
  const ModelGraph g = build_transformer(c);
  const Cluster cluster = cluster_preset("a100-80gb", 8);
  TrainingConfig t;
  t.global_batch = 8;
  Layout l;
  l.tp = 1;
  const auto base = layer_costs(g, cluster, t, l);
  l.recompute = Recompute::full;
  const auto full = layer_costs(g, cluster, t, l);
  l.recompute = Recompute::selective;
  const auto selective = layer_costs(g, cluster, t, l);
  const size_t b = 1;
  CHECK(base[b].recompute_s == 0);
  CHECK(full[b].recompute_s == Approx(base[b].forward_s));
  CHECK(selective[b].recompute_s > 0);
  CHECK(selective[b].recompute_s < 0.1 * full[b].recompute_s);  // Korthikanti: ~2.7% overhead
  CHECK(full[b].backward_s == Approx(2 * base[b].forward_s + full[b].recompute_s));
  // The loss head is never recomputed.
  CHECK(full.back().recompute_s == 0);
  l.recompute = Recompute::none;
  l.tp = 8;
  const auto tp8 = layer_costs(g, cluster, t, l);
  CHECK(tp8[b].params == Approx(base[b].params / 8));
  CHECK(tp8[b].tp_comm_s > 0);
  CHECK(tp8[b].forward_s - tp8[b].tp_comm_s / 2 < base[b].forward_s / 7);
}

TEST_CASE("predicted memory of a pinned plan adds up", "[cost_model]") {
  const ModelGraph g = build_transformer(gpt3());
  Plan plan;
  plan.model_name = g.name;
  plan.model_params = g.total_params();
  plan.cluster = cluster_preset("a100-80gb", 64);
  plan.training.global_batch = 64;
  plan.mesh = {8, 1, 8};
  plan.micro_batch_size = 1;
  plan.num_micro_batches = 64;
  plan.schedule = ScheduleKind::one_f_one_b;
  plan.recompute = Recompute::full;
  for (size_t i = 0; i < g.layers.size(); ++i) {
    LayerPlacement lp;
    lp.name = g.layers[i].name;
    lp.kind = g.layers[i].kind;
    lp.params = g.layers[i].params;
    lp.tp = g.layers[i].tp;
    lp.tp_dims = g.layers[i].tp_dims;
    lp.stage = i == 0 ? 0 : std::min<int64_t>(7, (static_cast<int64_t>(i) - 1) / 12);
    plan.layers.push_back(lp);
  }
  const Prediction p = predict(g, plan);
  CHECK(p.memory_bytes_per_device == Approx(p.memory.total()));
  // Stage 0 (embedding + 12 blocks) holds the most: 16 bytes per parameter, tp 8.
  const double stage0 = (g.layers[0].params + 12.0 * g.layers[1].params) / 8;
  CHECK(p.memory.params + p.memory.grads + p.memory.optimizer == Approx(16 * stage0).epsilon(0.02));
  // 1F1B: stage 0 keeps p = 8 micro-batches: 12 layers x 2sbh (full recompute, no sp).
  const double kept = 8 * 12 * 2.0 * 2048 * 12288 + 8 * 2048 * 12288.0;  // + embedding dropout masks
  CHECK(p.memory.activations >= kept);
  CHECK(p.step_time_s == p.time.total);
  // The parts add up to the total: the busiest rank's compute, tp and ZeRO time is its busy
  // time in the simulation, the rest of the makespan is pp comm + bubble; the end of step
  // adds dp comm and the optimizer, and the wait for the slowest of the 8 nodes scales the
  // whole (straggler_factor). Exact up to the order of summation.
  CHECK(p.time.total == Approx(p.time.compute + p.time.tp_comm + p.time.dp_comm + p.time.pp_comm +
                               p.time.bubble + p.time.optimizer + p.time.stragglers)
                            .epsilon(1e-9));
  CHECK(p.time.stragglers == Approx((straggler_factor(plan.cluster, 64) - 1) * (p.time.total - p.time.stragglers)));
  CHECK(p.time.stragglers > 0);
  CHECK(p.bubble_fraction > 0);
  CHECK(p.mfu > 0.2);
  CHECK(p.mfu < 0.7);
}

TEST_CASE("the pre-simulation bound never exceeds the simulated step time", "[cost_model][bound]") {
  // predict_if_faster may skip the simulation only when the layout cannot win; if its bound
  // were above the real time the search could drop the best plan.
  TransformerConfig c = transformer_config(24, 2048, 16, 1024, 32000);
  const ModelGraph g = build_transformer(c);
  uint64_t seed = 7;
  auto next = [&] { seed = seed * 6364136223846793005ULL + 1442695040888963407ULL; return seed >> 33; };
  const std::pair<ScheduleKind, int64_t> schedules[] = {
      {ScheduleKind::gpipe, 1}, {ScheduleKind::one_f_one_b, 1}, {ScheduleKind::zero_bubble_h1, 1},
      {ScheduleKind::interleaved_1f1b, 2}};
  int checked = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const auto [kind, v] = schedules[trial % 4];
    const int64_t pp = 2 + static_cast<int64_t>(next() % 3);  // 2..4
    const int64_t stages = pp * v;
    Plan plan;
    plan.model_name = g.name;
    plan.model_params = g.total_params();
    plan.cluster = cluster_preset("a100-80gb", 8 * pp);
    plan.mesh = {pp, 8, 1};
    plan.training.global_batch = 8 * pp * (1 + static_cast<int64_t>(next() % 3));
    plan.micro_batch_size = 1;
    plan.num_micro_batches = plan.training.global_batch / 8;
    plan.schedule = kind;
    plan.virtual_stages = v;
    plan.zero_stage = static_cast<int64_t>(next() % 4);
    // Random, uneven stage boundaries, between blocks (where the runtimes cut).
    std::vector<int64_t> allowed;
    for (size_t i = 1; i < g.layers.size(); ++i) {
      if (g.layers[i - 1].kind == LayerKind::block && g.layers[i].kind == LayerKind::block) {
        allowed.push_back(static_cast<int64_t>(i));
      }
    }
    std::vector<int64_t> cuts;
    while (static_cast<int64_t>(cuts.size()) < stages - 1) {
      const int64_t cut = allowed[next() % allowed.size()];
      if (std::find(cuts.begin(), cuts.end(), cut) == cuts.end()) cuts.push_back(cut);
    }
    std::sort(cuts.begin(), cuts.end());
    for (size_t i = 0, s = 0; i < g.layers.size(); ++i) {
      while (s < cuts.size() && static_cast<int64_t>(i) >= cuts[s]) ++s;
      LayerPlacement lp;
      lp.name = g.layers[i].name;
      lp.kind = g.layers[i].kind;
      lp.params = g.layers[i].params;
      lp.stage = static_cast<int64_t>(s);
      plan.layers.push_back(lp);
    }
    validate(plan, g);
    const Prediction full = predict(g, plan);
    INFO("trial " << trial << " " << plan.summary());
    const auto bounded = predict_if_faster(g, plan, nullptr, full.step_time_s * (1 + 1e-9));
    REQUIRE(bounded);
    CHECK(bounded->step_time_s == full.step_time_s);
    // And a threshold below the real time can be cut (for 1F1B-like schedules the bound is tight
    // enough to do so at half the time).
    if (kind != ScheduleKind::interleaved_1f1b) {
      CHECK_FALSE(predict_if_faster(g, plan, nullptr, full.step_time_s * 0.5));
    }
    ++checked;
  }
  CHECK(checked == 40);
}

TEST_CASE("estimated in-flight micro-batches match the simulated schedules",
          "[cost_model][schedule]") {
  // The stage partition bounds memory with estimated_in_flight before any schedule is
  // simulated; predict() then charges the simulated peak. They must agree (1F1B, GPipe,
  // ZB-H1) or the estimate must not be below the simulation (interleaved, per chunk).
  for (int64_t p : {2, 3, 4, 8}) {
    for (int64_t m : {1, 2, 3, 4, 8, 16}) {
      for (ScheduleKind kind : {ScheduleKind::one_f_one_b, ScheduleKind::gpipe, ScheduleKind::zero_bubble_h1,
                                ScheduleKind::interleaved_1f1b, ScheduleKind::zero_bubble_v}) {
        for (int64_t v : {1, 2, 3, 4, 6}) {
          if (kind == ScheduleKind::zero_bubble_v && v != 2) continue;
          if (kind != ScheduleKind::zero_bubble_v && (kind == ScheduleKind::interleaved_1f1b) != (v > 1)) continue;
          if (kind == ScheduleKind::interleaved_1f1b && m % p != 0) continue;
          Layout l;
          l.pp = p;
          l.num_micro_batches = m;
          l.schedule = kind;
          l.virtual_stages = v;
          const Schedule schedule = make_schedule(kind, p, m, v);
          const SimulationResult sim = simulate(schedule, {StageCosts{}});
          // Per stage (the search's partition charges these under interleaving): each
          // chunk's own peak is at most its rank's, and together they cover the rank's.
          const std::vector<int64_t> stage_peaks = stage_peak_in_flight(schedule);
          REQUIRE(stage_peaks.size() == static_cast<size_t>(p * v));
          if (kind == ScheduleKind::interleaved_1f1b) {  // counted without the schedule: the same
            CHECK(interleaved_stage_peak_in_flight(p, m, v) == stage_peaks);
          }
          for (int64_t r = 0; r < p; ++r) {
            INFO(to_string(kind) << " p=" << p << " m=" << m << " v=" << v << " rank " << r);
            const double simulated = static_cast<double>(sim.peak_in_flight[r]);
            int64_t chunks_sum = 0;
            for (int64_t stage = 0; stage < p * v; ++stage) {
              if (schedule.rank_of_stage(stage) != r) continue;
              CHECK(stage_peaks[stage] <= sim.peak_in_flight[r]);
              CHECK(stage_peaks[stage] >= 1);
              chunks_sum += stage_peaks[stage];
            }
            CHECK(chunks_sum >= sim.peak_in_flight[r]);
            if (v == 1) CHECK(stage_peaks[r] == sim.peak_in_flight[r]);
            if (v > 1) {
              CHECK(estimated_in_flight(l, r) >= simulated / static_cast<double>(v));
            } else {
              CHECK(estimated_in_flight(l, r) == simulated);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("interleaved chunks keep their own micro-batches in flight", "[cost_model][schedule]") {
  // Megatron-LM's interleaved 1F1B on p=2, v=2, m=4. The last rank warms up with
  // (p - r - 1) 2 + (v - 1) p = 2 forwards of its first chunk (stage 1, micro-batches 0 and 1);
  // in the steady state each forward of its head chunk (stage 3) is followed by that micro-
  // batch's backward, and its first chunk's third forward comes before its first backward.
  const std::vector<int64_t> peaks = stage_peak_in_flight(make_schedule(ScheduleKind::interleaved_1f1b, 2, 4, 2));
  CHECK(peaks[3] == 1);
  CHECK(peaks[1] == 3);
  // Spread evenly, the rank's peak of 3 would charge each chunk 1.5.
  CHECK(simulate(make_schedule(ScheduleKind::interleaved_1f1b, 2, 4, 2), {StageCosts{}}).peak_in_flight[1] == 3);
}

TEST_CASE("p2p transfers and buffers are the stage output's tp shard with sequence parallelism",
          "[cost_model]") {
  TransformerConfig c = transformer_config(4, 1024, 16, 512, 32000);
  const ModelGraph g = build_transformer(c);
  const Cluster cluster = cluster_preset("a100-80gb", 4);
  // Stage 0: embedding and three blocks (the most loaded rank); stage 1: the last block, norm
  // and head (the runtimes cut pipelines between blocks).
  const Plan plan = two_stage_plan(g, cluster, 2, 4, true);
  Layout l;
  l.pp = 2;
  l.tp = 2;
  l.micro_batch_size = 2;
  l.num_micro_batches = 4;
  l.schedule = ScheduleKind::one_f_one_b;
  l.sequence_parallel = true;
  // b s h bf16 activations, over tp = 2.
  const double shard = 2.0 * 512 * 1024 * 2 / 2;
  CHECK(stage_p2p_bytes(g, plan.training, l, 3) == shard);
  const Prediction p = predict(g, plan);
  CHECK(p.memory.buffers == 2 * shard);  // activation in, gradient out (dp = 1: no buckets)
  const auto costs = layer_costs(g, cluster, plan.training, l);
  Link link = axis_link(cluster, 2, 1, 2, Axis::pp);
  link.ranks = 2;
  CHECK(estimate_stage(g, costs, cluster, plan.training, l, 0, 3).costs.p2p_s ==
        collective_seconds(Collective::send_recv, shard, link));
}

TEST_CASE("each tied group's gradient is all-reduced among the ranks holding it", "[cost_model]") {
  TransformerConfig c = transformer_config(4, 1024, 16, 512, 32000, /*tied=*/true);
  ModelGraph g = build_transformer(c);
  const Cluster cluster = cluster_preset("a100-80gb", 2);
  // dp = 1, ZeRO 0: the end-of-step communication is only the tied all-reduces.
  Link link = axis_link(cluster, 2, 1, 1, Axis::pp);
  link.ranks = 2;
  auto all_reduce = [&](const Layer& layer) {
    return collective_seconds(Collective::all_reduce, 2.0 * layer.params, link);
  };
  const Prediction one = predict(g, two_stage_plan(g, cluster, 1, 3, false));
  CHECK(one.time.dp_comm == all_reduce(g.layers.front()));
  // A second group, of two blocks on different stages: its own all-reduce, of a block's
  // weight (not the embedding's).
  g.tied_groups.push_back({2, 4});
  const Prediction two = predict(g, two_stage_plan(g, cluster, 1, 3, false));
  CHECK(two.time.dp_comm ==
        Approx(all_reduce(g.layers.front()) + all_reduce(g.layers[2])).epsilon(1e-12));
  // A group whose layers share a stage needs no communication.
  g.tied_groups.back() = {3, 4};
  const Prediction same_stage = predict(g, two_stage_plan(g, cluster, 1, 3, false));
  CHECK(same_stage.time.dp_comm == one.time.dp_comm);
}

TEST_CASE("a weight tied between two stages of one rank (ZB-V) is one parameter there", "[cost_model]") {
  TransformerConfig c = transformer_config(4, 1024, 16, 512, 32000, /*tied=*/true);
  const ModelGraph g = build_transformer(c);
  const Cluster cluster = cluster_preset("a100-80gb", 2);
  Plan plan = two_stage_plan(g, cluster, 1, 3, false);
  // Four stages: through the first block, the second, the third, the rest (the head).
  std::vector<int64_t> blocks;
  for (size_t i = 0; i < g.layers.size(); ++i) {
    if (g.layers[i].kind == LayerKind::block) blocks.push_back(static_cast<int64_t>(i));
  }
  REQUIRE(blocks.size() == 4);
  for (size_t i = 0; i < g.layers.size(); ++i) {
    const auto at = static_cast<int64_t>(i);
    plan.layers[i].stage = at <= blocks[0] ? 0 : at <= blocks[1] ? 1 : at <= blocks[2] ? 2 : 3;
  }
  plan.schedule = ScheduleKind::zero_bubble_v;
  plan.virtual_stages = 2;
  validate(plan, g);
  const Prediction v = predict(g, plan);
  REQUIRE(v.ranks.size() == 2);
  // Rank 0 runs stages 0 and 3 (embedding and head): the job holds the model once.
  const double bytes = plan.training.param_bytes;
  CHECK(v.ranks[0].memory.params + v.ranks[1].memory.params ==
        Approx(static_cast<double>(g.total_params()) * bytes).epsilon(1e-12));
  CHECK(v.time.dp_comm == 0.0);  // nothing to all-reduce between ends on one rank
  // The same stages round robin (interleaved: stages 0 and 2 on rank 0, 1 and 3 on rank 1):
  // each end's rank holds a copy.
  plan.schedule = ScheduleKind::interleaved_1f1b;
  const Prediction rr = predict(g, plan);
  const double tied = static_cast<double>(g.tied_params(0));
  CHECK(rr.ranks[0].memory.params + rr.ranks[1].memory.params ==
        Approx((static_cast<double>(g.total_params()) + tied) * bytes).epsilon(1e-12));
}

TEST_CASE("tensor-parallel bytes per step: Megatron's all-reduces as ring volumes", "[cost_model][tp]") {
  TransformerConfig c = transformer_config(2, 64, 4, 32, 128);
  c.dtype = DType::fp32;
  const ModelGraph g = build_transformer(c);
  TrainingConfig t;
  t.global_batch = 8;
  t.activation_bytes = 4;
  Layout l;
  l.tp = 2;
  l.micro_batch_size = 4;
  l.num_micro_batches = 2;
  // Per micro-batch: 2 forward + 2 backward all-reduces per block, 1 for the embedding, 1
  // for the head's input gradient, each of b*s*h fp32 values; ring: 2(t-1)/t of it.
  const double message = 4.0 * 32 * 64 * 4;
  const double expected = (2 * 4 + 1 + 1) * message * 2 * (2 - 1) / 2.0 * 2;
  CHECK_THAT(tp_bytes_per_step(g, t, l), WithinRel(expected, 1e-12));
  // Full recompute runs the forward all-reduces of every recomputable layer again: the
  // blocks' two each and the embedding's (the graph marks only the head as not recomputed).
  l.recompute = Recompute::full;
  CHECK_THAT(tp_bytes_per_step(g, t, l), WithinRel(expected + (2 * 2 + 1) * message * 2, 1e-12));
  l.tp = 1;
  CHECK(tp_bytes_per_step(g, t, l) == 0.0);
}

TEST_CASE("GEMM utilization: tile and wave quantization, split-K for few tiles", "[cost_model][gemm]") {
  CHECK(gemm_utilization(8192, 8192, 8192, 0) == 1.0);  // no SM count: no effect (CPUs)
  // 64 x 64 = 4096 tiles in 38 waves of 108: the last wave nearly full.
  CHECK(gemm_utilization(8192, 8192, 8192, 108) == Approx(4096.0 / (38 * 108)));
  // GPT-3's 18B row at t = 8: q/k/v is 2048 x 6144 @ 6144 x 2304 per rank: 16 x 18 = 288
  // tiles, 3 waves of 108.
  CHECK(gemm_utilization(2048, 3 * 6144 / 8, 6144, 108) == Approx(288.0 / 324));
  // A side that is not a tile multiple pays for the padded tile.
  CHECK(gemm_utilization(2048, 8 * 108 * 128 + 64, 4096, 108) < gemm_utilization(2048, 8 * 108 * 128, 4096, 108));
  // One tile, K = 4096: split 8 ways over K, still most SMs idle.
  CHECK(gemm_utilization(128, 100, 4096, 108) == Approx((128.0 * 100 * 8 / (128 * 128)) / 108));
}

TEST_CASE("GEMM shapes: cutting a small model's GEMMs with tp costs more per FLOP", "[cost_model][gemm]") {
  TransformerConfig c = transformer_config(2, 1024, 16, 512, 32000);
  const ModelGraph g = build_transformer(c);
  const Cluster a100 = cluster_preset("a100-80gb", 8);
  TrainingConfig t;
  t.global_batch = 8;
  Layout l;
  l.micro_batch_size = 1;
  const double whole = layer_costs(g, a100, t, l)[1].forward_s;
  l.tp = 8;
  const LayerCost split = layer_costs(g, a100, t, l)[1];
  // The block's GEMMs at tp 8 (N or K of 128 to 1536, M = 512) leave most of 108 SMs idle.
  CHECK((split.forward_s - split.forward_tp_s) * 8 > 1.5 * whole);
  // On a CPU cluster (no SM count) the split is exact for the GEMM FLOPs.
  Cluster cpu = cluster_preset("cpu", 8);
  l.tp = 1;
  const LayerCost cpu_whole = layer_costs(g, cpu, t, l)[1];
  CHECK(cpu.sm_count == 0);
  CHECK(cpu_whole.forward_s > 0);
  // Larger micro-batches fill more tiles: time per sample falls.
  l.tp = 8;
  l.micro_batch_size = 8;
  const LayerCost bigger = layer_costs(g, a100, t, l)[1];
  CHECK((bigger.forward_s - bigger.forward_tp_s) / 8 < split.forward_s - split.forward_tp_s);
}

namespace {

// fp32 training with AdamW as the runtime runs it (torch_monarch.api.runtime_training).
TrainingConfig fp32_adamw(int64_t global_batch) {
  TrainingConfig t;
  t.global_batch = global_batch;
  t.compute_dtype = DType::fp32;
  t.param_bytes = t.grad_bytes = t.activation_bytes = 4;
  t.optimizer_bytes = 8;
  return t;
}

MemoryBreakdown zero_memory_of(const ModelGraph& g, const TrainingConfig& t, int64_t zero, int64_t micro_batch) {
  Pins pins = layout_pins(1, 1, 4, zero, micro_batch, ScheduleKind::none);
  pins.recompute = Recompute::none;
  const Plan p = evaluate_layout(g, cluster_preset("cpu", 4), t, pins, /*allow_over_memory=*/true);
  CHECK(p.prediction.memory_bytes_per_device == Approx(p.prediction.memory.total()));
  return p.prediction.memory;
}

}  // namespace

TEST_CASE("ZeRO-1/2 memory as the runtime holds it: the optimizer on the parameters' own rows in fp32, whole "
          "gradients only within one backward", "[cost_model][zero]") {
  // bench/layouts.py's GPT (4 blocks, h 256, s 64, V 1024), fp32, on 4 ranks.
  TransformerConfig cfg = transformer_config(4, 256, 8, 64, 1024);
  cfg.dtype = DType::fp32;
  cfg.attention = AttentionKernel::materialized;
  const ModelGraph g = build_transformer(cfg);
  const double P = static_cast<double>(g.total_params()), block = static_cast<double>(g.layers.at(1).params);
  REQUIRE(g.layers.at(1).kind == LayerKind::block);
  const double root = P - 4 * block;
  const TrainingConfig t = fp32_adamw(16);
  const MemoryBreakdown dp = zero_memory_of(g, t, 0, 4);

  for (int64_t zero : {1, 2}) {
    INFO("ZeRO-" << zero);
    // One micro-batch of 4: the activations (larger than the gradients here) are all there at
    // the backward's start, beside the root unit's and the first block's whole gradients.
    const MemoryBreakdown m = zero_memory_of(g, t, zero, 4);
    CHECK(m.params == Approx(4 * P));  // whole parameters; the optimizer steps on this rank's rows of them
    CHECK(m.optimizer == Approx(8 * P / 4));
    CHECK(m.grads == Approx(4 * P / 4));           // the shards' reduced gradients
    CHECK(m.activations == Approx(dp.activations));
    CHECK(m.buffers == Approx(4 * (root + block)));
    REQUIRE(m.activations + m.buffers > 4 * P + 2 * 4 * block);  // so the start is the peak
    // Not the sum of every part at once (whole gradients and all activations together).
    CHECK(m.total() < m.params + 4 * P + m.optimizer + m.activations);

    // Four micro-batches of 1: the whole gradients add up from the first backward on, beside
    // the activations of the micro-batch in flight.
    const MemoryBreakdown acc = zero_memory_of(g, t, zero, 1);
    CHECK(acc.grads == Approx(4 * P));
    CHECK(acc.activations == Approx(dp.activations / 4));
    // Two reductions in flight, each receiving the other 3 ranks' chunks (3/4 of a unit).
    CHECK(acc.buffers == Approx(2 * 4 * block * 3 / 4 + 4 * P / 4));
  }

  // Few activations (a 1-token sequence): the peak is the backward's end, activations freed.
  TransformerConfig tiny = cfg;
  tiny.seq = 1;
  const ModelGraph h = build_transformer(tiny);
  const double Ph = static_cast<double>(h.total_params()), bh = static_cast<double>(h.layers.at(1).params);
  const MemoryBreakdown z1 = zero_memory_of(h, t, 1, 4), z2 = zero_memory_of(h, t, 2, 4);
  CHECK(z1.activations == 0);
  CHECK(z1.grads == Approx(4 * Ph + 4 * Ph / 4));  // every whole gradient, then the shards'
  CHECK(z1.buffers == Approx(2 * 4 * bh * 3 / 4));  // two reductions' receive buffers (3 of 4 chunks)
  CHECK(z2.grads == Approx(4 * Ph / 4));
  CHECK(z2.buffers == Approx(2 * 4 * bh * (1 + 3.0 / 4)));  // + the units being filled and reduced
  CHECK(z2.total() < z1.total());

  // Mixed precision: the fp32 rows are the master weights, already in optimizer_bytes (12).
  TrainingConfig bf16 = t;
  bf16.compute_dtype = DType::bf16;
  bf16.param_bytes = bf16.grad_bytes = bf16.activation_bytes = 2;
  bf16.optimizer_bytes = 12;
  const MemoryBreakdown mixed = zero_memory_of(g, bf16, 1, 4);
  CHECK(mixed.params == Approx(2 * P));
  CHECK(mixed.optimizer == Approx(12 * P / 4));
  CHECK(mixed.grads == Approx(2 * P / 4));

  // A ZeRO engine that keeps its gradients in fp32 (the runtime's, zero_grad_bytes = 4) under
  // bf16 compute: the shards' gradients and the whole ones it accumulates are 4 bytes; data
  // parallelism's gradients stay in the compute dtype.
  TrainingConfig fp32_grads = bf16;
  fp32_grads.zero_grad_bytes = 4;
  CHECK(zero_memory_of(g, fp32_grads, 2, 4).grads == Approx(4 * P / 4));
  CHECK(zero_memory_of(g, fp32_grads, 1, 1).grads == Approx(4 * P));  // accumulating: whole
  CHECK(zero_memory_of(g, fp32_grads, 0, 4).grads == Approx(2 * P));
  // It is part of the plan, and the JSON keeps it.
  Pins pins = layout_pins(1, 1, 4, 2, 4, ScheduleKind::none);
  pins.recompute = Recompute::none;
  const Plan plan = evaluate_layout(g, cluster_preset("cpu", 4), fp32_grads, pins, true);
  CHECK(plan_from_json(to_json(plan)).training.zero_grad_bytes == 4);
}
