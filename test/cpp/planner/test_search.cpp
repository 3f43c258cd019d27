#include "catch_compat.h"
#include <map>
#include <tuple>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <string>

#include "monarch/planner/cost_model.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/estimator.h"
#include "monarch/planner/report.h"
#include "monarch/planner/search.h"
#include "test_configs.h"

using namespace monarch::planner;

namespace {

ModelGraph gpt3() { return gpt3_175b(); }

TrainingConfig batch(int64_t b) { return global_batch(b); }

// Narayanan et al. 2021, Table 2 (PTD-P row): GPT-3 175B, batch 1536, 384 A100s, t=8, p=12,
// 1F1B with activation recomputation: 153 TFLOP/s per GPU.
Pins narayanan_layout() {
  Pins pins = layout_pins(8, 12, 4, 0, 1, ScheduleKind::one_f_one_b);
  pins.recompute = Recompute::full;
  pins.sequence_parallel = false;  // came later (Korthikanti et al. 2022)
  return pins;
}

}  // namespace

TEST_CASE("calibration: GPT-3 175B on 384 A100-80GB within 15% of the published 153 TFLOP/s", "[search][calibration]") {
  const ModelGraph g = gpt3();
  const Cluster cluster = cluster_preset("a100-80gb", 384);
  const Plan pinned = evaluate_layout(g, cluster, batch(1536), narayanan_layout());
  CHECK(pinned.mesh.tp == 8);
  CHECK(pinned.mesh.pp == 12);
  CHECK(pinned.mesh.dp == 4);
  CHECK(pinned.recompute == Recompute::full);
  CHECK(pinned.prediction.tflops_per_device == Approx(153.0).epsilon(0.15));
  CHECK(pinned.prediction.memory_bytes_per_device <= cluster.usable_memory_bytes());

  // Unpinned, on the same cluster: fits and predicts at least as much.
  const Plan best = search(g, cluster, batch(1536));
  CHECK(best.prediction.memory_bytes_per_device <= cluster.usable_memory_bytes());
  CHECK(best.prediction.tflops_per_device >= pinned.prediction.tflops_per_device);
  CHECK(best.mesh.world_size() == 384);
  CHECK_FALSE(best.alternatives.empty());
  // Slower alternatives, or faster ones within the tie tolerance that lost on moving parts
  // (the plan says which it preferred, and why).
  for (const auto& a : best.alternatives) {
    if (a.step_time_s < best.prediction.step_time_s) {
      CHECK(a.step_time_s * 1.05 >= best.prediction.step_time_s);
      CHECK_THAT(a.reason, Catch::Contains("within the tie tolerance"));
      CHECK_THAT(best.tie_break, Catch::Contains("fewer moving parts"));
    }
    CHECK_FALSE(a.reason.empty());
  }
  INFO(best.summary() << " / " << best.tie_break);
  CHECK(best.tie_break.empty() == (best.alternatives.front().step_time_s >= best.prediction.step_time_s));
}

TEST_CASE("search is deterministic and consistent with predict()", "[search]") {
  const ModelGraph g = gpt3();
  const Cluster cluster = cluster_preset("a100-80gb", 1024);
  const Plan a = search(g, cluster, batch(1536));
  const Plan b = search(g, cluster, batch(1536));
  CHECK(a == b);
  validate(a, g);
  // Re-scoring the chosen plan gives the prediction it carries.
  CHECK(predict(g, a).step_time_s == Approx(a.prediction.step_time_s).epsilon(1e-12));
  // Tokens per second from the step time.
  CHECK(a.prediction.tokens_per_s == Approx(1536.0 * 2048 / a.prediction.step_time_s));
}

TEST_CASE("pins are honoured", "[search]") {
  const ModelGraph g = gpt3();
  const Cluster cluster = cluster_preset("a100-80gb", 1024);
  Pins pins;
  pins.tp = 4;
  pins.schedule = ScheduleKind::zero_bubble_h1;
  SearchOptions options;
  options.pins = pins;
  const Plan p = search(g, cluster, batch(1536), options);
  CHECK(p.mesh.tp == 4);
  CHECK(p.schedule == ScheduleKind::zero_bubble_h1);
  CHECK(p.mesh.pp > 1);
}

TEST_CASE("impossible requests name the constraint", "[search][errors]") {
  const ModelGraph g = gpt3();
  Pins pins;
  pins.tp = 5;
  SearchOptions options;
  options.pins = pins;
  CHECK_THROWS_WITH(search(g, cluster_preset("a100-80gb", 40), batch(1536), options),
                    Catch::Contains("pins.tp") && Catch::Contains("does not divide heads=96"));
  // Blocks tp cannot split (replicated patterns: names no rule recognised): tp is refused,
  // as the runtime refuses it (one rule: a tp that splits none of the blocks gains nothing).
  ModelGraph unsplit = g;
  for (auto& layer : unsplit.layers) {
    if (layer.kind == LayerKind::block) layer.tp = TpPattern::replicated;
  }
  pins.tp = 8;
  options.pins = pins;
  CHECK_THROWS_WITH(search(unsplit, cluster_preset("a100-80gb", 64), batch(1536), options),
                    Catch::Contains("pins.tp") && Catch::Contains("splits none of the blocks"));
  pins.tp = 8;
  pins.pp = 12;
  pins.dp = 5;
  options.pins = pins;
  CHECK_THROWS_AS(search(g, cluster_preset("a100-80gb", 384), batch(1536), options), ValidationError);
  // Too few devices: the message says what was needed.
  CHECK_THROWS_WITH(search(g, cluster_preset("a100-80gb", 8), batch(1536)),
                    Catch::Contains("no layout fits") && Catch::Contains("smallest need found"));
  CHECK_THROWS_AS(search(g, cluster_preset("a100-80gb", 8), batch(1536)), InfeasibleError);
  // No pipeline allowed, tp cannot split 3 heads, and dp=2 cannot split a batch of 3.
  TransformerConfig tiny = transformer_config(1, 66, 3, 16, 7);
  TrainingConfig no_pipeline = batch(3);
  no_pipeline.allow_pipeline_parallel = false;
  CHECK_THROWS_WITH(search(build_transformer(tiny), cluster_preset("a100-80gb", 2), no_pipeline),
                    Catch::Contains("not divisible by dp=2") && Catch::Contains("tp=2 does not divide"));
}

