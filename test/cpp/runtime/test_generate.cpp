// monarch/generate.h on one rank: the KV cache (appending, room, the causal + padding mask, a
// padding query seeing itself), Hugging Face's top-k / top-p warpers, and
// ParallelModule::generate on a small decoder with learned positions against a loop without a
// cache (each prompt alone), with left padding, EOS, sampling, modes restored and refusals; at
// tp=2 (2 worker ranks) its vocabulary-split head gathered, and tp ranks given different prompts
// refusing together. The layouts at scale are tested through the launcher (test_cpp_frontend.py).
#include "harness.h"

#include "catch_with_torch.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <limits>

#include "monarch/generate.h"
#include "monarch/parallelize.h"
#include "monarch/nn.h"
#include "monarch/runtime/world.h"

namespace {

// A decoder with learned position embeddings (so positions matter) and dropout (so eval matters).
struct TinyImpl : torch::nn::Module, monarch::CachedDecoder {
  TinyImpl() {
    torch::manual_seed(3);
    tok = register_module("tok", torch::nn::Embedding(16, 8));
    pos = register_module("pos", torch::nn::Embedding(24, 8));
    q = register_module("q", torch::nn::Linear(8, 8));
    k = register_module("k", torch::nn::Linear(8, 8));
    v = register_module("v", torch::nn::Linear(8, 8));
    o = register_module("o", torch::nn::Linear(8, 8));
    head = register_module("head", monarch::Linear(8, 16));  // torch::nn::Linear's until tp splits it
    drop = register_module("drop", torch::nn::Dropout(0.5));
  }
  at::Tensor heads(const at::Tensor& t) { return t.view({t.size(0), t.size(1), 2, 4}).transpose(1, 2); }
  at::Tensor merge(const at::Tensor& t) { return t.transpose(1, 2).reshape({t.size(0), t.size(2), 8}); }
  // Without a cache: one unpadded batch, positions 0..s-1.
  at::Tensor forward(const at::Tensor& tokens) {
    auto positions = torch::arange(tokens.size(1)).unsqueeze(0).expand_as(tokens);
    auto h = tok(tokens) + pos(positions);
    monarch::AttentionOptions core;
    core.causal = true;
    core.training = false;
    h = h + o(merge(monarch::attention_core(heads(q(h)), heads(k(h)), heads(v(h)), core)));
    return head(drop(h));
  }
  at::Tensor forward_cached(const at::Tensor& tokens, monarch::KVCache& cache) override {
    auto h = tok(tokens) + pos(cache.positions);
    monarch::AttentionOptions core;
    core.training = false;
    h = h + o(merge(cache.attend(0, heads(q(h)), heads(k(h)), heads(v(h)), core)));
    return head(drop(h));
  }
  int64_t max_positions() const override { return 24; }
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  monarch::Linear head{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Tiny);

// Three prompts of 3, 6 and 1 tokens, left-padded to 6.
const std::vector<std::vector<int64_t>> kPrompts = {{3, 7, 1}, {5, 2, 9, 9, 4, 11}, {8}};
std::pair<at::Tensor, at::Tensor> padded_prompts() {
  auto ids = torch::zeros({3, 6}, torch::kLong), mask = torch::zeros({3, 6}, torch::kLong);
  for (int64_t i = 0; i < 3; ++i) {
    const auto n = static_cast<int64_t>(kPrompts[i].size());
    ids[i].narrow(0, 6 - n, n).copy_(torch::tensor(kPrompts[i], torch::kLong));
    mask[i].narrow(0, 6 - n, n).fill_(1);
  }
  return {ids, mask};
}

std::unique_ptr<monarch::ParallelModule> one_rank(monarch::ChainModel chain) {
  monarch::ParallelizeOptions options;
  options.world = monarch::World::from_store(c10::make_intrusive<c10d::HashStore>(), 0, 1);
  return monarch::parallelize(std::move(chain), monarch::LayoutPins{}, options);
}

monarch::ChainModel chain(const Tiny& model) {
  return monarch::chain_of(model.ptr(), [m = model.ptr()](const at::Tensor& x) { return m->forward(x); });
}

std::vector<int64_t> greedy_alone(Tiny& model, const std::vector<int64_t>& prompt, int64_t n) {
  torch::NoGradGuard no_grad;
  model->eval();
  auto seq = torch::tensor(prompt, torch::kLong).unsqueeze(0);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = model->forward(seq)[0][seq.size(1) - 1].argmax().item<int64_t>();
    out.push_back(t);
    seq = torch::cat({seq, torch::full({1, 1}, t, torch::kLong)}, 1);
  }
  model->train();
  return out;
}

std::vector<int64_t> row(const at::Tensor& out, int64_t i, int64_t from) {
  auto r = out[i].narrow(0, from, out.size(1) - from).contiguous();
  return {r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel()};
}

}  // namespace

