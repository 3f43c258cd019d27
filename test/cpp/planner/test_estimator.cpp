#include "catch_compat.h"
#include <cstdint>
#include <string>

#include "monarch/planner/cost_model.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/estimator.h"
#include "monarch/planner/plan.h"
#include "monarch/planner/search.h"
#include "test_configs.h"

using namespace monarch::planner;

namespace {

ModelGraph small_gpt() {
  ModelGraph g = build_transformer(transformer_config(8, 1024, 16, 512, 32000));
  restrict_cuts_to_blocks(g);
  return g;
}

TrainingConfig batch(int64_t b) {
  TrainingConfig t;
  t.global_batch = b;
  return t;
}

// A profile that measured exactly what the analytic model predicts at tp = 1, at micro-batch
// sizes 1, 2 and 4 (the analytic time is not linear in the size: GEMM wave quantization).
MeasuredProfile analytic_profile(const ModelGraph& g, const Cluster& cluster, const TrainingConfig& t) {
  MeasuredProfile p;
  p.source = "the analytic model, written down";
  for (const auto& layer : g.layers) p.layers.push_back({layer.name, {}});
  for (int64_t mbs : {1, 2, 4}) {
    Layout l;
    l.micro_batch_size = mbs;
    const auto costs = layer_costs(g, cluster, t, l);
    for (size_t i = 0; i < g.layers.size(); ++i) {
      p.layers[i].points.push_back({mbs, costs[i].forward_s, costs[i].backward_compute_s});
    }
  }
  return p;
}

}  // namespace

TEST_CASE("a profile of what the analytic model predicts gives the analytic predictions", "[estimator]") {
  const ModelGraph g = small_gpt();
  const Cluster cluster = cluster_preset("a100-80gb", 8);
  const TrainingConfig t = batch(64);
  const ProfileEstimator profile(analytic_profile(g, cluster, t));
  // tp = 1 layouts of every kind: the same time to rounding, the same memory exactly.
  for (const Pins& pins : {layout_pins(1, 1, 8, 0, 2, ScheduleKind::none), layout_pins(1, 2, 4, 1, 2, ScheduleKind::one_f_one_b),
                           layout_pins(1, 4, 2, 3, 1, ScheduleKind::zero_bubble_h1),
                           layout_pins(1, 2, 4, 0, 4, ScheduleKind::interleaved_1f1b)}) {
    Pins p = pins;
    p.recompute = Recompute::full;
    const Plan a = evaluate_layout(g, cluster, t, p, true);
    const Plan b = evaluate_layout(g, cluster, t, p, true, &profile);
    INFO(a.summary());
    CHECK(b.summary() == a.summary());
    CHECK(b.prediction.step_time_s == Approx(a.prediction.step_time_s).epsilon(1e-9));
    CHECK(b.prediction.memory_bytes_per_device == a.prediction.memory_bytes_per_device);
    CHECK(b.prediction.time.recompute == Approx(a.prediction.time.recompute).epsilon(1e-9));
    CHECK(a.prediction.estimator == "analytic");
    CHECK(b.prediction.estimator == "profile: the analytic model, written down");
  }
}

TEST_CASE("measured layer times move the search: a slow layer gets a stage of its own", "[estimator]") {
  const ModelGraph g = small_gpt();
  const Cluster cluster = cluster_preset("a100-80gb", 8);
  const TrainingConfig t = batch(64);
  MeasuredProfile measured = analytic_profile(g, cluster, t);
  // The first block measures 6x what FLOPs say (say, an unfused kernel).
  for (auto& slow : measured.layers[1].points) {
    slow.forward_s *= 6;
    slow.backward_s *= 6;
  }
  const ProfileEstimator profile(measured);
  Pins pins = layout_pins(1, 4, 2, 0, 2, ScheduleKind::one_f_one_b);
  pins.recompute = Recompute::none;
  const Plan analytic = evaluate_layout(g, cluster, t, pins, false);
  const Plan from_profile = evaluate_layout(g, cluster, t, pins, false, &profile);
  auto layers_on_stage0 = [](const Plan& p) {
    int n = 0;
    for (const auto& l : p.layers) n += l.stage == 0;
    return n;
  };
  // Analytic: 8 blocks over 4 stages, two per stage (the embedding rides with the first).
  CHECK(layers_on_stage0(analytic) == 3);
  // Measured: the slow block shares its stage with nothing but the embedding.
  CHECK(layers_on_stage0(from_profile) == 2);
  CHECK(from_profile.prediction.step_time_s > analytic.prediction.step_time_s);
}

