#include "monarch/planner/model_graph.h"

#include <set>

namespace monarch::planner {

int64_t ModelGraph::total_params() const {
  // A weight shared by several layers (tied embedding / head) is one tensor: count it once.
  std::set<int> counted_elsewhere;
  for (const auto& group : tied_groups) {
    for (size_t i = 1; i < group.size(); ++i) counted_elsewhere.insert(group[i]);
  }
  int64_t total = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!counted_elsewhere.count(static_cast<int>(i))) total += layers[i].params;
  }
  return total;
}

bool ModelGraph::can_cut_before(int index) const {
  if (index <= 0 || index >= static_cast<int>(layers.size())) return false;
  // Only the chain edge (index-1 -> index) may cross the cut: it becomes the stage's p2p.
  for (const auto& [from, to] : edges) {
    const bool crosses = from < index && to >= index;
    if (crosses && !(from == index - 1 && to == index)) return false;
  }
  return true;
}

}  // namespace monarch::planner
