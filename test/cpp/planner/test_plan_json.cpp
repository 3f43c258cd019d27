// Tests planner/src/plan_json.cpp (and the equality / summary / enum names it relies on).
#include "catch_compat.h"

#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "monarch/planner/errors.h"
#include "monarch/planner/plan.h"
#include "monarch/planner/report.h"
#include "monarch/planner/search.h"

using namespace monarch::planner;
using Json = nlohmann::ordered_json;
using Catch::Contains;

namespace {

// A valid plan built by hand: a small Llama-like model on 2 nodes x 4 devices,
// pp=2 dp=2 tp=2, global batch 16 = mbs 2 x 4 micro-batches x dp 2.
Plan make_plan() {
  Plan p;
  p.model_name = "tiny-llama";
  TransformerConfig t;
  t.name = "tiny-llama";
  t.layers = 2;
  t.hidden = 4096;
  t.heads = 32;
  t.kv_heads = 8;
  t.ffn = 11008;
  t.gated_mlp = true;
  t.seq = 2048;
  t.vocab = 32000;
  t.dtype = DType::bf16;
  p.transformer = t;

  Cluster& c = p.cluster;
  c.name = "test-cluster";
  c.nodes = 2;
  c.devices_per_node = 4;
  c.device_memory_bytes = 80e9;
  c.memory_reserved_bytes = 2.5e9;
  c.peak_flops_fp32 = 19.5e12;
  c.peak_flops_tf32 = 156e12;
  c.peak_flops_bf16 = 312e12;
  c.peak_flops_fp8 = 3.14159e15;
  c.matmul_efficiency = 0.1;
  c.hbm_bytes_per_s = 2.039e12;
  c.intra_node_bytes_per_s = 240e9;
  c.intra_node_latency_s = 1e-7;
  c.inter_node_bytes_per_s = 25e9;
  c.inter_node_latency_s = 5e-6;

  p.training.global_batch = 16;
  p.training.max_micro_batch_size = 8;
  p.mesh = Mesh{2, 2, 2, {"pp", "dp", "tp"}};
  p.zero_stage = 1;
  p.micro_batch_size = 2;
  p.num_micro_batches = 4;
  p.schedule = ScheduleKind::one_f_one_b;
  p.recompute = Recompute::selective;
  p.sequence_parallel = true;
  p.dp_bucket_bytes = 50.0 * 1024 * 1024;

  auto layer = [](const char* name, LayerKind kind, int64_t params, int64_t stage, TpPattern tp,
                  TpDims dims) {
    LayerPlacement l;
    l.name = name;
    l.kind = kind;
    l.params = params;
    l.stage = stage;
    l.tp = tp;
    l.tp_dims = dims;
    l.sharding_unit = kind == LayerKind::block;
    return l;
  };
  const TpDims block_dims{32, 8, 11008, 0};
  p.layers = {
      layer("embed", LayerKind::embedding, 131072000, 0, TpPattern::vocab, {0, 0, 0, 32000}),
      layer("blocks.0", LayerKind::block, 218112000, 0, TpPattern::block, block_dims),
      layer("blocks.1", LayerKind::block, 218112000, 1, TpPattern::block, block_dims),
      layer("norm", LayerKind::norm, 4096, 1, TpPattern::replicated, {}),
      layer("head", LayerKind::head, 131072000, 1, TpPattern::vocab, {0, 0, 0, 32000}),
  };
  p.model_params = 131072000 + 2 * 218112000 + 4096 + 131072000;

  Prediction& pr = p.prediction;
  pr.step_time_s = 1.0 / 3.0;
  pr.tflops_per_device = 123.456;
  pr.mfu = 0.1;
  pr.tokens_per_s = 98304.5;
  pr.bubble_fraction = 0.2;
  pr.memory = MemoryBreakdown{1.5e9, 7.5e8, 4.5e9, 12345678.9, 0};
  pr.memory_bytes_per_device = pr.memory.total();
  pr.time = TimeBreakdown{0.25, 0.01, 1e-7, 0.03, 0.004, 0.05, 0.0005, 1.0 / 3.0};
  pr.stages = {StageCosts{0.01, 0.012, 0.008, 1e-4}, StageCosts{0.011, 0.013, 0.009, 0}};
  RankPrediction r0;
  r0.memory = MemoryBreakdown{1.5e9, 7.5e8, 4.5e9, 12345678.9, 0};
  r0.busy_s = 0.2;
  r0.idle_s = 0.05;
  r0.dp_bytes = 1e9;
  r0.tp_bytes = 2e9;
  r0.pp_bytes = 3e6;
  RankPrediction r1 = r0;
  r1.memory.activations = 1e6;
  r1.ends_bytes = 5e5;
  pr.ranks = {r0, r1};
  p.alternatives = {
      {"pp=1 dp=4 tp=2 zero=3 mbs=1 m=4 none recompute=full sp=on", 0.41, 6.2e10,
       "1.23x slower: dp_comm 0.12 s vs 0.03 s"},
      {"pp=2 dp=4 tp=1 zero=1 mbs=2 m=2 1f1b recompute=none sp=off", 0.0, 9.9e10,
       "does not fit: 99.0 GB > 77.5 GB"},
  };
  return p;
}

Json to_value(const Plan& p) { return Json::parse(to_json(p)); }

// Parses a hand-edited plan value.
Plan from_value(const Json& j) { return plan_from_json(j.dump(2)); }

// The ValidationError plan_from_json throws for `j` (fails the test if none is thrown).
ValidationError validation_error_of(const Json& j) {
  try {
    from_value(j);
  } catch (const ValidationError& e) {
    return e;
  }
  FAIL("expected a ValidationError");
  return ValidationError("", "");
}

std::string temp_path(const std::string& name) {
  return "/tmp/monarch_test_" + std::to_string(::getpid()) + "_" + name;
}

}  // namespace

