// The trace recorder (csrc/src/trace.cpp): a ring that keeps the newest events and counts the
// dropped ones, and Chrome trace output that the planner's reader (measured_trace.h) reads
// back with every field. The multi-rank save through the launcher is tested in
// test/python/test_report.py.
#include "catch_with_torch.h"

#include "monarch/planner/measured_trace.h"
#include "monarch/runtime/trace.h"

using namespace monarch;

namespace {

trace::Event pipeline_event(const char* name, int64_t start_ms, int64_t end_ms, int64_t step, int64_t mb) {
  trace::Event e;
  e.name = name;
  e.category = "pipeline";
  e.start_ns = start_ms * 1000000;
  e.end_ns = end_ms * 1000000;
  e.step = step;
  e.micro_batch = mb;
  e.stage = mb < 0 ? -1 : 0;
  return e;
}

}  // namespace

TEST_CASE("the trace ring keeps the newest events in order and counts the dropped ones", "[runtime][trace]") {
  auto& recorder = trace::Recorder::instance();
  recorder.set_capacity(3);
  for (int i = 0; i < 5; ++i) recorder.record(pipeline_event("forward", i, i + 1, 0, i));
  const auto events = recorder.snapshot();
  REQUIRE(events.size() == 3);
  CHECK(events[0].micro_batch == 2);
  CHECK(events[2].micro_batch == 4);
  CHECK(recorder.dropped() == 2);
  recorder.set_enabled(false);
  trace::record(pipeline_event("forward", 9, 10, 0, 9));  // disabled: not kept
  recorder.set_enabled(true);
  CHECK(recorder.snapshot().back().micro_batch == 4);
  recorder.clear();
  CHECK(recorder.snapshot().empty());
  CHECK(recorder.dropped() == 0);
  recorder.set_capacity(65536);
}

TEST_CASE("chrome trace output is read back by the planner with its steps, micro-batches and bytes",
          "[runtime][trace]") {
  std::vector<trace::Event> events = {pipeline_event("step", 100, 130, 7, -1),
                                      pipeline_event("forward", 100, 110, 7, 0),
                                      pipeline_event("backward", 115, 130, 7, 0)};
  trace::Event c;
  c.name = "all_reduce";
  c.category = "collective";
  c.start_ns = 120 * 1000000;
  c.end_ns = 125 * 1000000;
  c.bytes = 4096;
  c.group = "dp \"quoted\"";
  events.push_back(c);
  const std::string text = "{\"traceEvents\":[" + trace::chrome_events(events, 3) +
                           "],\"otherData\":{\"format\":\"monarch-trace\",\"version\":1,"
                           "\"ranks\":[{\"rank\":3,\"pp\":0,\"dp\":0,\"tp\":0}]}}";
  const planner::MeasuredTrace t = planner::measured_trace_from_json(text);
  REQUIRE(t.ranks.size() == 1);
  const auto& got = t.ranks[0].events;
  REQUIRE(got.size() == 4);
  CHECK(got[1].name == "forward");  // sorted by start; the step span starts first
  CHECK(got[1].micro_batch == 0);
  CHECK(got[1].step == 7);
  CHECK(got[1].end_s - got[1].start_s == Approx(0.010).margin(1e-6));
  CHECK(got[3].category == "collective");
  CHECK(got[3].bytes == 4096);
  CHECK(got[3].group == "dp \"quoted\"");
  const planner::MeasuredStep step = planner::measured_pipeline_step(t, 1);
  CHECK(step.makespan_s == Approx(0.030).margin(1e-6));
  CHECK(step.busy_s[0] == Approx(0.025).margin(1e-6));
}
