#pragma once
// Layers a C++ model declares so that monarch::parallelize can split them for tensor
// parallelism. A LibTorch module calls its children through its own members (`q(x)` on a
// torch::nn::Linear holder), so a child swapped in the module registry (replace_module) is
// never called: a frontend cannot redirect a torch::nn::Linear from outside. These are drop-in
// replacements with the same options, parameters ("weight", "bias"), initialization and state
// dict; until parallelize splits them they compute exactly what torch::nn::Linear /
// torch::nn::Embedding compute. parallelize (ParallelizeOptions::tp_plan) then cuts their
// weight in place (the same tensor object keeps this rank's slice, so weights tied between
// modules stay tied) and switches their forward to the tensor-parallel one (Megatron-LM,
// Shoeybi et al. 2019: column-split layers copy their input into the group, row-split ones
// sum their output over it).
//
// A module whose forward depends on its attention head count implements AttentionHeads:
// parallelize checks that tp divides its heads and key/value heads (refusing by name when
// not) and tells it its local counts.
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>

#include "monarch/runtime/communicator.h"

namespace monarch {

// How tensor parallelism splits a layer (Python: torch_monarch.Colwise, Rowwise,
// VocabEmbedding, VocabHead, Replicate).
enum class TpStyle {
  colwise,          // output features split; the input is copied into the group
  rowwise,          // input features split (the input arrives split); the output summed over the group
  vocab_embedding,  // embedding rows (the vocabulary) split; lookups summed over the group
  vocab_head,       // output features (the vocabulary) split, the logits gathered whole
  replicate,        // kept whole on every tp rank
};
std::string to_string(TpStyle style);
// "colwise", "rowwise", "vocab_embedding", "vocab_head", "replicate"; throws naming `field`.
TpStyle tp_style_from_string(const std::string& name, const std::string& field = "tp_plan");

class AttentionHeads {
 public:
  virtual ~AttentionHeads() = default;
  virtual int64_t attention_heads() const = 0;
  virtual int64_t attention_kv_heads() const { return attention_heads(); }
  // Called once by parallelize with tp > 1: the heads (and key/value heads) this rank computes.
  virtual void set_local_heads(int64_t heads, int64_t kv_heads) = 0;
};

// While one is alive on this thread, a vocabulary-split monarch::Linear (vocab_head) returns
// this rank's columns of the logits [..., vocab / tp] instead of gathering them whole:
// ParallelModule::generate holds one around each forward and gathers the last position's only.
class LocalVocabLogits {
 public:
  LocalVocabLogits();
  ~LocalVocabLogits();
  LocalVocabLogits(const LocalVocabLogits&) = delete;
  LocalVocabLogits& operator=(const LocalVocabLogits&) = delete;
  static bool active();
};

class LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias = true)
      : LinearImpl(torch::nn::LinearOptions(in_features, out_features).bias(bias)) {}
  explicit LinearImpl(const torch::nn::LinearOptions& options);
  // Over existing tensors, e.g. an output head tied to the token embedding's weight.
  explicit LinearImpl(const at::Tensor& weight, const at::Tensor& bias = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& x);

  // Splits this layer over `group` as `style` (colwise, rowwise or vocab_head): the weight
  // (and a column-split bias) keep this rank's slice in place. `fused_parts` > 1 splits a
  // fused weight (q|k|v: 3) part by part. `what` names it in errors. A tensor already split
  // (a weight shared with a layer split before it) is not cut again.
  void parallelize(Communicator& group, TpStyle style, int64_t fused_parts = 1, const std::string& what = "linear");
  TpStyle style() const { return style_; }

  torch::nn::LinearOptions options;
  at::Tensor weight, bias;

 private:
  TpStyle style_ = TpStyle::replicate;
  Communicator* group_ = nullptr;
};
TORCH_MODULE(Linear);

class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl> {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : EmbeddingImpl(torch::nn::EmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit EmbeddingImpl(const torch::nn::EmbeddingOptions& options);
  void reset() override;
  at::Tensor forward(const at::Tensor& tokens);

  // Splits the table's rows (the vocabulary) over `group` (style vocab_embedding).
  void parallelize(Communicator& group, const std::string& what = "embedding");
  bool split() const { return group_ != nullptr; }

  torch::nn::EmbeddingOptions options;
  at::Tensor weight;

 private:
  Communicator* group_ = nullptr;
  int64_t vocab_start_ = 0;
};
TORCH_MODULE(Embedding);

}  // namespace monarch
