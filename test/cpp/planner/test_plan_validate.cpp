// Tests planner/src/plan_validate.cpp: one case per rule, each checking the field path.
#include "catch_compat.h"

#include <cmath>
#include <cstdio>
#include <string>

#include "monarch/planner/errors.h"
#include "monarch/planner/plan.h"

using namespace monarch::planner;
using Catch::Contains;
using Catch::StartsWith;

namespace {

LayerPlacement placement(const char* name, LayerKind kind, int64_t params, int64_t stage,
                         TpPattern tp, TpDims dims) {
  LayerPlacement l;
  l.name = name;
  l.kind = kind;
  l.params = params;
  l.stage = stage;
  l.tp = tp;
  l.tp_dims = dims;
  return l;
}

// A valid plan: 5 layers on 2 nodes x 4 devices, pp=2 dp=2 tp=2, batch 16 = 2 x 4 x 2.
Plan valid_plan() {
  Plan p;
  p.model_name = "toy";
  TransformerConfig t;
  t.name = "toy";
  t.layers = 2;
  t.hidden = 256;
  t.heads = 8;
  t.kv_heads = 4;
  t.ffn = 1024;
  t.seq = 128;
  t.vocab = 1000;
  p.transformer = t;
  p.cluster.name = "test";
  p.cluster.nodes = 2;
  p.cluster.devices_per_node = 4;
  p.cluster.device_memory_bytes = 16e9;
  p.cluster.peak_flops_fp32 = 20e12;
  p.cluster.peak_flops_tf32 = 50e12;
  p.cluster.peak_flops_bf16 = 100e12;
  p.cluster.hbm_bytes_per_s = 2e12;
  p.cluster.intra_node_bytes_per_s = 200e9;
  p.cluster.intra_node_latency_s = 5e-6;
  p.cluster.inter_node_bytes_per_s = 20e9;
  p.cluster.inter_node_latency_s = 2e-5;
  p.training.global_batch = 16;
  p.mesh = Mesh{2, 2, 2, {"pp", "dp", "tp"}};
  p.micro_batch_size = 2;
  p.num_micro_batches = 4;
  p.schedule = ScheduleKind::one_f_one_b;
  p.layers = {
      placement("embed", LayerKind::embedding, 256000, 0, TpPattern::vocab, {0, 0, 0, 1000}),
      placement("blocks.0", LayerKind::block, 800000, 0, TpPattern::block, {8, 4, 1024, 0}),
      placement("blocks.1", LayerKind::block, 800000, 1, TpPattern::block, {8, 4, 1024, 0}),
      placement("norm", LayerKind::norm, 256, 1, TpPattern::replicated, {}),
      placement("head", LayerKind::head, 256000, 1, TpPattern::vocab, {0, 0, 0, 1000}),
  };
  p.model_params = 256000 + 800000 + 800000 + 256 + 256000;
  return p;
}

// The model graph `valid_plan()` was made for.
ModelGraph graph_of(const Plan& p) {
  ModelGraph g;
  g.name = p.model_name;
  for (const auto& l : p.layers) {
    Layer layer;
    layer.name = l.name;
    layer.kind = l.kind;
    layer.params = l.params;
    layer.tp = l.tp;
    layer.tp_dims = l.tp_dims;
    g.layers.push_back(layer);
  }
  g.transformer = p.transformer;
  return g;
}

// The field of the ValidationError validate(p) throws ("" and a failed check if none).
std::string failing_field(const Plan& p) {
  try {
    validate(p);
  } catch (const ValidationError& e) {
    return e.field();
  }
  FAIL_CHECK("validate() accepted the plan");
  return "";
}

}  // namespace

TEST_CASE("a consistent plan validates", "[plan_validate]") {
  const Plan p = valid_plan();
  REQUIRE_NOTHROW(validate(p));
  REQUIRE_NOTHROW(validate(p, graph_of(p)));
}

TEST_CASE("validate: format version", "[plan_validate]") {
  Plan p = valid_plan();
  p.version = 2;
  CHECK(failing_field(p) == "version");
}

TEST_CASE("validate: mesh axes are >= 1", "[plan_validate]") {
  Plan p = valid_plan();
  p.mesh.pp = 0;
  REQUIRE_THROWS_WITH(validate(p), "mesh.pp: must be >= 1, got 0");
  p = valid_plan();
  p.mesh.dp = -2;
  CHECK(failing_field(p) == "mesh.dp");
  p = valid_plan();
  p.mesh.tp = 0;
  CHECK(failing_field(p) == "mesh.tp");
}

