// What differs between two plans (report_html.h, diff_plans): text for a terminal or a review.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "monarch/planner/report.h"
#include "monarch/planner/report_html.h"

namespace monarch::planner {
namespace {

std::string signed_percent(double a, double b) {
  if (a == 0) return "";
  char buf[32];
  std::snprintf(buf, sizeof buf, " (%+.1f%%)", 100.0 * (b / a - 1));
  return buf;
}

// A layer's placement; its stage only when both plans have the same stages (otherwise the
// stage numbers mean different things and the cuts are compared instead).
std::string layer_state(const LayerPlacement& l, bool with_stage) {
  std::string s = with_stage ? "stage " + std::to_string(l.stage) + ", " : "";
  s += "tp " + to_string(l.tp);
  if (l.sharding_unit) s += ", sharding unit";
  return s;
}

// "blocks.2, blocks.4, ... (47 cuts)": the layers each new stage starts at.
std::string cuts(const Plan& p) {
  std::vector<std::string> names;
  for (size_t i = 1; i < p.layers.size(); ++i) {
    if (p.layers[i].stage != p.layers[i - 1].stage) names.push_back(p.layers[i].name);
  }
  if (names.empty()) return "none (one stage)";
  std::string out;
  const size_t shown = std::min<size_t>(names.size(), 8);
  for (size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + names[i];
  if (shown < names.size()) out += ", ...";
  return out + " (" + std::to_string(names.size()) + " cut" + (names.size() == 1 ? "" : "s") + ")";
}

std::string memory_range(const std::vector<RankPrediction>& ranks) {
  double lo = ranks.front().memory.total(), hi = lo;
  for (const auto& r : ranks) {
    lo = std::min(lo, r.memory.total());
    hi = std::max(hi, r.memory.total());
  }
  return std::to_string(ranks.size()) + " pipeline rank" + (ranks.size() == 1 ? "" : "s") + " from " +
         format_bytes(lo) + " to " + format_bytes(hi);
}

}  // namespace

std::string diff_plans(const Plan& a, const Plan& b) {
  std::ostringstream o;
  auto field = [&](const std::string& name, const std::string& x, const std::string& y) {
    if (x != y) o << "  " << name << ": " << x << " -> " << y << "\n";
  };
  auto integer = [&](const std::string& name, int64_t x, int64_t y) {
    field(name, std::to_string(x), std::to_string(y));
  };

  o << "model and cluster\n";
  const auto mark = o.tellp();
  field("model", a.model_name, b.model_name);
  integer("model params", a.model_params, b.model_params);
  field("cluster", a.cluster.name + " x" + std::to_string(a.cluster.world_size()),
        b.cluster.name + " x" + std::to_string(b.cluster.world_size()));
  integer("global batch", a.training.global_batch, b.training.global_batch);
  if (o.tellp() == mark) o << "  same\n";

  o << "layout\n";
  const auto layout_mark = o.tellp();
  field("mesh", mesh_summary(a.mesh), mesh_summary(b.mesh));
  integer("zero_stage", a.zero_stage, b.zero_stage);
  integer("micro_batch_size", a.micro_batch_size, b.micro_batch_size);
  integer("num_micro_batches", a.num_micro_batches, b.num_micro_batches);
  field("schedule", to_string(a.schedule), to_string(b.schedule));
  integer("virtual_stages", a.virtual_stages, b.virtual_stages);
  field("recompute", to_string(a.recompute), to_string(b.recompute));
  field("sequence_parallel", a.sequence_parallel ? "on" : "off", b.sequence_parallel ? "on" : "off");
  field("dp_bucket_bytes", format_bytes(a.dp_bucket_bytes), format_bytes(b.dp_bucket_bytes));
  field("dp_reduction", to_string(a.dp_reduction), to_string(b.dp_reduction));
  field("inter_node_compression", to_string(a.inter_node_compression), to_string(b.inter_node_compression));
  field("zero_overlap", a.zero_overlap ? "on" : "off", b.zero_overlap ? "on" : "off");
  field("embedding tables", a.embeddings ? "sharded" : "none", b.embeddings ? "sharded" : "none");
  if (o.tellp() == layout_mark) o << "  same\n";

  o << "layers\n";
  bool same_layers = a.layers.size() == b.layers.size();
  for (size_t i = 0; same_layers && i < a.layers.size(); ++i) same_layers = a.layers[i].name == b.layers[i].name;
  if (!same_layers) {
    o << "  different layers: " << a.layers.size() << " vs " << b.layers.size()
      << " (plans of different models; placements not compared)\n";
  } else {
    const bool same_stages = a.num_stages() == b.num_stages();
    if (!same_stages) {
      o << "  stages: " << a.num_stages() << " -> " << b.num_stages() << "\n";
      o << "    cuts before: " << cuts(a) << "\n";
      o << "             -> " << cuts(b) << "\n";
    }
    // Runs of consecutive layers with the same change, so 96 blocks moving stage read as one line.
    size_t changed = 0;
    for (size_t i = 0; i < a.layers.size();) {
      const std::string x = layer_state(a.layers[i], same_stages), y = layer_state(b.layers[i], same_stages);
      size_t j = i + 1;
      while (j < a.layers.size() && layer_state(a.layers[j], same_stages) == x &&
             layer_state(b.layers[j], same_stages) == y) {
        ++j;
      }
      if (x != y) {
        o << "  " << a.layers[i].name;
        if (j - i > 1) o << " .. " << a.layers[j - 1].name << " (" << j - i << " layers)";
        o << ": " << x << " -> " << y << "\n";
        changed += j - i;
      }
      i = j;
    }
    if (changed == 0) {
      o << "  " << (same_stages ? "same placement of all " : "same tensor-parallel patterns and units of all ")
        << a.layers.size() << " layers\n";
    }
  }

  const Prediction& p = a.prediction;
  const Prediction& q = b.prediction;
  o << "prediction\n";
  o << "  step time: " << format_seconds(p.step_time_s) << " -> " << format_seconds(q.step_time_s)
    << signed_percent(p.step_time_s, q.step_time_s) << "\n";
  o << "  memory per device (most loaded): " << format_bytes(p.memory_bytes_per_device) << " -> "
    << format_bytes(q.memory_bytes_per_device) << signed_percent(p.memory_bytes_per_device, q.memory_bytes_per_device)
    << "\n";
  char buf[160];
  std::snprintf(buf, sizeof buf, "  tokens/s: %.0f -> %.0f; MFU %.1f%% -> %.1f%%; bubble %.1f%% -> %.1f%%\n",
                p.tokens_per_s, q.tokens_per_s, 100 * p.mfu, 100 * q.mfu, 100 * p.bubble_fraction,
                100 * q.bubble_fraction);
  o << buf;
  const std::pair<const char*, std::pair<double, double>> parts[] = {
      {"compute", {p.time.compute, q.time.compute}},   {"recompute", {p.time.recompute, q.time.recompute}},
      {"tp comm", {p.time.tp_comm, q.time.tp_comm}},   {"dp comm", {p.time.dp_comm, q.time.dp_comm}},
      {"pp comm", {p.time.pp_comm, q.time.pp_comm}},   {"ep comm", {p.time.ep_comm, q.time.ep_comm}},
      {"cp comm", {p.time.cp_comm, q.time.cp_comm}},   {"bubble", {p.time.bubble, q.time.bubble}},
      {"optimizer", {p.time.optimizer, q.time.optimizer}}, {"stragglers", {p.time.stragglers, q.time.stragglers}}};
  for (const auto& [name, v] : parts) {
    if (v.first != v.second) {
      o << "    " << name << ": " << format_seconds(v.first) << " -> " << format_seconds(v.second) << "\n";
    }
  }
  if (!p.ranks.empty() && p.ranks.size() == q.ranks.size()) {
    o << "  memory per pipeline rank:\n";
    for (size_t r = 0; r < p.ranks.size(); ++r) {
      const double x = p.ranks[r].memory.total(), y = q.ranks[r].memory.total();
      o << "    pp " << r << ": " << format_bytes(x) << " -> " << format_bytes(y) << signed_percent(x, y) << "\n";
    }
  } else if (!p.ranks.empty() && !q.ranks.empty()) {
    o << "  memory per pipeline rank: " << memory_range(p.ranks) << " -> " << memory_range(q.ranks) << "\n";
  }
  if (a.inference || b.inference) {
    auto mode = [](const Plan& x) {
      return x.inference ? "inference " + to_string(x.inference->config.objective) : std::string("training");
    };
    o << "inference\n";
    if (mode(a) != mode(b)) o << "  mode: " << mode(a) << " -> " << mode(b) << "\n";
    if (a.inference && b.inference) {
      const InferencePlan& x = *a.inference;
      const InferencePlan& y = *b.inference;
      auto line = [&](const char* name, double u, double v, bool seconds) {
        o << "  " << name << ": " << (seconds ? format_seconds(u) : format_bytes(u)) << " -> "
          << (seconds ? format_seconds(v) : format_bytes(v)) << signed_percent(u, v) << "\n";
      };
      if (x.batch_per_replica != y.batch_per_replica || x.decode_micro_batches != y.decode_micro_batches) {
        o << "  batch per replica: " << x.batch_per_replica << " (m=" << x.decode_micro_batches << ") -> "
          << y.batch_per_replica << " (m=" << y.decode_micro_batches << ")\n";
      }
      line("time to first token", x.prediction.ttft_s, y.prediction.ttft_s, true);
      line("per-token latency", x.prediction.per_token_s, y.prediction.per_token_s, true);
      char tok[120];
      std::snprintf(tok, sizeof tok, "  tokens/s: %.0f -> %.0f%s\n", x.prediction.tokens_per_s,
                    y.prediction.tokens_per_s, signed_percent(x.prediction.tokens_per_s, y.prediction.tokens_per_s).c_str());
      o << tok;
      line("KV cache per device", x.prediction.kv_cache_bytes, y.prediction.kv_cache_bytes, false);
      line("weights per device", x.prediction.weights_bytes, y.prediction.weights_bytes, false);
    }
  }
  if (a == b) return "plans are identical\n";
  return o.str();
}

}  // namespace monarch::planner
