#pragma once
// Model-graph IR: what the planner knows about a model, with no torch in sight.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "monarch/planner/dtype.h"

namespace monarch::planner {

enum class LayerKind { embedding, attention, mlp, norm, block, head, other };
std::string to_string(LayerKind kind);
LayerKind layer_kind_from_string(const std::string& name, const std::string& field = "kind");

// How a layer can be split over the `tp` axis (Megatron-LM, Shoeybi et al. 2019).
enum class TpPattern {
  replicated,   // not split: every tp rank holds the whole layer (norms, small layers)
  column_row,   // MLP: first linear(s) column-parallel, last row-parallel
  heads,        // attention: q/k/v column-parallel by head, output row-parallel
  block,        // transformer block: attention by heads + MLP column/row
  vocab,        // embedding / output head split along the vocabulary
};
std::string to_string(TpPattern pattern);
TpPattern tp_pattern_from_string(const std::string& name, const std::string& field = "tp");

// What tp must divide for the layer to be split: 0 means "no constraint".
struct TpDims {
  int64_t heads = 0;     // attention heads (query heads)
  int64_t kv_heads = 0;  // key/value heads (grouped-query attention); == heads for MHA
  int64_t ffn = 0;       // MLP inner width
  int64_t vocab = 0;     // vocabulary size (embedding / head)
};

// Activation bytes one sample keeps alive for backward, split by how they shrink under
// tensor / sequence parallelism and recomputation (Korthikanti et al. 2022, Sec. 4).
struct ActivationBytes {
  double replicated = 0;       // e.g. layer-norm inputs, dropout masks: /tp only with sequence parallel
  double tp_sharded = 0;       // inside column/row-parallel regions: /tp
  double attention_scores = 0; // softmax/dropout over the s x s scores: /tp, dropped by selective recompute
  double layer_input = 0;      // what full recompute keeps (the layer's input): /tp with sequence parallel
  // Live only while this layer's backward runs, beyond what it keeps: the gradients it holds
  // at once where most, less what the layer kept after that point and freed by then
  // (docs/cost_model.md, "Activations as kept"). /tp like tp_sharded (in a layer tp does not
  // split, like replicated). Not in total().
  double backward_transient = 0;
  // Written by the forward and read once by a later op of the layer, not kept (the logits the
  // loss reads): memory traffic of the forward's memory-bound ops, not memory. /tp like
  // tp_sharded. Not in total().
  double read_once = 0;
  double total() const { return replicated + tp_sharded + attention_scores; }
};

// One matrix multiply of a layer's forward, for one sample: (m_per_sample x k) @ (k x n).
// The cost model uses the shapes for GEMM efficiency (tile and wave quantization, on
// devices with a known SM count); FLOPs stay in forward_flops_per_sample. `split` is the
// dimension tensor parallelism divides: n (column-parallel), k (row-parallel) or neither.
enum class GemmSplit { none, n, k };
struct Gemm {
  double m_per_sample = 0;  // rows per sample (tokens)
  int64_t n = 0, k = 0;
  GemmSplit split = GemmSplit::none;
  // > 0: a grouped GEMM over this many routed experts (one (m_e x k) @ (k x n) per expert):
  // m_per_sample is then every routed row of a sample (tokens x top_k), spread over the
  // experts; the cost model gives each rank experts / ep groups of rows (moe_cost.cpp).
  int64_t experts = 0;
};

// A Mixture-of-Experts feed-forward (Shazeer et al. 2017; GShard, Lepikhin et al. 2020;
// Switch, Fedus et al. 2021): a router sends each token to top_k of `experts` routed experts;
// shared experts see every token. What the cost model needs on top of the layer's totals.
struct MoeDims {
  int64_t experts = 0;            // routed experts; 0: not a MoE layer
  int64_t top_k = 0;
  int64_t expert_params = 0;      // all routed experts' weights (elements): what ep divides
  double routed_flops_per_sample = 0;  // forward FLOPs of the routed experts, balanced (top_k per token)
  double dispatch_bytes_per_sample = 0;  // one token copy per routed choice: s * h * act * top_k
  // Switch's capacity factor: each expert processes a buffer of capacity_factor x its fair
  // share of rows (padded; the rest dropped). 0: dropless.
  double capacity_factor = 0;
  // Dropless: rows on the busiest expert rank / the mean (what routing imbalance costs in
  // compute and all-to-all time). 1: perfectly balanced.
  double imbalance = 1.0;
  // The factor routed work and dispatch volume are scaled by: the capacity factor (padded
  // buffers) or the imbalance (dropless).
  double load_factor() const { return capacity_factor > 0 ? capacity_factor : imbalance; }
};

struct Layer {
  std::string name;
  LayerKind kind = LayerKind::other;
  int64_t params = 0;                     // parameter count (elements)
  DType param_dtype = DType::bf16;        // dtype the model computes in
  double forward_flops_per_sample = 0;    // one forward pass, one sample (multiply-add = 2)
  double attention_flops_per_sample = 0;  // the s^2 part (QK^T, AV): what selective recompute redoes
  ActivationBytes activations;            // kept for backward, per sample
  double output_bytes_per_sample = 0;     // what crosses a stage boundary after this layer
  TpPattern tp = TpPattern::replicated;
  TpDims tp_dims;
  bool recomputable = true;  // false for the loss head (Narayanan et al. do not recompute it)
  // The forward's weight GEMMs (empty when unknown, e.g. a graph read from a module: every
  // FLOP then runs at the cluster's large-GEMM efficiency).
  std::vector<Gemm> gemms;
  // Keys and values per token (elements, k and v together, all kv heads): what context
  // parallelism's ring sends (context_parallel_cost.cpp). 0: no attention in the layer.
  double kv_elements_per_token = 0;
  MoeDims moe;  // experts == 0 for dense layers
};

// Hyperparameters of a decoder-only transformer (GPT-3, Llama...).
// How attention is computed: FlashAttention (Dao et al. 2022; every current stack's default)
// keeps no s x s scores (only a per-row log-sum-exp), materialized attention keeps the
// softmax output, its dropout mask and the dropped-out scores (Korthikanti et al. 2022's
// 5as/h term). FLOPs are the same.
enum class AttentionKernel { flash, materialized };
std::string to_string(AttentionKernel kernel);
AttentionKernel attention_kernel_from_string(const std::string& name, const std::string& field = "attention");

// Mixture-of-Experts feed-forward layers of a transformer (DeepSeek-V3, Mixtral, Qwen3-MoE).
// Layer i (0-based) is a MoE layer when experts > 0, i >= first_dense_layers and
// (i - first_dense_layers) % every == 0; the others keep the dense MLP of width `ffn`.
struct MoeConfig {
  int64_t experts = 0;             // routed experts per MoE layer; 0: a dense model
  int64_t top_k = 0;               // routed experts per token
  int64_t expert_ffn = 0;          // each expert's inner width; 0 -> ffn
  int64_t shared_experts = 0;      // experts every token goes through (width expert_ffn each)
  int64_t first_dense_layers = 0;  // leading layers with a dense MLP (DeepSeek-V3: 3)
  int64_t every = 1;               // a MoE layer every `every` layers after those
  double capacity_factor = 0;      // 0: dropless; else Switch's capacity factor (e.g. 1.25)
  double imbalance = 1.0;          // dropless: busiest expert rank's rows / the mean
  bool operator==(const MoeConfig& o) const;
};

struct TransformerConfig {
  std::string name = "transformer";
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;      // 0 -> heads (multi-head attention)
  int64_t ffn = 0;           // 0 -> 4 * hidden
  bool gated_mlp = false;    // SwiGLU-style: gate and up projections, then down
  int64_t seq = 0;
  int64_t vocab = 0;
  bool tied_embeddings = false;
  DType dtype = DType::bf16;
  AttentionKernel attention = AttentionKernel::flash;
  // Per-head width; 0 -> hidden / heads. Qwen3 (heads x head_dim != hidden) needs it.
  int64_t head_dim = 0;
  // Attention weights per layer when not the q/k/v/o shapes' (0: from the shapes). For
  // attention with low-rank projections such as DeepSeek's MLA, which is then costed as
  // attention with this many weights (FLOPs 2 s x params) and heads x head_dim wide cores.
  int64_t attention_params = 0;
  MoeConfig moe;
  // How the ops around the matmuls run (docs/cost_model.md, "Memory"): fused kernels keep
  // what Megatron-LM with Transformer Engine keeps (a norm its input, a SwiGLU its gate and up
  // halves as one input, the loss its fp32 softmax, gradients computed in place); false: eager
  // PyTorch ops as Hugging Face's Llama writes them, each saving its own inputs (RMSNorm also
  // x * rsqrt(mean x^2), SwiGLU also silu(gate), materialized attention's keys and values
  // repeated to every query head). FlashAttention or not is `attention`.
  bool fused_kernels = true;
  // Dropout after attention, after the MLP and on the embeddings (GPT-2 / GPT-3, Korthikanti's
  // 1-byte masks; materialized attention also drops out the softmax). Llama-style models have
  // none, and with p = 0 torch keeps no mask.
  bool dropout = true;
  bool is_moe_layer(int64_t index) const {
    return moe.experts > 0 && index >= moe.first_dense_layers &&
           (index - moe.first_dense_layers) % std::max<int64_t>(moe.every, 1) == 0;
  }
  bool operator==(const TransformerConfig& o) const;
};

// A model as the planner sees it: layers in execution order (a chain unless `edges` says
// otherwise) plus groups of layers that share one weight.
struct ModelGraph {
  std::string name;
  std::vector<Layer> layers;
  // Extra data-flow edges (from, to) for non-chain graphs, as layer indices; the chain
  // i -> i+1 is implied. Pipeline cuts are only legal where no edge crosses the cut.
  std::vector<std::pair<int, int>> edges;
  // Layers whose weights are one tensor (e.g. embedding and output head). The shared
  // parameters are counted once in `total_params()`.
  std::vector<std::vector<int>> tied_groups;
  // Optional, parallel to tied_groups: the shared tensors' elements. Where absent (or 0),
  // the smallest layer of the group is taken as the shared tensor (exact when a layer is
  // just the tied weight, as an embedding or a bare output head; a model reader merging
  // modules into coarser layers, e.g. a masked-LM head around the decoder weight, says it).
  std::vector<int64_t> tied_group_params;
  // Set when built from hyperparameters; lets plans record and re-check the model.
  std::optional<TransformerConfig> transformer;