TEST_CASE("plan JSON round-trips exactly", "[plan_json]") {
  const Plan p = make_plan();
  const std::string text = to_json(p);
  const Plan back = plan_from_json(text);
  CHECK(back == p);
  CHECK(to_json(back) == text);
}

TEST_CASE("plan JSON writes cp and ep only when used, and reads them back", "[plan_json]") {
  Plan p = make_plan();
  CHECK_FALSE(to_value(p)["mesh"].contains("cp"));
  CHECK_FALSE(to_value(p)["mesh"].contains("ep"));
  p.mesh.dp = 1;  // 8 devices: pp 2 x dp 1 x cp 2 x tp 2
  p.mesh.cp = 2;
  p.mesh.ep = 2;
  p.mesh.order = {"pp", "dp", "cp", "tp"};
  p.training.global_batch /= 2;
  const std::string text = to_json(p);
  CHECK(to_value(p)["mesh"]["cp"] == 2);
  CHECK(to_value(p)["mesh"]["ep"] == 2);
  const Plan back = plan_from_json(text);
  CHECK(back.mesh == p.mesh);
  CHECK(to_json(back) == text);
}

TEST_CASE("plan JSON round-trips without the optional transformer", "[plan_json]") {
  Plan p = make_plan();
  p.transformer.reset();
  const std::string text = to_json(p);
  CHECK(to_value(p)["model"].contains("transformer") == false);
  const Plan back = plan_from_json(text);
  CHECK_FALSE(back.transformer.has_value());
  CHECK(back == p);
  CHECK(to_json(back) == text);
}

TEST_CASE("plan JSON keeps doubles bit-exact", "[plan_json]") {
  Plan p = make_plan();
  const double values[] = {0.1,
                           1e-7,
                           3.14159e15,
                           1.0 / 3.0,
                           2.0 / 3.0 * 1e-300,
                           std::numeric_limits<double>::denorm_min(),
                           std::numeric_limits<double>::max(),
                           123456789012345678.0,
                           0.0};
  for (double v : values) {
    p.prediction.mfu = v;
    p.prediction.time.tp_comm = v;
    p.cluster.intra_node_latency_s = v;
    p.training.optimizer_bytes = v;
    p.alternatives[0].step_time_s = v;
    const std::string text = to_json(p);
    const Plan back = plan_from_json(text);
    INFO("value " << v);
    CHECK(back.prediction.mfu == v);
    CHECK(back == p);
    CHECK(to_json(back) == text);
  }
}

TEST_CASE("plan JSON writes integers as integers and doubles as doubles", "[plan_json]") {
  Plan p = make_plan();
  p.model_params = 1000000000000;  // 1e12, as an int64 (the layers hold as many: still valid)
  int64_t others = 0;
  for (size_t i = 1; i < p.layers.size(); ++i) others += p.layers[i].params;
  p.layers[0].params = p.model_params - others;
  const Json j = to_value(p);
  CHECK(j["version"].is_number_integer());
  CHECK(j["model"]["params"].is_number_integer());
  CHECK(j["model"]["params"].get<int64_t>() == 1000000000000);
  CHECK(j["mesh"]["tp"].is_number_integer());
  CHECK(j["layers"][2]["stage"].is_number_integer());
  CHECK(j["cluster"]["nodes"].is_number_integer());
  CHECK(j["cluster"]["device_memory_bytes"].is_number_float());  // 80e9 stays a double
  CHECK(j["prediction"]["memory"]["buffers"].is_number_float());  // 0.0, not 0
  const std::string text = to_json(p);
  CHECK_THAT(text, Contains("\"params\": 1000000000000,"));
  CHECK_THAT(text, Contains("\"device_memory_bytes\": 80000000000.0,"));
  CHECK(plan_from_json(text) == p);
}

