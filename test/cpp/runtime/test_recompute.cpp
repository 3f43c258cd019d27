// Full recomputation (monarch/runtime/recompute.h) on one process: backward re-runs the block
// with forward's RNG state, so gradients are bit-identical to a plain backward (dropout
// included), the caller's random stream is left where a plain backward leaves it, and only
// the block's input is kept. Selective: monarch::attention_core under a SelectiveRecompute
// scope keeps q, k and v and re-runs the core in backward, bit-identically.
#include "catch_with_torch.h"

#include <optional>

#include "monarch/runtime/attention.h"
#include "monarch/runtime/recompute.h"

namespace {

struct Counted {
  torch::nn::Linear up{16, 64}, down{64, 16};
  int calls = 0;
  at::Tensor operator()(const at::Tensor& x) {
    ++calls;
    return down(torch::dropout(torch::gelu(up(x)), 0.3, /*train=*/true));
  }
  std::vector<at::Tensor> params() {
    auto a = up->parameters(), b = down->parameters();
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }
};

struct Result {
  std::vector<at::Tensor> grads;
  at::Tensor input_grad;
  double after = 0;  // the next random number after backward
  int calls = 0;
};

Result run(bool recompute) {
  torch::manual_seed(7);
  Counted block;
  auto x = torch::randn({8, 16}).requires_grad_();
  torch::manual_seed(11);
  auto fn = [&](const at::Tensor& in) { return block(in); };
  auto y = recompute ? monarch::recompute_full(fn, x, block.params()) : fn(x);
  (y * y).sum().backward();
  Result r;
  for (auto& p : block.params()) r.grads.push_back(p.grad().clone());
  r.input_grad = x.grad().clone();
  r.after = torch::rand({1}).item<double>();
  r.calls = block.calls;
  return r;
}

}  // namespace

TEST_CASE("recompute_full gives a plain backward's gradients, dropout included", "[runtime][recompute]") {
  const Result plain = run(false), again = run(true);
  CHECK(plain.calls == 1);
  CHECK(again.calls == 2);  // forward, then once more in backward
  REQUIRE(plain.grads.size() == again.grads.size());
  for (size_t i = 0; i < plain.grads.size(); ++i) CHECK(torch::equal(plain.grads[i], again.grads[i]));
  CHECK(torch::equal(plain.input_grad, again.input_grad));
  CHECK(plain.after == again.after);  // the random stream is not disturbed
}

TEST_CASE("recompute_full keeps nothing but the input, and is a plain call without grad mode", "[runtime][recompute]") {
  Counted block;
  auto x = torch::randn({8, 16}).requires_grad_();
  auto fn = [&](const at::Tensor& in) { return block(in); };
  auto y = monarch::recompute_full(fn, x, block.params());
  // The graph behind the output is one node (the recompute function) whose only edges are the
  // input and the parameters: no gelu or dropout node holds activations.
  REQUIRE(y.grad_fn());
  CHECK(y.grad_fn()->num_inputs() == 1);
  CHECK(y.grad_fn()->num_outputs() == 1 + block.params().size());
  for (const auto& edge : y.grad_fn()->next_edges()) {
    REQUIRE(edge.function);
    CHECK(edge.function->name().find("AccumulateGrad") != std::string::npos);
  }
  torch::NoGradGuard no_grad;
  const int before = block.calls;
  auto z = monarch::recompute_full(fn, x, block.params());
  CHECK(block.calls == before + 1);
  CHECK(!z.requires_grad());
}

// ---- selective: the attention core alone (monarch::attention_core under a scope) ------------

namespace {

struct CoreResult {
  at::Tensor out, gq, gk, gv;
  double after = 0;
  int64_t cores = 0;
  std::string node;  // the output's grad_fn
};

// A block-like computation around the core: projections before it (so q, k, v are
// activations), a product after it, dropout inside.
CoreResult run_core(bool selective, int64_t kv_heads) {
  torch::manual_seed(3);
  auto x = torch::randn({2, 4, 6, 8}).requires_grad_();         // [b, heads, s, d]
  auto kx = torch::randn({2, kv_heads, 6, 8}).requires_grad_();
  auto vx = torch::randn({2, kv_heads, 6, 8}).requires_grad_();
  torch::manual_seed(5);
  monarch::AttentionOptions o;
  o.causal = true;
  o.dropout = 0.25;
  CoreResult r;
  at::Tensor out;
  {
    std::optional<monarch::SelectiveRecompute> scope;
    if (selective) scope.emplace();
    out = monarch::attention_core(x * 2, kx * 1, vx * 1, o);
    if (scope) r.cores = scope->cores();
  }
  r.node = out.grad_fn()->name();
  (out * out).sum().backward();
  r.out = out.detach();
  r.gq = x.grad().clone();
  r.gk = kx.grad().clone();
  r.gv = vx.grad().clone();
  r.after = torch::rand({1}).item<double>();
  return r;
}

}  // namespace

