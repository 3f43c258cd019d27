#include "monarch/runtime/attention.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "monarch/runtime/recompute.h"

namespace monarch {
namespace {

// k or v with each of its kv heads repeated for the query heads it serves (dim -3).
at::Tensor repeat_heads(const at::Tensor& t, int64_t heads, const char* what) {
  const int64_t kv = t.size(-3);
  if (kv == heads) return t;
  TORCH_CHECK(kv > 0 && heads % kv == 0, "monarch::attention_core: ", what, " has ", kv, " heads, which do not divide q's ",
              heads);
  return t.repeat_interleave(heads / kv, t.dim() - 3);
}

// The most negative finite value of `t`: a masked score, so that a row with every key masked
// gives uniform probabilities, not NaN (as Hugging Face models mask with finfo.min).
double lowest(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return -65504.0;
    case at::kBFloat16: return -3.3895313892515355e38;
    case at::kFloat: return std::numeric_limits<float>::lowest();
    default: return std::numeric_limits<double>::lowest();
  }
}

at::Tensor core(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionOptions& o) {
  const int64_t heads = q.size(-3), s_q = q.size(-2), s_k = k.size(-2);
  const at::Tensor kh = repeat_heads(k, heads, "k"), vh = repeat_heads(v, heads, "v");
  const double scale = o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q, kh.transpose(-2, -1)) * scale;
  if (o.causal) {
    // Query i sits at key position i + (s_k - s_q) (a cache of earlier keys before it).
    auto above = at::ones({s_q, s_k}, q.options().dtype(at::kBool)).triu(s_k - s_q + 1);
    scores = scores.masked_fill(above, lowest(scores.scalar_type()));
  }
  if (o.mask) {
    scores = o.mask->scalar_type() == at::kBool ? scores.masked_fill(*o.mask, lowest(scores.scalar_type()))
                                                : scores + *o.mask;
  }
  at::Tensor probs = scores.softmax(-1);
  if (o.dropout > 0 && o.training) probs = at::dropout(probs, o.dropout, /*train=*/true);
  return at::matmul(probs, vh);
}

}  // namespace

at::Tensor attention_core(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionOptions& options) {
  TORCH_CHECK(q.dim() >= 3 && k.dim() == q.dim() && v.dim() == q.dim(), "monarch::attention_core: q, k and v must be "
              "[..., heads, seq, dim] with the same number of dimensions; got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  TORCH_CHECK(k.size(-1) == q.size(-1) && v.size(-2) == k.size(-2), "monarch::attention_core: q ", q.sizes(), ", k ",
              k.sizes(), ", v ", v.sizes(), " do not fit (q and k share the last dimension, k and v the sequence)");
  TORCH_CHECK(options.dropout >= 0 && options.dropout < 1, "monarch::attention_core: dropout ", options.dropout,
              " is not in [0, 1)");
  SelectiveRecompute* scope = SelectiveRecompute::active();
  if (!scope || !at::GradMode::is_enabled()) return core(q, k, v, options);
  scope->count_core();
  // Only q, k and v are kept (and the mask, held by the closure); the scores, probabilities
  // and dropout mask are rebuilt in backward with forward's RNG state.
  return recompute([options](const std::vector<at::Tensor>& in) { return core(in[0], in[1], in[2], options); },
                   {q, k, v}, {});
}

}  // namespace monarch