TEST_CASE("plan JSON writes keys in schema order", "[plan_json]") {
  const Json j = to_value(make_plan());
  std::vector<std::string> keys;
  for (const auto& item : j.items()) keys.push_back(item.key());
  CHECK(keys == std::vector<std::string>{
                    "version", "model", "cluster", "training", "mesh", "zero_stage",
                    "micro_batch_size", "num_micro_batches", "schedule", "virtual_stages",
                    "recompute", "sequence_parallel", "dp_bucket_bytes", "dp_reduction",
                    "inter_node_compression", "zero_overlap", "layers", "prediction", "alternatives"});
  CHECK(j["dp_reduction"] == "flat");
  CHECK(j["inter_node_compression"] == "none");
  CHECK(j["training"]["allow_hierarchical_dp"] == true);
  CHECK(j["training"]["inter_node_compression"] == "none");
  CHECK(j["mesh"]["order"] == Json::array({"pp", "dp", "tp"}));
  CHECK(j["schedule"] == "1f1b");
  CHECK(j["layers"][0]["kind"] == "embedding");
  CHECK(j["layers"][0]["tp"] == "vocab");
  CHECK(j["training"]["schedules"] ==
        Json::array({"1f1b", "interleaved_1f1b", "zb_h1"}));
  CHECK(j["model"]["transformer"]["dtype"] == "bf16");
}

TEST_CASE("plan JSON honours indent; compact output round-trips too", "[plan_json]") {
  const Plan p = make_plan();
  const std::string compact = to_json(p, -1);
  CHECK(compact.find('\n') == std::string::npos);
  CHECK(plan_from_json(compact) == p);
  CHECK(to_json(plan_from_json(compact), -1) == compact);
  CHECK(to_json(p, 4).find("\n    \"model\"") != std::string::npos);
}

TEST_CASE("plan JSON accepts integers where numbers are expected", "[plan_json]") {
  Json j = to_value(make_plan());
  j["cluster"]["device_memory_bytes"] = 80000000000;  // hand-written without ".0"
  CHECK(from_value(j).cluster.device_memory_bytes == 80e9);
}

TEST_CASE("plan JSON reads schedule aliases", "[plan_json]") {
  Json j = to_value(make_plan());
  j["training"]["schedules"] = Json::array({"interleaved", "zb-h1", "zbh1"});
  const Plan p = from_value(j);
  CHECK(p.training.schedules == std::vector<ScheduleKind>{ScheduleKind::interleaved_1f1b,
                                                           ScheduleKind::zero_bubble_h1,
                                                           ScheduleKind::zero_bubble_h1});
}

TEST_CASE("plan JSON refuses malformed text", "[plan_json]") {
  REQUIRE_THROWS_AS(plan_from_json("{\"version\": 1,"), FormatError);
  REQUIRE_THROWS_WITH(plan_from_json("{\"version\": 1,"),
                      Contains("plan JSON: parse error at byte"));
  REQUIRE_THROWS_WITH(plan_from_json("{\"version\": x}"),
                      Contains("plan JSON: parse error at byte 13: "));
  REQUIRE_THROWS_WITH(plan_from_json(""), Contains("plan JSON: parse error at byte"));
  std::string truncated = to_json(make_plan());
  truncated.resize(truncated.size() / 2);
  REQUIRE_THROWS_AS(plan_from_json(truncated), FormatError);
  REQUIRE_THROWS_WITH(plan_from_json("[1, 2]"),
                      "plan JSON: expected an object at the top level, got array");
}

TEST_CASE("plan JSON refuses numbers beyond a double with their position", "[plan_json]") {
  // nlohmann reports these as out_of_range, which used to escape as its own exception type.
  REQUIRE_THROWS_AS(plan_from_json("{\"version\": 1, \"x\": 1e400}"), FormatError);
  REQUIRE_THROWS_WITH(plan_from_json("{\"version\": 1, \"x\": 1e400}"),
                      "plan JSON: parse error at byte 25: number overflow parsing '1e400'");
  Json j = to_value(make_plan());
  std::string text = j.dump(2);
  const std::string key = "\"step_time_s\": ";
  const size_t at = text.find(key) + key.size();
  text.replace(at, text.find(',', at) - at, "-1e999");
  REQUIRE_THROWS_WITH(plan_from_json(text), Contains("number overflow parsing '-1e999'"));
  REQUIRE_THROWS_WITH(plan_from_json(text),
                      Contains("plan JSON: parse error at byte " + std::to_string(at + 6)));
}

