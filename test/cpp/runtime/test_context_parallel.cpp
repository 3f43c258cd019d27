// Ring attention's block math (monarch/runtime/context_parallel.h) in one process: the same
// block steps run for cp simulated ranks (simulate_ring_attention) against attention_core on
// the whole sequence, forward and backward, causal (load-balanced chunks) and not, with
// grouped-query heads; the layout helpers round-trip. The ring's messages themselves are
// tested on 4 ranks by test/python/test_context_parallel.py.
#include "catch_with_torch.h"

#include <string>

#include "monarch/runtime/attention.h"
#include "monarch/runtime/context_parallel.h"

namespace {

// Largest elementwise difference relative to the reference's largest magnitude.
double rel(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>() /
         want.to(at::kDouble).abs().max().item<double>();
}

struct Case {
  int64_t cp;
  bool causal;
  int64_t heads, kv_heads;
  int64_t block_rows = 0;  // 3: blocks cut into tiles of 3 query rows (uneven last tile)
};

}  // namespace

TEST_CASE("ring attention's blocks equal attention_core on the whole sequence", "[runtime][cp]") {
  // fp64 throughout: the only difference from attention_core is the order of summation
  // (blockwise online softmax), so 1e-12 of the output's scale is a real bound.
  for (Case c : {Case{1, true, 4, 4}, Case{2, true, 4, 2}, Case{4, true, 4, 1}, Case{3, true, 2, 2},
                 Case{2, false, 4, 2}, Case{4, false, 4, 4},
                 Case{2, true, 4, 2, 3}, Case{4, true, 4, 1, 3}, Case{1, true, 2, 1, 5}}) {
    INFO("cp=" << c.cp << " causal=" << c.causal << " heads=" << c.heads << " kv_heads=" << c.kv_heads
                << " block_rows=" << c.block_rows);
    torch::manual_seed(3);
    const int64_t b = 2, s = 8 * c.cp, d = 8, dv = 6;
    auto opts = torch::TensorOptions().dtype(torch::kDouble);
    auto q = torch::randn({b, c.heads, s, d}, opts).requires_grad_();
    auto k = torch::randn({b, c.kv_heads, s, d}, opts).requires_grad_();
    auto v = torch::randn({b, c.kv_heads, s, dv}, opts).requires_grad_();
    auto dout = torch::randn({b, c.heads, s, dv}, opts);
    monarch::AttentionOptions ao;
    ao.causal = c.causal;
    auto want = monarch::attention_core(q, k, v, ao);
    want.backward(dout);

    std::vector<at::Tensor> qs, ks, vs, douts;
    for (int64_t r = 0; r < c.cp; ++r) {
      qs.push_back(monarch::cp::shard_sequence(q.detach(), 2, r, c.cp));
      ks.push_back(monarch::cp::shard_sequence(k.detach(), 2, r, c.cp));
      vs.push_back(monarch::cp::shard_sequence(v.detach(), 2, r, c.cp));
      douts.push_back(monarch::cp::shard_sequence(dout, 2, r, c.cp));
    }
    monarch::cp::RingAttentionOptions ro;
    ro.causal = c.causal;
    ro.block_rows = c.block_rows;
    auto got = monarch::cp::simulate_ring_attention(qs, ks, vs, douts, ro);
    CHECK(rel(monarch::cp::unshard_sequence(got.out, 2), want) < 1e-12);
    CHECK(rel(monarch::cp::unshard_sequence(got.dq, 2), q.grad()) < 1e-12);
    CHECK(rel(monarch::cp::unshard_sequence(got.dk, 2), k.grad()) < 1e-12);
    CHECK(rel(monarch::cp::unshard_sequence(got.dv, 2), v.grad()) < 1e-12);
  }
}

TEST_CASE("ring attention accumulates bf16 inputs in float32", "[runtime][cp]") {
  // bf16 in and out; the reference is attention_core in float32 on the bf16 values. The only
  // bf16 rounding left is of the result (2^-8 relative), well under 1e-2.
  torch::manual_seed(5);
  const int64_t cp = 4, s = 64;
  auto q = torch::randn({1, 4, s, 16}).to(torch::kBFloat16);
  auto k = torch::randn({1, 2, s, 16}).to(torch::kBFloat16);
  auto v = torch::randn({1, 2, s, 16}).to(torch::kBFloat16);
  monarch::AttentionOptions ao;
  ao.causal = true;
  auto want = monarch::attention_core(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), ao);
  std::vector<at::Tensor> qs, ks, vs;
  for (int64_t r = 0; r < cp; ++r) {
    qs.push_back(monarch::cp::shard_sequence(q, 2, r, cp));
    ks.push_back(monarch::cp::shard_sequence(k, 2, r, cp));
    vs.push_back(monarch::cp::shard_sequence(v, 2, r, cp));
  }
  auto got = monarch::cp::simulate_ring_attention(qs, ks, vs, {});
  auto out = monarch::cp::unshard_sequence(got.out, 2);
  CHECK(out.scalar_type() == torch::kBFloat16);
  CHECK(rel(out, want) < 1e-2);
}

TEST_CASE("the load-balanced layout: chunks i and 2cp-1-i, positions, round trip, errors", "[runtime][cp]") {
  auto x = torch::arange(16).view({1, 16});
  CHECK(torch::equal(monarch::cp::shard_sequence(x, 1, 1, 4), torch::tensor({{2, 3, 12, 13}})));
  CHECK(torch::equal(monarch::cp::sequence_positions(16, 1, 4), torch::tensor({2, 3, 12, 13}, torch::kLong)));
  CHECK(torch::equal(monarch::cp::local_sequence_positions(4, 3, 4), torch::tensor({6, 7, 8, 9}, torch::kLong)));
  std::vector<at::Tensor> parts;
  for (int64_t r = 0; r < 4; ++r) parts.push_back(monarch::cp::shard_sequence(x, 1, r, 4));
  CHECK(torch::equal(monarch::cp::unshard_sequence(parts, 1), x));
  CHECK(torch::equal(monarch::cp::shard_sequence(x, 1, 0, 1), x));

  std::string error;
  try {
    monarch::cp::shard_sequence(torch::zeros({2, 12}), 1, 0, 4);
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  CHECK(error.find("sequence length 12") != std::string::npos);
  CHECK(error.find("2*cp = 8") != std::string::npos);

  error.clear();
  try {
    auto q = torch::zeros({1, 4, 6, 8});
    monarch::cp::simulate_ring_attention({q, q}, {torch::zeros({1, 3, 6, 8}), torch::zeros({1, 3, 6, 8})},
                                         {torch::zeros({1, 3, 6, 8}), torch::zeros({1, 3, 6, 8})}, {});
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  CHECK(error.find("3 heads, which do not divide q's 4") != std::string::npos);

  // Bytes: float32 backward is exactly twice forward; bf16 gradients travel in float32.
  auto f32 = monarch::cp::ring_attention_bytes(2, 128, 4, 16, 16, 4, torch::kFloat);
  CHECK(f32.forward == 3.0 * 2 * 128 * 4 * 32 * 4);
  CHECK(f32.backward == 2 * f32.forward);
  auto bf16 = monarch::cp::ring_attention_bytes(2, 128, 4, 16, 16, 4, torch::kBFloat16);
  CHECK(bf16.backward == 3 * bf16.forward);
}