TEST_CASE("small models stay on few devices' worth of parallelism", "[search]") {
  TransformerConfig c;
  c.layers = 12; c.hidden = 768; c.heads = 12; c.seq = 1024; c.vocab = 50304;  // GPT-2 small
  const Plan p = search(build_transformer(c), cluster_preset("a100-80gb", 8), batch(64));
  // Fits easily: pure data parallelism without recompute beats anything else.
  CHECK(p.mesh.dp == 8);
  CHECK(p.mesh.tp == 1);
  CHECK(p.mesh.pp == 1);
  CHECK(p.recompute == Recompute::none);
}

namespace {

ModelGraph tiny_model(int64_t layers = 2) {
  TransformerConfig c = transformer_config(layers, 64, 4, 16, 100);
  return build_transformer(c);
}

SearchOptions with_pins(const Pins& pins) {
  SearchOptions options;
  options.pins = pins;
  return options;
}

}  // namespace

TEST_CASE("a negative number of alternatives is refused", "[search][errors]") {
  SearchOptions options;
  options.alternatives = -1;  // used to size the pruning threshold: read out of bounds
  try {
    search(tiny_model(), cluster_preset("cpu", 2), batch(8), options);
    FAIL("expected a ValidationError");
  } catch (const ValidationError& e) {
    CHECK(e.field() == "alternatives");
    CHECK(std::string(e.what()) == "alternatives: must be >= 0, got -1");
  }
  options.alternatives = 0;
  CHECK(search(tiny_model(), cluster_preset("cpu", 2), batch(8), options).alternatives.empty());
}

TEST_CASE("a tied embedding counts once in memory", "[search][memory]") {
  // 400000 x 1024 embedding tied to the head: 0.41 B parameters, 6.1 GiB of model state
  // once, 12.2 GiB if counted twice; the CPU preset has 7.5 GiB usable.
  TransformerConfig c = transformer_config(1, 1024, 8, 16, 400000, /*tied=*/true);
  const ModelGraph g = build_transformer(c);
  const Cluster cluster = cluster_preset("cpu", 1);
  const Plan p = search(g, cluster, batch(1));
  CHECK(p.prediction.memory_bytes_per_device <= cluster.usable_memory_bytes());
  CHECK(p.prediction.memory.params == Approx(2.0 * static_cast<double>(g.total_params())));
  validate(p, g);
}

TEST_CASE("sequence parallelism pinned on is never dropped: it implies tp > 1", "[search]") {
  Pins pins;
  pins.sequence_parallel = true;
  const ModelGraph g = tiny_model();
  // One device: no tp to split along; refused by name rather than planned without it.
  CHECK_THROWS_WITH(search(g, cluster_preset("cpu", 1), batch(8), with_pins(pins)),
                    Catch::Contains("pins.sequence_parallel"));
  // Four devices: only layouts with tp > 1 are candidates.
  const Plan p = search(g, cluster_preset("cpu", 4), batch(8), with_pins(pins));
  CHECK(p.mesh.tp > 1);
  CHECK(p.sequence_parallel);
  CHECK_NOTHROW(validate(p, g));
}

TEST_CASE("a compute dtype without peak FLOP/s is refused", "[search][errors]") {
  TrainingConfig fp8 = batch(8);
  fp8.compute_dtype = DType::fp8;  // A100s have no fp8 tensor cores: peak_flops_fp8 = 0
  const Cluster a100 = cluster_preset("a100-80gb", 2);
  CHECK_THROWS_WITH(search(tiny_model(), a100, fp8),
                    "cluster.peak_flops_fp8: must be > 0 for compute_dtype fp8");
  Pins pins = layout_pins(1, 1, 2, 0, 1, ScheduleKind::none);
  CHECK_THROWS_AS(evaluate_layout(tiny_model(), a100, fp8, pins, true), ValidationError);
  // fp16 shares the bf16 peak, and the message names that field.
  Cluster no_bf16 = a100;
  no_bf16.peak_flops_bf16 = 0;
  TrainingConfig fp16 = batch(8);
  fp16.compute_dtype = DType::fp16;
  CHECK_THROWS_WITH(search(tiny_model(), no_bf16, fp16),
                    "cluster.peak_flops_bf16: must be > 0 for compute_dtype fp16");
  // H100s have fp8.
  CHECK_NOTHROW(search(tiny_model(), cluster_preset("h100-80gb", 2), fp8));
}

