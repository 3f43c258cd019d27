#pragma once
// Shared by inference_cost.cpp and inference_search.cpp: per-layer and per-stage costs of a
// layout, precomputed once per tp (the search scores many batches and stage counts on them).
#include <cstdint>
#include <string>
#include <vector>

#include "monarch/planner/cluster.h"
#include "monarch/planner/collectives.h"
#include "monarch/planner/inference.h"
#include "monarch/planner/model_graph.h"

namespace monarch::planner {
namespace inference_detail {

// One layer on one tp rank.
struct LayerCost {
  double weight_bytes = 0;          // the rank's share
  double read_bytes = 0;            // of which a step reads (an embedding reads only its rows: 0)
  double expert_weight_bytes = 0;   // of which routed experts (read only when a token picks them)
  int64_t experts = 0, top_k = 0;
  double dense_flops_per_token = 0;           // FLOPs per token outside the attention core
  double attention_flops_per_token_ctx = 0;   // attention core FLOPs per token per context token
  double kv_bytes_per_token = 0;              // KV-cache bytes per sequence per token
  double hidden_bytes_per_token = 0;          // the layer's output per token (tp all-reduce message)
  double activation_bytes_per_token = 0;      // a forward's live activations per token (one layer)
  double scores_bytes_per_token2 = 0;         // materialized attention scores per token^2
  double logit_bytes_per_sequence = 0;        // head: fp32 logits of one position, the rank's share
  int64_t vocab = 0;
  int64_t all_reduces = 0;                    // tp all-reduces per forward
  bool gathers_logits = false;                // head split by vocabulary: logits all-gathered
  bool head = false;
  bool can_cut_before = false;
};

struct ModelCosts {
  std::vector<LayerCost> layers;
  double weight_bytes = 2, kv_bytes = 2;  // per element
  double peak_flops = 0;                  // peak FLOP/s in the model's dtype
};

struct MoeRead {
  double bytes = 0;
  int64_t experts = 0, top_k = 0;
};

// One pipeline stage (sums over its layers; per-token activation sizes are the largest layer's).
struct StageCost {
  int64_t first_layer = 0, end_layer = 0;
  int64_t blocks = 0;  // decoder blocks: layers holding a KV cache (the host's operators scale with them)
  double weight_bytes = 0, dense_weight_bytes = 0;
  std::vector<MoeRead> moe;
  double dense_flops_per_token = 0, head_flops_per_token = 0, attention_flops_per_token_ctx = 0;
  double kv_bytes_per_token = 0;
  int64_t all_reduces = 0;
  double hidden_bytes_per_token = 0, out_bytes_per_token = 0;
  double activation_bytes_per_token = 0, scores_bytes_per_token2 = 0;
  double logit_bytes_per_sequence = 0, logit_gather_bytes_per_sequence = 0;
};

double all_reduce_seconds(double bytes, const Link& link);
double all_gather_seconds(double bytes, const Link& link);
ModelCosts model_costs(const ModelGraph& graph, const InferenceConfig& config, int64_t tp);
// First layer of each stage; stages balance weights + kv_per_token_weight x KV bytes per token.
std::vector<int64_t> partition_stages(const ModelCosts& m, int64_t pp, double kv_per_token_weight);
std::vector<StageCost> stage_costs(const ModelCosts& m, const std::vector<int64_t>& first);
// "" when tp can split the graph, else why not.
std::string tp_infeasible(const ModelGraph& graph, int64_t tp);
// Validates the three inputs and the cluster's peak FLOP/s in the model's dtype; returns that dtype.
DType checked_inputs(const ModelGraph& graph, const Cluster& cluster, const InferenceConfig& config);

}  // namespace inference_detail

// Scores a layout from precomputed stage costs (evaluate_inference and the search).
InferencePlan evaluate_stages(const inference_detail::ModelCosts& m,
                              const std::vector<inference_detail::StageCost>& stages,
                              const Cluster& cluster, const InferenceConfig& config, int64_t tp,
                              int64_t pp, int64_t batch, int64_t micro_batches);

}  // namespace monarch::planner