TEST_CASE("plan JSON refuses other format versions", "[plan_json]") {
  Json j = to_value(make_plan());
  j["version"] = 7;
  REQUIRE_THROWS_AS(from_value(j), FormatError);
  REQUIRE_THROWS_WITH(
      from_value(j),
      "version: plan format version 7 is not supported (this build reads version 1)");
  j["version"] = 0;
  REQUIRE_THROWS_WITH(from_value(j), Contains("plan format version 0 is not supported"));
  j["version"] = "1";
  REQUIRE_THROWS_AS(from_value(j), FormatError);
  REQUIRE_THROWS_WITH(from_value(j), Contains("version: expected integer, got string"));
  j.erase("version");
  REQUIRE_THROWS_AS(from_value(j), FormatError);
  REQUIRE_THROWS_WITH(from_value(j), Contains("version: missing required field"));
}

TEST_CASE("plan JSON names a missing required field", "[plan_json]") {
  const Json good = to_value(make_plan());
  Json j = good;
  j["mesh"].erase("tp");
  REQUIRE_THROWS_WITH(from_value(j), "mesh.tp: missing required field");
  CHECK(validation_error_of(j).field() == "mesh.tp");

  j = good;
  j.erase("prediction");
  CHECK(validation_error_of(j).field() == "prediction");
  j = good;
  j["prediction"]["time"].erase("bubble");
  CHECK(validation_error_of(j).field() == "prediction.time.bubble");
  j = good;
  j["layers"][3].erase("stage");
  REQUIRE_THROWS_WITH(from_value(j), "layers[3].stage: missing required field");
  j = good;
  j["layers"][1]["tp_dims"].erase("kv_heads");
  CHECK(validation_error_of(j).field() == "layers[1].tp_dims.kv_heads");
  j = good;
  j["model"]["transformer"].erase("vocab");
  CHECK(validation_error_of(j).field() == "model.transformer.vocab");
  j = good;
  j["alternatives"][1].erase("reason");
  CHECK(validation_error_of(j).field() == "alternatives[1].reason");
}

TEST_CASE("plan JSON names a field of the wrong type", "[plan_json]") {
  const Json good = to_value(make_plan());
  Json j = good;
  j["mesh"]["tp"] = "2";
  REQUIRE_THROWS_WITH(from_value(j), "mesh.tp: expected integer, got string");
  j["mesh"]["tp"] = 2.5;
  REQUIRE_THROWS_WITH(from_value(j), "mesh.tp: expected integer, got number 2.5");
  j["mesh"]["tp"] = nullptr;
  REQUIRE_THROWS_WITH(from_value(j), "mesh.tp: expected integer, got null");

  j = good;
  j["layers"][3]["stage"] = true;
  REQUIRE_THROWS_WITH(from_value(j), "layers[3].stage: expected integer, got boolean");
  j = good;
  j["sequence_parallel"] = 1;
  REQUIRE_THROWS_WITH(from_value(j), "sequence_parallel: expected boolean, got integer");
  j = good;
  j["cluster"]["matmul_efficiency"] = "0.75";
  REQUIRE_THROWS_WITH(from_value(j), "cluster.matmul_efficiency: expected number, got string");
  j = good;
  j["model"]["name"] = 3;
  REQUIRE_THROWS_WITH(from_value(j), "model.name: expected string, got integer");
  j = good;
  j["layers"] = Json::object();
  REQUIRE_THROWS_WITH(from_value(j), "layers: expected array, got object");
  j = good;
  j["layers"][2] = "blocks.1";
  REQUIRE_THROWS_WITH(from_value(j), "layers[2]: expected object, got string");
  j = good;
  j["mesh"]["order"][1] = 1;
  REQUIRE_THROWS_WITH(from_value(j), "mesh.order[1]: expected string, got integer");
  j = good;
  j["model"]["params"] = 9223372036854775808ULL;
  REQUIRE_THROWS_WITH(from_value(j), Contains("model.params: 9223372036854775808 is out of range"));
}

TEST_CASE("plan JSON names an unknown enum value", "[plan_json]") {
  const Json good = to_value(make_plan());
  Json j = good;
  j["layers"][0]["kind"] = "conv";
  REQUIRE_THROWS_WITH(from_value(j), Contains("layers[0].kind: unknown layer kind 'conv'"));
  j = good;
  j["layers"][1]["tp"] = "rows";
  CHECK(validation_error_of(j).field() == "layers[1].tp");
  j = good;
  j["schedule"] = "2f2b";
  REQUIRE_THROWS_WITH(
      from_value(j),
      "schedule: unknown schedule '2f2b' (expected one of none, gpipe, 1f1b, interleaved_1f1b, "
      "zb_h1, zbv)");
  j = good;
  j["training"]["schedules"][1] = "pipedream";
  CHECK(validation_error_of(j).field() == "training.schedules[1]");
  j = good;
  j["recompute"] = "some";
  CHECK(validation_error_of(j).field() == "recompute");
  j = good;
  j["training"]["compute_dtype"] = "int8";
  REQUIRE_THROWS_WITH(
      from_value(j),
      "training.compute_dtype: unknown dtype 'int8' (expected one of fp32, tf32, bf16, fp16, "
      "fp8)");
  j = good;
  j["model"]["transformer"]["dtype"] = "fp64";
  CHECK(validation_error_of(j).field() == "model.transformer.dtype");
}

