#pragma once
// C++ frontend: tensor-parallel modules over torch::nn, built from the full module the model
// already has (so every rank cuts the same weights). The collectives are the autograd
// functions of monarch/runtime/tensor_parallel.h, the same ones torch_monarch's Python
// modules call.
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "monarch/runtime/tensor_parallel.h"

namespace monarch {

struct ColumnParallelOptions {
  int64_t fused_parts = 1;         // q|k|v = 3, gate|up = 2: each part split separately
  bool gather_output = false;      // all-gather the output features
  bool sequence_parallel = false;  // input split along sequence_dim: all-gather it first
  int64_t sequence_dim = 1;
};

// Output features split over the group.
class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  ColumnParallelLinearImpl(const torch::nn::Linear& full, Communicator& group, ColumnParallelOptions options = {},
                           const std::string& name = "linear")
      : group_(group), options_(options) {
    torch::NoGradGuard no_grad;
    const int64_t rank = group.group_rank(), size = group.size();
    weight = register_parameter("weight", tp::shard_tensor(full->weight, 0, rank, size, options.fused_parts, name));
    if (full->bias.defined()) {
      bias = register_parameter("bias", tp::shard_tensor(full->bias, 0, rank, size, options.fused_parts, name));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    auto in = options_.sequence_parallel ? tp::sequence_gather(x, group_, options_.sequence_dim)
                                         : tp::copy_to_group(x, group_);
    auto y = at::linear(in, weight, bias);
    return options_.gather_output ? tp::gather_from_group(y.contiguous(), group_, -1) : y;
  }
  at::Tensor weight, bias;

 private:
  Communicator& group_;
  ColumnParallelOptions options_;
};
TORCH_MODULE(ColumnParallelLinear);

// Input features split over the group; the input arrives split (a column-parallel output).
class RowParallelLinearImpl : public torch::nn::Module {
 public:
  RowParallelLinearImpl(const torch::nn::Linear& full, Communicator& group, bool sequence_parallel = false,
                        int64_t sequence_dim = 1, const std::string& name = "linear")
      : group_(group), sequence_parallel_(sequence_parallel), sequence_dim_(sequence_dim) {
    torch::NoGradGuard no_grad;
    weight = register_parameter("weight", tp::shard_tensor(full->weight, 1, group.group_rank(), group.size(), 1, name));
    if (full->bias.defined()) bias = register_parameter("bias", full->bias.detach().clone());
  }
  at::Tensor forward(const at::Tensor& x) {
    auto y = at::linear(x, weight);
    y = sequence_parallel_ ? tp::sequence_reduce_scatter(y.contiguous(), group_, sequence_dim_)
                           : tp::reduce_from_group(y, group_);
    if (!bias.defined()) return y;
    // Under sequence parallelism each rank adds the bias to its own tokens: sum its gradient.
    return y + (sequence_parallel_ ? tp::copy_to_group(bias, group_) : bias);
  }
  at::Tensor weight, bias;

 private:
  Communicator& group_;
  bool sequence_parallel_;
  int64_t sequence_dim_;
};
TORCH_MODULE(RowParallelLinear);

// Embedding rows (the vocabulary) split over the group.
class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  VocabParallelEmbeddingImpl(const torch::nn::Embedding& full, Communicator& group,
                             const std::string& name = "embedding")
      : group_(group) {
    torch::NoGradGuard no_grad;
    weight = register_parameter("weight", tp::shard_tensor(full->weight, 0, group.group_rank(), group.size(), 1, name));
    vocab_start_ = group.group_rank() * weight.size(0);
    padding_idx_ = full->options.padding_idx().value_or(-1);
  }
  at::Tensor forward(const at::Tensor& tokens) {
    return tp::vocab_parallel_embedding(tokens, weight, vocab_start_, group_, -1, padding_idx_);
  }
  int64_t vocab_start() const { return vocab_start_; }
  at::Tensor weight;

 private:
  Communicator& group_;
  int64_t vocab_start_ = 0;
  int64_t padding_idx_ = -1;
};
TORCH_MODULE(VocabParallelEmbedding);

// Mean cross-entropy of vocabulary-split logits (see tp::vocab_parallel_cross_entropy).
inline at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_shard, const at::Tensor& targets,
                                               Communicator& group, int64_t ignore_index = -100) {
  auto losses = tp::vocab_parallel_cross_entropy(logits_shard, targets, group.group_rank() * logits_shard.size(-1),
                                                 group, ignore_index);
  auto count = targets.ne(ignore_index).sum().clamp_min(1);
  return losses.sum() / count;
}

}  // namespace monarch
