#include "monarch/planner/traffic.h"

#include <set>

#include "monarch/planner/collectives.h"
#include "monarch/planner/cost_model.h"

namespace monarch::planner {

std::vector<AxisBytes> bytes_per_step(const ModelGraph& graph, const Plan& plan) {
  const Layout layout = layout_of(plan);
  const TrainingConfig& training = plan.training;
  const int64_t pp = plan.mesh.pp, d = plan.mesh.token_parallel(), stages = plan.num_stages();
  const double m = static_cast<double>(plan.num_micro_batches);
  const size_t n = plan.layers.size();
  validate(plan, graph);  // stages in range and non-empty, the plan made for this graph
  std::vector<AxisBytes> out(pp);
  const DpGroup group = dp_group(plan.cluster, pp, d, plan.mesh.tp, plan.dp_reduction,
                                 plan.inter_node_compression);

  std::vector<int64_t> first(stages, -1), last(stages, -1);
  for (size_t i = 0; i < n; ++i) {
    const int64_t s = plan.layers[i].stage;
    if (first[s] < 0) first[s] = static_cast<int64_t>(i);
    last[s] = static_cast<int64_t>(i);
  }

  // Layers whose weight is tied to a layer on another pipeline rank: synchronised by their
  // own all-reduces (over dp and between the ends), outside the dp / ZeRO engines. A tied
  // group inside one rank is one parameter, counted once (at its first layer).
  std::vector<bool> tied_across(n, false), tied_duplicate(n, false);
  for (const auto& group : graph.tied_groups) {
    std::set<int64_t> holders;
    for (int idx : group) holders.insert(plan.layers[idx].stage % pp);
    std::set<int64_t> seen_rank;
    for (int idx : group) {
      if (holders.size() > 1) tied_across[idx] = true;
      if (!seen_rank.insert(plan.layers[idx].stage % pp).second) tied_duplicate[idx] = true;
    }
  }

  for (int64_t r = 0; r < pp; ++r) {
    AxisBytes& b = out[r];
    double units = 0, root = 0, tied = 0;  // parameters on one tp rank
    for (size_t i = 0; i < n; ++i) {
      if (plan.layers[i].stage % pp != r) continue;
      b.tp += m * tp_layer_bytes_per_micro_batch(graph.layers[i], training, layout);
      if (tied_duplicate[i]) continue;  // the weight is counted at its first layer on this rank
      const double params = layer_params_per_tp_rank(graph.layers[i], plan.mesh.tp);
      if (tied_across[i]) {
        tied += params;
      } else if (plan.layers[i].sharding_unit) {
        units += params;
      } else {
        root += params;
      }
    }
    const double engine = units + root;
    if (d > 1) {
      auto bytes = [&](Collective c, double size, double element_bytes) {
        return group.bytes_per_rank(c, size, element_bytes);
      };
      auto sum = [](const LevelBytes& x, const LevelBytes& y, double times = 1) {
        return LevelBytes{times * (x.intra + y.intra), times * (x.inter + y.inter)};
      };
      const double g = training.grad_bytes, w = training.param_bytes;
      LevelBytes dp;
      if (plan.zero_stage == 0) {
        dp = bytes(Collective::all_reduce, engine * g, g);
      } else if (plan.zero_stage <= 2) {
        dp = sum(bytes(Collective::reduce_scatter, engine * g, g), bytes(Collective::all_gather, engine * w, w));
      } else {
        // Forward gathers of every unit and the root; backward re-gathers of the units (inside
        // the node under ZeRO++: node_gather_bytes_per_rank).
        const LevelBytes gathers = sum(bytes(Collective::all_gather, engine * w, w),
                                       group.node_gather_bytes_per_rank(units * w, w));
        dp = sum(gathers, bytes(Collective::reduce_scatter, engine * g, g), m);
      }
      dp = sum(dp, bytes(Collective::all_reduce, tied * g, g));
      b.dp += dp.total();
      b.dp_inter_node += dp.inter;
    }
    if (tied > 0) b.ends = ring_bytes_per_rank(Collective::all_reduce, tied * training.grad_bytes, 2);
    for (int64_t s = r; s < stages; s += pp) {
      if (s + 1 < stages) b.pp += m * stage_p2p_bytes(graph, training, layout, last[s]);
      if (s > 0) b.pp += m * stage_p2p_bytes(graph, training, layout, last[s - 1]);
    }
  }
  return out;
}

void add_traffic(const ModelGraph& graph, Plan& plan) {
  auto& ranks = plan.prediction.ranks;
  if (static_cast<int64_t>(ranks.size()) != plan.mesh.pp) return;  // not predicted: nothing to add to
  const std::vector<AxisBytes> bytes = bytes_per_step(graph, plan);
  for (size_t r = 0; r < ranks.size(); ++r) {
    ranks[r].dp_bytes = bytes[r].dp;
    ranks[r].tp_bytes = bytes[r].tp;
    ranks[r].pp_bytes = bytes[r].pp;
    ranks[r].ends_bytes = bytes[r].ends;
    ranks[r].dp_inter_node_bytes = bytes[r].dp_inter_node;
  }
}

}  // namespace monarch::planner