TEST_CASE("plan JSON refuses unknown fields", "[plan_json]") {
  const Json good = to_value(make_plan());
  Json j = good;
  j["mesh"]["tpp"] = 2;
  REQUIRE_THROWS_WITH(from_value(j), "mesh.tpp: unknown field");
  j = good;
  j["mesh"].erase("tp");
  j["mesh"]["tpp"] = 2;  // a typo is reported as the typo, not as the missing field
  REQUIRE_THROWS_WITH(from_value(j), "mesh.tpp: unknown field");
  j = good;
  j["comment"] = "hand-tuned";
  REQUIRE_THROWS_WITH(from_value(j), "comment: unknown field");
  j = good;
  j["layers"][4]["tp_dims"]["vocabulary"] = 32000;
  REQUIRE_THROWS_WITH(from_value(j), "layers[4].tp_dims.vocabulary: unknown field");
  j = good;
  j["prediction"]["memory"]["kv_cache"] = 0.0;
  CHECK(validation_error_of(j).field() == "prediction.memory.kv_cache");
  j = good;
  j["model"]["transformer"]["rope"] = true;
  CHECK(validation_error_of(j).field() == "model.transformer.rope");
}

TEST_CASE("plan_from_json validates the plan it reads", "[plan_json]") {
  Json j = to_value(make_plan());
  j["mesh"]["dp"] = 4;  // world 16 on an 8-device cluster
  REQUIRE_THROWS_AS(from_value(j), ValidationError);
  CHECK(validation_error_of(j).field() == "mesh");
  j = to_value(make_plan());
  j["layers"][3]["stage"] = 0;  // stages go 0 0 1 0 1
  CHECK(validation_error_of(j).field() == "layers[3].stage");
}

TEST_CASE("plan JSON checks the per-stage and per-rank predictions", "[plan_json]") {
  Json j = to_value(make_plan());
  j["prediction"]["stages"].erase(1);
  CHECK(validation_error_of(j).field() == "prediction.stages");
  j = to_value(make_plan());
  j["prediction"]["stages"][1]["forward_s"] = -1;
  CHECK(validation_error_of(j).field() == "prediction.stages[1].forward_s");
  j = to_value(make_plan());
  j["prediction"]["ranks"][0]["bytes_sent"]["tp"] = "many";
  CHECK(validation_error_of(j).field() == "prediction.ranks[0].bytes_sent.tp");
  j = to_value(make_plan());
  j["prediction"]["ranks"].push_back(j["prediction"]["ranks"][0]);
  CHECK(validation_error_of(j).field() == "prediction.ranks");
  // Absent (plans written before they existed): read as empty.
  j = to_value(make_plan());
  j["prediction"].erase("stages");
  j["prediction"].erase("ranks");
  const Plan old = from_value(j);
  CHECK(old.prediction.stages.empty());
  CHECK(old.prediction.ranks.empty());
}

TEST_CASE("save_plan and load_plan round-trip through a file", "[plan_json]") {
  const Plan p = make_plan();
  const std::string path = temp_path("plan.json");
  save_plan(p, path);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  CHECK(text.str() == to_json(p) + "\n");
  CHECK(load_plan(path) == p);
  std::remove(path.c_str());
}

TEST_CASE("load_plan and save_plan report file errors", "[plan_json]") {
  REQUIRE_THROWS_AS(load_plan("/nonexistent/plan.json"), FormatError);
  REQUIRE_THROWS_WITH(load_plan("/nonexistent/plan.json"),
                      "cannot read plan file '/nonexistent/plan.json': No such file or directory");
  REQUIRE_THROWS_WITH(load_plan("/tmp"), "cannot read plan file '/tmp': Is a directory");
  REQUIRE_THROWS_AS(save_plan(make_plan(), "/nonexistent/plan.json"), PlannerError);
  REQUIRE_THROWS_WITH(save_plan(make_plan(), "/nonexistent/plan.json"),
                      Contains("cannot write plan file '/nonexistent/plan.json'"));

  const std::string path = temp_path("bad.json");
  std::ofstream(path) << "{\"version\": 2}";
  REQUIRE_THROWS_WITH(load_plan(path), Contains("plan format version 2 is not supported"));
  std::remove(path.c_str());
}