  // Throws ValidationError("layers", ...) if the sum overflows int64 (validate() first).
  int64_t total_params() const;
  // Elements of tied group `g`'s shared tensor (see tied_group_params).
  int64_t tied_params(size_t g) const;
  // Sequence length the per-sample numbers were built for (0 if unknown).
  int64_t seq_len() const { return transformer ? transformer->seq : 0; }
  // True when a pipeline stage may start at layer `index` (no edge jumps over it).
  bool can_cut_before(int index) const;
};

// Keeps pipeline cuts where a runtime can make them: only between two blocks (layers of kind
// `block`); what comes before the first block runs on the first stage, what comes after the
// last block on the last. Replaces `graph.edges` with the edges that say so. A graph without
// blocks cannot be cut at all.
void restrict_cuts_to_blocks(ModelGraph& graph);

// Parameter counts are int64 but flow through doubles (costs, memory), which hold integers
// exactly only below 2^53: a layer's, and the model's, parameter count must stay below this.
inline constexpr int64_t kMaxParams = int64_t{1} << 53;
// Most blocks build_transformer accepts: the layer list and the stage partition's tables
// grow with it.
inline constexpr int64_t kMaxTransformerLayers = 100000;

// Checks that the search can plan `graph`: at least one layer; parameter counts, FLOPs,
// activation and output bytes finite and >= 0; the parameter total below kMaxParams; every
// edge (from < to) and tied group (non-empty, no layer twice) names existing layers. Throws
// ValidationError naming the field ("layers[3].params", "tied_groups[0][1]", "edges[2]").
void validate(const ModelGraph& graph);

// Builds the layer list of a decoder transformer: embedding, `layers` blocks, final norm,
// LM head. FLOPs follow Narayanan et al. 2021 (24 s h^2 + 4 s^2 h per block forward, plus
// 2 s h V for the logits), generalized for grouped KV heads and gated MLPs.
// Throws ValidationError naming the bad hyperparameter, also when the model would exceed
// kMaxTransformerLayers blocks or kMaxParams parameters ("transformer.hidden: ... too large").
ModelGraph build_transformer(const TransformerConfig& config);

}  // namespace monarch::planner
