// The HTML report and the plan diff: what the page holds for a pipelined plan (one timeline
// row per pipeline rank, one memory bar per rank class, the limit line), the fit advice of a
// plan that does not fit, the measured rows of a trace, old plans without the per-stage
// details, and escaping. Rendering in a browser is tested in test/python/test_report.py.
#include "catch_compat.h"

#include <regex>
#include <string>

#include "monarch/planner/embeddings.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/measured_trace.h"
#include "monarch/planner/plan.h"
#include "monarch/planner/report_html.h"
#include "monarch/planner/search.h"
#include "test_configs.h"

using namespace monarch::planner;

namespace {

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

Plan pipelined_plan(int64_t pp, int64_t dp, int64_t tp, ScheduleKind schedule, int64_t gpus = 16) {
  TransformerConfig c = transformer_config(8, 1024, 16, 1024, 32000);
  const ModelGraph graph = build_transformer(c);
  TrainingConfig training;
  training.global_batch = 64;
  Pins pins = layout_pins(tp, pp, dp, 1, 1, schedule);
  return evaluate_layout(graph, cluster_preset("a100-80gb", gpus), training, pins, true);
}

// GPT-3 175B scored in exactly the given layout (over memory allowed).
Plan gpt3_plan(int64_t global_batch, const Pins& pins, int64_t gpus) {
  const ModelGraph graph = build_transformer(transformer_config(96, 12288, 96, 2048, 51200));
  TrainingConfig training;
  training.global_batch = global_batch;
  return evaluate_layout(graph, cluster_preset("a100-80gb", gpus), training, pins, true);
}

}  // namespace

TEST_CASE("a pipelined plan's report holds a timeline row per pipeline rank, a memory bar per rank class and the limit") {
  const Plan plan = pipelined_plan(4, 2, 2, ScheduleKind::one_f_one_b);
  REQUIRE(plan.prediction.stages.size() == 4);
  REQUIRE(plan.prediction.ranks.size() == 4);
  const std::string html = html_report(plan);
  CHECK(html.rfind("<!DOCTYPE html>", 0) == 0);
  CHECK(count(html, "class=\"timeline-row\" data-kind=\"predicted\"") == 4);
  CHECK(count(html, "class=\"timeline-row\" data-kind=\"measured\"") == 0);
  CHECK(count(html, "class=\"memory-bar\"") == 4);
  CHECK(count(html, "data-most-loaded=\"true\"") == 1);
  CHECK(count(html, "class=\"memory-limit\"") == 1);
  CHECK(count(html, "class=\"rank\"") == 16);  // the mesh: every rank drawn
  // 4 ranks x 32 micro-batches x (F + B) compute rectangles.
  CHECK(count(html, "class=\"action\"") == 4 * 32 * 2);
  // Self-contained: no script, no link to anything outside the file.
  CHECK(html.find("<script") == std::string::npos);
  CHECK(html.find("http://") == std::string::npos);
  CHECK(html.find("https://") == std::string::npos);
  // The predicted bubble is stated, as the simulator computes it.
  const Schedule s = make_schedule(ScheduleKind::one_f_one_b, 4, 32);
  const SimulationResult sim = simulate(s, plan.prediction.stages);
  char expected[64];
  std::snprintf(expected, sizeof expected, "%.1f%%", 100 * sim.bubble_fraction);
  CHECK(html.find(std::string("class=\"bubble-predicted\">") + expected) != std::string::npos);
  // Alternatives section and no fit advice for a plan that fits.
  CHECK(html.find("id=\"alternatives\"") != std::string::npos);
  CHECK(html.find("id=\"fit\"") == std::string::npos);
}