TEST_CASE("huge batches are refused instead of enumerated or allocated", "[search][errors]") {
  // B/dp near 2^63: the divisor loop used to overflow (d * d) and never end.
  CHECK_THROWS_WITH(search(tiny_model(), cluster_preset("cpu", 1), batch(INT64_MAX)),
                    Catch::Contains("too large a schedule"));
  // 2^26 samples at micro-batch 1 on pp=2: every schedule has more than 2^22
  // (micro-batch, stage) pairs; the search skips them instead of allocating gigabytes.
  Pins pins;
  pins.pp = 2;
  pins.micro_batch_size = 1;
  try {
    search(tiny_model(), cluster_preset("a100-80gb", 8), batch(int64_t{1} << 26), with_pins(pins));
    FAIL("expected an InfeasibleError");
  } catch (const InfeasibleError& e) {
    CHECK_THAT(e.what(),
               Catch::Contains("micro-batches x 1 virtual stages is too large a schedule"));
  }
  // A larger micro-batch makes the same batch plannable.
  pins.micro_batch_size = 1024;
  CHECK(
      search(tiny_model(), cluster_preset("a100-80gb", 8), batch(int64_t{1} << 26), with_pins(pins))
          .micro_batch_size == 1024);
}

TEST_CASE("pins that rule every layout out say why", "[search][errors]") {
  // Interleaving needs a pipeline; one device has none.
  Pins pins;
  pins.virtual_stages = 2;
  CHECK_THROWS_WITH(search(tiny_model(), cluster_preset("cpu", 1), batch(8), with_pins(pins)),
                    Catch::Contains("virtual_stages=2 needs pp > 1"));
  pins.pp = 1;
  CHECK_THROWS_WITH(search(tiny_model(), cluster_preset("cpu", 2), batch(8), with_pins(pins)),
                    "pins.virtual_stages: 2 needs pp > 1 (pp=1 has no pipeline)");
  pins = Pins{};
  pins.virtual_stages = 2;
  pins.schedule = ScheduleKind::one_f_one_b;
  CHECK_THROWS_WITH(search(tiny_model(), cluster_preset("cpu", 2), batch(8), with_pins(pins)),
                    Catch::Contains("pins.virtual_stages: 2 needs the interleaved_1f1b or zbv schedule"));
  // ZB-V on 4 ranks needs 8 stages; a 4-block model is cut into at most 4.
  pins = Pins{};
  pins.pp = 4;
  pins.schedule = ScheduleKind::zero_bubble_v;
  CHECK_THROWS_WITH(search(tiny_model(4), cluster_preset("cpu", 4), batch(8), with_pins(pins)),
                    Catch::Contains("zbv with pp=4 needs 8 stages (two per rank), the model can be cut into at most 4"));
  try {  // the cause alone: no "impossible with pp=4 and N micro-batches" beside it
    search(tiny_model(4), cluster_preset("cpu", 4), batch(8), with_pins(pins));
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()).find("impossible with") == std::string::npos);
  }
  pins.pp = 2;  // 4 stages fit: a V of two stages per rank
  const Plan v = search(tiny_model(4), cluster_preset("cpu", 2), batch(8), with_pins(pins));
  CHECK(v.schedule == ScheduleKind::zero_bubble_v);
  CHECK(v.virtual_stages == 2);
  // A micro-batch size that does not divide the replica's share of the batch.
  pins = Pins{};
  pins.dp = 2;
  pins.micro_batch_size = 3;
  CHECK_THROWS_WITH(search(tiny_model(), cluster_preset("cpu", 2), batch(8), with_pins(pins)),
                    Catch::Contains("micro-batch size 3 does not divide the 4 samples per "
                                    "data-parallel replica (global batch 8 / dp=2)"));
}

TEST_CASE("a malformed graph is refused before it is indexed", "[search][errors]") {
  ModelGraph g = tiny_model();
  g.tied_groups.push_back({0, 99});
  CHECK_THROWS_WITH(search(g, cluster_preset("cpu", 1), batch(8)),
                    Catch::StartsWith("tied_groups[0][1]: layer 99 is outside [0, 5)"));
  Pins pins = layout_pins(1, 1, 1, 0, 1, ScheduleKind::none);
  CHECK_THROWS_AS(evaluate_layout(g, cluster_preset("cpu", 1), batch(8), pins), ValidationError);
}

TEST_CASE("interleaved chunks share their rank's buffers", "[search][memory]") {
  // Full recompute with large micro-batches: the rank's recompute workspace dominates its
  // memory. Each of the v chunks gets 1/v of the memory, so it must be charged 1/v of the
  // rank's buffers, not all of them.
  const ModelGraph g = tiny_model(8);
  Pins pins = layout_pins(1, 2, 1, 0, 64, ScheduleKind::interleaved_1f1b);
  pins.virtual_stages = 2;
  pins.recompute = Recompute::full;
  Cluster cluster = cluster_preset("cpu", 2);
  const Plan roomy = evaluate_layout(g, cluster, batch(256), pins);
  const double need = roomy.prediction.memory_bytes_per_device;
  REQUIRE(roomy.prediction.memory.activations > 0.5 * need);
  // 10% more than the plan needs: fits. (The partition gives each chunk 1/v of the rank's
  // memory, charged its own in-flight peak; the last rank's head chunk holds one micro-batch at
  // a time but is the larger. Where no split fits those shares, they are loosened and predict()
  // decides: search.cpp, partition_sharing_rank_memory. Charging every chunk the whole buffers,
  // what this guards against, needs 56% more.)
  cluster.device_memory_bytes = cluster.memory_reserved_bytes + 1.1 * need;
  const Plan tight = evaluate_layout(g, cluster, batch(256), pins);
  CHECK(tight.prediction.memory_bytes_per_device <= cluster.usable_memory_bytes());
}