TEST_CASE("validate: mesh.order is pp, dp, tp", "[plan_validate]") {
  // The cost model puts tp innermost (NVLink) and pp outermost; a plan laid out in another
  // order would run a layout nobody costed, so even permutations are refused.
  Plan p = valid_plan();
  p.mesh.order = {"tp", "pp", "dp"};
  REQUIRE_THROWS_WITH(validate(p), "mesh.order: only [pp, dp, tp] or [pp, dp, cp, tp] is supported, got [tp, pp, dp]");
  p.mesh.order = {"pp", "tp"};
  CHECK(failing_field(p) == "mesh.order");
  p.mesh.order = {"pp", "pp", "tp"};
  CHECK(failing_field(p) == "mesh.order");
  p.mesh.order = {"pp", "dp", "cp"};
  CHECK(failing_field(p) == "mesh.order");
  p.mesh.order = {"pp", "dp", "tp", "ep"};
  CHECK(failing_field(p) == "mesh.order");
  p.mesh.order = {};
  REQUIRE_THROWS_WITH(validate(p), "mesh.order: only [pp, dp, tp] or [pp, dp, cp, tp] is supported, got []");
}

TEST_CASE("validate: cp is an axis between dp and tp, ep divides dp x cp", "[plan_validate]") {
  Plan p = valid_plan();  // pp=2 dp=2 tp=2 on 8 devices
  p.mesh.dp = 1;
  p.mesh.cp = 2;
  // cp > 1 must be in the order, where the cost model puts it.
  REQUIRE_THROWS_WITH(validate(p), "mesh.order: cp=2 needs [pp, dp, cp, tp], got [pp, dp, tp]");
  p.mesh.order = {"pp", "cp", "dp", "tp"};
  CHECK(failing_field(p) == "mesh.order");
  p.mesh.order = {"pp", "dp", "cp", "tp"};
  p.training.global_batch = 8;  // 2 x 4 x dp 1: cp ranks share samples
  CHECK_NOTHROW(validate(p));
  p.mesh.cp = 4;
  REQUIRE_THROWS_WITH(validate(p), "mesh: pp*dp*cp*tp = 16 does not equal the cluster's world size 8 "
                                   "(2 nodes x 4 devices)");
  p.mesh.cp = 2;
  p.mesh.ep = 3;
  REQUIRE_THROWS_WITH(validate(p), "mesh.ep: ep=3 must divide dp*cp = 1*2 (experts are split over ranks "
                                   "that hold different tokens)");
  p.mesh.ep = 0;
  CHECK(failing_field(p) == "mesh.ep");
  p.mesh.ep = 2;
  CHECK_NOTHROW(validate(p));
}

TEST_CASE("expert_groups: ep takes the innermost of dp x cp, edp the rest", "[plan_validate]") {
  Mesh m{1, 2, 1, {"pp", "dp", "cp", "tp"}};
  m.cp = 2;
  m.tp = 2;
  m.ep = 2;  // 8 ranks: rank = (dp_i * 2 + cp_i) * 2 + tp_i
  const ExpertGroups g = expert_groups(m);
  // tp 0: f = 0..3 are ranks 0, 2, 4, 6; ep groups {0,2} {4,6}; edp {0,4} {2,6}. Same for tp 1.
  CHECK(g.ep == std::vector<std::vector<int64_t>>{{0, 2}, {4, 6}, {1, 3}, {5, 7}});
  CHECK(g.edp == std::vector<std::vector<int64_t>>{{0, 4}, {2, 6}, {1, 5}, {3, 7}});
  m.ep = 4;
  CHECK(expert_groups(m).ep == std::vector<std::vector<int64_t>>{{0, 2, 4, 6}, {1, 3, 5, 7}});
  CHECK(expert_groups(m).edp.size() == 8);
  CHECK(mesh_summary(m) == "pp=1 dp=2 cp=2 tp=2 ep=4");
}

TEST_CASE("validate: pp*dp*tp equals the world size", "[plan_validate]") {
  Plan p = valid_plan();
  p.mesh = Mesh{1, 3, 2, {"pp", "dp", "tp"}};
  REQUIRE_THROWS_WITH(validate(p),
                      "mesh: pp*dp*tp = 6 does not equal the cluster's world size 8 "
                      "(2 nodes x 4 devices)");
  p.mesh = Mesh{int64_t(1) << 40, int64_t(1) << 40, 1, {"pp", "dp", "tp"}};  // overflows
  CHECK(failing_field(p) == "mesh");
}

