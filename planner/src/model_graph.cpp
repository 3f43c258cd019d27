#include <algorithm>
#include "monarch/planner/model_graph.h"

#include <cmath>
#include <cstdio>
#include <set>

#include "monarch/planner/errors.h"

namespace monarch::planner {
namespace {

std::string layer_path(size_t i) { return "layers[" + std::to_string(i) + "]"; }

std::string approx(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

// Costs and memory are sums and products of these: one NaN, infinity or negative value
// would turn every prediction into nonsense.
void require_finite_non_negative(double value, const std::string& field) {
  if (!std::isfinite(value) || value < 0) {
    throw ValidationError(field, "must be finite and >= 0, got " + approx(value));
  }
}

void check_layer(const Layer& l, size_t i) {
  const std::string path = layer_path(i);
  if (l.params < 0 || l.params >= kMaxParams) {
    throw ValidationError(path + ".params",
                          "must be in [0, 2^53), got " + std::to_string(l.params));
  }
  require_finite_non_negative(l.forward_flops_per_sample, path + ".forward_flops_per_sample");
  require_finite_non_negative(l.attention_flops_per_sample, path + ".attention_flops_per_sample");
  require_finite_non_negative(l.activations.replicated, path + ".activations.replicated");
  require_finite_non_negative(l.activations.tp_sharded, path + ".activations.tp_sharded");
  require_finite_non_negative(l.activations.attention_scores,
                              path + ".activations.attention_scores");
  require_finite_non_negative(l.activations.layer_input, path + ".activations.layer_input");
  require_finite_non_negative(l.activations.backward_transient, path + ".activations.backward_transient");
  require_finite_non_negative(l.activations.read_once, path + ".activations.read_once");
  require_finite_non_negative(l.output_bytes_per_sample, path + ".output_bytes_per_sample");
  const std::pair<const char*, int64_t> dims[] = {{"heads", l.tp_dims.heads},
                                                  {"kv_heads", l.tp_dims.kv_heads},
                                                  {"ffn", l.tp_dims.ffn},
                                                  {"vocab", l.tp_dims.vocab}};
  for (const auto& [name, value] : dims) {
    if (value < 0) {
      throw ValidationError(path + ".tp_dims." + name,
                            "must be >= 0, got " + std::to_string(value));
    }
  }
}

// The cost model indexes layers with these; an index out of range would read past the list.
void check_edges_and_groups(const ModelGraph& g) {
  const int n = static_cast<int>(g.layers.size());
  for (size_t e = 0; e < g.edges.size(); ++e) {
    const auto [from, to] = g.edges[e];
    if (from < 0 || to >= n || from >= to) {
      throw ValidationError("edges[" + std::to_string(e) + "]",
                            "(" + std::to_string(from) + ", " + std::to_string(to) +
                                ") must go forward between layers in [0, " + std::to_string(n) +
                                ")");
    }
  }
  for (size_t t = 0; t < g.tied_groups.size(); ++t) {
    const std::string path = "tied_groups[" + std::to_string(t) + "]";
    if (g.tied_groups[t].empty()) throw ValidationError(path, "must name at least one layer");
    std::set<int> seen;
    for (size_t k = 0; k < g.tied_groups[t].size(); ++k) {
      const int idx = g.tied_groups[t][k];
      const std::string field = path + "[" + std::to_string(k) + "]";
      if (idx < 0 || idx >= n) {
        throw ValidationError(
            field, "layer " + std::to_string(idx) + " is outside [0, " + std::to_string(n) + ")");
      }
      if (!seen.insert(idx).second) {
        throw ValidationError(field, "layer " + std::to_string(idx) + " appears twice");
      }
    }
  }
  if (g.tied_group_params.size() > g.tied_groups.size()) {
    throw ValidationError("tied_group_params", "has " + std::to_string(g.tied_group_params.size()) +
                                                   " entries for " + std::to_string(g.tied_groups.size()) +
                                                   " tied groups");
  }
  for (size_t t = 0; t < g.tied_group_params.size(); ++t) {
    if (g.tied_group_params[t] < 0) {
      throw ValidationError("tied_group_params[" + std::to_string(t) + "]", "must be >= 0");
    }
  }
}

}  // namespace

void validate(const ModelGraph& g) {
  if (g.layers.empty()) throw ValidationError("layers", "a model needs at least one layer");
  double total = 0;  // in double: cannot overflow while checking
  for (size_t i = 0; i < g.layers.size(); ++i) {
    check_layer(g.layers[i], i);
    total += static_cast<double>(g.layers[i].params);
  }
  if (total >= static_cast<double>(kMaxParams)) {
    throw ValidationError(
        "layers", "the layers hold " + approx(total) + " parameters in all; the limit is 2^53");
  }
  check_edges_and_groups(g);
}

int64_t ModelGraph::total_params() const {
  // A weight shared by several layers (tied embedding / head) is one tensor: count it once.
  // Its size is the smallest of its layers' (a layer may hold more than the shared tensor,
  // e.g. a masked-LM head around the tied decoder weight).
  int64_t total = 0;
  for (const auto& layer : layers) {
    if (__builtin_add_overflow(total, layer.params, &total)) {
      throw ValidationError("layers", "the parameter count overflows a 64-bit integer");
    }
  }
  for (size_t g = 0; g < tied_groups.size(); ++g) {
    total -= static_cast<int64_t>(tied_groups[g].size() - 1) * tied_params(g);
  }
  return total;
}

int64_t ModelGraph::tied_params(size_t g) const {
  const auto& group = tied_groups.at(g);
  int64_t smallest = layers[group.front()].params;
  for (int idx : group) smallest = std::min(smallest, layers[idx].params);
  if (g < tied_group_params.size() && tied_group_params[g] > 0) return std::min(smallest, tied_group_params[g]);
  return smallest;
}

void restrict_cuts_to_blocks(ModelGraph& graph) {
  const int n = static_cast<int>(graph.layers.size());
  int first = -1, last = -1;
  for (int i = 0; i < n; ++i) {
    if (graph.layers[i].kind != LayerKind::block) continue;
    if (first < 0) first = i;
    last = i;
  }
  graph.edges.clear();
  if (first < 0) {
    if (n > 1) graph.edges.emplace_back(0, n - 1);
    return;
  }
  if (first > 0) graph.edges.emplace_back(0, first);
  if (last < n - 1) graph.edges.emplace_back(last, n - 1);
}

bool ModelGraph::can_cut_before(int index) const {
  if (index <= 0 || index >= static_cast<int>(layers.size())) return false;
  // In a model made of blocks the runtimes cut only between two blocks (what comes before
  // the first block runs on the first stage, what comes after the last on the last), and
  // validate() refuses a stage without a block: one rule for search, validator and runtime.
  bool has_blocks = false;
  for (const auto& l : layers) has_blocks = has_blocks || l.kind == LayerKind::block;
  if (has_blocks && !(layers[index - 1].kind == LayerKind::block && layers[index].kind == LayerKind::block)) {
    return false;
  }
  // Only the chain edge (index-1 -> index) may cross the cut: it becomes the stage's p2p.
  for (const auto& [from, to] : edges) {
    const bool crosses = from < index && to >= index;
    if (crosses && !(from == index - 1 && to == index)) return false;
  }
  return true;
}

}  // namespace monarch::planner