TEST_CASE("Plan equality compares every field", "[plan]") {
  const Plan p = make_plan();
  Plan q = p;
  CHECK(q == p);
  q.prediction.time.optimizer += 1e-12;
  CHECK_FALSE(q == p);
  q = p;
  q.layers[2].tp_dims.ffn = 1;
  CHECK_FALSE(q == p);
  q = p;
  q.transformer->gated_mlp = false;
  CHECK_FALSE(q == p);
  q = p;
  q.cluster.inter_node_latency_s = 0;
  CHECK_FALSE(q == p);
  q = p;
  q.training.schedules.pop_back();
  CHECK_FALSE(q == p);
  q = p;
  q.alternatives[1].reason = "";
  CHECK_FALSE(q == p);
  q = p;
  q.mesh.order = {"pp", "tp", "dp"};
  CHECK_FALSE(q == p);
  q = p;
  q.prediction.stages[1].p2p_s = 1;
  CHECK_FALSE(q == p);
  q = p;
  q.prediction.ranks[1].ends_bytes = 0;
  CHECK_FALSE(q == p);
}

TEST_CASE("Plan::summary is one line", "[plan]") {
  Plan p = make_plan();
  CHECK(p.summary() == "pp=2 dp=2 tp=2 zero=1 mbs=2 m=4 1f1b recompute=selective sp=on");
  p.schedule = ScheduleKind::interleaved_1f1b;
  p.virtual_stages = 2;
  p.sequence_parallel = false;
  p.recompute = Recompute::full;
  CHECK(p.summary() == "pp=2 dp=2 tp=2 zero=1 mbs=2 m=4 interleaved_1f1b v=2 recompute=full sp=off");
}

TEST_CASE("enum and dtype names round-trip", "[plan_json]") {
  for (auto k : {LayerKind::embedding, LayerKind::attention, LayerKind::mlp, LayerKind::norm,
                 LayerKind::block, LayerKind::head, LayerKind::other}) {
    CHECK(layer_kind_from_string(to_string(k)) == k);
  }
  for (auto t : {TpPattern::replicated, TpPattern::column_row, TpPattern::heads,
                 TpPattern::block, TpPattern::vocab}) {
    CHECK(tp_pattern_from_string(to_string(t)) == t);
  }
  for (auto s : {ScheduleKind::none, ScheduleKind::gpipe, ScheduleKind::one_f_one_b,
                 ScheduleKind::interleaved_1f1b, ScheduleKind::zero_bubble_h1}) {
    CHECK(schedule_from_string(to_string(s)) == s);
  }
  for (auto r : {Recompute::none, Recompute::selective, Recompute::full}) {
    CHECK(recompute_from_string(to_string(r)) == r);
  }
  for (auto d : {DType::fp32, DType::tf32, DType::bf16, DType::fp16, DType::fp8}) {
    CHECK(dtype_from_string(to_string(d)) == d);
  }
  CHECK(bytes_of(DType::fp32) == 4);
  CHECK(bytes_of(DType::tf32) == 4);
  CHECK(bytes_of(DType::bf16) == 2);
  CHECK(bytes_of(DType::fp16) == 2);
  CHECK(bytes_of(DType::fp8) == 1);
  REQUIRE_THROWS_WITH(
      recompute_from_string("most", "pins.recompute"),
      "pins.recompute: unknown recompute mode 'most' (expected one of none, selective, full)");
  REQUIRE_THROWS_WITH(tp_pattern_from_string("rows"),
                      "tp: unknown tp pattern 'rows' (expected one of replicated, column_row, "
                      "heads, block, vocab)");
  REQUIRE_THROWS_WITH(layer_kind_from_string("Block"),
                      "kind: unknown layer kind 'Block' (expected one of embedding, attention, "
                      "mlp, norm, block, head, other)");
}

TEST_CASE("plan JSON carries an embeddings section, checked against the mesh", "[plan_json][embeddings]") {
  Plan p = make_plan();
  EmbeddingTable t;
  t.name = "user_id";
  t.rows = 1000;
  t.dim = 16;
  t.features = {"user_id"};
  EmbeddingOptions o;
  o.world_size = p.mesh.world_size();
  o.batch_per_rank = 4;
  p.embeddings = plan_embeddings({t}, p.cluster, o);
  const std::string text = to_json(p);
  const Plan back = plan_from_json(text);
  CHECK(back == p);
  CHECK(to_json(back) == text);
  validate(back);
  CHECK_THAT(format_report(back), Contains("embedding tables: 1 on") && Contains("user_id (1000 x 16)"));

  Plan other = p;
  other.embeddings->world_size = 3;
  try {
    validate(other);
    FAIL("expected a ValidationError");
  } catch (const ValidationError& e) {
    CHECK(e.field() == "embeddings.world_size");
  }
  Json j = to_value(p);
  j["embeddings"]["placements"][0]["shards"][0]["rows"] = 999;
  CHECK_THROWS_WITH(validate(from_value(j)), Contains("embeddings.placements.user_id.shards"));
}