TEST_CASE("validate: the cluster and training config are checked", "[plan_validate]") {
  Plan p = valid_plan();
  p.cluster.nodes = 0;
  CHECK_THAT(failing_field(p), StartsWith("cluster"));
  p = valid_plan();
  p.training.global_batch = 0;
  CHECK_THAT(failing_field(p), StartsWith("training"));
}

TEST_CASE("validate: the cluster has peak FLOP/s for the compute dtype", "[plan_validate]") {
  // Step times would be infinite and the prediction NaN.
  Plan p = valid_plan();
  p.training.compute_dtype = DType::fp8;  // valid_plan's cluster has peak_flops_fp8 = 0
  REQUIRE_THROWS_WITH(validate(p), "cluster.peak_flops_fp8: must be > 0 for compute_dtype fp8");
  p.cluster.peak_flops_fp8 = 200e12;
  CHECK_NOTHROW(validate(p));
}

TEST_CASE("validate: zero stage, micro-batches and the global batch", "[plan_validate]") {
  Plan p = valid_plan();
  for (int64_t z : {0, 1, 2, 3}) {
    p.zero_stage = z;
    REQUIRE_NOTHROW(validate(p));
  }
  p.zero_stage = 4;
  REQUIRE_THROWS_WITH(validate(p), "zero_stage: must be 0, 1, 2 or 3, got 4");
  p.zero_stage = -1;
  CHECK(failing_field(p) == "zero_stage");

  p = valid_plan();
  p.micro_batch_size = 0;
  CHECK(failing_field(p) == "micro_batch_size");
  p = valid_plan();
  p.num_micro_batches = 0;
  CHECK(failing_field(p) == "num_micro_batches");
  p = valid_plan();
  p.num_micro_batches = 3;
  REQUIRE_THROWS_WITH(validate(p),
                      "num_micro_batches: micro_batch_size * num_micro_batches * dp = "
                      "2 * 3 * 2 = 12 does not equal training.global_batch = 16");
}

TEST_CASE("validate: schedule matches pp", "[plan_validate]") {
  Plan p = valid_plan();
  p.schedule = ScheduleKind::none;
  REQUIRE_THROWS_WITH(validate(p), "schedule: pp=2 needs a pipeline schedule, got 'none'");
  for (auto s : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::zero_bubble_h1}) {
    p.schedule = s;
    REQUIRE_NOTHROW(validate(p));
  }

  // pp=1: every layer on stage 0, schedule none.
  p = valid_plan();
  p.mesh = Mesh{1, 4, 2, {"pp", "dp", "tp"}};
  p.num_micro_batches = 2;
  for (auto& l : p.layers) l.stage = 0;
  REQUIRE_THROWS_WITH(validate(p), "schedule: pp=1 needs schedule 'none', got '1f1b'");
  p.schedule = ScheduleKind::none;
  REQUIRE_NOTHROW(validate(p));
}

TEST_CASE("validate: virtual stages only with the interleaved schedule", "[plan_validate]") {
  Plan p = valid_plan();
  p.virtual_stages = 0;
  CHECK(failing_field(p) == "virtual_stages");
  p.virtual_stages = 2;
  REQUIRE_THROWS_WITH(validate(p),
                      "virtual_stages: 2 needs schedule 'interleaved_1f1b' or 'zbv', got '1f1b'");

  // Interleaved: 2 ranks x 2 virtual stages = 4 stages, each holding a block.
  p = valid_plan();
  p.schedule = ScheduleKind::interleaved_1f1b;
  p.virtual_stages = 2;
  p.layers.insert(p.layers.begin() + 3, {p.layers[1], p.layers[1]});
  p.layers[3].name = "blocks.2";
  p.layers[4].name = "blocks.3";
  p.model_params += 2 * p.layers[1].params;
  const int64_t stages[] = {0, 0, 1, 2, 3, 3, 3};
  for (size_t i = 0; i < p.layers.size(); ++i) p.layers[i].stage = stages[i];
  REQUIRE_NOTHROW(validate(p));

  Plan q = p;
  q.virtual_stages = 1;
  CHECK(failing_field(q) == "virtual_stages");

  q = p;
  q.micro_batch_size = 8;
  q.num_micro_batches = 1;  // 1 % pp=2 != 0
  REQUIRE_THROWS_WITH(validate(q),
                      "num_micro_batches: interleaved_1f1b needs a multiple of pp=2, got 1");
}

