#include "tiny_gpt.h"

#include <cmath>

namespace monarch::testing {

BlockImpl::BlockImpl(int64_t hidden, int64_t heads_) : heads(heads_) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
  // No qkv bias: the key bias has an exactly-zero gradient (softmax ignores a constant
  // shift), so its float gradient is rounding noise that Adam's normalization turns into
  // lr-sized, run-dependent updates -- parity tests would compare noise.
  qkv = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(hidden, 3 * hidden).bias(false)));
  proj = register_module("proj", torch::nn::Linear(hidden, hidden));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
  fc1 = register_module("fc1", torch::nn::Linear(hidden, 4 * hidden));
  fc2 = register_module("fc2", torch::nn::Linear(4 * hidden, hidden));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2), d = H / heads;
  auto parts = qkv(ln1(x)).view({B, S, 3, heads, d}).permute({2, 0, 3, 1, 4});
  auto q = parts[0], k = parts[1], v = parts[2];
  auto scores = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
  auto causal = torch::ones({S, S}, torch::kBool).triu(1);
  scores = scores.masked_fill(causal, -std::numeric_limits<float>::infinity());
  auto attended = scores.softmax(-1).matmul(v).transpose(1, 2).reshape({B, S, H});
  auto h = x + proj(attended);
  return h + fc2(torch::gelu(fc1(ln2(h))));
}

TinyGptImpl::TinyGptImpl(const GptConfig& c) : config(c) {
  wte = register_module("wte", torch::nn::Embedding(c.vocab, c.hidden));
  wpe = register_module("wpe", torch::nn::Embedding(c.seq, c.hidden));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(Block(c.hidden, c.heads));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden})));
}

torch::Tensor TinyGptImpl::forward(const torch::Tensor& tokens) {
  if (sharded) sharded->begin_forward();
  auto positions = torch::arange(tokens.size(1), torch::kLong);
  auto x = wte(tokens) + wpe(positions);
  int64_t unit = 1;
  for (const auto& block : *blocks) {
    auto* b = block->as<Block>();
    x = sharded ? sharded->run_unit(unit++, [&] { return b->forward(x); }) : b->forward(x);
  }
  auto logits = ln_f(x).matmul(wte->weight.t());  // tied output head
  return sharded ? sharded->end_forward(logits) : logits;
}

TinyGpt make_model(const GptConfig& config, uint64_t seed) {
  torch::manual_seed(seed);
  return TinyGpt(config);
}

std::pair<torch::Tensor, torch::Tensor> batch_for_step(const GptConfig& c, int64_t step,
                                                       int64_t global_batch) {
  auto gen = at::detail::createCPUGenerator(1000 + step);
  auto tokens = torch::randint(c.vocab, {global_batch, c.seq + 1}, gen, torch::kLong);
  return {tokens.narrow(1, 0, c.seq), tokens.narrow(1, 1, c.seq)};
}

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

}  // namespace monarch::testing