// ---- Hierarchical dp reduction ---------------------------------------------------------------

namespace {

// A model whose gradient reduction matters: 4 blocks of hidden 2048, short sequences.
ModelGraph comm_heavy() { return build_transformer(transformer_config(4, 2048, 16, 128, 32000)); }

// Pure data parallelism over every device, ZeRO stage pinned; the dp reduction is searched.
Plan data_parallel(const Cluster& cluster, const TrainingConfig& training, int64_t zero) {
  const int64_t world = cluster.world_size();
  Pins pins = layout_pins(1, 1, world, zero, 1, ScheduleKind::none);
  pins.recompute = Recompute::none;
  return evaluate_layout(comm_heavy(), cluster, training, pins);
}

}  // namespace

TEST_CASE("search reduces dp hierarchically across nodes with >1 rank per node", "[search][hierarchical]") {
  const Cluster two_nodes = cluster_preset("a100-80gb", 16);  // 2 x 8: 8 dp ranks per node
  const Plan hier = data_parallel(two_nodes, batch(16), 0);
  CHECK(hier.dp_reduction == DpReduction::hierarchical);
  CHECK(hier.inter_node_compression == Compression::none);  // lossy compression not allowed
  validate(hier, comm_heavy());

  // Not allowed: flat, and predicted slower.
  TrainingConfig no_hier = batch(16);
  no_hier.allow_hierarchical_dp = false;
  const Plan flat = data_parallel(two_nodes, no_hier, 0);
  CHECK(flat.dp_reduction == DpReduction::flat);
  CHECK(hier.prediction.step_time_s < flat.prediction.step_time_s);
  CHECK(hier.prediction.time.dp_comm < flat.prediction.time.dp_comm);
  CHECK(hier.prediction.time.compute == flat.prediction.time.compute);
  CHECK(hier.prediction.memory == flat.prediction.memory);  // it changes no memory

  // The bytes each rank sends (traffic.h): S = the rank's gradients; all-reduce
  // 2 (L-1)/L S inside the node, 2 (N-1)/N S/L across (L = 8, N = 2), vs the flat ring's
  // 2 (15/16) S, all across.
  const double S = static_cast<double>(comm_heavy().total_params()) * hier.training.grad_bytes;
  REQUIRE(hier.prediction.ranks.size() == 1);
  CHECK(hier.prediction.ranks[0].dp_bytes == Approx(2.0 * 7 / 8 * S + 2.0 * 1 / 2 * S / 8));
  CHECK(hier.prediction.ranks[0].dp_inter_node_bytes == Approx(S / 8));
  CHECK(flat.prediction.ranks[0].dp_bytes == Approx(2.0 * 15 / 16 * S));
  CHECK(flat.prediction.ranks[0].dp_inter_node_bytes == flat.prediction.ranks[0].dp_bytes);
  // Re-scoring the plan gives what it carries.
  CHECK(predict(comm_heavy(), hier).step_time_s == Approx(hier.prediction.step_time_s).epsilon(1e-12));

  // The runtime's ZeRO-1/2 engines reduce flat: the search does not offer them the hierarchy.
  const Plan zero1 = data_parallel(two_nodes, batch(16), 1);
  CHECK(zero1.dp_reduction == DpReduction::flat);
  CHECK(zero1.inter_node_compression == Compression::none);
  // ZeRO-3 runs it as ZeRO++ (two-hop gathers and reduce-scatters, backward gathers inside the
  // node): faster here, for the memory of the secondary shards (1/8 of the units, fp32).
  const Plan zero3 = data_parallel(two_nodes, batch(16), 3);
  CHECK(zero3.dp_reduction == DpReduction::hierarchical);
  validate(zero3, comm_heavy());
  TrainingConfig flat_only = batch(16);
  flat_only.allow_hierarchical_dp = false;
  const Plan zero3_flat = data_parallel(two_nodes, flat_only, 3);
  CHECK(zero3_flat.dp_reduction == DpReduction::flat);
  CHECK(zero3.prediction.time.dp_comm < zero3_flat.prediction.time.dp_comm);
  CHECK(zero3.prediction.memory.buffers > zero3_flat.prediction.memory.buffers);
  CHECK(zero3.prediction.ranks[0].dp_inter_node_bytes < zero3_flat.prediction.ranks[0].dp_inter_node_bytes);
}

TEST_CASE("search keeps the flat reduction on one node or with one dp rank per node", "[search][hierarchical]") {
  const Plan one_node = data_parallel(cluster_preset("a100-80gb", 8), batch(8), 0);
  CHECK(one_node.dp_reduction == DpReduction::flat);
  CHECK(one_node.prediction.ranks[0].dp_inter_node_bytes == 0);
  // tp=8 fills each node: one dp rank per node.
  Pins pins = layout_pins(8, 1, 2, 0, 1, ScheduleKind::none);
  const Plan tp8 = evaluate_layout(comm_heavy(), cluster_preset("a100-80gb", 16), batch(8), pins);
  CHECK(tp8.dp_reduction == DpReduction::flat);
  // Unpinned search on one node: never hierarchical.
  CHECK(search(comm_heavy(), cluster_preset("a100-80gb", 8), batch(16)).dp_reduction == DpReduction::flat);
}