TEST_CASE("attention_core under a SelectiveRecompute scope keeps q, k, v only and gives a plain backward's gradients",
          "[runtime][recompute][selective]") {
  for (int64_t kv : {4, 2, 1}) {  // multi-head, grouped-query, multi-query
    const CoreResult plain = run_core(false, kv), again = run_core(true, kv);
    CHECK(plain.cores == 0);
    CHECK(again.cores == 1);
    CHECK(plain.node.find("Recompute") == std::string::npos);
    CHECK(again.node.find("Recompute") != std::string::npos);
    CHECK(torch::equal(plain.out, again.out));
    CHECK(torch::equal(plain.gq, again.gq));  // dropout masks match: the RNG state is forward's
    CHECK(torch::equal(plain.gk, again.gk));
    CHECK(torch::equal(plain.gv, again.gv));
    CHECK(plain.after == again.after);
  }
}

TEST_CASE("attention_core computes softmax(q k^T / sqrt(d) + mask) v, with grouped kv heads", "[runtime][recompute][selective]") {
  torch::manual_seed(9);
  auto q = torch::randn({3, 4, 5, 8}), k = torch::randn({3, 2, 7, 8}), v = torch::randn({3, 2, 7, 6});
  monarch::AttentionOptions o;
  o.causal = true;  // 5 queries after 2 earlier keys: query i sees keys 0..i+2
  auto out = monarch::attention_core(q, k, v, o);
  REQUIRE(out.sizes() == at::IntArrayRef({3, 4, 5, 6}));
  auto kk = k.repeat_interleave(2, 1), vv = v.repeat_interleave(2, 1);
  auto allowed = torch::ones({5, 7}, torch::kBool).tril(2);
  auto scores = torch::matmul(q, kk.transpose(-2, -1)) / std::sqrt(8.0);
  auto expect = torch::matmul(scores.masked_fill(allowed.logical_not(), -1e30).softmax(-1), vv);
  CHECK(torch::allclose(out, expect, 1e-5, 1e-6));
  // The same mask given explicitly (bool, true = not allowed), and as an additive one.
  monarch::AttentionOptions m;
  m.mask = allowed.logical_not();
  CHECK(torch::allclose(monarch::attention_core(q, k, v, m), expect, 1e-5, 1e-6));
  m.mask = torch::zeros({5, 7}).masked_fill(allowed.logical_not(), -1e30);
  CHECK(torch::allclose(monarch::attention_core(q, k, v, m), expect, 1e-5, 1e-6));
  // A row with every key masked: uniform, not NaN.
  monarch::AttentionOptions all;
  all.mask = torch::ones({5, 7}, torch::kBool);
  CHECK(!monarch::attention_core(q, k, v, all).isnan().any().item<bool>());
  // kv heads that do not divide the query heads, and dropout outside [0, 1): one clear error.
  CHECK_THROWS_WITH(monarch::attention_core(q, torch::randn({3, 3, 7, 8}), torch::randn({3, 3, 7, 6})),
                    Catch::Contains("k has 3 heads, which do not divide q's 4"));
  monarch::AttentionOptions bad;
  bad.dropout = 1.0;
  CHECK_THROWS_WITH(monarch::attention_core(q, k, v, bad), Catch::Contains("dropout 1 is not in [0, 1)"));
}

TEST_CASE("attention_core without grad mode is a plain call, scope or not", "[runtime][recompute][selective]") {
  auto q = torch::randn({1, 2, 3, 4}).requires_grad_();
  monarch::SelectiveRecompute scope;
  torch::NoGradGuard no_grad;
  auto out = monarch::attention_core(q, q, q);
  CHECK(!out.requires_grad());
  CHECK(scope.cores() == 0);
}

TEST_CASE("attention_core: a learned additive bias gets its gradient under selective; bf16 scores take a float mask",
          "[runtime][recompute][selective]") {
  auto grads = [](bool selective) {
    torch::manual_seed(4);
    auto q = torch::randn({2, 2, 5, 4}).requires_grad_();
    auto bias = torch::randn({2, 5, 5}).requires_grad_();  // per head, as T5's relative position bias
    monarch::AttentionOptions o;
    o.mask = bias * 1;
    o.causal = true;
    std::optional<monarch::SelectiveRecompute> scope;
    if (selective) scope.emplace();
    auto out = monarch::attention_core(q * 1, q * 2, q * 3, o);
    scope.reset();
    out.pow(2).sum().backward();
    return std::make_pair(q.grad().clone(), bias.grad().clone());
  };
  auto plain = grads(false), again = grads(true);
  CHECK(plain.second.abs().sum().item<double>() > 0);
  CHECK(torch::equal(plain.first, again.first));
  CHECK(torch::equal(plain.second, again.second));

  auto q = torch::randn({1, 2, 3, 4}).to(torch::kBFloat16);
  monarch::AttentionOptions m;
  m.mask = torch::zeros({3, 3});
  CHECK(monarch::attention_core(q, q, q, m).scalar_type() == torch::kBFloat16);
  m.mask = torch::ones({3, 3}, torch::kLong);
  CHECK_THROWS_WITH(monarch::attention_core(q, q, q, m), Catch::Contains("an integer mask"));
}
