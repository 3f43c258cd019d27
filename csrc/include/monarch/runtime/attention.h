#pragma once
// The attention core, softmax(q k^T * scale + mask) with dropout, times v, as a call the C++
// frontend can recompute (recompute=selective; monarch/runtime/recompute.h). A C++ model that
// computes its attention with it gets selective recomputation from a plan; one that computes
// it inline is refused under selective, naming the block.
//
//   monarch::AttentionOptions opts;
//   opts.causal = true;
//   opts.dropout = 0.1;
//   opts.training = is_training();
//   auto ctx = monarch::attention_core(q, k, v, opts);
//
// Shapes: q [..., heads, s_q, d], k and v [..., kv_heads, s_k, d] (v's last dimension may
// differ); kv_heads divides heads (grouped-query attention: each kv head serves heads /
// kv_heads consecutive query heads, as Llama's repeat_kv). Returns [..., heads, s_q, d_v].
#include <ATen/core/Tensor.h>

#include <optional>

namespace monarch {

struct AttentionOptions {
  bool causal = false;                // query i attends to keys j <= i + (s_k - s_q)
  // Bool, true where attention is not allowed; or additive, floating-point (cast to the
  // scores' dtype; a learned bias gets its gradient, selective or not). A score masked out by
  // a bool mask or causal is the dtype's lowest finite value: a row with every key masked
  // gets uniform probabilities, not NaN (as Hugging Face masks with finfo.min).
  std::optional<at::Tensor> mask;
  double dropout = 0.0;               // on the attention probabilities, when training
  bool training = true;
  std::optional<double> scale;        // default 1 / sqrt(d)
};

at::Tensor attention_core(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionOptions& options = {});

}  // namespace monarch