TEST_CASE("profile times interpolate between micro-batch sizes and split under tp", "[estimator]") {
  const ModelGraph g = small_gpt();
  const Cluster cluster = cluster_preset("a100-80gb", 8);
  const TrainingConfig t = batch(64);
  MeasuredProfile p;
  p.source = "hand";
  for (const auto& layer : g.layers) p.layers.push_back({layer.name, {{1, 1.0, 2.0}, {4, 3.0, 5.0}}});
  const ProfileEstimator profile(p);
  Layout l;
  auto at = [&](int64_t mbs, int64_t tp) {
    l.micro_batch_size = mbs;
    l.tp = tp;
    return profile.layer_costs(g, cluster, t, l)[1];  // a block
  };
  CHECK(at(1, 1).forward_s == Approx(1.0));
  CHECK(at(2, 1).forward_s == Approx(1.0 + 2.0 / 3.0));  // linear between 1 and 4
  CHECK(at(2, 1).backward_compute_s == Approx(3.0));
  CHECK(at(8, 1).forward_s == Approx(3.0 + 4 * 2.0 / 3.0));  // the last slope beyond 4
  // tp = 2: the block keeps the share of its compute the analytic model keeps on one tp rank
  // (about half: its GEMMs split, its norms do not without sequence parallelism); its
  // all-reduces come on top.
  const LayerCost split = at(4, 2);
  Layout a;
  a.micro_batch_size = 4;
  const LayerCost whole = layer_costs(g, cluster, t, a)[1];
  a.tp = 2;
  const LayerCost half = layer_costs(g, cluster, t, a)[1];
  const double share = (half.forward_s - half.forward_tp_s) / (whole.forward_s - whole.forward_tp_s);
  CHECK(share > 0.5);
  CHECK(share < 0.6);
  CHECK(split.forward_s - split.forward_tp_s == Approx(3.0 * share));
  CHECK(split.forward_tp_s == Approx(half.forward_tp_s));
  CHECK(split.backward_compute_s == Approx(5.0 * half.backward_compute_s / whole.backward_compute_s));
  // The norm layer (replicated under tp) keeps its whole time.
  l.micro_batch_size = 4;
  CHECK(profile.layer_costs(g, cluster, t, l)[g.layers.size() - 2].forward_s == Approx(3.0));

  // A noisy last segment sloping down: beyond the largest size, never less than its time.
  MeasuredProfile noisy = p;
  for (auto& layer : noisy.layers) layer.points = {{1, 1.0, 2.0}, {2, 2.0, 4.0}, {4, 1.5, 3.0}};
  const ProfileEstimator down(noisy);
  l.tp = 1;
  l.micro_batch_size = 16;
  CHECK(down.layer_costs(g, cluster, t, l)[1].forward_s == Approx(1.5));
  CHECK(down.layer_costs(g, cluster, t, l)[1].backward_compute_s == Approx(3.0));
}

TEST_CASE("a profile's links replace the cluster's and are recorded in the plan", "[estimator]") {
  const ModelGraph g = small_gpt();
  const Cluster cluster = cluster_preset("a100-80gb", 8);
  const TrainingConfig t = batch(64);
  MeasuredProfile p = analytic_profile(g, cluster, t);
  p.intra_node = LinkProfile{2e-5, 50e9};
  const ProfileEstimator profile(p);
  SearchOptions o;
  o.estimator = &profile;
  const Plan plan = search(g, cluster, t, o);
  CHECK(plan.cluster.intra_node_bytes_per_s == 50e9);
  CHECK(plan.cluster.intra_node_latency_s == 2e-5);
  CHECK(plan.cluster.inter_node_bytes_per_s == cluster.inter_node_bytes_per_s);
  CHECK(plan.prediction.estimator.rfind("profile: ", 0) == 0);
  // What the plan records survives JSON, and predict() with the same estimator agrees.
  const Plan back = plan_from_json(to_json(plan));
  CHECK(back == plan);
  CHECK(predict(g, back, nullptr, &profile).step_time_s == Approx(plan.prediction.step_time_s).epsilon(1e-12));
}

