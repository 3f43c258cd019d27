#pragma once
// Costs of Mixture-of-Experts layers under expert parallelism (docs/cost_model.md, "Experts"):
// the dispatch / combine all-to-all and the grouped expert GEMMs.
#include <cstdint>

#include "monarch/planner/cluster.h"
#include "monarch/planner/collectives.h"
#include "monarch/planner/model_graph.h"
#include "monarch/planner/training_config.h"

namespace monarch::planner {

struct Layout;  // cost_model.h

// All-to-alls of one MoE layer per micro-batch: dispatch and combine in the forward, their
// gradients (combine's, then dispatch's) in the backward, and the forward's again when the
// layer is fully recomputed (Megatron-Core's MoE recomputes the dispatch with the layer).
struct MoeAllToAlls {
  int forward = 2, backward = 2, recompute = 0;
};
MoeAllToAlls moe_all_to_alls(Recompute recompute);

// Bytes one rank sends in one all-to-all of `layer` for one micro-batch: its tokens
// (b s / (cp tp): the sequence is split over cp, and each tp rank dispatches its 1/tp share,
// as with sequence parallelism) x hidden x top_k x bytes, of which (ep-1)/ep leave the rank,
// times the load factor (the busiest rank's share under imbalance; the padded capacity with
// a capacity factor). Lepikhin et al. 2020 (GShard), Sec. 2.2; Megatron-Core's alltoall
// token dispatcher. 0 for dense layers or ep = 1.
double moe_all_to_all_bytes(const Layer& layer, const TrainingConfig& training, const Layout& layout);

// Time of an all-to-all in which each of `ranks` ranks sends `bytes_per_rank` bytes, spread
// evenly over the other ranks, the group spanning ranks x `stride` consecutive global ranks
// (an ep group: stride tp; Mesh's expert_groups). Pairwise exchange (Thakur, Rabenseifner &
// Gropp 2005, Sec. 3.6): ranks - 1 steps; the bytes to peers on the rank's node go over the
// intra-node link and the rest over the inter-node link at the same time, so
//   time = (ranks - 1) latency + max(intra bytes / intra bw, inter bytes / inter bw),
// with a peer share of (L - 1)/(ranks - 1) on the node for L group ranks per node.
double all_to_all_seconds(double bytes_per_rank, int64_t ranks, int64_t stride, const Cluster& cluster);
// The inter-node part of those bytes.
double all_to_all_inter_node_bytes(double bytes_per_rank, int64_t ranks, int64_t stride, const Cluster& cluster);

// Utilization of a grouped GEMM of `groups` (m x k) @ (k x n) problems launched as one kernel
// (the experts of one rank: grouped GEMM, as Megatron-Core's GroupedMLP / CUTLASS grouped
// GEMM): tile and wave quantization over the groups' tiles together (gemm_utilization's
// model). Equal to gemm_utilization for one group.
double grouped_gemm_utilization(double m, double n, double k, double groups, int64_t sm_count);

}  // namespace monarch::planner
