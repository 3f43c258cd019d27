// monarch::Linear / monarch::Embedding (nn.h): torch::nn's layers until parallelize splits them.
#include "monarch/nn.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/embedding.h>
#include <torch/nn/init.h>

#include <cmath>
#include <stdexcept>

#include "monarch/runtime/tensor_parallel.h"

namespace monarch {

std::string to_string(TpStyle style) {
  switch (style) {
    case TpStyle::colwise: return "colwise";
    case TpStyle::rowwise: return "rowwise";
    case TpStyle::vocab_embedding: return "vocab_embedding";
    case TpStyle::vocab_head: return "vocab_head";
    case TpStyle::replicate: return "replicate";
  }
  return "?";
}

TpStyle tp_style_from_string(const std::string& name, const std::string& field) {
  for (TpStyle s : {TpStyle::colwise, TpStyle::rowwise, TpStyle::vocab_embedding, TpStyle::vocab_head,
                    TpStyle::replicate}) {
    if (to_string(s) == name) return s;
  }
  throw std::invalid_argument(field + ": unknown tensor-parallel style '" + name +
                              "' (expected colwise, rowwise, vocab_embedding, vocab_head or replicate)");
}

// ---- Linear ----------------------------------------------------------------------------------

LinearImpl::LinearImpl(const torch::nn::LinearOptions& options_) : options(options_) { reset(); }

LinearImpl::LinearImpl(const at::Tensor& weight_, const at::Tensor& bias_)
    : options(torch::nn::LinearOptions(weight_.size(1), weight_.size(0)).bias(bias_.defined())) {
  TORCH_CHECK(weight_.dim() == 2, "monarch::Linear: the weight must be 2-D (out x in), got ", weight_.sizes());
  weight = register_parameter("weight", weight_);
  if (bias_.defined()) bias = register_parameter("bias", bias_);
}

void LinearImpl::reset() {
  // torch::nn::Linear's parameters and initialization (Kaiming-uniform with a = sqrt(5)).
  weight = register_parameter("weight", torch::empty({options.out_features(), options.in_features()}));
  if (options.bias()) {
    bias = register_parameter("bias", torch::empty(options.out_features()));
  } else {
    bias = register_parameter("bias", {}, /*requires_grad=*/false);
  }
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5));
  if (bias.defined()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(options.in_features()));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

namespace {
thread_local int local_vocab_logits = 0;
}

LocalVocabLogits::LocalVocabLogits() { ++local_vocab_logits; }
LocalVocabLogits::~LocalVocabLogits() { --local_vocab_logits; }
bool LocalVocabLogits::active() { return local_vocab_logits > 0; }

at::Tensor LinearImpl::forward(const at::Tensor& x) {
  switch (style_) {
    case TpStyle::colwise:
      return at::linear(tp::copy_to_group(x, *group_), weight, bias);
    case TpStyle::vocab_head:
      if (LocalVocabLogits::active()) return at::linear(tp::copy_to_group(x, *group_), weight, bias);
      return tp::gather_from_group(at::linear(tp::copy_to_group(x, *group_), weight, bias).contiguous(), *group_, -1);
    case TpStyle::rowwise: {
      auto y = tp::reduce_from_group(at::linear(x, weight), *group_);
      return bias.defined() ? y + bias : y;  // added once, after the sum
    }
    default:
      return at::linear(x, weight, bias);
  }
}

namespace {

// Cuts `t` in place to this rank's slice along `dim`, unless it already holds a slice (a
// tensor shared with a layer split first: a tied embedding and output head).
void cut_in_place(at::Tensor& t, int64_t full_rows, int64_t dim, Communicator& group, int64_t fused_parts,
                  const std::string& what) {
  const int64_t size = group.size();
  if (t.size(dim) * size == full_rows && full_rows % size == 0 && size > 1) return;  // already this rank's slice
  TORCH_CHECK(t.size(dim) == full_rows, "monarch::parallelize: ", what, " holds ", t.size(dim),
              " rows along dim ", dim, ", expected ", full_rows, " (whole) or ", full_rows / size, " (split)");
  at::NoGradGuard no_grad;
  t.set_data(tp::shard_tensor(t.detach(), dim, group.group_rank(), size, fused_parts, what).contiguous());
}

}  // namespace

void LinearImpl::parallelize(Communicator& group, TpStyle style, int64_t fused_parts, const std::string& what) {
  TORCH_CHECK(style == TpStyle::colwise || style == TpStyle::rowwise || style == TpStyle::vocab_head ||
                  style == TpStyle::replicate,
              "monarch::parallelize: ", what, " is a monarch::Linear; style ", to_string(style), " is for embeddings");
  TORCH_CHECK(style_ == TpStyle::replicate, "monarch::parallelize: ", what, " is already split (",
              to_string(style_), ")");
  if (style == TpStyle::replicate || group.size() == 1) return;
  TORCH_CHECK(style != TpStyle::rowwise || fused_parts == 1, "monarch::parallelize: ", what,
              ": a row-split layer has no fused parts");
  if (style == TpStyle::rowwise) {
    cut_in_place(weight, options.in_features(), 1, group, 1, what);
  } else {
    cut_in_place(weight, options.out_features(), 0, group, fused_parts, what);
    if (bias.defined()) cut_in_place(bias, options.out_features(), 0, group, fused_parts, what + ".bias");
  }
  style_ = style;
  group_ = &group;
}

// ---- Embedding -------------------------------------------------------------------------------

EmbeddingImpl::EmbeddingImpl(const torch::nn::EmbeddingOptions& options_) : options(options_) { reset(); }

void EmbeddingImpl::reset() {
  TORCH_CHECK(!options._weight().defined(), "monarch::Embedding: a given _weight is not supported; assign "
              "weight after construction");
  weight = register_parameter("weight", torch::empty({options.num_embeddings(), options.embedding_dim()}));
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(weight);  // torch::nn::Embedding's initialization
  if (auto pad = options.padding_idx()) weight[*pad < 0 ? *pad + options.num_embeddings() : *pad].fill_(0);
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& tokens) {
  int64_t pad = -1;
  if (auto p = options.padding_idx()) pad = *p < 0 ? *p + options.num_embeddings() : *p;
  if (group_ != nullptr) return tp::vocab_parallel_embedding(tokens, weight, vocab_start_, *group_, -1, pad);
  // Unsplit: torch::nn::Embedding's forward, every option honoured.
  return torch::nn::functional::detail::embedding(tokens, weight, options.padding_idx(), options.max_norm(),
                                                  options.norm_type(), options.scale_grad_by_freq(),
                                                  options.sparse());
}

void EmbeddingImpl::parallelize(Communicator& group, const std::string& what) {
  TORCH_CHECK(group_ == nullptr, "monarch::parallelize: ", what, " is already split");
  TORCH_CHECK(!options.max_norm().has_value() && !options.scale_grad_by_freq() && !options.sparse(),
              "monarch::parallelize: ", what, " uses max_norm, scale_grad_by_freq or sparse gradients, which the "
              "vocabulary-split lookup does not: not split by tensor parallelism");
  if (group.size() == 1) return;
  cut_in_place(weight, options.num_embeddings(), 0, group, 1, what);
  vocab_start_ = group.group_rank() * weight.size(0);
  group_ = &group;
}

}  // namespace monarch
