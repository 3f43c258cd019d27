// The plan as an HTML page (report_html.h). Everything is drawn here as inline SVG from the
// plan alone (and a measured trace when given): the timeline replays the plan's schedule in
// the simulator with the per-stage times the plan records.
#include "monarch/planner/report_html.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <map>
#include <sstream>
#include <vector>

#include "monarch/planner/collectives.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/report.h"
#include "monarch/planner/schedule.h"
#include "monarch/planner/search.h"

namespace monarch::planner {
namespace {

std::string esc(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string num(double v, int digits = 1) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string pct(double fraction) { return num(100.0 * fraction, 1) + "%"; }

// A tick spacing of 1, 2 or 5 x 10^k giving about `target` ticks over `range`.
double tick_step(double range, int target = 8) {
  if (!(range > 0)) return 1;
  const double raw = range / target;
  const double base = std::pow(10.0, std::floor(std::log10(raw)));
  for (double f : {1.0, 2.0, 5.0, 10.0}) {
    if (raw <= f * base) return f * base;
  }
  return 10 * base;
}

std::string rect(double x, double y, double w, double h, const std::string& fill, const std::string& title,
                 const std::string& cls = "") {
  std::ostringstream o;
  o << "<rect x=\"" << num(x, 2) << "\" y=\"" << num(y, 2) << "\" width=\"" << num(std::max(w, 0.0), 2)
    << "\" height=\"" << num(h, 2) << "\" fill=\"" << fill << "\"";
  if (!cls.empty()) o << " class=\"" << cls << "\"";
  o << "><title>" << esc(title) << "</title></rect>";
  return o.str();
}

std::string text(double x, double y, const std::string& s, const std::string& attrs = "") {
  std::ostringstream o;
  o << "<text x=\"" << num(x, 2) << "\" y=\"" << num(y, 2) << "\" " << attrs << ">" << esc(s) << "</text>";
  return o.str();
}

const char* kCss = R"(
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px; color: #222; max-width: 1240px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.note { color: #555; font-size: 13px; } .warn { color: #a40000; font-weight: 600; }
svg { font-size: 11px; } svg text { fill: #222; }
.legend span { display: inline-block; margin-right: 14px; font-size: 12px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -2px; }
)";

// Colours of the actions and memory parts (Tableau 10).
const char* action_colour(ActionType t) {
  switch (t) {
    case ActionType::forward: return "#4e79a7";
    case ActionType::backward: return "#59a14f";
    case ActionType::backward_input: return "#8cd17d";
    case ActionType::backward_weight: return "#f28e2b";
    case ActionType::recv_activation:
    case ActionType::recv_gradient: return "#d7d7d7";
    case ActionType::send_activation:
    case ActionType::send_gradient: return "#b07aa1";
  }
  return "#999";
}

const char* action_short(ActionType t) {
  switch (t) {
    case ActionType::forward: return "F";
    case ActionType::backward: return "B";
    case ActionType::backward_input: return "Bi";
    case ActionType::backward_weight: return "W";
    case ActionType::recv_activation: return "wait for activation";
    case ActionType::recv_gradient: return "wait for gradient";
    case ActionType::send_activation: return "send activation";
    case ActionType::send_gradient: return "send gradient";
  }
  return "?";
}

bool is_send(ActionType t) { return t == ActionType::send_activation || t == ActionType::send_gradient; }
bool is_compute(ActionType t) {
  return t == ActionType::forward || t == ActionType::backward || t == ActionType::backward_input ||
         t == ActionType::backward_weight;
}

std::string legend(const std::vector<std::pair<std::string, std::string>>& items) {
  std::ostringstream o;
  o << "<div class=\"legend\">";
  for (const auto& [colour, label] : items) o << "<span><i style=\"background:" << colour << "\"></i>" << esc(label) << "</span>";
  o << "</div>";
  return o.str();
}

// ---------------------------------------------------------------------- summary

std::string summary_section(const Plan& plan) {
  const Prediction& p = plan.prediction;
  const Cluster& c = plan.cluster;
  std::ostringstream o;
  o << "<table class=\"summary\">";
  auto row = [&](const std::string& k, const std::string& v) {
    o << "<tr><th>" << esc(k) << "</th><td>" << esc(v) << "</td></tr>";
  };
  row("model", plan.model_name + ", " + num(static_cast<double>(plan.model_params) / 1e9, 2) + "B parameters");
  row("cluster", c.name + ": " + std::to_string(c.nodes) + " node(s) x " + std::to_string(c.devices_per_node) +
                     " devices, " + format_bytes(c.device_memory_bytes) + " each (" +
                     format_bytes(c.usable_memory_bytes()) + " usable)");
  if (!c.levels.empty()) {
    std::string levels;
    for (const LinkLevel& l : c.levels) {
      levels += (levels.empty() ? "" : " > ") + l.name + (l.devices > 0 ? " " + std::to_string(l.devices) : "") +
                " (" + num(l.bytes_per_s / 1e9, 1) + " GB/s per device" +
                (l.oversubscription != 1 ? ", " + num(l.oversubscription, 1) + ":1" : std::string()) + ")";
    }
    row("network levels", levels);
  }
  row("layout", plan.summary());
  row("global batch", std::to_string(plan.training.global_batch) + " = micro-batch " +
                          std::to_string(plan.micro_batch_size) + " x " + std::to_string(plan.num_micro_batches) +
                          " micro-batches x dp " + std::to_string(plan.mesh.dp));
  row("predicted step", format_seconds(p.step_time_s) + ", " + num(p.tokens_per_s, 0) + " tokens/s, " +
                            num(p.tflops_per_device, 1) + " TFLOP/s per device, MFU " + pct(p.mfu));
  row("memory (most loaded rank)", format_bytes(p.memory_bytes_per_device) + " of " +
                                       format_bytes(c.usable_memory_bytes()) + " usable");
  row("times from", p.estimator);
  if (plan.inference) {  // an inference plan: what it serves and the generation prediction
    const InferencePlan& inf = *plan.inference;
    const InferencePrediction& q = inf.prediction;
    row("inference", to_string(inf.config.objective) + ": batch " + std::to_string(inf.batch_per_replica) +
                         " per replica x " + std::to_string(plan.mesh.dp) + ", prompt " +
                         std::to_string(inf.config.prompt_len) + " + " + std::to_string(inf.config.max_new_tokens) +
                         " new tokens");
    row("time to first token", format_seconds(q.ttft_s));
    row("per-token latency", format_seconds(q.per_token_s) + " (weights read " + format_seconds(q.decode_weights_s) +
                                 ", KV read " + format_seconds(q.decode_kv_s) + ", tp " +
                                 format_seconds(q.decode_tp_comm_s) + ", pp " + format_seconds(q.decode_pp_comm_s) + ")");
    row("tokens/s", num(q.tokens_per_s, 0) + " (all replicas)");
    row("per device", "weights " + format_bytes(q.weights_bytes) + ", KV cache " + format_bytes(q.kv_cache_bytes) +
                          ", activations " + format_bytes(q.activation_bytes));
  }
  if (!plan.tie_break.empty()) row("tie break", plan.tie_break);
  for (const auto& why : plan.choices) row("why", why);  // ep and cp (Plan::choices)
  o << "</table>";
  if (p.memory_bytes_per_device > c.usable_memory_bytes()) {
    o << "<p class=\"warn\">This plan does not fit: " << esc(format_bytes(p.memory_bytes_per_device)) << " needed, "
      << esc(format_bytes(c.usable_memory_bytes())) << " usable per device (see \"What would make it fit\").</p>";
  }
  return o.str();
}

// ---------------------------------------------------------------------- mesh

std::string link_text(const Cluster& c, const Link& l) {
  if (l.ranks <= 1) return "unused (size 1)";
  // A cluster with levels names the level the group reaches (its slowest link is charged).
  const std::string where = c.levels.empty() ? std::string(l.inter_node ? "inter-node" : "intra-node")
                                             : c.levels[static_cast<size_t>(l.level)].name + " level";
  return where + ", " + num(l.bytes_per_s / 1e9, 1) + " GB/s per device, " + format_seconds(l.latency_s) + " latency";
}

std::string mesh_section(const Plan& plan) {
  const Mesh& m = plan.mesh;
  const Cluster& c = plan.cluster;
  std::ostringstream o;
  o << "<table class=\"axes\"><tr><th>axis</th><th>size</th><th>link</th></tr>";
  const std::pair<const char*, Axis> axes[] = {{"pp", Axis::pp}, {"dp", Axis::dp}, {"tp", Axis::tp}};
  for (const auto& [name, axis] : axes) {
    const int64_t size = axis == Axis::pp ? m.pp : axis == Axis::dp ? m.dp : m.tp;
    std::string link = link_text(c, axis_link(c, m.pp, m.dp, m.tp, axis));
    if (axis == Axis::dp && plan.dp_reduction == DpReduction::hierarchical) {
      const NodeSplit split = dp_node_split(c, m.pp, m.dp, m.tp);
      link = "hierarchical: " + std::to_string(split.ranks_per_node) + " ranks per node (intra-node) x " +
             std::to_string(split.nodes) + " nodes (inter-node" +
             (plan.inter_node_compression != Compression::none
                  ? ", " + to_string(plan.inter_node_compression) + " compressed"
                  : std::string()) +
             ")";
    }
    o << "<tr><td>" << name << "</td><td class=\"n\">" << size << "</td><td>" << esc(link) << "</td></tr>";
  }
  o << "</table>";
  const int64_t world = m.world_size();
  constexpr int64_t kMaxDrawn = 8192;
  if (world > kMaxDrawn) {
    o << "<p class=\"note\">" << world << " ranks: too many to draw one by one.</p>";
    return o.str();
  }
  // One block per pipeline position: dp rows x tp columns; blocks wrap at the page width.
  const double cell = std::clamp(256.0 / static_cast<double>(std::max(m.dp, m.tp)), 6.0, 24.0);
  const double block_w = cell * static_cast<double>(m.tp), block_h = cell * static_cast<double>(m.dp);
  const double gap = 28, width = 1180;
  const int64_t per_row = std::max<int64_t>(1, static_cast<int64_t>((width + gap) / (block_w + gap)));
  const int64_t rows = (m.pp + per_row - 1) / per_row;
  const double height = static_cast<double>(rows) * (block_h + gap + 14) + 10;
  o << "<svg class=\"mesh\" width=\"" << num(width, 0) << "\" height=\"" << num(height, 0) << "\">";
  const int64_t per_node = std::max<int64_t>(1, c.devices_per_node);
  auto origin = [&](int64_t pp_i) {
    return std::make_pair(static_cast<double>(pp_i % per_row) * (block_w + gap),
                          static_cast<double>(pp_i / per_row) * (block_h + gap + 14) + 14);
  };
  for (int64_t i = 0; i < m.pp; ++i) {
    auto [x0, y0] = origin(i);
    o << "<g class=\"mesh-stage\" data-pp=\"" << i << "\">" << text(x0, y0 - 3, "pp " + std::to_string(i));
    for (int64_t d = 0; d < m.dp; ++d) {
      for (int64_t t = 0; t < m.tp; ++t) {
        const int64_t rank = (i * m.dp + d) * m.tp + t;
        const int64_t node = rank / per_node;
        o << rect(x0 + static_cast<double>(t) * cell + 1, y0 + static_cast<double>(d) * cell + 1, cell - 2, cell - 2,
                  node % 2 ? "#9ecae9" : "#c6dbef",
                  "rank " + std::to_string(rank) + " (pp " + std::to_string(i) + ", dp " + std::to_string(d) +
                      ", tp " + std::to_string(t) + "), node " + std::to_string(node),
                  "rank");
      }
    }
    // Node outlines: the box around each node's ranks within this block.
    std::map<int64_t, std::array<double, 4>> boxes;  // node -> x0, y0, x1, y1
    for (int64_t d = 0; d < m.dp; ++d) {
      for (int64_t t = 0; t < m.tp; ++t) {
        const int64_t node = ((i * m.dp + d) * m.tp + t) / per_node;
        const double x = x0 + static_cast<double>(t) * cell, y = y0 + static_cast<double>(d) * cell;
        auto it = boxes.find(node);
        if (it == boxes.end()) {
          boxes[node] = {x, y, x + cell, y + cell};
        } else {
          auto& b = it->second;
          b = {std::min(b[0], x), std::min(b[1], y), std::max(b[2], x + cell), std::max(b[3], y + cell)};
        }
      }
    }
    for (const auto& [node, b] : boxes) {
      o << "<rect class=\"node\" x=\"" << num(b[0], 2) << "\" y=\"" << num(b[1], 2) << "\" width=\""
        << num(b[2] - b[0], 2) << "\" height=\"" << num(b[3] - b[1], 2)
        << "\" fill=\"none\" stroke=\"#08519c\" stroke-width=\"1.5\"><title>node " << node << "</title></rect>";
    }
    o << "</g>";
  }
  o << "</svg><p class=\"note\">Each square is a rank: rows are data-parallel replicas, columns tensor-parallel "
       "ranks, one block per pipeline position; dark outlines are nodes of "
    << per_node << " devices (rank = (pp x dp + dp_i) x tp + tp_i).</p>";
  return o.str();
}

// ---------------------------------------------------------------------- timeline

struct TimelineRow {
  std::string label;
  std::string kind;  // "predicted" or "measured"
  int64_t rank = 0;
  std::vector<TimelineEvent> events;
};

// Above this many intervals a row is drawn at pixel resolution (pixel_runs): the page stays
// a few megabytes for schedules of 10^5 actions.
constexpr size_t kMaxDrawnActionsPerRow = 4000;

std::string pixel_runs(const std::vector<TimelineEvent>& events, double span, double left, double y, double width,
                       double height) {
  const int columns = static_cast<int>(width);
  const double per_column = span / width;
  constexpr int kKinds = 4;  // forward, backward (B or Bi), weight, nothing
  std::vector<std::array<double, kKinds>> cover(columns, std::array<double, kKinds>{});
  for (const TimelineEvent& e : events) {
    if (!is_compute(e.type) || per_column <= 0) continue;
    const int kind = e.type == ActionType::forward ? 0 : e.type == ActionType::backward_weight ? 2 : 1;
    const int first = std::clamp(static_cast<int>(e.start_s / per_column), 0, columns - 1);
    const int last = std::clamp(static_cast<int>(e.end_s / per_column), 0, columns - 1);
    for (int c = first; c <= last; ++c) {
      const double lo = std::max(e.start_s, c * per_column), hi = std::min(e.end_s, (c + 1) * per_column);
      if (hi > lo) cover[c][kind] += hi - lo;
    }
  }
  const ActionType kind_type[] = {ActionType::forward, ActionType::backward, ActionType::backward_weight};
  std::ostringstream o;
  int run_start = 0, run_kind = -1;
  auto flush = [&](int end) {
    if (run_kind >= 0 && run_kind < 3) {
      o << rect(left + run_start, y, end - run_start, height - 3, action_colour(kind_type[run_kind]),
                std::string(action_short(kind_type[run_kind])) + ": " + format_seconds(run_start * per_column) +
                    " to " + format_seconds(end * per_column) + " (drawn per pixel)",
                "action");
    }
  };
  for (int c = 0; c <= columns; ++c) {
    int kind = 3;
    if (c < columns) {
      double busy = 0;
      for (int k = 0; k < 3; ++k) busy += cover[c][k];
      if (busy >= per_column / 2) {
        kind = 0;
        for (int k = 1; k < 3; ++k) {
          if (cover[c][k] > cover[c][kind]) kind = k;
        }
      }
    }
    if (c == columns || kind != run_kind) {
      flush(c);
      run_start = c;
      run_kind = kind;
    }
  }
  return o.str();
}

std::string timeline_svg(const std::vector<TimelineRow>& rows, double span) {
  constexpr double kLeft = 130, kWidth = 1040, kRowH = 20, kGap = 6;
  const double scale = span > 0 ? kWidth / span : 1;
  const double height = static_cast<double>(rows.size()) * (kRowH + kGap) + 30;
  std::ostringstream o;
  o << "<svg class=\"timeline\" width=\"" << num(kLeft + kWidth + 20, 0) << "\" height=\"" << num(height, 0) << "\">";
  // Time axis.
  const double step = tick_step(span);
  const double axis_y = static_cast<double>(rows.size()) * (kRowH + kGap) + 4;
  for (double t = 0; t <= span * (1 + 1e-9); t += step) {
    const double x = kLeft + t * scale;
    o << "<line x1=\"" << num(x, 2) << "\" y1=\"0\" x2=\"" << num(x, 2) << "\" y2=\"" << num(axis_y, 2)
      << "\" stroke=\"#eee\"/>" << text(x, axis_y + 14, format_seconds(t), "text-anchor=\"middle\"");
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    const TimelineRow& r = rows[i];
    const double y = static_cast<double>(i) * (kRowH + kGap);
    o << "<g class=\"timeline-row\" data-kind=\"" << r.kind << "\" data-rank=\"" << r.rank << "\">"
      << text(0, y + kRowH * 0.7, r.label);
    o << rect(kLeft, y, span * scale, kRowH, "#fafafa", r.label + ": idle", "idle");
    if (r.events.size() > kMaxDrawnActionsPerRow) {
      // Too many actions to draw one by one (a large schedule): each pixel column takes the
      // compute kind that covers most of it, and runs of equal columns become one bar.
      o << pixel_runs(r.events, span, kLeft, y, kWidth, kRowH);
      o << "</g>";
      continue;
    }
    for (const TimelineEvent& e : r.events) {
      const double x = kLeft + e.start_s * scale, w = (e.end_s - e.start_s) * scale;
      std::string title = std::string(action_short(e.type)) + " micro-batch " + std::to_string(e.micro_batch) +
                          ", stage " + std::to_string(e.stage) + ": " + format_seconds(e.start_s) + " to " +
                          format_seconds(e.end_s);
      if (is_send(e.type)) {  // in flight to the peer: a thin bar under the row
        o << rect(x, y + kRowH - 3, w, 3, action_colour(e.type), title, "send");
        continue;
      }
      o << rect(x, y + (is_compute(e.type) ? 0 : 4), w, is_compute(e.type) ? kRowH - 3 : kRowH - 11,
                action_colour(e.type), title, is_compute(e.type) ? "action" : "wait");
      if (is_compute(e.type) && w >= 14) {
        o << text(x + w / 2, y + kRowH * 0.62, std::to_string(e.micro_batch),
                  "text-anchor=\"middle\" style=\"fill:#fff;font-size:10px\"");
      }
    }
    o << "</g>";
  }
  o << "</svg>";
  return o.str();
}

struct PhaseTotals {
  double forward = 0, backward = 0, weight = 0;  // idle time comes from the makespan
};

PhaseTotals totals(const std::vector<TimelineEvent>& events) {
  PhaseTotals t;
  for (const auto& e : events) {
    const double d = e.end_s - e.start_s;
    switch (e.type) {
      case ActionType::forward: t.forward += d; break;
      case ActionType::backward:
      case ActionType::backward_input: t.backward += d; break;
      case ActionType::backward_weight: t.weight += d; break;
      default: break;
    }
  }
  return t;
}

std::string timeline_section(const Plan& plan, const HtmlReportOptions& options) {
  const Prediction& p = plan.prediction;
  std::ostringstream o;
  if (static_cast<int64_t>(p.stages.size()) != plan.num_stages()) {
    o << "<p class=\"note\">This plan records no per-stage times (it was written before plans carried them): "
         "plan it again to see its timeline. Predicted bubble: "
      << pct(p.bubble_fraction) << ".</p>";
    return o.str();
  }
  const Schedule schedule = make_schedule(plan.schedule, plan.mesh.pp, plan.num_micro_batches, plan.virtual_stages);
  const SimulationResult sim = simulate(schedule, p.stages, true);
  std::vector<TimelineRow> rows;
  for (int64_t r = 0; r < plan.mesh.pp; ++r) {
    rows.push_back({"pp " + std::to_string(r) + " predicted", "predicted", r, sim.timeline[r]});
  }
  std::optional<MeasuredStep> measured;
  std::string trace_problem;
  if (options.trace) {
    try {
      measured = measured_pipeline_step(*options.trace, plan.mesh.pp, options.trace_step);
    } catch (const PlannerError& e) {
      trace_problem = e.what();
    }
  }
  double span = sim.makespan_s;
  if (measured) {
    span = std::max(span, measured->makespan_s);
    for (int64_t r = 0; r < plan.mesh.pp; ++r) {
      rows.push_back({"pp " + std::to_string(r) + " measured", "measured", r, measured->timeline[r]});
    }
  }
  o << "<p>" << to_string(plan.schedule) << ", " << plan.mesh.pp << " pipeline rank(s), "
    << plan.num_micro_batches << " micro-batch(es)";
  if (plan.virtual_stages > 1) o << ", " << plan.virtual_stages << " virtual stages per rank";
  o << ". Predicted bubble: <b class=\"bubble-predicted\">" << pct(sim.bubble_fraction) << "</b> of the "
    << esc(format_seconds(sim.makespan_s)) << " simulated pipeline step";
  if (measured) {
    o << "; measured bubble: <b class=\"bubble-measured\">" << pct(measured->bubble_fraction) << "</b> of "
      << esc(format_seconds(measured->makespan_s)) << " (step " << measured->step << " of the trace)";
  }
  o << ".</p>";
  const Cluster& c = plan.cluster;
  if (c.cores_per_node > 0 && c.cores_per_node < static_cast<double>(c.devices_per_node)) {
    o << "<p class=\"note\">The devices share " << num(c.cores_per_node, 0) << " cores per node of "
      << c.devices_per_node << " devices: the timeline runs every rank at its all-busy rate, while the "
      << "predicted step (" << esc(format_seconds(p.step_time_s))
      << ") lets a rank idle in a bubble lend its core to the busy ones (docs/cost_model.md).</p>";
  }
  if (!trace_problem.empty()) o << "<p class=\"warn\">The trace could not be drawn: " << esc(trace_problem) << "</p>";
  o << legend({{action_colour(ActionType::forward), "forward (F)"},
               {action_colour(ActionType::backward), "backward (B)"},
               {action_colour(ActionType::backward_input), "input gradient (Bi)"},
               {action_colour(ActionType::backward_weight), "weight gradient (W)"},
               {action_colour(ActionType::recv_activation), "waiting to receive"},
               {action_colour(ActionType::send_activation), "send in flight"},
               {"#fafafa", "idle"}});
  o << timeline_svg(rows, span);
  if (measured) {
    o << "<table class=\"phases\"><tr><th>pipeline rank</th><th>phase</th><th>predicted</th><th>measured</th>"
         "<th>measured / predicted</th></tr>";
    for (int64_t r = 0; r < plan.mesh.pp; ++r) {
      const PhaseTotals a = totals(sim.timeline[r]), b = totals(measured->timeline[r]);
      const double idle_a = sim.makespan_s - sim.busy_s[r];
      const double idle_b = measured->makespan_s - measured->busy_s[r];
      const std::pair<const char*, std::pair<double, double>> phases[] = {
          {"forward", {a.forward, b.forward}},
          {"backward (B or Bi)", {a.backward, b.backward}},
          {"weight gradient (W)", {a.weight, b.weight}},
          {"idle (bubble and waits)", {idle_a, idle_b}},
          {"step", {sim.makespan_s, measured->makespan_s}}};
      for (const auto& [name, v] : phases) {
        if (v.first == 0 && v.second == 0) continue;
        o << "<tr><td>" << r << "</td><td>" << name << "</td><td class=\"n\">" << esc(format_seconds(v.first))
          << "</td><td class=\"n\">" << esc(format_seconds(v.second)) << "</td><td class=\"n\">"
          << (v.first > 0 ? num(v.second / v.first, 2) + "x" : "-") << "</td></tr>";
      }
    }
    o << "</table>";
    if (options.trace->dropped > 0) {
      o << "<p class=\"note\">" << options.trace->dropped
        << " older events were overwritten in the ranks' ring buffers before the trace was saved.</p>";
    }
  }
  return o.str();
}

// ---------------------------------------------------------------------- memory

struct Part {
  const char* name;
  const char* colour;
};
constexpr Part kMemoryParts[] = {{"parameters", "#4e79a7"},
                                 {"gradients", "#59a14f"},
                                 {"optimizer state", "#f28e2b"},
                                 {"activations", "#e15759"},
                                 {"buffers", "#b07aa1"}};

std::vector<double> parts_of(const MemoryBreakdown& m) {
  return {m.params, m.grads, m.optimizer, m.activations, m.buffers};
}

std::string memory_section(const Plan& plan) {
  const Prediction& p = plan.prediction;
  std::vector<std::pair<std::string, MemoryBreakdown>> bars;
  if (!p.ranks.empty()) {
    for (size_t r = 0; r < p.ranks.size(); ++r) bars.push_back({"pp " + std::to_string(r), p.ranks[r].memory});
  } else {
    bars.push_back({"most loaded", p.memory});
  }
  size_t worst = 0;
  double largest = 0;
  for (size_t i = 0; i < bars.size(); ++i) {
    if (bars[i].second.total() > largest) {
      largest = bars[i].second.total();
      worst = i;
    }
  }
  const double limit = plan.cluster.usable_memory_bytes();
  // A limit far above every bar would squash the bars into slivers: then the scale follows
  // the bars and the limit is noted at the right edge instead.
  const bool limit_on_scale = limit <= 4 * largest;
  double full = (limit_on_scale ? std::max(limit, largest) : largest) * 1.08;
  if (!(full > 0)) full = 1;  // nothing to draw (a plan whose memory is all zero)
  constexpr double kLeft = 110, kWidth = 900, kBarH = 18, kGap = 8;
  const double height = static_cast<double>(bars.size()) * (kBarH + kGap) + 34;
  std::ostringstream o;
  o << "<p>Each bar is one pipeline position: every data- and tensor-parallel rank at that position holds the "
       "same. The red line is the usable device memory ("
    << esc(format_bytes(limit)) << ").</p>";
  std::vector<std::pair<std::string, std::string>> items;
  for (const Part& part : kMemoryParts) items.push_back({part.colour, part.name});
  o << legend(items);
  o << "<svg class=\"memory\" width=\"" << num(kLeft + kWidth + 130, 0) << "\" height=\"" << num(height, 0) << "\">";
  const double scale = kWidth / full;
  for (size_t i = 0; i < bars.size(); ++i) {
    const double y = static_cast<double>(i) * (kBarH + kGap);
    o << "<g class=\"memory-bar\" data-rank=\"" << i << "\"" << (i == worst ? " data-most-loaded=\"true\"" : "")
      << ">" << text(0, y + kBarH * 0.7, bars[i].first);
    double x = kLeft;
    const auto parts = parts_of(bars[i].second);
    for (size_t k = 0; k < parts.size(); ++k) {
      o << rect(x, y, parts[k] * scale, kBarH, kMemoryParts[k].colour,
                bars[i].first + " " + kMemoryParts[k].name + ": " + format_bytes(parts[k]));
      x += parts[k] * scale;
    }
    o << text(x + 6, y + kBarH * 0.7,
              format_bytes(bars[i].second.total()) + (i == worst && bars.size() > 1 ? "  (most loaded)" : ""),
              i == worst ? "style=\"font-weight:bold\"" : "");
    o << "</g>";
  }
  const double lx = kLeft + (limit_on_scale ? limit * scale : kWidth);
  const double bottom = static_cast<double>(bars.size()) * (kBarH + kGap);
  o << "<line class=\"memory-limit\" x1=\"" << num(lx, 2) << "\" y1=\"0\" x2=\"" << num(lx, 2) << "\" y2=\""
    << num(bottom, 2) << "\" stroke=\"#d62728\" stroke-width=\"2\"" << (limit_on_scale ? "" : " stroke-dasharray=\"4 3\"")
    << "><title>usable memory " << esc(format_bytes(limit)) << "</title></line>"
    << text(lx, bottom + 14,
            limit_on_scale ? "limit " + format_bytes(limit) : "limit " + format_bytes(limit) + " (off scale, to the right)",
            "text-anchor=\"" + std::string(limit_on_scale ? "middle" : "end") + "\" style=\"fill:#d62728\"");
  o << "</svg>";
  return o.str();
}

// ---------------------------------------------------------------------- fit advice

// The plan's own layout as pins (what evaluate_layout scores), for changing one thing.
Pins pins_of(const Plan& plan) {
  Pins p;
  p.tp = plan.mesh.tp;
  p.pp = plan.mesh.pp;
  p.dp = plan.mesh.dp;
  p.cp = plan.mesh.cp;
  p.ep = plan.mesh.ep;
  p.zero_stage = plan.zero_stage;
  p.micro_batch_size = plan.micro_batch_size;
  p.schedule = plan.schedule;
  p.virtual_stages = plan.virtual_stages;
  p.recompute = plan.recompute;
  p.sequence_parallel = plan.sequence_parallel;
  return p;
}

std::string fit_section(const Plan& plan) {
  const Prediction& p = plan.prediction;
  const double limit = plan.cluster.usable_memory_bytes();
  if (p.memory_bytes_per_device <= limit) return "";
  const MemoryBreakdown& m = p.memory;
  const double total = m.total(), over = total - limit;
  const double d = static_cast<double>(plan.mesh.dp);
  struct Lever {
    std::string change, why;
    double saves;                          // estimated from the breakdown
    std::function<void(Pins&)> apply;      // the same change as pins, for an exact evaluation
  };
  std::vector<Lever> levers;
  // ZeRO stage s shards the optimizer state (s >= 1), the gradients (s >= 2) and the
  // parameters (3) over dp (Rajbhandari et al. 2020); what the plan's stage already shards
  // saves nothing more.
  const std::pair<const char*, std::string> stage_why[] = {
      {"zero_stage=1", "optimizer state sharded over dp=" + std::to_string(plan.mesh.dp)},
      {"zero_stage=2", "optimizer state and gradients sharded over dp"},
      {"zero_stage=3", "optimizer state, gradients and parameters sharded (units gathered on use)"}};
  const double sharded_by[] = {m.optimizer, m.grads, m.params};
  for (int64_t stage = plan.zero_stage + 1; plan.mesh.dp > 1 && stage <= 3; ++stage) {
    double saves = 0;
    for (int64_t k = plan.zero_stage + 1; k <= stage; ++k) saves += sharded_by[k - 1] * (1 - 1 / d);
    levers.push_back({stage_why[stage - 1].first, stage_why[stage - 1].second, saves,
                      [stage](Pins& q) { q.zero_stage = stage; }});
  }
  if (plan.recompute != Recompute::full && m.activations > 0)
    // Full recomputation keeps each block's input only: 2sbh of sbh(34 + 5as/h) bytes per
    // layer (Korthikanti et al. 2022, Table 2), so at most 32/34 of the activations go.
    levers.push_back({"recompute=full", "blocks re-run in backward; about a third more compute",
                      m.activations * 32.0 / 34.0, [](Pins& q) { q.recompute = Recompute::full; }});
  // More model parallelism on the same devices: dp halves (the global batch is unchanged).
  // What ZeRO shards over dp stays the same per rank (half the model over half the ranks);
  // the rest halves.
  const bool halvable = plan.mesh.dp % 2 == 0;
  const double unsharded = (plan.zero_stage >= 1 ? 0 : m.optimizer) + (plan.zero_stage >= 2 ? 0 : m.grads) +
                           (plan.zero_stage >= 3 ? 0 : m.params);
  levers.push_back({"pp x 2, dp / 2", "half the layers per rank (more in-flight activations on early ranks)",
                    unsharded / 2, halvable ? std::function<void(Pins&)>([&plan](Pins& q) {
                      q.pp = plan.mesh.pp * 2;
                      q.dp = plan.mesh.dp / 2;
                      if (plan.schedule == ScheduleKind::none) q.schedule = ScheduleKind::one_f_one_b;
                    })
                                                                    : nullptr});
  levers.push_back({"tp x 2, dp / 2", "every layer split in two; more tensor-parallel traffic",
                    (unsharded + m.activations) / 2,
                    halvable ? std::function<void(Pins&)>([&plan](Pins& q) {
                      q.tp = plan.mesh.tp * 2;
                      q.dp = plan.mesh.dp / 2;
                    })
                             : nullptr});
  // With the model's own description (plans of transformers carry it), each change is scored
  // by the cost model itself; otherwise the saving is estimated from the breakdown.
  // A plan timed from a measured profile is not rescored with the analytic model (its own
  // numbers would not compare): it gets the estimates too.
  std::optional<ModelGraph> graph;
  std::string why_estimated = "the plan carries no model description to score it with";
  if (plan.transformer && plan.prediction.estimator == "analytic") {
    try {
      graph = build_transformer(*plan.transformer);
    } catch (const std::exception& e) {
      why_estimated = std::string("its transformer description does not build: ") + e.what();
    }
  } else if (plan.transformer) {
    why_estimated = "its times come from a measured profile (" + plan.prediction.estimator + ")";
  }
  std::ostringstream o;
  o << "<p>The most loaded rank needs " << esc(format_bytes(total)) << ", " << esc(format_bytes(over))
    << " more than the " << esc(format_bytes(limit)) << " usable. Each change alone"
    << (graph ? std::string(", scored by the cost model (the plan describes its transformer):")
              : ", estimated from this breakdown (" + why_estimated + "):")
    << "</p>";
  o << "<table class=\"fit\"><tr><th>change</th><th>what it does</th><th>then needs</th><th>predicted step</th>"
       "<th>fits?</th></tr>";
  for (const Lever& l : levers) {
    std::string need = "about " + format_bytes(total - l.saves) + " (estimate)", step = "", fits =
        total - l.saves <= limit ? "yes" : "no";
    if (graph && l.apply) {
      try {
        Pins q = pins_of(plan);
        l.apply(q);
        TrainingConfig training = plan.training;
        training.allow_recompute = training.allow_zero = true;
        training.allow_pipeline_parallel = training.allow_tensor_parallel = true;
        const Plan changed = evaluate_layout(*graph, plan.cluster, training, q, /*allow_over_memory=*/true);
        const double after = changed.prediction.memory_bytes_per_device;
        need = format_bytes(after);
        step = format_seconds(changed.prediction.step_time_s);
        fits = after <= limit ? "yes" : "no";
      } catch (const std::exception& e) {
        need = "not possible";
        fits = std::string("no: ") + e.what();
      }
    } else if (graph && !l.apply) {
      need = "not possible";
      fits = "no: dp=" + std::to_string(plan.mesh.dp) + " cannot be halved";
    }
    o << "<tr><td>" << esc(l.change) << "</td><td>" << esc(l.why) << "</td><td class=\"n\">" << esc(need)
      << "</td><td class=\"n\">" << esc(step) << "</td><td>" << esc(fits) << "</td></tr>";
  }
  o << "</table>";
  return o.str();
}

// ---------------------------------------------------------------------- time and traffic

std::string time_section(const Plan& plan) {
  const TimeBreakdown& t = plan.prediction.time;
  const std::vector<std::tuple<const char*, const char*, double>> parts = {
      {"compute", "#4e79a7", t.compute - t.recompute},
      {"recompute", "#76b7b2", t.recompute},
      {"tensor-parallel comm (exposed)", "#e15759", t.tp_comm},
      {"data-parallel / ZeRO comm (exposed)", "#f28e2b", t.dp_comm},
      {"pipeline send/recv (exposed)", "#b07aa1", t.pp_comm},
      {"bubble", "#bab0ac", t.bubble},
      {"optimizer", "#59a14f", t.optimizer},
      {"stragglers (the wait for the slowest node)", "#9c755f", t.stragglers}};
  std::ostringstream o;
  std::vector<std::pair<std::string, std::string>> items;
  for (const auto& [name, colour, v] : parts) items.push_back({colour, name});
  o << legend(items);
  constexpr double kWidth = 1000;
  const double total = std::max(t.total, 1e-30);
  o << "<svg class=\"step-time\" width=\"" << num(kWidth + 20, 0) << "\" height=\"46\">";
  double x = 0;
  for (const auto& [name, colour, v] : parts) {
    const double w = v / total * kWidth;
    o << rect(x, 0, w, 24, colour, std::string(name) + ": " + format_seconds(v) + " (" + pct(v / total) + ")");
    if (w > 60) o << text(x + 4, 16, pct(v / total), "style=\"fill:#fff\"");
    x += w;
  }
  o << text(0, 40, "0") << text(kWidth, 40, format_seconds(t.total), "text-anchor=\"end\"") << "</svg>";
  o << "<table class=\"breakdown\"><tr><th>part</th><th>seconds per step</th><th>share</th></tr>";
  for (const auto& [name, colour, v] : parts) {
    o << "<tr><td>" << name << "</td><td class=\"n\">" << esc(format_seconds(v)) << "</td><td class=\"n\">"
      << pct(v / total) << "</td></tr>";
  }
  o << "<tr><th>step</th><th class=\"n\">" << esc(format_seconds(t.total)) << "</th><th></th></tr></table>";

  // Traffic per axis and link level, per pipeline rank.
  const auto& ranks = plan.prediction.ranks;
  if (ranks.empty()) {
    o << "<p class=\"note\">This plan records no traffic per rank (written before plans carried it).</p>";
    return o.str();
  }
  const Mesh& m = plan.mesh;
  const Cluster& c = plan.cluster;
  const Link links[] = {axis_link(c, m.pp, m.dp, m.tp, Axis::dp), axis_link(c, m.pp, m.dp, m.tp, Axis::tp),
                        axis_link(c, m.pp, m.dp, m.tp, Axis::pp)};
  // dp's bytes over the network run on the level its group (or its hierarchical hop between
  // nodes) reaches; two-level clusters: the inter-node link.
  double dp_intra_bytes_per_s = c.intra_node_bytes_per_s, dp_inter_bytes_per_s = c.inter_node_bytes_per_s;
  if (!c.levels.empty()) {
    const DpGroup dpg = dp_group(c, m.pp, m.dp, m.tp, plan.dp_reduction, plan.inter_node_compression);
    dp_intra_bytes_per_s = group_link(c, 1, 1).bytes_per_s;
    dp_inter_bytes_per_s = (dpg.hierarchical() ? dpg.inter : dpg.flat).bytes_per_s;
  }
  o << "<p>Bytes each rank sends per optimizer step (ring volumes, as the runtime's counters count them), and the "
       "time they take on their link when nothing overlaps them. The step-time parts above are what stays exposed.</p>";
  o << "<table class=\"traffic\"><tr><th>pipeline rank</th><th>dp</th><th>tp</th><th>pp (+ tied ends)</th>"
       "<th>intra-node</th><th>inter-node</th><th>time on the links</th></tr>";
  for (size_t r = 0; r < ranks.size(); ++r) {
    const RankPrediction& q = ranks[r];
    const double bytes[] = {q.dp_bytes, q.tp_bytes, q.pp_bytes + q.ends_bytes};
    double intra = 0, inter = 0, seconds = 0;
    for (int a = 1; a < 3; ++a) {
      (links[a].inter_node ? inter : intra) += bytes[a];
      if (bytes[a] > 0) seconds += bytes[a] / links[a].bytes_per_s;
    }
    // dp: the part that crosses nodes is recorded (a hierarchical reduction uses both links).
    const double dp_inter = std::min(q.dp_inter_node_bytes, q.dp_bytes), dp_intra = q.dp_bytes - dp_inter;
    intra += dp_intra;
    inter += dp_inter;
    if (dp_intra > 0) seconds += dp_intra / dp_intra_bytes_per_s;
    if (dp_inter > 0) seconds += dp_inter / dp_inter_bytes_per_s;
    o << "<tr><td>" << r << "</td>";
    for (double b : bytes) o << "<td class=\"n\">" << esc(format_bytes(b)) << "</td>";
    o << "<td class=\"n\">" << esc(format_bytes(intra)) << "</td><td class=\"n\">" << esc(format_bytes(inter))
      << "</td><td class=\"n\">" << esc(format_seconds(seconds)) << "</td></tr>";
  }
  o << "</table>";
  return o.str();
}

// ---------------------------------------------------------------------- alternatives

std::string alternatives_section(const Plan& plan) {
  std::ostringstream o;
  if (plan.alternatives.empty()) {
    o << "<p class=\"note\">The plan lists no alternatives (its layout was pinned, or it was written by hand).</p>";
    return o.str();
  }
  o << "<table class=\"alternatives\"><tr><th>layout</th><th>predicted step</th><th>memory per device</th>"
       "<th>why not chosen</th></tr>";
  o << "<tr><td><b>" << esc(plan.summary()) << "</b> (chosen)</td><td class=\"n\">"
    << esc(format_seconds(plan.prediction.step_time_s)) << "</td><td class=\"n\">"
    << esc(format_bytes(plan.prediction.memory_bytes_per_device)) << "</td><td></td></tr>";
  for (const auto& a : plan.alternatives) {
    o << "<tr><td>" << esc(a.summary) << "</td><td class=\"n\">" << esc(format_seconds(a.step_time_s))
      << "</td><td class=\"n\">" << esc(format_bytes(a.memory_bytes_per_device)) << "</td><td>" << esc(a.reason)
      << "</td></tr>";
  }
  o << "</table>";
  return o.str();
}

// ---------------------------------------------------------------------- embeddings

std::string embeddings_section(const Plan& plan) {
  if (!plan.embeddings) return "";
  const EmbeddingPlan& e = *plan.embeddings;
  std::ostringstream o;
  o << "<h2>Embedding tables per rank</h2><table class=\"embeddings\"><tr><th>rank</th><th>shards</th>"
       "<th>storage</th><th>lookup</th><th>all-to-all</th><th>sent per step</th></tr>";
  std::vector<std::vector<std::string>> shards(e.world_size);
  for (size_t t = 0; t < e.placements.size(); ++t) {
    const EmbeddingPlacement& p = e.placements[t];
    for (const auto& s : p.shards) {
      if (s.rank < 0 || s.rank >= e.world_size) continue;
      shards[s.rank].push_back(p.table + " (" + to_string(p.sharding) + ", rows " + std::to_string(s.row_offset) +
                               "+" + std::to_string(s.rows) + ", cols " + std::to_string(s.col_offset) + "+" +
                               std::to_string(s.cols) + ")");
    }
  }
  for (int64_t r = 0; r < e.world_size; ++r) {
    o << "<tr><td>" << r << "</td><td>";
    for (size_t i = 0; i < shards[r].size(); ++i) o << (i ? "<br>" : "") << esc(shards[r][i]);
    o << "</td>";
    if (r < static_cast<int64_t>(e.ranks.size())) {
      const EmbeddingRankLoad& l = e.ranks[r];
      o << "<td class=\"n\">" << esc(format_bytes(l.storage_bytes)) << "</td><td class=\"n\">"
        << esc(format_seconds(l.lookup_s)) << "</td><td class=\"n\">" << esc(format_seconds(l.comm_s))
        << "</td><td class=\"n\">" << esc(format_bytes(l.sent_bytes)) << "</td>";
    } else {
      o << "<td></td><td></td><td></td><td></td>";
    }
    o << "</tr>";
  }
  o << "</table>";
  return o.str();
}

}  // namespace

std::string html_report(const Plan& plan, const HtmlReportOptions& options) {
  validate(plan);
  const std::string title = options.title.empty() ? plan.model_name + ": " + plan.summary() : options.title;
  std::ostringstream o;
  o << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>" << esc(title)
    << "</title><style>" << kCss << "</style></head><body>\n";
  o << "<h1>" << esc(title) << "</h1>\n";
  o << "<section id=\"summary\">" << summary_section(plan) << "</section>\n";
  o << "<section id=\"mesh\"><h2>Mesh</h2>" << mesh_section(plan) << "</section>\n";
  o << "<section id=\"timeline\"><h2>Pipeline timeline of one step</h2>" << timeline_section(plan, options)
    << "</section>\n";
  o << "<section id=\"memory\"><h2>Memory per rank</h2>" << memory_section(plan) << "</section>\n";
  const std::string fit = fit_section(plan);
  if (!fit.empty()) o << "<section id=\"fit\"><h2>What would make it fit</h2>" << fit << "</section>\n";
  o << "<section id=\"time\"><h2>Step time and traffic</h2>" << time_section(plan) << "</section>\n";
  o << "<section id=\"alternatives\"><h2>Alternatives</h2>" << alternatives_section(plan) << "</section>\n";
  const std::string tables = embeddings_section(plan);
  if (!tables.empty()) o << "<section id=\"embeddings\">" << tables << "</section>\n";
  o << "<p class=\"note\">Written by monarch-plan from the plan JSON (format version " << plan.version
    << "); every number above is the plan's prediction unless labelled measured.</p>\n</body></html>\n";
  return o.str();
}

void save_html_report(const Plan& plan, const std::string& path, const HtmlReportOptions& options) {
  const std::string html = html_report(plan, options);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw FormatError("cannot write report '" + path + "'");
  out << html;
  out.close();
  if (!out) throw FormatError("cannot write report '" + path + "' (disk full?)");
}

}  // namespace monarch::planner