TEST_CASE("a plan that does not fit says so and what would make it fit") {
  const Plan plan = gpt3_plan(64, layout_pins(1, 1, 8, 0, 1, ScheduleKind::none), 8);
  REQUIRE(plan.prediction.memory_bytes_per_device > plan.cluster.usable_memory_bytes());
  const std::string html = html_report(plan);
  CHECK(html.find("This plan does not fit") != std::string::npos);
  CHECK(html.find("id=\"fit\"") != std::string::npos);
  for (const char* lever : {"zero_stage=1", "zero_stage=2", "zero_stage=3", "recompute=full", "pp x 2"}) {
    CHECK(html.find(lever) != std::string::npos);
  }
  // The plan describes its transformer: each change is scored by the cost model.
  CHECK(html.find("scored by the cost model") != std::string::npos);
  CHECK(count(html, "<tr><td>zero_stage=") == 3);
  Plan bare = plan;
  bare.transformer.reset();
  CHECK(html_report(bare).find("estimated from this breakdown (the plan carries no model description") !=
        std::string::npos);
  Plan profiled = plan;
  profiled.prediction.estimator = "profile: a machine";
  CHECK(html_report(profiled).find("its times come from a measured profile") != std::string::npos);
  CHECK(count(html, "class=\"timeline-row\" data-kind=\"predicted\"") == 1);
}

TEST_CASE("a plan written before per-stage details still reports, and says what is missing") {
  Plan plan = pipelined_plan(2, 8, 1, ScheduleKind::one_f_one_b);
  plan.prediction.stages.clear();
  plan.prediction.ranks.clear();
  const Plan reread = plan_from_json(to_json(plan));
  CHECK(reread.prediction.stages.empty());
  const std::string html = html_report(reread);
  CHECK(html.find("records no per-stage times") != std::string::npos);
  CHECK(count(html, "class=\"memory-bar\"") == 1);  // the most loaded rank only
  CHECK(count(html, "class=\"timeline-row\"") == 0);
}

TEST_CASE("text from the plan is escaped") {
  Plan plan = pipelined_plan(2, 8, 1, ScheduleKind::one_f_one_b);
  plan.model_name = "<script>alert(1)</script> & co";
  const std::string html = html_report(plan);
  CHECK(html.find("<script>") == std::string::npos);
  CHECK(html.find("&lt;script&gt;alert(1)&lt;/script&gt; &amp; co") != std::string::npos);
}