TEST_CASE("validate: sequence parallel needs tp > 1", "[plan_validate]") {
  Plan p = valid_plan();
  p.sequence_parallel = true;
  REQUIRE_NOTHROW(validate(p));
  p.mesh = Mesh{2, 4, 1, {"pp", "dp", "tp"}};
  p.num_micro_batches = 2;
  REQUIRE_THROWS_WITH(validate(p), "sequence_parallel: needs tp > 1, got tp=1");
  p.sequence_parallel = false;
  REQUIRE_NOTHROW(validate(p));
}

TEST_CASE("validate: dp bucket bytes are positive", "[plan_validate]") {
  Plan p = valid_plan();
  p.dp_bucket_bytes = 0;
  CHECK(failing_field(p) == "dp_bucket_bytes");
  p.dp_bucket_bytes = -1;
  CHECK(failing_field(p) == "dp_bucket_bytes");
  p.dp_bucket_bytes = std::nan("");
  CHECK(failing_field(p) == "dp_bucket_bytes");
  p.dp_bucket_bytes = INFINITY;
  CHECK(failing_field(p) == "dp_bucket_bytes");
}

TEST_CASE("validate: layers exist and stages are in range", "[plan_validate]") {
  Plan p = valid_plan();
  p.layers.clear();
  CHECK(failing_field(p) == "layers");

  p = valid_plan();
  p.layers[4].stage = 2;
  REQUIRE_THROWS_WITH(validate(p),
                      "layers[4].stage: 2 is outside [0, 2) (pp=2 x virtual_stages=1)");
  p = valid_plan();
  p.layers[0].stage = -1;
  CHECK(failing_field(p) == "layers[0].stage");
}

TEST_CASE("validate: stages are non-decreasing and none is empty", "[plan_validate]") {
  Plan p = valid_plan();
  p.layers[2].stage = 0;
  p.layers[1].stage = 1;  // 0 1 0 1 1
  REQUIRE_THROWS_WITH(validate(p),
                      "layers[2].stage: 0 comes after stage 1 (stages must be non-decreasing "
                      "along the layer list)");

  p = valid_plan();
  for (auto& l : p.layers) l.stage = 0;
  REQUIRE_THROWS_WITH(validate(p), "layers: stage 1 has no layer");

  // Every block on stage 0, stage 1 only the norm and head: the runtime cuts between blocks.
  p = valid_plan();
  p.layers[2].stage = 0;
  REQUIRE_THROWS_WITH(validate(p), "layers: stage 1 holds no block (the runtime cuts the pipeline between "
                                   "blocks, so every stage needs one)");

  p = valid_plan();
  p.schedule = ScheduleKind::interleaved_1f1b;
  p.virtual_stages = 2;
  const int64_t stages[] = {0, 0, 1, 3, 3};
  for (size_t i = 0; i < p.layers.size(); ++i) p.layers[i].stage = stages[i];
  REQUIRE_THROWS_WITH(validate(p), "layers: stage 2 has no layer");

  // More stages than layers: 2 x 3 = 6 stages for 5 layers.
  p.virtual_stages = 3;
  p.num_micro_batches = 4;
  CHECK(failing_field(p) == "layers");
}

TEST_CASE("validate: tp divides every split layer's dimensions", "[plan_validate]") {
  Plan p = valid_plan();
  p.layers[1].tp_dims.heads = 3;
  REQUIRE_THROWS_WITH(validate(p), "mesh.tp: 2 does not divide heads=3 (layer 'blocks.0')");
  p = valid_plan();
  p.layers[2].tp_dims.kv_heads = 1;
  REQUIRE_THROWS_WITH(validate(p), "mesh.tp: 2 does not divide kv_heads=1 (layer 'blocks.1')");
  p = valid_plan();
  p.layers[1].tp_dims.ffn = 1023;
  REQUIRE_THROWS_WITH(validate(p), "mesh.tp: 2 does not divide ffn=1023 (layer 'blocks.0')");
  p = valid_plan();
  p.layers[4].tp_dims.vocab = 1001;
  REQUIRE_THROWS_WITH(validate(p), "mesh.tp: 2 does not divide vocab=1001 (layer 'head')");

  // Replicated layers are not split: their dimensions do not matter.
  p = valid_plan();
  p.layers[3].tp_dims = TpDims{3, 3, 3, 3};
  REQUIRE_NOTHROW(validate(p));
  p.layers[3].tp_dims.heads = -1;
  CHECK(failing_field(p) == "layers[3].tp_dims.heads");
}