TEST_CASE("search compresses the inter-node hop only when allowed and faster", "[search][hierarchical]") {
  TrainingConfig int8 = batch(16);
  int8.grad_bytes = 4;  // fp32 gradients: int8 is a quarter of them (plus scales)
  int8.inter_node_compression = Compression::int8;
  // 2 nodes: the compressed all-gather sends (N-1) C(S/L) = 0.254 S/L vs 2 (N-1)/N S/L = S/L.
  const Plan two = data_parallel(cluster_preset("a100-80gb", 16), int8, 0);
  CHECK(two.dp_reduction == DpReduction::hierarchical);
  CHECK(two.inter_node_compression == Compression::int8);
  const double S = static_cast<double>(comm_heavy().total_params()) * 4;
  CHECK(two.prediction.ranks[0].dp_inter_node_bytes == Approx(S / 8 * (0.25 + 1.0 / 256)));
  // 16 nodes: 15 x 0.254 S/L > 2 (15/16) S/L: uncompressed is faster.
  int8.global_batch = 128;
  const Plan sixteen = data_parallel(cluster_preset("a100-80gb", 128), int8, 0);
  CHECK(sixteen.dp_reduction == DpReduction::hierarchical);
  CHECK(sixteen.inter_node_compression == Compression::none);
  // ZeRO-1's collectives are not compressed: no reason to pick it.
  int8.global_batch = 16;
  CHECK(data_parallel(cluster_preset("a100-80gb", 16), int8, 1).inter_node_compression == Compression::none);
}

namespace {

// This machine as the layouts bench sees it: 4 CPU ranks on one node; a small GPT in fp32.
Cluster four_cpu_ranks() {
  Cluster cluster = cluster_preset("cpu", 1);
  cluster.devices_per_node = 4;
  cluster.nodes = 1;
  return cluster;
}

TrainingConfig fp32_batch(int64_t global_batch) {
  TrainingConfig training = batch(global_batch);
  training.compute_dtype = DType::fp32;
  return training;
}

// pp=1 dp=4 tp=1 without recomputation or sequence parallelism.
Pins dp4_pins() {
  Pins pins;
  pins.pp = 1;
  pins.dp = 4;
  pins.tp = 1;
  pins.recompute = Recompute::none;
  pins.sequence_parallel = false;
  return pins;
}

}  // namespace

TEST_CASE("within a mesh, layouts predicted within 0.5% go to the one with fewer moving parts", "[search][ties]") {
  // A small GPT on 4 CPU ranks sharing 2 cores (this machine), dp = 4: ZeRO-1 is predicted a
  // fraction of a percent faster than plain dp (its optimizer step is a quarter), and the
  // micro-batch count changes nothing the model sees. Measured (bench/layouts.py), the
  // simpler layouts ran faster: the pick is the simplest among the equal ones.
  const ModelGraph g = build_transformer(transformer_config(4, 256, 8, 64, 1024));
  Cluster cluster = four_cpu_ranks();
  cluster.cores_per_node = 1.9;
  // The rates bench/layouts.py measured here (per rank, all busy).
  cluster.peak_flops_fp32 = cluster.peak_flops_tf32 = cluster.peak_flops_bf16 = 3.2e9;
  cluster.matmul_efficiency = 0.62;
  cluster.hbm_bytes_per_s = 19.8e9;
  cluster.intra_node_bytes_per_s = cluster.inter_node_bytes_per_s = 1.5e9;
  cluster.intra_node_latency_s = cluster.inter_node_latency_s = 1.2e-3;
  const TrainingConfig training = fp32_batch(16);
  const Pins pins = dp4_pins();
  SearchOptions options;
  options.pins = pins;
  const Plan chosen = search(g, cluster, training, options);
  const double t = chosen.prediction.step_time_s;
  INFO(chosen.summary() << " " << t);
  int equal = 0;
  for (int64_t zero = 0; zero <= 3; ++zero) {
    for (int64_t mbs : {1, 2, 4}) {
      Pins p = pins;
      p.zero_stage = zero;
      p.micro_batch_size = mbs;
      p.schedule = ScheduleKind::none;
      const Plan other = evaluate_layout(g, cluster, training, p);
      const double u = other.prediction.step_time_s;
      INFO(other.summary() << " " << u);
      CHECK(u >= t * (1 - 0.005));  // nothing clearly faster was passed over
      if (std::abs(u - t) <= 0.005 * std::max(u, t)) {
        ++equal;
        // Nothing as fast is simpler: a lower ZeRO stage, or as low with fewer micro-batches.
        CHECK(std::make_pair(chosen.zero_stage, chosen.num_micro_batches) <=
              std::make_pair(zero, other.num_micro_batches));
      }
    }
  }
  CHECK(equal >= 2);  // the case this rule is for: more than one layout the model cannot tell apart
  CHECK(chosen.num_micro_batches == 1);

  // Tie tolerance 0: the fastest, inside a mesh too.
  options.tie_tolerance = 0;
  const Plan fastest = search(g, cluster, training, options);
  CHECK(fastest.prediction.step_time_s <= t);
  for (int64_t zero = 0; zero <= 3; ++zero) {
    Pins p = pins;
    p.zero_stage = zero;
    p.micro_batch_size = 4;
    p.schedule = ScheduleKind::none;
    CHECK(evaluate_layout(g, cluster, training, p).prediction.step_time_s >= fastest.prediction.step_time_s);
  }
}