TEST_CASE("a measured trace draws a measured row per pipeline rank and its bubble") {
  const Plan plan = pipelined_plan(2, 8, 1, ScheduleKind::gpipe);
  // Two ranks (dp=0, tp=0 at each pipeline position) and a third that is not drawn.
  // Step 1 on both ranks: rank 0 F 0..10 ms, B 30..50 ms; rank 1 F 10..20, B 20..40.
  const std::string trace = R"({"traceEvents":[
    {"name":"process_name","ph":"M","pid":0,"tid":0,"args":{"name":"rank 0"}},
    {"name":"step","cat":"pipeline","ph":"X","pid":0,"tid":0,"ts":0,"dur":1000,"args":{"step":0}},
    {"name":"step","cat":"pipeline","ph":"X","pid":0,"tid":0,"ts":100000,"dur":50000,"args":{"step":1}},
    {"name":"forward","cat":"pipeline","ph":"X","pid":0,"tid":0,"ts":100000,"dur":10000,"args":{"step":1,"mb":0,"stage":0}},
    {"name":"recv_gradient","cat":"pipeline","ph":"X","pid":0,"tid":0,"ts":110000,"dur":20000,"args":{"step":1,"mb":0,"stage":0}},
    {"name":"backward","cat":"pipeline","ph":"X","pid":0,"tid":0,"ts":130000,"dur":20000,"args":{"step":1,"mb":0,"stage":0}},
    {"name":"all_reduce","cat":"collective","ph":"X","pid":0,"tid":1,"ts":150000,"dur":100,"args":{"bytes":4096,"group":"dp"}},
    {"name":"step","cat":"pipeline","ph":"X","pid":8,"tid":0,"ts":100000,"dur":40000,"args":{"step":1}},
    {"name":"forward","cat":"pipeline","ph":"X","pid":8,"tid":0,"ts":110000,"dur":10000,"args":{"step":1,"mb":0,"stage":1}},
    {"name":"backward","cat":"pipeline","ph":"X","pid":8,"tid":0,"ts":120000,"dur":20000,"args":{"step":1,"mb":0,"stage":1}}
  ],"displayTimeUnit":"ms","otherData":{"format":"monarch-trace","version":1,"dropped":0,
    "ranks":[{"rank":0,"pp":0,"dp":0,"tp":0},{"rank":8,"pp":1,"dp":0,"tp":0},{"rank":9,"pp":1,"dp":1,"tp":0}]}})";
  const MeasuredTrace t = measured_trace_from_json(trace);
  REQUIRE(t.ranks.size() == 3);
  const MeasuredStep step = measured_pipeline_step(t, 2);
  CHECK(step.step == 1);  // step 0 is on rank 0 only
  CHECK(step.makespan_s == Approx(0.05));
  CHECK(step.busy_s[0] == Approx(0.03));
  CHECK(step.busy_s[1] == Approx(0.03));
  CHECK(step.bubble_fraction == Approx(0.4));
  CHECK(step.timeline[1][0].start_s == Approx(0.01));
  CHECK_THROWS_WITH(measured_pipeline_step(t, 2, 0), Catch::Contains("step 0 is not recorded on every pipeline rank"));
  CHECK_THROWS_WITH(measured_pipeline_step(t, 4), Catch::Contains("no rank at pipeline position 2"));
  // A trace that states its mesh is matched against the plan's pipeline depth.
  MeasuredTrace with_mesh = t;
  with_mesh.pp = 2;
  CHECK(measured_pipeline_step(with_mesh, 2).step == 1);
  CHECK_THROWS_WITH(measured_pipeline_step(with_mesh, 4), Catch::Contains("a run with pp=2, the plan has pp=4"));
  CHECK_THROWS_WITH(measured_pipeline_step(t, 0), Catch::Contains("must be >= 1"));

  HtmlReportOptions options;
  options.trace = t;
  const std::string html = html_report(plan, options);
  CHECK(count(html, "class=\"timeline-row\" data-kind=\"measured\"") == 2);
  CHECK(html.find("class=\"bubble-measured\">40.0%") != std::string::npos);
  CHECK(html.find("class=\"phases\"") != std::string::npos);

  // A trace for another pipeline depth: the report still renders, with the reason.
  const Plan deeper = pipelined_plan(4, 4, 1, ScheduleKind::gpipe);
  const std::string other = html_report(deeper, options);
  CHECK(other.find("The trace could not be drawn") != std::string::npos);
  CHECK(count(other, "class=\"timeline-row\" data-kind=\"measured\"") == 0);
}

TEST_CASE("a file that is not a monarch trace is refused with the field") {
  CHECK_THROWS_AS(measured_trace_from_json("{not json"), FormatError);
  CHECK_THROWS_WITH(measured_trace_from_json(R"({"traceEvents":[]})"), Catch::Contains("otherData.format"));
  CHECK_THROWS_WITH(
      measured_trace_from_json(R"({"traceEvents":[{"ph":"X","name":"forward","pid":3,"ts":0,"dur":1}],
        "otherData":{"format":"monarch-trace","ranks":[{"rank":0,"pp":0,"dp":0,"tp":0}]}})"),
      Catch::Contains("traceEvents[0].pid"));
  CHECK_THROWS_WITH(
      measured_trace_from_json(R"({"traceEvents":[{"ph":"X","name":"forward","pid":0,"ts":0,"dur":-1}],
        "otherData":{"format":"monarch-trace","ranks":[{"rank":0,"pp":0,"dp":0,"tp":0}]}})"),
      Catch::Contains("negative duration"));
}

