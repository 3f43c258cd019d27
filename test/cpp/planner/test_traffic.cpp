// bytes_per_step: what each rank sends per step and axis, from the layout alone. The runtime's
// counters are checked against it on 4 ranks by test/python/test_traffic.py; these cases pin
// the formulas on a graph small enough to add up by hand.
#include "catch_compat.h"

#include "monarch/planner/cost_model.h"
#include "monarch/planner/search.h"
#include "monarch/planner/traffic.h"
#include "test_configs.h"

using namespace monarch::planner;
using Catch::Matchers::WithinRel;

namespace {

struct Setup {
  ModelGraph graph;
  TrainingConfig training;
  Cluster cluster;
};

Setup tiny(int64_t devices, bool tied) {
  TransformerConfig c = transformer_config(4, 64, 4, 32, 128);
  c.dtype = DType::fp32;
  c.tied_embeddings = tied;
  Setup s{build_transformer(c), {}, cluster_preset("cpu", devices)};
  s.training.global_batch = 8;
  s.training.compute_dtype = DType::fp32;
  s.training.param_bytes = s.training.grad_bytes = s.training.activation_bytes = 4;
  s.training.schedules = {ScheduleKind::one_f_one_b, ScheduleKind::gpipe};
  return s;
}

Plan pinned(const Setup& s, int64_t pp, int64_t dp, int64_t tp, int64_t zero, int64_t mbs, ScheduleKind schedule) {
  Pins p = layout_pins(tp, pp, dp, zero, mbs, schedule);
  p.recompute = Recompute::none;
  p.sequence_parallel = false;
  return evaluate_layout(s.graph, s.cluster, s.training, p, /*allow_over_memory=*/true);
}

double block_params(const ModelGraph& g) {
  double n = 0;
  for (const auto& l : g.layers) n += l.kind == LayerKind::block ? static_cast<double>(l.params) : 0.0;
  return n;
}

}  // namespace

TEST_CASE("bytes per step: dp reduces once per step; ZeRO-1/2 add the gather; ZeRO-3 gathers blocks twice",
          "[traffic]") {
  const Setup s = tiny(4, /*tied=*/false);
  const double P = static_cast<double>(s.graph.total_params()), B = block_params(s.graph);
  const double ring = 3.0 / 4.0;  // (n-1)/n on 4 ranks
  const auto dp = bytes_per_step(s.graph, pinned(s, 1, 4, 1, 0, 1, ScheduleKind::none));
  REQUIRE(dp.size() == 1);
  CHECK_THAT(dp[0].dp, WithinRel(2 * ring * P * 4, 1e-12));  // one all-reduce, whatever m (here 2)
  CHECK(dp[0].tp == 0.0);
  CHECK(dp[0].pp == 0.0);
  for (int64_t zero : {1, 2}) {
    const auto z = bytes_per_step(s.graph, pinned(s, 1, 4, 1, zero, 1, ScheduleKind::none));
    CHECK_THAT(z[0].dp, WithinRel(ring * P * 4 + ring * P * 4, 1e-12));
  }
  const Plan z3plan = pinned(s, 1, 4, 1, 3, 1, ScheduleKind::none);
  REQUIRE(z3plan.num_micro_batches == 2);
  const auto z3 = bytes_per_step(s.graph, z3plan);
  // Per micro-batch: blocks gathered for forward and backward, the rest once, every gradient
  // reduce-scattered.
  CHECK_THAT(z3[0].dp, WithinRel(2 * ring * ((2 * B + (P - B)) * 4 + P * 4), 1e-12));
}

TEST_CASE("bytes per step: pipeline sends per micro-batch; tied ends all-reduce their weight", "[traffic]") {
  const Setup s = tiny(2, /*tied=*/true);
  const Plan plan = pinned(s, 2, 1, 1, 0, 1, ScheduleKind::one_f_one_b);
  REQUIRE(plan.num_micro_batches == 8);
  const auto b = bytes_per_step(s.graph, plan);
  REQUIRE(b.size() == 2);
  const double activation = 1 * 32 * 64 * 4.0;  // micro-batch x seq x hidden x fp32
  CHECK_THAT(b[0].pp, WithinRel(8 * activation, 1e-12));  // activations down
  CHECK_THAT(b[1].pp, WithinRel(8 * activation, 1e-12));  // their gradients up
  const double tied = 128 * 64;                            // vocab x hidden
  CHECK_THAT(b[0].ends, WithinRel(tied * 4, 1e-12));      // ring all-reduce over 2: S
  CHECK_THAT(b[1].ends, WithinRel(tied * 4, 1e-12));
  CHECK(b[0].dp == 0.0);
  // One process per stage with the weight in both: no ends traffic without a pipeline.
  const Setup one = tiny(1, /*tied=*/true);
  const auto single = bytes_per_step(one.graph, pinned(one, 1, 1, 1, 0, 8, ScheduleKind::none));
  CHECK(single[0].total() == 0.0);
}