TEST_CASE("KVCache appends in its room, masks causal and padding, and a padding query sees itself",
          "[runtime][generate]") {
  monarch::KVCache cache;
  cache.reserve(6);
  auto k1 = torch::randn({2, 3, 4, 5}), v1 = torch::randn({2, 3, 4, 5});
  auto [keys, values] = cache.update(1, k1, v1);
  CHECK(cache.num_layers() == 2);
  CHECK(!cache.has_layer(0));
  CHECK(cache.length(1) == 4);
  CHECK(torch::equal(keys, k1));
  const void* storage = keys.data_ptr();
  auto k2 = torch::randn({2, 3, 2, 5}), v2 = torch::randn({2, 3, 2, 5});
  std::tie(keys, values) = cache.update(1, k2, v2);
  CHECK(keys.data_ptr() == storage);  // within the reserved room: written in place
  CHECK(torch::equal(keys, torch::cat({k1, k2}, 2)));
  CHECK(torch::equal(values, torch::cat({v1, v2}, 2)));
  CHECK(cache.bytes() == 2 * 2 * 3 * 6 * 5 * 4);
  // Beyond the room: it grows (doubles), keeping what it held.
  auto k3 = torch::randn({2, 3, 1, 5});
  std::tie(keys, values) = cache.update(1, k3, k3);
  CHECK(keys.size(2) == 7);
  CHECK(torch::equal(keys, torch::cat({k1, k2, k3}, 2)));
  CHECK(cache.bytes() == 2 * 2 * 3 * 12 * 5 * 4);
  CHECK_THROWS_WITH(cache.update(1, torch::randn({2, 2, 1, 5}), torch::randn({2, 2, 1, 5})),
                    Catch::Contains("layer 1 holds keys [2, 3, 7, 5]"));
  CHECK_THROWS_WITH(cache.update(0, torch::randn({2, 3, 1, 5}), torch::randn({2, 3, 2, 5})),
                    Catch::Contains("must be [batch, kv_heads, tokens, head_dim]"));

  // Row 0: 2 tokens of left padding then 3 real; row 1: all real. 2 queries (the last 2 of 5).
  cache.attention_mask = torch::tensor({0, 0, 1, 1, 1, 1, 1, 1, 1, 1}, torch::kLong).view({2, 5});
  auto allowed = cache.allowed(2, 5);
  REQUIRE(allowed.sizes() == at::IntArrayRef({2, 1, 2, 5}));
  CHECK(torch::equal(allowed[0][0], torch::tensor({0, 0, 1, 1, 0, 0, 0, 1, 1, 1}, torch::kBool).view({2, 5})));
  CHECK(torch::equal(allowed[1][0], torch::tensor({1, 1, 1, 1, 0, 1, 1, 1, 1, 1}, torch::kBool).view({2, 5})));
  // A padding query (the prefill of row 0) sees only itself: its row stays finite.
  auto prefill = cache.allowed(5, 5)[0][0];
  CHECK(prefill[0].sum().item<int64_t>() == 1);
  CHECK(prefill[0][0].item<bool>());
  CHECK(prefill[1][1].item<bool>());
  CHECK(!prefill[1][0].item<bool>());
  CHECK_THROWS_WITH(cache.allowed(2, 6), Catch::Contains("an attention_mask of 5 tokens"));

  // attend = attention_core over the concatenation, masked by allowed().
  monarch::KVCache fresh;
  fresh.attention_mask = cache.attention_mask;
  auto q = torch::randn({2, 4, 5, 3}), k = torch::randn({2, 2, 5, 3}), v = torch::randn({2, 2, 5, 3});
  auto got = fresh.attend(0, q, k, v);
  monarch::AttentionOptions o;
  o.mask = cache.allowed(5, 5).logical_not();
  CHECK(torch::allclose(got, monarch::attention_core(q, k, v, o)));
  CHECK(torch::isfinite(got).all().item<bool>());
  CHECK(fresh.keys(0).size(1) == 2);  // grouped-query attention: the kv heads are cached, not repeated
}