TEST_CASE("diff names the layout fields, the moved layers and the predicted change") {
  const Plan a = pipelined_plan(4, 2, 2, ScheduleKind::one_f_one_b);
  const Plan b = pipelined_plan(2, 8, 1, ScheduleKind::one_f_one_b);
  CHECK(diff_plans(a, a) == "plans are identical\n");
  const std::string d = diff_plans(a, b);
  CHECK(d.find("mesh: pp=4 dp=2 tp=2 -> pp=2 dp=8 tp=1") != std::string::npos);
  CHECK(d.find("blocks.") != std::string::npos);
  CHECK(d.find("step time:") != std::string::npos);
  CHECK(std::regex_search(d, std::regex(R"(step time: .* -> .* \([+-][0-9]+\.[0-9]%\))")));
  CHECK(d.find("stages: 4 -> 2") != std::string::npos);
  CHECK(d.find("cuts before: blocks.") != std::string::npos);
  CHECK(d.find("memory per pipeline rank: 4 pipeline ranks from") != std::string::npos);
  // Same stages, another tp: the layers' stages are compared directly.
  const Plan c = pipelined_plan(4, 4, 1, ScheduleKind::one_f_one_b);
  const std::string e = diff_plans(a, c);
  CHECK(e.find("stages:") == std::string::npos);
  CHECK(e.find(", tp block -> stage") != std::string::npos);
}

TEST_CASE("a plan with embedding tables lists each rank's shards") {
  Plan plan = pipelined_plan(2, 8, 1, ScheduleKind::one_f_one_b);
  std::vector<EmbeddingTable> tables;
  for (int i = 0; i < 3; ++i) {
    EmbeddingTable t;
    t.name = "table" + std::to_string(i);
    t.rows = 100000 * (i + 1);
    t.dim = 64;
    t.features = {"f" + std::to_string(i)};
    tables.push_back(t);
  }
  EmbeddingOptions o;
  o.world_size = plan.mesh.world_size();
  o.batch_per_rank = 64;
  plan.embeddings = plan_embeddings(tables, plan.cluster, o);
  const std::string html = html_report(plan);
  REQUIRE(html.find("id=\"embeddings\"") != std::string::npos);
  for (const auto& t : tables) CHECK(html.find(t.name + " (") != std::string::npos);
  const size_t section = html.find("id=\"embeddings\"");
  // One row per rank in the tables' section.
  CHECK(count(html.substr(section), "<tr><td>") == static_cast<size_t>(plan.mesh.world_size()));
}

TEST_CASE("a schedule of many actions is drawn at pixel resolution and the page stays small") {
  Pins pins = layout_pins(8, 8, 16, 1, 1, ScheduleKind::interleaved_1f1b);
  pins.virtual_stages = 6;
  const Plan plan = gpt3_plan(3072, pins, 1024);
  REQUIRE(plan.num_micro_batches == 192);  // per rank 192 micro-batches x 6 chunks x (F + B) and the transfers
  const std::string html = html_report(plan);
  CHECK(count(html, "class=\"timeline-row\" data-kind=\"predicted\"") == 8);
  CHECK(html.find("(drawn per pixel)") != std::string::npos);
  CHECK(html.size() < 4u * 1024 * 1024);
}

TEST_CASE("diff shows ep and cp, and the all-to-all's time", "[moe][cp]") {
  const ModelGraph g = build_transformer(mixtral_8x7b_config(8192));
  const Cluster cluster = cluster_preset("h100-80gb", 64);
  Pins pins = layout_pins(1, 1, 64, 3, 1, ScheduleKind::none);
  pins.ep = 4;
  pins.recompute = Recompute::full;
  const Plan a = evaluate_layout(g, cluster, global_batch(64), pins, true);
  pins.ep = 8;
  pins.dp = 32;
  pins.cp = 2;
  const Plan b = evaluate_layout(g, cluster, global_batch(32), pins, true);
  const std::string d = diff_plans(a, b);
  CHECK(d.find("mesh: pp=1 dp=64 tp=1 ep=4 -> pp=1 dp=32 cp=2 tp=1 ep=8") != std::string::npos);
  CHECK(d.find("ep comm:") != std::string::npos);
  CHECK(d.find("cp comm:") == std::string::npos);  // the ring hides behind 4096-token blocks
}
