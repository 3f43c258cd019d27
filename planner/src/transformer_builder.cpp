// Decoder-transformer layer list from hyperparameters.
//
// FLOPs: Narayanan et al. 2021 (SC'21), Sec. 5.1: a block's forward is 24 B s h^2 + 4 B s^2 h
// (QKV 6sh^2, attention scores and values 4s^2h, output projection 2sh^2, MLP 16sh^2 for
// ffn = 4h); the logits add 2 B s h V. Here every matmul is 2 * s * (its weight count), so
// grouped KV heads and gated MLPs come out right and the paper's numbers are the special case.
//
// Activations kept for backward: Korthikanti et al. 2022, "Reducing Activation Recomputation
// in Large Transformer Models", Sec. 4.1: sbh(34 + 5as/h) bytes per block with 16-bit
// activations and 1-byte dropout masks, split as
//   replicated 10sbh  (layer-norm inputs 4sbh, QKV and MLP inputs 4sbh, two dropout masks 2sbh)
//   tp-sharded 24sbh  (Q, K, V, attention output 8sbh; MLP intermediate in and out 16sbh)
//   attention  5as^2b (softmax output 2, its dropout mask 1, dropout output 2)
// generalized, op by op as the kernels keep them (docs/cost_model.md, "Memory"):
//   * dropout (TransformerConfig::dropout): the masks only when the model has dropout (torch
//     keeps none at p = 0); Llama-style models have none.
//   * attention: FlashAttention (Dao et al. 2022, Alg. 2 and its backward) keeps Q, K, V, the
//     output O and one fp32 log-sum-exp per head and row, K and V at the kv heads' width (GQA:
//     the kernel reads each kv head for its group of query heads); materialized attention the
//     softmax output (and with dropout its mask and output), keys and values repeated to every
//     query head in eager PyTorch (Hugging Face's repeat_kv).
//   * MLP: a plain one its activation's input and output (2 ffn-wide); a gated one fused (Megatron's
//     bias_swiglu: one kernel keeping its gate|up input, then the down projection's input) 3 ffn-wide,
//     eager 4 (gate, silu(gate), up, their product).
//   * norms: a fused norm (Apex / Transformer Engine, and torch's native layer_norm) keeps its
//     input, its output is the next linear's input; eager RMSNorm (Hugging Face's Llama:
//     weight * (x * rsqrt(mean(x^2)))) also keeps x * rsqrt (models with a gated MLP are taken
//     to be Llama-style, RMSNorm; GPT-style ones use nn.LayerNorm, native in eager too).
//   * the loss keeps its fp32 softmax over the vocabulary (Megatron's vocab-parallel cross
//     entropy, and F.cross_entropy on fp32 logits: log_softmax's output), not the logits.
// Backward transient (ActivationBytes::backward_transient): what a layer's backward holds at
// once beyond what it keeps, where most, the tensors it kept after that point already freed
// (backward runs last to first): the MLP's activation function (1 ffn-wide tensor for a plain
// MLP, 2 for a gated one), materialized attention's softmax (2 s x s tensors less what the block
// kept after it); the loss: eager cross entropy's gradients of the log-probabilities and of the
// logits (2 x 4 sV); Megatron's computes its gradient in place in the kept softmax and only
// casts it to the logits' dtype (act sV when act < 4).
#include <algorithm>
#include <cstdio>
#include <string>

#include "monarch/planner/errors.h"
#include "monarch/planner/model_graph.h"

