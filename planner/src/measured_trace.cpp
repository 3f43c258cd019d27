// Reading the runtime's Chrome trace (measured_trace.h).
#include "monarch/planner/measured_trace.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "json_fields.h"
#include "monarch/planner/errors.h"

namespace monarch::planner {
namespace {

using json_detail::as_integer;
using json_detail::as_number;
using json_detail::as_string;
using json_detail::element;
using json_detail::Json;

bool is_compute(ActionType t) {
  return t == ActionType::forward || t == ActionType::backward || t == ActionType::backward_input ||
         t == ActionType::backward_weight;
}

int64_t optional_integer(const Json& args, const char* key, const std::string& path) {
  if (!args.contains(key)) return -1;
  return as_integer(args.at(key), path + ".args." + key);
}

}  // namespace

MeasuredTrace measured_trace_from_json(const std::string& text) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(std::string("trace is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw ValidationError("trace", "expected a JSON object (Chrome trace-event format)");
  if (!j.contains("otherData") || !j["otherData"].is_object() || !j["otherData"].contains("format") ||
      j["otherData"]["format"] != "monarch-trace") {
    throw ValidationError("otherData.format", "not a monarch trace (written by model.trace() / monarch::save_trace)");
  }
  const Json& other = j["otherData"];
  if (!other.contains("ranks") || !other["ranks"].is_array())
    throw ValidationError("otherData.ranks", "missing: the mesh coordinates of each rank");
  MeasuredTrace trace;
  std::map<int64_t, size_t> index;  // rank -> position in trace.ranks
  const Json& ranks = other["ranks"];
  for (size_t i = 0; i < ranks.size(); ++i) {
    const std::string at = element("otherData.ranks", i);
    if (!ranks[i].is_object()) throw ValidationError(at, "expected an object");
    MeasuredRank r;
    for (const char* key : {"rank", "pp", "dp", "tp"}) {
      if (!ranks[i].contains(key)) throw ValidationError(at + "." + key, "missing required field");
    }
    r.rank = as_integer(ranks[i]["rank"], at + ".rank");
    r.pp = as_integer(ranks[i]["pp"], at + ".pp");
    r.dp = as_integer(ranks[i]["dp"], at + ".dp");
    r.tp = as_integer(ranks[i]["tp"], at + ".tp");
    if (index.count(r.rank)) throw ValidationError(at + ".rank", "rank " + std::to_string(r.rank) + " listed twice");
    index[r.rank] = trace.ranks.size();
    trace.ranks.push_back(r);
  }
  if (other.contains("dropped")) trace.dropped = as_integer(other["dropped"], "otherData.dropped");
  if (other.contains("mesh")) {
    const Json& mesh = other["mesh"];
    if (!mesh.is_object()) throw ValidationError("otherData.mesh", "expected an object");
    for (const char* key : {"pp", "dp", "tp"}) {
      if (!mesh.contains(key)) throw ValidationError(std::string("otherData.mesh.") + key, "missing required field");
    }
    trace.pp = as_integer(mesh["pp"], "otherData.mesh.pp");
    trace.dp = as_integer(mesh["dp"], "otherData.mesh.dp");
    trace.tp = as_integer(mesh["tp"], "otherData.mesh.tp");
  }
  if (!j.contains("traceEvents") || !j["traceEvents"].is_array())
    throw ValidationError("traceEvents", "missing: expected an array of trace events");
  const Json& events = j["traceEvents"];
  for (size_t i = 0; i < events.size(); ++i) {
    const std::string at = element("traceEvents", i);
    const Json& e = events[i];
    if (!e.is_object()) throw ValidationError(at, "expected an object");
    if (!e.contains("ph") || e["ph"] != "X") continue;  // metadata and other phases: not timed
    for (const char* key : {"name", "pid", "ts", "dur"}) {
      if (!e.contains(key)) throw ValidationError(at + "." + key, "missing required field");
    }
    const int64_t pid = as_integer(e["pid"], at + ".pid");
    auto it = index.find(pid);
    if (it == index.end())
      throw ValidationError(at + ".pid", "rank " + std::to_string(pid) + " is not in otherData.ranks");
    MeasuredEvent ev;
    ev.name = as_string(e["name"], at + ".name");
    if (e.contains("cat")) ev.category = as_string(e["cat"], at + ".cat");
    const double ts = as_number(e["ts"], at + ".ts"), dur = as_number(e["dur"], at + ".dur");
    if (dur < 0) throw ValidationError(at + ".dur", "negative duration");
    ev.start_s = ts * 1e-6;  // trace-event times are microseconds
    ev.end_s = (ts + dur) * 1e-6;
    if (e.contains("args")) {
      const Json& args = e["args"];
      if (!args.is_object()) throw ValidationError(at + ".args", "expected an object");
      ev.step = optional_integer(args, "step", at);
      ev.micro_batch = optional_integer(args, "mb", at);
      ev.stage = optional_integer(args, "stage", at);
      if (args.contains("bytes")) ev.bytes = as_number(args["bytes"], at + ".args.bytes");
      if (args.contains("group")) ev.group = as_string(args["group"], at + ".args.group");
    }
    trace.ranks[it->second].events.push_back(ev);
  }
  for (auto& r : trace.ranks) {
    std::stable_sort(r.events.begin(), r.events.end(),
                     [](const MeasuredEvent& a, const MeasuredEvent& b) { return a.start_s < b.start_s; });
  }
  std::sort(trace.ranks.begin(), trace.ranks.end(),
            [](const MeasuredRank& a, const MeasuredRank& b) { return a.rank < b.rank; });
  return trace;
}

MeasuredTrace load_measured_trace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FormatError("cannot read trace file '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  try {
    return measured_trace_from_json(text.str());
  } catch (const ValidationError& e) {
    throw ValidationError(path + ": " + e.field(), std::string(e.what()).substr(e.field().size() + 2));
  } catch (const FormatError& e) {
    throw FormatError(path + ": " + e.what());
  }
}

MeasuredStep measured_pipeline_step(const MeasuredTrace& trace, int64_t pp, int64_t step) {
  if (pp < 1) throw ValidationError("pp", "must be >= 1, got " + std::to_string(pp));
  if (trace.pp > 0 && trace.pp != pp) {
    throw ValidationError("otherData.mesh.pp", "the trace is of a run with pp=" + std::to_string(trace.pp) +
                                                   ", the plan has pp=" + std::to_string(pp));
  }
  // The rank at each pipeline position whose dp and tp coordinates are 0.
  std::vector<const MeasuredRank*> at(pp, nullptr);
  for (const auto& r : trace.ranks) {
    if (r.dp == 0 && r.tp == 0 && r.pp >= 0 && r.pp < pp) at[r.pp] = &r;
  }
  for (int64_t i = 0; i < pp; ++i) {
    if (!at[i]) throw ValidationError("otherData.ranks", "no rank at pipeline position " + std::to_string(i) +
                                                              " (dp=0, tp=0) for a plan with pp=" + std::to_string(pp));
  }
  // Steps each position completed: its "step" events (a position counted once per step).
  std::map<int64_t, std::set<int64_t>> complete;  // step -> positions that recorded it
  for (int64_t position = 0; position < pp; ++position) {
    for (const auto& e : at[position]->events) {
      if (e.category == "pipeline" && e.name == "step" && e.step >= 0) complete[e.step].insert(position);
    }
  }
  int64_t chosen = -1;
  for (const auto& [s, positions] : complete) {
    if (static_cast<int64_t>(positions.size()) == pp && (step < 0 || s == step)) chosen = s;
  }
  if (chosen < 0) {
    throw ValidationError("traceEvents", step < 0 ? "no pipeline step recorded on every pipeline rank"
                                                  : "pipeline step " + std::to_string(step) +
                                                        " is not recorded on every pipeline rank");
  }
  MeasuredStep out;
  out.step = chosen;
  double begin = std::numeric_limits<double>::infinity(), end = -begin;
  for (const MeasuredRank* r : at) {
    for (const auto& e : r->events) {
      if (e.category == "pipeline" && e.name == "step" && e.step == chosen) {
        begin = std::min(begin, e.start_s);
        end = std::max(end, e.end_s);
      }
    }
  }
  out.makespan_s = end - begin;
  double idle_share = 0;
  for (const MeasuredRank* r : at) {
    std::vector<TimelineEvent> row;
    double busy = 0;
    for (const auto& e : r->events) {
      if (e.category != "pipeline" || e.step != chosen || e.name == "step") continue;
      ActionType type;
      try {
        type = action_type_from_string(e.name);
      } catch (const ValidationError&) {
        continue;  // an event of a later format version: not drawn
      }
      row.push_back({type, static_cast<int32_t>(e.micro_batch), static_cast<int32_t>(e.stage), e.start_s - begin,
                     e.end_s - begin});
      if (is_compute(type)) busy += e.end_s - e.start_s;
    }
    out.timeline.push_back(std::move(row));
    out.busy_s.push_back(busy);
    if (out.makespan_s > 0) idle_share += std::max(0.0, out.makespan_s - busy) / out.makespan_s;
  }
  out.bubble_fraction = idle_share / static_cast<double>(pp);
  return out;
}

}  // namespace monarch::planner