namespace {

// The analytic model's layer costs with every compute time scaled by `f`.
std::vector<LayerCost> scaled_costs(const ModelGraph& graph, const Cluster& cluster, const TrainingConfig& training,
                                    const Layout& layout, double f) {
  auto costs = analytic_estimator().layer_costs(graph, cluster, training, layout);
  for (auto& c : costs) {
    c.forward_s *= f;
    c.backward_s *= f;
    c.backward_compute_s *= f;
  }
  return costs;
}

// The analytic model with micro-batches of 1 predicted 1% cheaper (what a measured profile's
// noise did on this machine: four micro-batch-1 layer times under one micro-batch-4 time),
// stating a resolution.
class SkewedEstimator final : public Estimator {
 public:
  explicit SkewedEstimator(double resolution) : resolution_(resolution) {}
  std::string name() const override { return "skewed"; }
  std::vector<LayerCost> layer_costs(const ModelGraph& graph, const Cluster& cluster, const TrainingConfig& training,
                                     const Layout& layout) const override {
    return scaled_costs(graph, cluster, training, layout, layout.micro_batch_size == 1 ? 0.99 : 1.0);
  }
  double resolution() const override { return resolution_; }

 private:
  double resolution_;
};

}  // namespace

TEST_CASE("an estimator's stated resolution widens the within-mesh tie window", "[search][ties]") {
  const ModelGraph g = build_transformer(transformer_config(4, 256, 8, 64, 1024));
  const Cluster cluster = four_cpu_ranks();
  const TrainingConfig training = fp32_batch(16);
  Pins pins = dp4_pins();
  pins.zero_stage = 0;
  SearchOptions options;
  options.pins = pins;
  const SkewedEstimator sharp(0), coarse(0.02);
  options.estimator = &sharp;
  const Plan fine = search(g, cluster, training, options);
  CHECK(fine.micro_batch_size == 1);  // 1% faster is more than kSameTime (0.5%)
  options.estimator = &coarse;
  options.alternatives = 3;
  const Plan simple = search(g, cluster, training, options);
  CHECK(simple.num_micro_batches == 1);  // within the estimator's 2%: the simpler layout
  CHECK(simple.prediction.step_time_s > fine.prediction.step_time_s);
  // Said, against the fastest layout, and that layout is the first alternative.
  INFO(simple.tie_break);
  CHECK_THAT(simple.tie_break, Catch::Contains("preferred over " + fine.summary()));
  CHECK_THAT(simple.tie_break, Catch::Contains("1 micro-batches vs 4"));
  CHECK_THAT(simple.tie_break, Catch::Contains("from the estimator's resolution 2.00%"));
  REQUIRE(!simple.alternatives.empty());
  CHECK(simple.alternatives.front().summary == fine.summary());
  options.alternatives = 0;
  CHECK(search(g, cluster, training, options).summary() == simple.summary());
  options.tie_tolerance = 0;  // never wider than the tie tolerance
  CHECK(search(g, cluster, training, options).micro_batch_size == 1);
}

TEST_CASE("the tie rules do not compound: the pick is within the tie tolerance of the fastest layout of all",
          "[search][ties]") {
  // A resolution as coarse as the tolerance, over the whole space (every mesh of 4 ranks).
  const ModelGraph g = build_transformer(transformer_config(4, 256, 8, 64, 1024));
  Cluster cluster = four_cpu_ranks();
  cluster.cores_per_node = 2;
  const TrainingConfig training = fp32_batch(16);
  const SkewedEstimator coarse(0.05);
  SearchOptions options;
  options.estimator = &coarse;
  options.tie_tolerance = 0.05;
  options.alternatives = 0;
  const Plan pick = search(g, cluster, training, options);
  SearchOptions exact = options;
  exact.tie_tolerance = 0;
  const Plan fastest = search(g, cluster, training, exact);
  INFO(pick.summary() << " " << pick.tie_break << " vs " << fastest.summary());
  CHECK(pick.prediction.step_time_s <= fastest.prediction.step_time_s * 1.05 * (1 + 1e-12));
  options.alternatives = 5;  // the pick does not depend on how many alternatives are asked for
  CHECK(search(g, cluster, training, options).summary() == pick.summary());
}

namespace {

// The analytic model, each layout's layer costs scaled by a factor of its own (2 for layouts
// not listed): the search sees only the listed ones as contenders.
class ScaledEstimator final : public Estimator {
 public:
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t>;  // pp, dp, tp, micro-batch size
  explicit ScaledEstimator(std::map<Key, double> factors) : factors_(std::move(factors)) {}
  std::string name() const override { return "scaled"; }
  std::vector<LayerCost> layer_costs(const ModelGraph& graph, const Cluster& cluster, const TrainingConfig& training,
                                     const Layout& layout) const override {
    const auto it = factors_.find({layout.pp, layout.dp, layout.tp, layout.micro_batch_size});
    return scaled_costs(graph, cluster, training, layout, it == factors_.end() ? 2.0 : it->second);
  }

 private:
  std::map<Key, double> factors_;
};

}  // namespace

