#pragma once
// A small GPT (2 blocks, embedding tied to the output head) and its deterministic data,
// shared by the single-process reference and the distributed workers.
#include <torch/torch.h>

#include <vector>

#include "monarch/parallel.h"

namespace monarch::testing {

struct GptConfig {
  int64_t vocab = 64;
  int64_t hidden = 32;
  int64_t heads = 4;
  int64_t seq = 16;
  int64_t layers = 2;
};

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t hidden, int64_t heads);
  torch::Tensor forward(const torch::Tensor& x);
  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct TinyGptImpl : torch::nn::Module {
  explicit TinyGptImpl(const GptConfig& config);
  // tokens [batch, seq] -> logits [batch, seq, vocab]; the head is the embedding's weight.
  torch::Tensor forward(const torch::Tensor& tokens);
  GptConfig config;
  // Set when the model is fully sharded: forward then runs each block as a sharding unit.
  monarch::FullyShard* sharded = nullptr;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(TinyGpt);

// Seeded model (same weights in every process).
TinyGpt make_model(const GptConfig& config = {}, uint64_t seed = 1234);

// Global batch for one step: inputs and next-token targets [batch, seq].
std::pair<torch::Tensor, torch::Tensor> batch_for_step(const GptConfig& config, int64_t step,
                                                       int64_t global_batch);

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets);

}  // namespace monarch::testing