TEST_CASE("profiles of another model or malformed ones are refused by field", "[estimator]") {
  const ModelGraph g = small_gpt();
  const Cluster cluster = cluster_preset("a100-80gb", 8);
  const TrainingConfig t = batch(64);
  MeasuredProfile p = analytic_profile(g, cluster, t);
  SECTION("a layer missing") {
    p.layers.pop_back();
    const ProfileEstimator profile(p);
    SearchOptions o;
    o.estimator = &profile;
    CHECK_THROWS_WITH(search(g, cluster, t, o),
                      "profile.layers: no measurement for layer 'lm_head': the profile was measured on another model");
  }
  SECTION("a layer the model does not have") {
    p.layers.push_back({"decoder.extra", {{1, 1, 1}}});
    const ProfileEstimator profile(p);
    SearchOptions o;
    o.estimator = &profile;
    CHECK_THROWS_WITH(search(g, cluster, t, o), Catch::Contains("layer 'decoder.extra' is not in model"));
  }
  SECTION("sizes out of order, negative times, bad links") {
    p.layers[2].points = {{2, 1, 1}, {1, 1, 1}};
    CHECK_THROWS_WITH(ProfileEstimator(p), "profile.layers[2].points[1].micro_batch: sizes must be ascending without repeats");
    p.layers[2].points = {{1, -1, 1}};
    CHECK_THROWS_WITH(ProfileEstimator(p), "profile.layers[2].points[0].forward_s: must be finite and >= 0");
    p.layers[2].points = {{1, 1, 1}};
    p.inter_node = LinkProfile{1e-5, 0};
    CHECK_THROWS_WITH(ProfileEstimator(p), "profile.links.inter_node.bytes_per_s: must be finite and > 0");
    p.inter_node.reset();
    p.repeatability = 0.7;
    CHECK_THROWS_WITH(ProfileEstimator(p), Catch::Contains("profile.repeatability: must be in [0, 0.5)"));
  }
  SECTION("JSON: round trip, unknown field, wrong format") {
    p.intra_node = LinkProfile{1e-5, 1e10};
    p.repeatability = 0.012;
    const std::string text = to_json(p);
    const MeasuredProfile back = profile_from_json(text);
    CHECK(to_json(back) == text);
    CHECK(back.repeatability == Approx(0.012));
    CHECK(ProfileEstimator(back).resolution() == Approx(0.012));
    CHECK_THROWS_WITH(profile_from_json(R"({"format": "monarch-profile", "version": 1, "source": "x",
                                            "layers": [{"name": "a", "points": [{"micro_batch": 1, "forward_s": 1,
                                            "backward_s": 1, "flops": 3}]}]})"),
                      "profile.layers[0].points[0].flops: unknown field");
    CHECK_THROWS_WITH(profile_from_json(R"({"format": "monarch-plan", "version": 1, "source": "x", "layers": []})"),
                      Catch::Contains("format 'monarch-plan' is not 'monarch-profile'"));
    CHECK_THROWS_AS(profile_from_json("{"), FormatError);
    CHECK_THROWS_WITH(load_profile("/nonexistent/profile.json"), Catch::Contains("/nonexistent/profile.json"));
  }
}

TEST_CASE("ties: within the tolerance the layout with fewer moving parts wins, and says so", "[search][ties]") {
  // GPT-3 175B on 384 A100s: the fastest layouts are 3D, within a few percent of each other.
  const ModelGraph g = build_transformer(transformer_config(96, 12288, 96, 2048, 51200));
  const Cluster cluster = cluster_preset("a100-80gb", 384);
  SearchOptions exact;
  exact.tie_tolerance = 0;
  const Plan fastest = search(g, cluster, batch(1536), exact);
  CHECK(fastest.tie_break.empty());
  for (const auto& a : fastest.alternatives) CHECK(a.step_time_s >= fastest.prediction.step_time_s);

  const Plan chosen = search(g, cluster, batch(1536));  // the default tolerance, 5%
  INFO(fastest.summary() << " -> " << chosen.summary() << ": " << chosen.tie_break);
  REQUIRE(chosen.summary() != fastest.summary());
  CHECK(chosen.prediction.step_time_s <= fastest.prediction.step_time_s * 1.05);
  CHECK_THAT(chosen.tie_break, Catch::Contains("preferred over " + fastest.summary()) &&
                                   Catch::Contains("fewer moving parts"));
  CHECK(chosen.alternatives.front().summary == fastest.summary());
  CHECK_THAT(chosen.alternatives.front().reason, Catch::Contains("within the tie tolerance"));
  CHECK(plan_from_json(to_json(chosen)) == chosen);  // the tie break is part of the plan

  CHECK_THROWS_WITH(search(g, cluster, batch(1536), [] { SearchOptions o; o.tie_tolerance = -0.1; return o; }()),
                    Catch::Contains("tie_tolerance: must be in [0, 1)"));
}