TEST_CASE("validate: tp divides the transformer's heads and kv heads", "[plan_validate]") {
  Plan p = valid_plan();
  p.transformer->heads = 9;
  REQUIRE_THROWS_WITH(validate(p), "mesh.tp: 2 does not divide heads=9 (transformer 'toy')");
  p = valid_plan();
  p.transformer->kv_heads = 1;
  REQUIRE_THROWS_WITH(validate(p), "mesh.tp: 2 does not divide kv_heads=1 (transformer 'toy')");
  p = valid_plan();
  p.transformer->kv_heads = 0;  // 0 means kv_heads = heads = 8
  REQUIRE_NOTHROW(validate(p));
  p.transformer.reset();
  REQUIRE_NOTHROW(validate(p));
}

TEST_CASE("validate: parameter counts are not negative", "[plan_validate]") {
  Plan p = valid_plan();
  p.model_params = -1;
  CHECK(failing_field(p) == "model.params");
  p = valid_plan();
  p.layers[2].params = -5;
  CHECK(failing_field(p) == "layers[2].params");
}

TEST_CASE("validate with a graph: the graph itself is checked", "[plan_validate]") {
  const Plan p = valid_plan();
  ModelGraph g = graph_of(p);
  g.tied_groups.push_back({0, 7});  // five layers
  try {
    validate(p, g);
    FAIL("expected a ValidationError");
  } catch (const ValidationError& e) {
    CHECK(e.field() == "tied_groups[0][1]");
  }
}

TEST_CASE("validate with a graph: same layers and parameter counts", "[plan_validate]") {
  const Plan p = valid_plan();

  ModelGraph g = graph_of(p);
  g.layers.pop_back();
  REQUIRE_THROWS_WITH(validate(p, g), "layers: plan has 5 layers, the model has 4");

  g = graph_of(p);
  g.layers[4].name = "lm_head";
  REQUIRE_THROWS_WITH(validate(p, g), "layers[4].name: plan has 'head', the model has 'lm_head'");

  g = graph_of(p);
  g.layers[2].params = 800001;
  REQUIRE_THROWS_AS(validate(p, g), ValidationError);
  REQUIRE_THROWS_WITH(validate(p, g), StartsWith("layers[2].params: plan has 800000, the model "
                                                 "has 800001"));

  // Tied embedding and head: the graph counts the shared weight once.
  g = graph_of(p);
  g.tied_groups = {{0, 4}};
  REQUIRE_THROWS_WITH(validate(p, g), Contains("model.params: plan has 2112256, the model has "
                                               "1856256"));
  Plan tied = p;
  tied.model_params = g.total_params();
  REQUIRE_NOTHROW(validate(tied, g));

  // The plan itself is validated first.
  Plan bad = p;
  bad.mesh.tp = 4;
  CHECK_THROWS_WITH(validate(bad, graph_of(p)), StartsWith("mesh:"));
}

TEST_CASE("validate: each layer name appears once", "[plan_validate]") {
  Plan p = valid_plan();
  p.layers[2].name = "blocks.0";  // a duplicated entry
  CHECK(failing_field(p) == "layers[2].name");
  CHECK_THROWS_WITH(validate(p), Contains("'blocks.0' is also layers[1]'s name"));
  p = valid_plan();
  p.layers[3].name = "";
  CHECK(failing_field(p) == "layers[3].name");
}

TEST_CASE("validate: model.params agrees with the layers", "[plan_validate]") {
  Plan p = valid_plan();
  p.model_params = 5;
  CHECK(failing_field(p) == "model.params");
  p.model_params = valid_plan().model_params + 1;  // more than the layers hold
  CHECK(failing_field(p) == "model.params");
  p.model_params = valid_plan().model_params - 256000;  // the head tied to the embedding
  CHECK_NOTHROW(validate(p));
}

TEST_CASE("validate: predictions are finite and non-negative", "[plan_validate]") {
  Plan p = valid_plan();
  p.prediction.step_time_s = -1;
  CHECK(failing_field(p) == "prediction.step_time_s");
  p = valid_plan();
  p.prediction.memory.activations = std::nan("");
  CHECK(failing_field(p) == "prediction.memory.activations");
}

TEST_CASE("validate: sequence parallelism needs tp to divide the sequence", "[plan_validate]") {
  Plan p = valid_plan();
  p.sequence_parallel = true;
  REQUIRE_NOTHROW(validate(p));  // seq 128 on tp=2
  p.transformer->seq = 127;
  CHECK(failing_field(p) == "sequence_parallel");
  CHECK_THROWS_WITH(validate(p), Contains("does not divide seq=127"));
}