TEST_CASE("top-k then top-p as Hugging Face's warpers", "[runtime][generate]") {
  const double inf = std::numeric_limits<double>::infinity();
  auto logits = torch::tensor({1.0, 3.0, 2.0, 3.0, 0.0}, torch::kFloat).unsqueeze(0);
  // top_k=2: the two 3.0s; top_k=3: ties at the 3rd value kept (2.0 is the 3rd).
  CHECK(torch::equal(monarch::generation::filter_top_k_top_p(logits, 2, std::nullopt),
                     torch::tensor({-inf, 3.0, -inf, 3.0, -inf}).unsqueeze(0).to(torch::kFloat)));
  CHECK(torch::isfinite(monarch::generation::filter_top_k_top_p(logits, 3, std::nullopt)).sum().item<int64_t>() == 3);
  // top_p: the smallest set whose probability exceeds p, the most likely always kept.
  auto p = torch::tensor({std::log(0.5), std::log(0.3), std::log(0.15), std::log(0.05)}, torch::kFloat).unsqueeze(0);
  auto kept = [&](double top_p) {
    return torch::isfinite(monarch::generation::filter_top_k_top_p(p, std::nullopt, top_p)).sum().item<int64_t>();
  };
  CHECK(kept(0.4) == 1);
  CHECK(kept(0.7) == 2);
  CHECK(kept(0.9) == 3);
  CHECK(kept(1.0) == 4);
  CHECK(kept(0.01) == 1);
}

TEST_CASE("generate on one rank: left-padded prompts decode as each alone, EOS, sampling, modes restored",
          "[runtime][generate]") {
  Tiny model;
  auto pm = one_rank(chain(model));
  const auto& prompts = kPrompts;
  auto [ids, mask] = padded_prompts();
  model->train();
  model->drop->eval();  // a module in another mode than its parent keeps it
  monarch::GenerateOptions g;
  g.max_new_tokens = 12;
  g.attention_mask = mask;
  monarch::KVCache cache;
  g.cache = &cache;
  auto out = pm->generate(ids, g);
  REQUIRE(out.sizes() == at::IntArrayRef({3, 18}));
  CHECK(torch::equal(out.narrow(1, 0, 6), ids));
  CHECK(model->is_training());
  CHECK(!model->drop->is_training());
  CHECK(model->q->is_training());
  CHECK(cache.length(0) == 6 + 12 - 1);  // the last token chosen is not fed back
  std::vector<std::vector<int64_t>> expected;
  for (int64_t i = 0; i < 3; ++i) {
    expected.push_back(greedy_alone(model, prompts[i], 12));
    CHECK(row(out, i, 6) == expected.back());
  }
  // int32 ids, the same tokens.
  CHECK(torch::equal(pm->generate(ids.to(torch::kInt), g), out));

  // EOS: each sequence stops at its first EOS, then pads; the call ends when all stopped.
  const int64_t eos = expected[0][2];
  g.eos_token_ids = {eos};
  g.pad_token_id = 15;
  auto stopped = pm->generate(ids, g);
  int64_t longest = 0;
  for (int64_t i = 0; i < 3; ++i) {
    auto it = std::find(expected[i].begin(), expected[i].end(), eos);
    longest = std::max<int64_t>(longest, it == expected[i].end() ? 12 : it - expected[i].begin() + 1);
  }
  REQUIRE(stopped.size(1) == 6 + longest);
  for (int64_t i = 0; i < 3; ++i) {
    auto got = row(stopped, i, 6);
    bool done = false;
    for (int64_t t = 0; t < longest; ++t) {
      CHECK(got[t] == (done ? 15 : expected[i][t]));
      done = done || expected[i][t] == eos;
    }
  }
  g.eos_token_ids.clear();
  g.pad_token_id.reset();

  // Sampling: one seeded generator, so the same seed draws the same; top_k=1 is greedy.
  g.temperature = 0.9;
  g.seed = 11;
  auto a = pm->generate(ids, g), b = pm->generate(ids, g);
  CHECK(torch::equal(a, b));
  g.seed = 12;
  CHECK(!torch::equal(pm->generate(ids, g), a));
  g.top_k = 1;
  CHECK(torch::equal(pm->generate(ids, g), out));

  g = monarch::GenerateOptions{};
  g.max_new_tokens = 0;
  CHECK(torch::equal(pm->generate(ids, g), ids));
}