namespace {
// make_plan() with pp=1 dp=4 tp=2 on its 2 nodes x 4 devices (2 dp ranks per node), reduced
// hierarchically with int8 on the inter-node hop.
Plan hierarchical_plan() {
  Plan p = make_plan();
  p.mesh = Mesh{1, 4, 2, {"pp", "dp", "tp"}};
  p.num_micro_batches = 2;
  p.schedule = ScheduleKind::none;
  for (auto& l : p.layers) l.stage = 0;
  p.prediction.stages.resize(1);
  p.prediction.ranks.resize(1);
  p.prediction.ranks[0].dp_inter_node_bytes = 0.125e9;
  p.zero_stage = 0;  // the runtime reduces hierarchically under ZeRO 0 only
  p.dp_reduction = DpReduction::hierarchical;
  p.inter_node_compression = Compression::int8;
  p.training.allow_hierarchical_dp = false;
  p.training.inter_node_compression = Compression::bf16;
  return p;
}
}  // namespace

TEST_CASE("plan JSON carries the dp reduction and its compression", "[plan_json][hierarchical]") {
  const Plan p = hierarchical_plan();
  const std::string text = to_json(p);
  CHECK_THAT(text, Contains("\"dp_reduction\": \"hierarchical\","));
  CHECK_THAT(text, Contains("\"inter_node_compression\": \"int8\","));
  CHECK_THAT(text, Contains("\"allow_hierarchical_dp\": false,"));
  CHECK_THAT(text, Contains("\"inter_node_compression\": \"bf16\"\n"));
  CHECK_THAT(text, Contains("\"dp_inter_node\": 125000000.0"));
  const Plan back = plan_from_json(text);
  CHECK(back == p);
  CHECK(to_json(back) == text);
  for (Compression c : {Compression::none, Compression::bf16, Compression::int8}) {
    CHECK(compression_from_string(to_string(c)) == c);
  }
  for (DpReduction r : {DpReduction::flat, DpReduction::hierarchical}) CHECK(dp_reduction_from_string(to_string(r)) == r);

  Plan q = p;
  q.dp_reduction = DpReduction::flat;
  CHECK_FALSE(q == p);
  q = p;
  q.inter_node_compression = Compression::bf16;
  CHECK_FALSE(q == p);
  q = p;
  q.training.inter_node_compression = Compression::none;
  CHECK_FALSE(q == p);
  q = p;
  q.training.allow_hierarchical_dp = true;
  CHECK_FALSE(q == p);
  q = p;
  q.prediction.ranks[0].dp_inter_node_bytes = 0;
  CHECK_FALSE(q == p);
  CHECK(p.summary() == "pp=1 dp=4 tp=2 zero=0 mbs=2 m=2 none recompute=selective sp=on dp_reduction=hierarchical "
                       "compression=int8");
}

TEST_CASE("plan JSON: the dp reduction fields are optional, defaults flat and none", "[plan_json][hierarchical]") {
  Json j = to_value(hierarchical_plan());
  j.erase("dp_reduction");
  j.erase("inter_node_compression");
  j["training"].erase("allow_hierarchical_dp");
  j["training"].erase("inter_node_compression");
  j["prediction"]["ranks"][0]["bytes_sent"].erase("dp_inter_node");
  const Plan old = from_value(j);
  CHECK(old.dp_reduction == DpReduction::flat);
  CHECK(old.inter_node_compression == Compression::none);
  CHECK(old.training.allow_hierarchical_dp);
  CHECK(old.training.inter_node_compression == Compression::none);
  // A plan written before ranks carried it reduced flat: its dp group spans both nodes, so
  // all of dp crossed them.
  CHECK(old.prediction.ranks[0].dp_inter_node_bytes == old.prediction.ranks[0].dp_bytes);
  // make_plan's dp groups stay on one node: none crossed.
  j = to_value(make_plan());
  j["prediction"]["ranks"][0]["bytes_sent"].erase("dp_inter_node");
  CHECK(from_value(j).prediction.ranks[0].dp_inter_node_bytes == 0);
}

