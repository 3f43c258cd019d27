#pragma once
// Bytes on the wire per optimizer step, per mesh axis, as the runtime's communicator counts
// them (ring volumes: all-reduce 2(n-1)/n S, reduce-scatter and all-gather (n-1)/n S, a send
// S; Patarasuk & Yuan 2009). The same collectives the cost model times, in bytes, so a run's
// counters check the plan directly (bench/traffic.py) and a report can show what each link
// carries.
#include <cstdint>
#include <vector>

#include "monarch/planner/model_graph.h"
#include "monarch/planner/plan.h"

namespace monarch::planner {

struct AxisBytes {
  double dp = 0;    // gradient reduction, ZeRO gathers, tied-weight gradients over dp
  double tp = 0;    // Megatron's all-reduces (or all-gather + reduce-scatter with SP)
  double pp = 0;    // activations sent downstream and gradients sent upstream
  double ends = 0;  // all-reduce of weights tied between the pipeline's first and last rank
  // The part of `dp` sent over the inter-node link (DpGroup::bytes_per_rank): all of it when a
  // flat dp group spans nodes, none on one node, the cross-node hop of a hierarchical reduction.
  double dp_inter_node = 0;
  // Expert parallelism: the MoE layers' dispatch and combine all-to-alls (moe_cost.h), and the
  // part of them to ranks on other nodes. Context parallelism: the ring's k/v (and, backward,
  // dk/dv) sends (context_parallel_cost.h), and the part over the inter-node link (all of it
  // when the cp group spans nodes: its boundary ranks send every step across).
  double ep = 0, ep_inter_node = 0;
  double cp = 0, cp_inter_node = 0;
  double total() const { return dp + tp + pp + ends + ep + cp; }
};

// One entry per pipeline rank (every rank at one pipeline position sends the same bytes).
// What is sent, per step of m micro-batches on one rank, with d = dp x cp and P the rank's
// parameters on its tp rank (weights tied across the pipeline counted apart, T):
//   dp, ZeRO 0:   all-reduce of P's gradients once per step (no_sync on earlier micro-batches;
//                 Li et al. 2020, PyTorch DDP)
//   dp, ZeRO 1-2: reduce-scatter of P's gradients once per step and all-gather of the updated
//                 P (Rajbhandari et al. 2020, Sec. 5 and 7)
//   dp, ZeRO 3:   per micro-batch, all-gather of each sharding unit before its forward and
//                 again before its backward (the root unit, the layers outside the units, once:
//                 it stays gathered through backward), reduce-scatter of every gradient (Zhao
//                 et al. 2023, PyTorch FSDP)
//   dp, tied:     all-reduce of T's gradients over dp once per step, whatever the ZeRO stage
//   ends:         all-reduce of T's gradients between the two ends once per step
//   tp:           tp_bytes_per_step over the rank's layers
//   pp:           per micro-batch, each stage's output to the next stage and the gradient of
//                 its input to the previous one (stage_p2p_bytes)
//   experts:      the routed experts' share of P (1/ep) goes over their dp x cp / ep group
//   ep:           per micro-batch and MoE layer, 2 all-to-alls forward, 2 backward (+2 under
//                 full recompute) of moe_all_to_all_bytes
//   cp:           per micro-batch and attention layer, cp - 1 ring steps of cp_ring_step_bytes
//                 forward, twice those backward (+ the forward's under full recompute)
// Gradients travel at grad_bytes, gathered parameters at param_bytes; padding of shards is
// not counted. Under plan.dp_reduction = hierarchical each dp collective is the two-level
// decomposition of collectives.h (hierarchical_bytes_per_rank): dp is the sum of both levels
// (what the rank's dp communicator sends), dp_inter_node the cross-node part, compressed
// as plan.inter_node_compression says (all-reduces only).
std::vector<AxisBytes> bytes_per_step(const ModelGraph& graph, const Plan& plan);

// Writes bytes_per_step into plan.prediction.ranks (one entry per pipeline rank, as
// predict() leaves them). Done for the plans the search returns, not for every candidate.
void add_traffic(const ModelGraph& graph, Plan& plan);

}  // namespace monarch::planner
