#include "monarch/planner/traffic.h"

#include <set>

#include "monarch/planner/collectives.h"
#include "monarch/planner/context_parallel_cost.h"
#include "monarch/planner/cost_model.h"
#include "monarch/planner/moe_cost.h"

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
  // The routed experts' own group: dp x cp / ep ranks, ep x tp apart (expert_groups).
  const int64_t edp = plan.mesh.expert_data_parallel();
  const DpGroup expert_group = dp_group(plan.cluster, pp, edp, plan.mesh.ep * plan.mesh.tp);
  const bool cp_inter = axis_link(plan.cluster, pp, plan.mesh.cp, plan.mesh.tp, Axis::dp).inter_node;

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
    for (int idx : group) holders.insert(pipeline_rank_of_stage(plan.schedule, pp, plan.layers[idx].stage));
    std::set<int64_t> seen_rank;
    for (int idx : group) {
      if (holders.size() > 1) tied_across[idx] = true;
      if (!seen_rank.insert(pipeline_rank_of_stage(plan.schedule, pp, plan.layers[idx].stage)).second) tied_duplicate[idx] = true;
    }
  }

  for (int64_t r = 0; r < pp; ++r) {
    AxisBytes& b = out[r];
    double units = 0, root = 0, tied = 0;  // parameters on one tp rank
    double expert_units = 0, expert_root = 0;  // routed experts' (on one tp and ep rank)
    for (size_t i = 0; i < n; ++i) {
      if (pipeline_rank_of_stage(plan.schedule, pp, plan.layers[i].stage) != r) continue;
      const Layer& layer = graph.layers[i];
      b.tp += m * tp_layer_bytes_per_micro_batch(layer, training, layout);
      if (layer.moe.experts > 0 && plan.mesh.ep > 1) {
        const double one = moe_all_to_all_bytes(layer, training, layout);
        const MoeAllToAlls a = moe_all_to_alls(plan.recompute);
        const double sent = m * (a.forward + a.backward + a.recompute) * one;
        b.ep += sent;
        b.ep_inter_node += all_to_all_inter_node_bytes(sent, plan.mesh.ep, plan.mesh.tp, plan.cluster);
      }
      if (plan.mesh.cp > 1) {
        const double step = cp_ring_step_bytes(layer, training, layout, graph.seq_len());
        const double passes = 1.0 + 2.0 + (plan.recompute == Recompute::full && layer.recomputable ? 1.0 : 0.0);
        const double sent = m * static_cast<double>(plan.mesh.cp - 1) * step * passes;
        b.cp += sent;
        if (cp_inter) b.cp_inter_node += sent;
      }
      if (tied_duplicate[i]) continue;  // the weight is counted at its first layer on this rank
      double params = layer_params_per_tp_rank(layer, plan.mesh.tp);
      if (layer.moe.experts > 0) {
        const double experts = static_cast<double>(layer.moe.expert_params) /
                               (layer.tp == TpPattern::replicated ? 1.0 : static_cast<double>(plan.mesh.tp));
        const double held = experts / static_cast<double>(plan.mesh.ep);
        params -= experts;
        (plan.layers[i].sharding_unit ? expert_units : expert_root) += held;
      }
      if (tied_across[i]) {
        tied += params;
      } else if (plan.layers[i].sharding_unit) {
        units += params;
      } else {
        root += params;
      }
    }
    auto sum = [](const LevelBytes& x, const LevelBytes& y, double times = 1) {
      return LevelBytes{times * (x.intra + y.intra), times * (x.inter + y.inter)};
    };
    const double g = training.grad_bytes, w = training.param_bytes;
    // One group's gradient reduction (and ZeRO's gathers) of `unit_params` in sharding units
    // and `root_params` outside them.
    auto engine_bytes = [&](const DpGroup& grp, double unit_params, double root_params) {
      auto bytes = [&](Collective c, double size, double element_bytes) {
        return grp.bytes_per_rank(c, size, element_bytes);
      };
      const double engine = unit_params + root_params;
      if (plan.zero_stage == 0) return bytes(Collective::all_reduce, engine * g, g);
      if (plan.zero_stage <= 2) {
        return sum(bytes(Collective::reduce_scatter, engine * g, g), bytes(Collective::all_gather, engine * w, w));
      }
      // Forward gathers of every unit and the root; backward re-gathers of the units (inside
      // the node under ZeRO++: node_gather_bytes_per_rank).
      const LevelBytes gathers = sum(bytes(Collective::all_gather, engine * w, w),
                                     grp.node_gather_bytes_per_rank(unit_params * w, w));
      return sum(gathers, bytes(Collective::reduce_scatter, engine * g, g), m);
    };
    if (d > 1) {
      LevelBytes dp = engine_bytes(group, units, root);
      dp = sum(dp, group.bytes_per_rank(Collective::all_reduce, tied * g, g));
      if (edp > 1 && expert_units + expert_root > 0) dp = sum(dp, engine_bytes(expert_group, expert_units, expert_root));
      b.dp += dp.total();
      b.dp_inter_node += dp.inter;
    }
    if (tied > 0) b.ends = ring_bytes_per_rank(Collective::all_reduce, tied * training.grad_bytes, 2);
    // Each of the rank's stages sends its activations on and its input's gradient back,
    // except across a boundary inside the rank (ZB-V's turn), which moves no bytes.
    auto rank_of = [&](int64_t s) { return pipeline_rank_of_stage(plan.schedule, pp, s); };
    for (int64_t s = 0; s < stages; ++s) {
      if (rank_of(s) != r) continue;
      if (s + 1 < stages && rank_of(s + 1) != r) b.pp += m * stage_p2p_bytes(graph, training, layout, last[s]);
      if (s > 0 && rank_of(s - 1) != r) b.pp += m * stage_p2p_bytes(graph, training, layout, last[s - 1]);
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