namespace monarch::planner {
namespace {

void require_positive(int64_t value, const char* field) {
  if (value < 1) {
    throw ValidationError(std::string("transformer.") + field,
                          "must be >= 1, got " + std::to_string(value));
  }
}

// Parameter counts must stay below kMaxParams (model_graph.h). They are computed here in
// double, which cannot overflow, before any int64 product (vocab * hidden, 4 * hidden) is.
void require_params_below_limit(double params, const char* field, int64_t value, const char* what) {
  if (params < static_cast<double>(kMaxParams)) return;
  char count[32];
  std::snprintf(count, sizeof count, "%.3g", params);
  throw ValidationError(std::string("transformer.") + field,
                        std::to_string(value) + " is too large: " + what + " would hold " + count +
                            " parameters (the limit is 2^53)");
}

// Sizes that keep every count the builder computes exact and in range.
void check_sizes(const TransformerConfig& c) {
  if (c.layers > kMaxTransformerLayers) {
    throw ValidationError("transformer.layers",
                          std::to_string(c.layers) + " is too large (at most " +
                              std::to_string(kMaxTransformerLayers) + " blocks)");
  }
  const double h = static_cast<double>(c.hidden);
  const double f = c.ffn == 0 ? 4.0 * h : static_cast<double>(c.ffn);
  // Upper bound: k and v at most h x h each (q/k/v/o as wide as heads x head_dim when set).
  const double width = c.head_dim > 0 ? std::max(h, static_cast<double>(c.heads) * c.head_dim) : h;
  const double attention = c.attention_params > 0 ? static_cast<double>(c.attention_params) : 4.0 * h * width;
  double mlp = (c.gated_mlp ? 3.0 : 2.0) * h * f;
  if (c.moe.experts > 0) {
    const double fe = c.moe.expert_ffn > 0 ? static_cast<double>(c.moe.expert_ffn) : f;
    const double experts = static_cast<double>(c.moe.experts) + std::max<int64_t>(c.moe.shared_experts, 0);
    mlp = std::max(mlp, (c.gated_mlp ? 3.0 : 2.0) * h * fe * experts + h * c.moe.experts);
  }
  // Blame ffn only when the user set it and it is what makes the block too large.
  const bool ffn_to_blame = c.ffn != 0 && mlp > attention && c.moe.experts == 0;
  require_params_below_limit(attention + mlp + 4.0 * h, ffn_to_blame ? "ffn" : "hidden",
                             ffn_to_blame ? c.ffn : c.hidden, "a block");
  const double embedding = static_cast<double>(c.vocab) * h;
  require_params_below_limit(embedding, "vocab", c.vocab, "the embedding");
  // Summed as if untied: the cost model adds up every layer's count.
  const double blocks = static_cast<double>(c.layers) * (attention + mlp + 4.0 * h);
  const bool layers_to_blame = blocks >= 2.0 * embedding;
  require_params_below_limit(blocks + 2.0 * embedding + 2.0 * h,
                             layers_to_blame ? "layers" : "vocab",
                             layers_to_blame ? c.layers : c.vocab, "the model");
}

void check_moe(const TransformerConfig& c) {
  const MoeConfig& m = c.moe;
  if (m.experts < 0) require_positive(m.experts, "moe.experts");
  if (m.experts == 0) return;
  if (m.top_k < 1 || m.top_k > m.experts) {
    throw ValidationError("transformer.moe.top_k", "must be in [1, experts=" + std::to_string(m.experts) +
                                                       "], got " + std::to_string(m.top_k));
  }
  if (m.expert_ffn < 0) require_positive(m.expert_ffn, "moe.expert_ffn");
  if (m.shared_experts < 0) {
    throw ValidationError("transformer.moe.shared_experts", "must be >= 0, got " + std::to_string(m.shared_experts));
  }
  if (m.first_dense_layers < 0 || m.first_dense_layers >= c.layers) {
    throw ValidationError("transformer.moe.first_dense_layers",
                          "must be in [0, layers=" + std::to_string(c.layers) + "), got " +
                              std::to_string(m.first_dense_layers));
  }
  require_positive(m.every, "moe.every");
  if (!(m.capacity_factor == 0 || (m.capacity_factor >= 1 && m.capacity_factor < 1e6))) {
    throw ValidationError("transformer.moe.capacity_factor",
                          "must be 0 (dropless) or >= 1, got " + std::to_string(m.capacity_factor));
  }
  if (!(m.imbalance >= 1 && m.imbalance < 1e6)) {
    throw ValidationError("transformer.moe.imbalance", "must be >= 1, got " + std::to_string(m.imbalance));
  }
}

TransformerConfig normalized(TransformerConfig c) {
  require_positive(c.layers, "layers");
  require_positive(c.hidden, "hidden");
  require_positive(c.heads, "heads");
  require_positive(c.seq, "seq");
  require_positive(c.vocab, "vocab");
  if (c.kv_heads < 0) require_positive(c.kv_heads, "kv_heads");
  if (c.ffn < 0) require_positive(c.ffn, "ffn");
  if (c.head_dim < 0) require_positive(c.head_dim, "head_dim");
  if (c.attention_params < 0) require_positive(c.attention_params, "attention_params");
  check_moe(c);
  check_sizes(c);
  if (c.kv_heads == 0) c.kv_heads = c.heads;
  if (c.ffn == 0) c.ffn = 4 * c.hidden;
  if (c.moe.experts > 0 && c.moe.expert_ffn == 0) c.moe.expert_ffn = c.ffn;
  if (c.head_dim == 0 && c.hidden % c.heads != 0) {
    throw ValidationError("transformer.hidden", std::to_string(c.hidden) +
                                                    " is not a multiple of heads=" +
                                                    std::to_string(c.heads));
  }
  if (c.heads % c.kv_heads != 0) {
    throw ValidationError("transformer.kv_heads", std::to_string(c.kv_heads) +
                                                      " does not divide heads=" +
                                                      std::to_string(c.heads));
  }
  return c;
}

Layer embedding_layer(const TransformerConfig& c, double act) {
  const double s = c.seq, h = c.hidden;
  Layer l;
  l.name = "embedding";
  l.kind = LayerKind::embedding;
  l.params = c.vocab * c.hidden;
  l.param_dtype = c.dtype;
  l.forward_flops_per_sample = 0;  // a lookup
  l.activations.replicated = c.dropout ? s * h : 0.0;  // embedding-dropout mask (1 byte)
  l.activations.layer_input = 0;
  l.output_bytes_per_sample = act * s * h;
  l.tp = TpPattern::vocab;
  l.tp_dims.vocab = c.vocab;
  return l;
}

Layer block_layer(const TransformerConfig& c, int64_t index, double act) {
  const double s = c.seq, h = c.hidden, a = c.heads, f = c.ffn;
  const double kv_ratio = static_cast<double>(c.kv_heads) / c.heads;
  // Query / key-value widths: hidden (and its kv share) unless head_dim is set.
  const double q_width = c.head_dim > 0 ? static_cast<double>(c.heads * c.head_dim) : h;
  const double kv_width = c.head_dim > 0 ? static_cast<double>(c.kv_heads * c.head_dim) : h * kv_ratio;
  const double attention_weights = c.attention_params > 0
      ? static_cast<double>(c.attention_params)
      : h * q_width /*q*/ + 2 * h * kv_width /*k,v*/ + q_width * h /*out*/;
  const bool moe = c.is_moe_layer(index);
  const double mlp_matrices = c.gated_mlp ? 3.0 : 2.0;  // weight matrices
  // MoE (moe_cost.cpp): routed experts (every one held, top_k run per token), shared experts
  // (run for every token) and the router's h x experts weights.
  const double fe = moe ? static_cast<double>(c.moe.expert_ffn) : 0.0;
  const double expert_weights = mlp_matrices * h * fe;
  const double routed_weights = moe ? expert_weights * c.moe.experts : 0.0;
  const double shared_weights = moe ? expert_weights * c.moe.shared_experts : 0.0;
  const double router_weights = moe ? h * c.moe.experts : 0.0;
  const double mlp_weights = moe ? routed_weights + shared_weights + router_weights : mlp_matrices * h * f;
  const double active_mlp_weights =
      moe ? expert_weights * c.moe.top_k + shared_weights + router_weights : mlp_weights;
  const double norm_weights = 2 * 2 * h;  // two layer norms, weight and bias
  Layer l;
  l.name = "blocks." + std::to_string(index);
  l.kind = LayerKind::block;
  l.params = static_cast<int64_t>(attention_weights + mlp_weights + norm_weights);
  l.param_dtype = c.dtype;
  const double matmul_flops = 2 * s * (attention_weights + active_mlp_weights) + 4 * s * s * q_width;
  l.forward_flops_per_sample = matmul_flops;
  l.attention_flops_per_sample = 4 * s * s * q_width;
  // Per sample, in the order the block keeps them (for the backward transient below).
  const double mask = c.dropout ? s * h : 0.0;  // one 1-byte dropout mask of the residual stream
  // Norm inputs and outputs (the QKV and MLP inputs); eager RMSNorm also x * rsqrt(mean x^2).
  const double norm_kept = (c.gated_mlp && !c.fused_kernels ? 3 : 2) * act * s * h;
  // Materialized attention in eager PyTorch repeats K and V to every query head.
  const double kv_kept = c.attention == AttentionKernel::materialized && !c.fused_kernels ? q_width : kv_width;
  // MLP: the tensors kept, and the largest one (its backward's gradients are the transient).
  const double mlp_tensors = !c.gated_mlp ? 2.0 : c.fused_kernels ? 3.0 : 4.0;
  l.activations.replicated = 2 * norm_kept + 2 * mask;
  l.activations.tp_sharded = act * s * (2 * q_width + 2 * kv_kept);
  double mlp_unit = 0;  // one ffn-wide tensor of the (dense or routed) MLP, per sample
  if (moe) {
    // Per routed copy of a token (top_k x the load factor): the permuted input and the
    // expert's inner activations (as a dense MLP's); the shared experts' as a dense MLP's;
    // the router's fp32 logits (4 bytes x experts per token).
    const double copies = c.moe.top_k * (c.moe.capacity_factor > 0 ? c.moe.capacity_factor : c.moe.imbalance);
    // The routed experts are whole on each tp rank (the runtime does not split them; every tp
    // rank routes all its tokens): their inner activations do not shrink with tp.
    l.activations.replicated += act * s * h * copies + 4 * s * static_cast<double>(c.moe.experts) +
                                mlp_tensors * act * s * fe * copies;
    l.activations.tp_sharded += mlp_tensors * act * s * fe * static_cast<double>(c.moe.shared_experts);
    mlp_unit = act * s * fe * copies;
  } else {
    l.activations.tp_sharded += mlp_tensors * act * s * f;
    mlp_unit = act * s * f;
  }
  // Materialized: softmax output (act bytes), with dropout also its mask (1 byte) and the
  // dropped-out scores (act bytes); FlashAttention: one fp32 log-sum-exp per head and row
  // (Dao et al. 2022, Alg. 2). Materialized scores are what selective recompute drops; flash's
  // log-sum-exp is kept by it (the runtime's flash kernel saves it like any other tensor),
  // split by heads under tp.
  const double score = act * a * s * s;  // one s x s tensor over the heads
  if (c.attention == AttentionKernel::materialized) {
    l.activations.attention_scores = c.dropout ? (2 * act + 1) * a * s * s : score;
  } else {
    l.activations.tp_sharded += 4 * a * s;
  }
  // Backward transient: the gradients live at once beyond what the block keeps, where most.
  // The MLP's activation function, once the down projection's backward freed its input (the
  // activation's output): a plain one holds the gradients of its output and input (2 ffn wide)
  // of which one replaces the freed tensor: 1 ffn wide; a gated one (eager: silu(gate) x up;
  // fused: one SwiGLU kernel) the product's gradient and those of its two (or one 2-wide)
  // inputs: 2 ffn wide more than the freed product. Materialized attention's softmax backward
  // holds the gradients of its output and input (2 s x s tensors), the block's tensors kept
  // after the softmax (O, the second norm, the MLP, the masks) already freed.
  const double mlp_kept = mlp_tensors * mlp_unit;
  double transient = (c.gated_mlp ? 2 : 1) * mlp_unit - mask;
  if (c.attention == AttentionKernel::materialized) {
    transient = std::max(transient, 2 * score - (act * s * q_width + 2 * mask + norm_kept + mlp_kept));
  }
  l.activations.backward_transient = std::max(0.0, transient);
  l.activations.layer_input = act * s * h;
  l.output_bytes_per_sample = act * s * h;
  l.kv_elements_per_token = 2 * kv_width;
  // Weight GEMMs as Megatron runs them: fused q/k/v and (gated: fused gate/up) column-parallel,
  // output and down projections row-parallel. Attention given by its parameter count (MLA):
  // one fused GEMM of that many weights.
  const int64_t q = c.head_dim > 0 ? c.heads * c.head_dim : c.hidden;
  const int64_t kv = c.head_dim > 0 ? c.kv_heads * c.head_dim : c.hidden / c.heads * c.kv_heads;
  if (c.attention_params > 0) {
    l.gemms = {{s, std::max<int64_t>(1, c.attention_params / c.hidden), c.hidden, GemmSplit::n}};
  } else {
    l.gemms = {{s, q + 2 * kv, c.hidden, GemmSplit::n}, {s, c.hidden, q, GemmSplit::k}};
  }
  const int64_t up = c.gated_mlp ? 2 : 1;
  if (moe) {
    const int64_t e = c.moe.experts, k = c.moe.top_k, sh = c.moe.shared_experts;
    l.gemms.push_back({s * k, up * c.moe.expert_ffn, c.hidden, GemmSplit::n, e});
    l.gemms.push_back({s * k, c.hidden, c.moe.expert_ffn, GemmSplit::k, e});
    if (sh > 0) {
      l.gemms.push_back({s, up * sh * c.moe.expert_ffn, c.hidden, GemmSplit::n});
      l.gemms.push_back({s, c.hidden, sh * c.moe.expert_ffn, GemmSplit::k});
    }
    l.gemms.push_back({s, e, c.hidden, GemmSplit::none});  // router
    l.moe.experts = e;
    l.moe.top_k = k;
    l.moe.expert_params = static_cast<int64_t>(routed_weights);
    l.moe.routed_flops_per_sample = 2 * s * expert_weights * k;
    l.moe.dispatch_bytes_per_sample = act * s * h * k;
    l.moe.capacity_factor = c.moe.capacity_factor;
    l.moe.imbalance = c.moe.imbalance;
  } else {
    l.gemms.push_back({s, up * c.ffn, c.hidden, GemmSplit::n});
    l.gemms.push_back({s, c.hidden, c.ffn, GemmSplit::k});
  }
  l.tp = TpPattern::block;
  l.tp_dims.heads = c.heads;
  l.tp_dims.kv_heads = c.kv_heads;
  l.tp_dims.ffn = moe ? c.moe.expert_ffn : c.ffn;
  return l;
}

Layer final_norm_layer(const TransformerConfig& c, double act) {
  Layer l;
  l.name = "final_norm";
  l.kind = LayerKind::norm;
  l.params = 2 * c.hidden;
  l.param_dtype = c.dtype;
  // Its input (its output is the head's input); eager RMSNorm also x * rsqrt(mean x^2).
  l.activations.replicated = (c.gated_mlp && !c.fused_kernels ? 2 : 1) * act * c.seq * c.hidden;
  l.activations.backward_transient = 2 * act * c.seq * c.hidden;
  l.activations.layer_input = act * c.seq * c.hidden;
  l.output_bytes_per_sample = act * c.seq * c.hidden;
  return l;
}

Layer head_layer(const TransformerConfig& c, double act) {
  const double s = c.seq, h = c.hidden, v = c.vocab;
  Layer l;
  l.name = "lm_head";
  l.kind = LayerKind::head;
  l.params = c.vocab * c.hidden;
  l.param_dtype = c.dtype;
  l.forward_flops_per_sample = 2 * s * h * v;
  l.gemms = {{s, c.vocab, c.hidden, GemmSplit::n}};
  // Input (for the weight gradient) and the loss's fp32 softmax over the vocabulary (split
  // over tp by the vocab-parallel cross entropy). The logits are not kept: the loss reads them
  // once (Megatron's casts them to fp32 and keeps its softmax; F.cross_entropy on fp32 logits
  // keeps log_softmax's output), and the runtimes drop them once the loss is computed.
  l.activations.replicated = act * s * h;
  l.activations.tp_sharded = 4 * s * v;
  l.activations.read_once = act * s * v;  // the logits: written by the GEMM, read by the loss
  // Backward: Megatron's cross entropy writes its gradient into the kept softmax and casts it
  // to the logits' dtype; eager cross entropy makes the gradients of the log-probabilities and
  // of the logits, both fp32.
  l.activations.backward_transient = c.fused_kernels ? (act < 4 ? act * s * v : 0.0) : 2 * 4 * s * v;
  l.activations.layer_input = act * s * h;
  l.output_bytes_per_sample = 0;  // the loss
  l.tp = TpPattern::vocab;
  l.tp_dims.vocab = c.vocab;
  l.recomputable = false;  // Narayanan et al.'s F counts 3 passes for the logits, not 4
  return l;
}

}  // namespace

ModelGraph build_transformer(const TransformerConfig& config) {
  const TransformerConfig c = normalized(config);
  const double act = bytes_of(c.dtype);
  ModelGraph g;
  g.name = c.name;
  g.transformer = c;
  g.layers.reserve(static_cast<size_t>(c.layers) + 3);
  g.layers.push_back(embedding_layer(c, act));
  for (int64_t i = 0; i < c.layers; ++i) g.layers.push_back(block_layer(c, i, act));
  g.layers.push_back(final_norm_layer(c, act));
  g.layers.push_back(head_layer(c, act));
  if (c.tied_embeddings) g.tied_groups.push_back({0, static_cast<int>(g.layers.size()) - 1});
  return g;
}

}  // namespace monarch::planner
