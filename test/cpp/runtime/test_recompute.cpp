// Full recomputation (monarch/runtime/recompute.h) on one process: backward re-runs the block
// with forward's RNG state, so gradients are bit-identical to a plain backward (dropout
// included), the caller's random stream is left where a plain backward leaves it, and only
// the block's input is kept.
#include "catch_with_torch.h"

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