TEST_CASE("within the tie tolerance, at most half the micro-batches counts before fewer dimensions",
          "[search][ties]") {
  // What the layouts bench ran into: a 4-stage pipeline of 16 micro-batches of 1, predicted 4%
  // ahead of a 2 x 2 mesh of one micro-batch of 8 (one dimension against two), measured 8.5%
  // behind it. Per-micro-batch work is what the estimators undercount.
  const ModelGraph g = build_transformer(transformer_config(4, 256, 8, 64, 1024));
  const Cluster cluster = four_cpu_ranks();
  const TrainingConfig training = fp32_batch(16);
  const auto step = [&](const Estimator& e, int64_t pp, int64_t dp, int64_t mbs) {
    Pins p = layout_pins(1, pp, dp, 0, mbs, ScheduleKind::gpipe);
    p.recompute = Recompute::none;
    return evaluate_layout(g, cluster, training, p, true, &e).prediction.step_time_s;
  };
  const ScaledEstimator plain({{{4, 1, 1, 1}, 1.0}, {{2, 2, 1, 8}, 1.0}});
  // Scale the 2 x 2 mesh so that it is predicted 3% behind the pipeline.
  const double f = 1.03 * step(plain, 4, 1, 1) / step(plain, 2, 2, 8);
  const ScaledEstimator skewed({{{4, 1, 1, 1}, 1.0}, {{2, 2, 1, 8}, f}});
  const double deep = step(skewed, 4, 1, 1), wide = step(skewed, 2, 2, 8);
  REQUIRE(wide > deep);
  REQUIRE(wide < 1.05 * deep);
  SearchOptions options;
  options.estimator = &skewed;
  options.pins.tp = 1;
  options.pins.zero_stage = 0;
  options.pins.recompute = Recompute::none;
  options.pins.schedule = ScheduleKind::gpipe;
  options.alternatives = 0;
  const Plan pick = search(g, cluster, training, options);
  INFO(pick.summary() << " / " << pick.tie_break);
  CHECK(pick.mesh.pp == 2);
  CHECK(pick.mesh.dp == 2);
  CHECK(pick.num_micro_batches == 1);
  CHECK_THAT(pick.tie_break, Catch::Contains("1 micro-batches vs 16"));
  // Tie tolerance 0: the pipeline, the fastest.
  options.tie_tolerance = 0;
  const Plan fastest = search(g, cluster, training, options);
  CHECK(fastest.mesh.pp == 4);
  CHECK(fastest.num_micro_batches == 16);
}

TEST_CASE("ranks lend idle cores only on one node, and only as many times as there are stages", "[search][cores]") {
  Cluster cluster = cluster_preset("cpu", 1);
  cluster.devices_per_node = 4;
  cluster.nodes = 1;
  cluster.cores_per_node = 2;
  Layout l;
  l.pp = 4;
  l.dp = 1;
  l.tp = 1;
  CHECK(shared_core_speedup(cluster, l) == Approx(2.0));  // over = 4 ranks / 2 cores
  l.pp = 1;
  l.dp = 4;
  CHECK(shared_core_speedup(cluster, l) == Approx(1.0));  // nobody idles without a pipeline
  cluster.cores_per_node = 1;
  l.pp = 2;
  l.dp = 2;
  CHECK(shared_core_speedup(cluster, l) == Approx(2.0));  // over 4, but one of 2 stages idles at most
  cluster.nodes = 2;
  l.pp = 2;
  l.dp = 4;
  CHECK(shared_core_speedup(cluster, l) == Approx(1.0));  // stages on two machines: not modelled
  cluster.nodes = 1;
  cluster.cores_per_node = 0;  // GPUs: every device computes on its own
  CHECK(shared_core_speedup(cluster, l) == Approx(1.0));
}

TEST_CASE("ZeRO's collectives overlap computation only where that can save time", "[search][zero_overlap]") {
  const ModelGraph g = comm_heavy();
  // GPUs (overlap contention below 1): overlapped, faster than waiting for each reduction,
  // for one unit's gradients more. (Micro-batches whose backward is long enough to hide the
  // collectives: when communication dominates, the backward hides as much either way.)
  auto compute_bound = [&](const Cluster& cluster, int64_t zero) {
    Pins pins = layout_pins(1, 1, cluster.world_size(), zero, 64, ScheduleKind::none);
    pins.recompute = Recompute::none;
    return evaluate_layout(g, cluster, batch(64 * cluster.world_size()), pins);
  };
  const Cluster gpus = cluster_preset("a100-80gb", 8);
  REQUIRE(zero_overlap_pays(gpus));
  for (int64_t zero : {2, 3}) {
    INFO("zero_stage " << zero);
    const Plan on = compute_bound(gpus, zero);
    CHECK(on.zero_overlap);
    Plan off = on;
    off.zero_overlap = false;
    const Prediction waited = predict(g, off);
    CHECK(on.prediction.step_time_s < waited.step_time_s);
    // (ZeRO-2's peak here is the backward's start, where no reduction is in flight yet.)
    CHECK(waited.memory.buffers <= on.prediction.memory.buffers);
    CHECK(waited.memory.params == on.prediction.memory.params);
    CHECK(waited.memory.activations == on.prediction.memory.activations);
    CHECK(off.summary() == on.summary() + " overlap=off");
  }
  // ZeRO-3's difference is one unit's gradient buffer: the largest block's.
  const Plan on3 = compute_bound(gpus, 3);
  Plan off3 = on3;
  off3.zero_overlap = false;
  double block = 0;  // the largest sharding unit (each block, tp = 1)
  for (const auto& l : on3.layers) {
    if (l.sharding_unit) block = std::max(block, static_cast<double>(l.params));
  }
  REQUIRE(block > 0);
  CHECK(on3.prediction.memory.buffers - predict(g, off3).memory.buffers ==
        Approx(block * on3.training.zero_gradient_bytes()));

  // Where overlap does not fit and waiting does, waiting is chosen.
  Cluster tight = gpus;
  const double need_on = on3.prediction.memory_bytes_per_device, need_off = predict(g, off3).memory_bytes_per_device;
  tight.device_memory_bytes = tight.memory_reserved_bytes + (need_on + need_off) / 2;
  CHECK_FALSE(compute_bound(tight, 3).zero_overlap);

  // CPU ranks with no core to spare (contention 1): overlap would hide nothing (the same
  // predicted time), so the collectives are waited for, holding less.
  Cluster cpus = cluster_preset("cpu", 4);
  cpus.overlap_contention = 1.0;
  REQUIRE_FALSE(zero_overlap_pays(cpus));
  const Plan waited = data_parallel(cpus, batch(16), 3);
  CHECK_FALSE(waited.zero_overlap);
  Plan overlapped = waited;
  overlapped.zero_overlap = true;
  const Prediction p = predict(g, overlapped);
  CHECK(p.step_time_s == Approx(waited.prediction.step_time_s).epsilon(1e-9));
  CHECK(p.memory.buffers > waited.prediction.memory.buffers);

  // A pin is honoured; DDP keeps its bucket overlap whatever the cluster.
  Pins pinned = layout_pins(1, 1, 4, 3, 1, ScheduleKind::none);
  pinned.recompute = Recompute::none;
  pinned.zero_overlap = true;
  CHECK(evaluate_layout(g, cpus, batch(16), pinned).zero_overlap);
  CHECK(data_parallel(cpus, batch(16), 0).zero_overlap);
}

