#include "monarch/runtime/attention.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
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

// `mask`: the options' mask (an input of the recomputed function when it is given).
at::Tensor core(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                const AttentionOptions& o) {
  const int64_t heads = q.size(-3), s_q = q.size(-2), s_k = k.size(-2);
  const at::Tensor kh = repeat_heads(k, heads, "k"), vh = repeat_heads(v, heads, "v");
  const double scale = o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q, kh.transpose(-2, -1)) * scale;
  const double masked = lowest(scores.scalar_type());
  // The additive mask first, then the fills, which overwrite (adding to a filled score could
  // overflow to -inf, and a row of -inf is NaN after softmax).
  if (mask.defined() && mask.scalar_type() != at::kBool) scores = scores + mask.to(scores.scalar_type());
  if (mask.defined() && mask.scalar_type() == at::kBool) scores = scores.masked_fill(mask, masked);
  if (o.causal) {
    // Query i sits at key position i + (s_k - s_q) (a cache of earlier keys before it).
    auto above = at::ones({s_q, s_k}, q.options().dtype(at::kBool)).triu(s_k - s_q + 1);
    scores = scores.masked_fill(above, masked);
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
  const at::Tensor mask = options.mask ? *options.mask : at::Tensor();
  TORCH_CHECK(!mask.defined() || mask.scalar_type() == at::kBool || at::isFloatingType(mask.scalar_type()),
              "monarch::attention_core: mask of dtype ", mask.defined() ? c10::toString(mask.scalar_type()) : "",
              ": give a bool mask (true where attention is not allowed) or an additive floating-point one "
              "(an integer mask such as Hugging Face's attention_mask, 1 = attend, must be converted first)");
  SelectiveRecompute* scope = SelectiveRecompute::active();
  if (!scope || !at::GradMode::is_enabled()) return core(q, k, v, mask, options);
  scope->count_core();
  // Only q, k and v are kept (and the mask: an input, so a learned bias gets its gradient);
  // the scores, probabilities and dropout mask are rebuilt in backward with forward's RNG state.
  std::vector<at::Tensor> inputs{q, k, v};
  if (mask.defined()) inputs.push_back(mask);
  // The closure holds the options but the mask (an input).
  return recompute(
      [causal = options.causal, dropout = options.dropout, training = options.training,
       scale = options.scale](const std::vector<at::Tensor>& in) {
        AttentionOptions o;
        o.causal = causal;
        o.dropout = dropout;
        o.training = training;
        o.scale = scale;
        return core(in[0], in[1], in[2], in.size() > 3 ? in[3] : at::Tensor(), o);
      },
      inputs, {});
}

}  // namespace monarch