TEST_CASE("plan JSON: a key twice in one object is refused; save never writes an invalid plan", "[plan_validate]") {
  const Plan p = valid_plan();
  std::string text = to_json(p);
  const std::string key = "\"zero_stage\": 0,";
  const size_t at = text.find(key);
  REQUIRE(at != std::string::npos);
  text.insert(at, "\"zero_stage\": 3,\n  ");
  CHECK_THROWS_AS(plan_from_json(text), FormatError);
  CHECK_THROWS_WITH(plan_from_json(text), Contains("key 'zero_stage' appears twice"));
  Plan bad = valid_plan();
  bad.model_params = 5;
  const std::string path = "/tmp/monarch-invalid-plan-test.json";
  std::remove(path.c_str());
  CHECK_THROWS_AS(save_plan(bad, path), ValidationError);
  std::FILE* f = std::fopen(path.c_str(), "rb");
  CHECK(f == nullptr);  // nothing written
  if (f) std::fclose(f);
}

namespace {
// valid_plan() with pp=1 dp=4 tp=2 on its 2 nodes x 4 devices: each dp group has 2 ranks on
// each of the 2 nodes.
Plan two_level_plan() {
  Plan p = valid_plan();
  p.mesh = Mesh{1, 4, 2, {"pp", "dp", "tp"}};
  p.num_micro_batches = 2;
  p.schedule = ScheduleKind::none;
  for (auto& l : p.layers) l.stage = 0;
  return p;
}
}  // namespace

TEST_CASE("validate: hierarchical dp reduction needs a dp group over nodes with >1 rank on each",
          "[plan_validate][hierarchical]") {
  Plan p = two_level_plan();
  p.dp_reduction = DpReduction::hierarchical;
  validate(p);
  p.inter_node_compression = Compression::int8;
  validate(p);
  p.inter_node_compression = Compression::bf16;
  validate(p);
  p.mesh = Mesh{1, 8, 1, {"pp", "dp", "tp"}};  // 4 dp ranks per node
  p.num_micro_batches = 1;
  validate(p);

  // pp=2 dp=2 tp=2: each dp group sits on one node.
  Plan q = valid_plan();
  q.dp_reduction = DpReduction::hierarchical;
  CHECK(failing_field(q) == "dp_reduction");
  REQUIRE_THROWS_WITH(validate(q), "dp_reduction: hierarchical needs the dp group to span nodes with >1 rank per "
                                   "node; dp=2 tp=2 on 1 node of 4 devices (2 dp ranks per node; the cluster "
                                   "has 2 nodes)");
  // pp=1 dp=2 tp=4: one dp rank per node.
  q = two_level_plan();
  q.mesh = Mesh{1, 2, 4, {"pp", "dp", "tp"}};
  q.num_micro_batches = 4;
  q.dp_reduction = DpReduction::hierarchical;
  REQUIRE_THROWS_WITH(validate(q), Contains("dp=2 tp=4 on 2 nodes of 4 devices (1 dp rank per node"));
  // One node.
  q = two_level_plan();
  q.cluster.nodes = 1;
  q.cluster.devices_per_node = 8;
  q.dp_reduction = DpReduction::hierarchical;
  REQUIRE_THROWS_WITH(validate(q), StartsWith("dp_reduction: hierarchical needs the dp group to span nodes"));
  // ZeRO-1/2 engines reduce flat in the runtime; ZeRO-3 runs it (ZeRO++).
  q = two_level_plan();
  q.dp_reduction = DpReduction::hierarchical;
  q.zero_stage = 1;
  REQUIRE_THROWS_WITH(validate(q), "dp_reduction: hierarchical is run for zero_stage 0 (DataParallel) and 3 "
                                   "(ZeRO++) only; the plan has zero_stage 1");
  q.zero_stage = 3;
  CHECK_NOTHROW(validate(q));
}

TEST_CASE("validate: inter-node compression needs the hierarchical reduction", "[plan_validate][hierarchical]") {
  Plan p = two_level_plan();
  p.inter_node_compression = Compression::bf16;
  CHECK(failing_field(p) == "inter_node_compression");
  REQUIRE_THROWS_WITH(validate(p), "inter_node_compression: bf16 compresses the inter-node hop of a hierarchical "
                                   "dp reduction; needs dp_reduction hierarchical, got flat");
  p.dp_reduction = DpReduction::hierarchical;
  validate(p);
}