TEST_CASE("generate refuses by name what it does not run", "[runtime][generate]") {
  Tiny model;
  auto pm = one_rank(chain(model));
  auto ids = torch::zeros({2, 4}, torch::kLong);
  monarch::GenerateOptions g;
  CHECK_THROWS_WITH(pm->generate(ids, g), Catch::Contains("max_new_tokens must be >= 0, got -1 (GenerateOptions::"));
  g.max_new_tokens = 4;
  g.attention_mask = torch::ones({2, 3}, torch::kLong);
  CHECK_THROWS_WITH(pm->generate(ids, g), Catch::Contains("attention_mask has shape [2, 3], input_ids [2, 4]"));
  g.attention_mask = at::Tensor();
  CHECK_THROWS_WITH(pm->generate(ids.to(torch::kFloat), g), Catch::Contains("input_ids must be an integer tensor"));
  g.max_new_tokens = 21;
  CHECK_THROWS_WITH(pm->generate(ids, g), Catch::Contains("need 25 positions; the model has 24 (max_positions())"));
  g.max_new_tokens = 4;
  g.top_p = 0.0;
  CHECK_THROWS_WITH(pm->generate(ids, g), Catch::Contains("top_p must be in (0, 1]"));
  g.top_p.reset();
  g.temperature = -1;
  CHECK_THROWS_AS(pm->generate(ids, g), std::invalid_argument);

  // Models without the interface: a Sequential, a module that does not implement it.
  torch::nn::Sequential seq(torch::nn::Embedding(16, 4), torch::nn::Linear(4, 16));
  auto plain = one_rank(monarch::chain_of(seq));
  g.temperature = 0;
  CHECK_THROWS_WITH(plain->generate(ids, g), Catch::Contains("a torch::nn::Sequential has no KV cache interface"));
  torch::nn::Linear lin(4, 4);
  auto other = one_rank(monarch::chain_of(lin.ptr(), [l = lin](const at::Tensor& x) mutable { return l(x); }));
  CHECK_THROWS_WITH(other->generate(ids, g), Catch::Contains("does not implement monarch::CachedDecoder"));
}

namespace monarch::testing {

// 2 ranks, tp=2: the head split by vocabulary (each rank 8 of its 16 rows); generate gathers the
// last position's logits and equals the unsplit model's loop without a cache. Then rank 1 is
// given other prompts: both ranks refuse, naming the difference, instead of hanging.
int run_generate_worker(const std::string& scenario, const std::string& out) {
  if (scenario != "generate_tp2") return -1;
  torch::set_num_threads(1);
  auto world = World::init(InitOptions{});
  Tiny model, whole;
  ParallelizeOptions options;
  options.world = world;
  options.tp_plan = {{"head", TpStyle::vocab_head}};
  LayoutPins pins;
  pins.tp = 2;
  auto pm = parallelize(chain(model), pins, options);
  if (model->head->weight.size(0) != 8) {
    std::cerr << "the head holds " << model->head->weight.size(0) << " rows, expected 8\n";
    return 2;
  }
  auto [ids, mask] = padded_prompts();
  GenerateOptions g;
  g.max_new_tokens = 10;
  g.attention_mask = mask;
  auto generated = pm->generate(ids, g);
  for (int64_t i = 0; i < 3; ++i) {
    if (row(generated, i, 6) != greedy_alone(whole, kPrompts[i], 10)) {
      std::cerr << "prompt " << i << " differs from one process: " << generated[i] << "\n";
      return 3;
    }
  }
  try {
    pm->generate(world->rank() == 1 ? ids.flip(1) : ids, g);
    std::cerr << "different prompts on the tp ranks were not refused\n";
    return 4;
  } catch (const std::invalid_argument& e) {
    if (std::string(e.what()).find("the tp ranks of one group were given different prompts") == std::string::npos) {
      std::cerr << "unexpected error: " << e.what() << "\n";
      return 5;
    }
  }
  return 0;
}

}  // namespace monarch::testing

TEST_CASE("generate at tp=2 gathers the vocabulary-split head, and tp ranks given different prompts refuse",
          "[runtime][generate]") {
  const auto r = monarch::testing::launch_ranks(2, "generate_tp2", std::chrono::seconds(120));
  INFO(r.describe());
  CHECK(r.all_ok());
}