// ---- Expert and context parallelism -------------------------------------------------------

TEST_CASE("expert memory forces ep, and the plan says so", "[search][moe]") {
  // Mixtral 8x7B on 64 H100s with tp and pp off and ZeRO-1 (DeepSeek-V3's style): whole
  // experts per rank need ep; ep=4 holds 2 experts of every layer in 16-bit weights and
  // gradients and does not fit.
  const ModelGraph g = build_transformer(mixtral_8x7b_config(4096));
  const Cluster cluster = cluster_preset("h100-80gb", 64);
  SearchOptions o;
  o.pins.tp = 1;
  o.pins.pp = 1;
  o.pins.zero_stage = 1;
  const Plan p = search(g, cluster, batch(256), o);
  CHECK(p.mesh.ep == 8);
  CHECK(p.prediction.memory_bytes_per_device <= cluster.usable_memory_bytes());
  REQUIRE(p.choices.size() >= 2);
  CHECK_THAT(p.choices[0], Catch::Contains("expert memory needs ep>=8"));
  CHECK_THAT(p.choices[1], Catch::Contains("ep=4 needs"));
  CHECK_THAT(format_report(p), Catch::Contains("expert memory needs ep>=8"));
  // Pinned, the search takes it; a value the experts do not split into is refused.
  o.pins.ep = 4;
  o.pins.zero_stage = 3;
  CHECK(search(g, cluster, batch(256), o).mesh.ep == 4);
  o.pins.ep = 3;
  CHECK_THROWS_WITH(search(g, cluster, batch(256), o), Catch::Contains("pins.ep"));
}

TEST_CASE("activation memory of a long sequence forces cp, and the plan says so", "[search][cp]") {
  // Llama 3 8B's shapes at 128K tokens on 64 H100s, no tp, pp or recompute: a sequence's
  // activations (about 34 s h bytes per layer) fit only split 16 ways.
  TransformerConfig c = transformer_config(32, 4096, 32, 131072, 128256);
  c.kv_heads = 8;
  c.ffn = 14336;
  c.gated_mlp = true;
  const ModelGraph g = build_transformer(c);
  const Cluster cluster = cluster_preset("h100-80gb", 64);
  SearchOptions o;
  o.pins.tp = 1;
  o.pins.pp = 1;
  o.pins.recompute = Recompute::none;
  const Plan p = search(g, cluster, batch(8), o);
  CHECK(p.mesh.cp == 16);
  CHECK(p.mesh.order == std::vector<std::string>{"pp", "dp", "cp", "tp"});
  REQUIRE(p.choices.size() >= 2);
  CHECK_THAT(p.choices[0], Catch::Contains("activations at seq 131072 need cp>=16"));
  CHECK_THAT(p.choices[1], Catch::Contains("cp=8 needs"));
  validate(p, g);
  // Short sequences are not split (chunks under 4096 tokens per rank are not searched).
  const Plan short_seq = search(gpt3(), cluster_preset("a100-80gb", 64), batch(64));
  CHECK(short_seq.mesh.cp == 1);
  for (const auto& a : short_seq.alternatives) CHECK_THAT(a.summary, !Catch::Contains("cp="));
}

TEST_CASE("a 671B MoE on 2048 GPUs: the search stays small", "[search][moe]") {
  // bench_planner times it (under 2 s is the goal); here the work is bounded instead.
  const ModelGraph g = build_transformer(deepseek_v3_config(4096));
  SearchStats stats;
  SearchOptions o;
  o.stats = &stats;
  const Plan p = search(g, cluster_preset("h100-80gb", 2048), batch(15360), o);
  CHECK(stats.considered < 150000);
  CHECK(stats.scored < 2000);
  CHECK(p.prediction.memory_bytes_per_device <= cluster_preset("h100-80gb", 2048).usable_memory_bytes());
  CHECK_FALSE(p.choices.empty());  // ep is explained
  validate(p, g);
  Plan bad = p;
  bad.mesh.ep = 3;  // does not divide dp*cp nor 256 experts
  CHECK_THROWS_WITH(validate(bad, g), Catch::Contains("mesh.ep"));
}