TEST_CASE("plan JSON names an unknown dp reduction or compression", "[plan_json][hierarchical]") {
  const Json good = to_value(hierarchical_plan());
  Json j = good;
  j["dp_reduction"] = "tree";
  REQUIRE_THROWS_WITH(from_value(j), "dp_reduction: unknown dp reduction 'tree' (expected one of flat, hierarchical)");
  j = good;
  j["inter_node_compression"] = "fp8";
  REQUIRE_THROWS_WITH(from_value(j),
                      "inter_node_compression: unknown compression 'fp8' (expected one of none, bf16, int8)");
  j = good;
  j["training"]["inter_node_compression"] = "zstd";
  CHECK(validation_error_of(j).field() == "training.inter_node_compression");
  j = good;
  j["training"]["allow_hierarchical_dp"] = "yes";
  CHECK(validation_error_of(j).field() == "training.allow_hierarchical_dp");
  j = good;
  j["prediction"]["ranks"][0]["bytes_sent"]["dp_inter_node"] = -1.0;
  CHECK(validation_error_of(j).field() == "prediction.ranks[0].bytes_sent.dp_inter_node");
  // Validation after parsing: compression without the hierarchical reduction.
  j = good;
  j["dp_reduction"] = "flat";
  REQUIRE_THROWS_WITH(from_value(j), Contains("inter_node_compression: int8 compresses the inter-node hop"));
}

TEST_CASE("plan JSON carries zero_overlap; plans written before it overlap", "[plan_json][zero_overlap]") {
  Plan p = make_plan();
  p.zero_overlap = false;
  const Plan back = plan_from_json(to_json(p));
  CHECK_FALSE(back.zero_overlap);
  CHECK(back == p);
  CHECK_FALSE(back == make_plan());
  Json j = to_value(p);
  CHECK(j["zero_overlap"] == false);
  j.erase("zero_overlap");
  CHECK(from_value(j).zero_overlap);
  j["zero_overlap"] = "no";
  CHECK_THROWS_WITH(from_value(j), Catch::Contains("zero_overlap"));
}

TEST_CASE("plan JSON carries MoE, head_dim, attention_params, ep/cp times and choices", "[plan_json][moe]") {
  Plan p = make_plan();
  // A dense plan writes none of them (plans of dense models read and write as before).
  const Json dense = to_value(p);
  CHECK_FALSE(dense["model"]["transformer"].contains("moe"));
  CHECK_FALSE(dense["model"]["transformer"].contains("head_dim"));
  CHECK_FALSE(dense["model"]["transformer"].contains("attention_params"));
  CHECK_FALSE(dense["prediction"]["time"].contains("ep_comm"));
  CHECK_FALSE(dense.contains("choices"));

  p.transformer->head_dim = 128;
  p.transformer->attention_params = 123456789;
  p.transformer->moe.experts = 64;
  p.transformer->moe.top_k = 6;
  p.transformer->moe.expert_ffn = 1408;
  p.transformer->moe.shared_experts = 2;
  p.transformer->moe.first_dense_layers = 1;
  p.transformer->moe.every = 1;
  p.transformer->moe.capacity_factor = 1.25;
  p.transformer->moe.imbalance = 1.1;
  p.prediction.time.ep_comm = 0.125;
  p.prediction.time.cp_comm = 0.0625;
  p.choices = {"ep=8: expert memory needs ep>=8", "  smaller: ep=4 needs 90 GiB"};
  const std::string text = to_json(p);
  const Json j = Json::parse(text);
  CHECK(j["model"]["transformer"]["moe"]["experts"] == 64);
  CHECK(j["model"]["transformer"]["moe"]["capacity_factor"] == 1.25);
  CHECK(j["prediction"]["time"]["ep_comm"] == 0.125);
  CHECK(j["choices"][0] == "ep=8: expert memory needs ep>=8");
  const Plan back = plan_from_json(text);
  CHECK(back == p);
  CHECK(back.transformer->moe == p.transformer->moe);
  CHECK(to_json(back) == text);

  // Unknown MoE fields are refused, naming them; a choice must be a string.
  Json bad = j;
  bad["model"]["transformer"]["moe"]["experts_per_token"] = 2;
  CHECK(validation_error_of(bad).field() == "model.transformer.moe.experts_per_token");
  bad = j;
  bad["choices"][1] = 3;
  CHECK(validation_error_of(bad).field() == "choices[1]");
}

TEST_CASE("plans searched for MoE and long-context models round-trip", "[plan_json][moe]") {
  TransformerConfig c;
  c.name = "tiny-moe";
  c.layers = 4;
  c.hidden = 256;
  c.heads = 8;
  c.kv_heads = 2;
  c.seq = 16384;
  c.vocab = 1000;
  c.gated_mlp = true;
  c.moe.experts = 8;
  c.moe.top_k = 2;
  c.moe.expert_ffn = 512;
  const ModelGraph g = build_transformer(c);
  SearchOptions o;
  o.pins.ep = 2;
  o.pins.cp = 2;
  const Plan p = search(g, cluster_preset("h100-80gb", 8), [] {
    TrainingConfig t;
    t.global_batch = 8;
    return t;
  }(), o);
  CHECK(p.mesh.ep == 2);
  CHECK(p.mesh.cp == 2);
  const std::string text = to_json(p);
  const Plan back = plan_from_json(text);
  CHECK(back == p);
  CHECK(to_json(back) == text);
  validate(back, g);
}
