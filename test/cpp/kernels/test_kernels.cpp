// The CPU references in kernels/cpu (the torch-free kernels) against ATen on random shapes,
// odd sizes, empty inputs and all-zero blocks.
#include "catch_with_torch.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "monarch/kernels/quantize.h"

namespace mk = monarch::kernels;

namespace {

at::Tensor randn(int64_t n, double scale = 1.0) {
  return at::randn({n}, at::kFloat) * scale;
}

// round half away from zero with ATen ops (at::round rounds half to even).
at::Tensor round_half_away(const at::Tensor& x) {
  at::Tensor t = at::trunc(x);
  at::Tensor frac = (x - t).abs();
  return at::where(frac >= 0.5, t + at::sign(x), t);
}

struct QuantRef {
  at::Tensor q, scales, error;
};

// The quantization formula with ATen ops: pad to whole blocks with zeros (which do not change
// max|x|), per-block scale, q and residual.
QuantRef quantize_ref(const at::Tensor& src, const at::Tensor& error, int64_t block) {
  const int64_t n = src.numel();
  const int64_t nb = (n + block - 1) / block;
  at::Tensor corrected = error.defined() ? src + error : src.clone();
  at::Tensor padded = at::zeros({nb * block}, at::kFloat);
  padded.narrow(0, 0, n).copy_(corrected);
  at::Tensor blocks = padded.view({nb, block});
  at::Tensor scales = std::get<0>(blocks.abs().max(1)) / 127.0f;
  at::Tensor s = scales.unsqueeze(1).expand({nb, block});
  at::Tensor qf = at::where(s == 0, at::zeros_like(blocks),
                            round_half_away(blocks / s).clamp(-127, 127));
  at::Tensor res = blocks - qf * s;
  return {qf.reshape({-1}).narrow(0, 0, n).to(at::kChar), scales,
          res.reshape({-1}).narrow(0, 0, n).contiguous()};
}

struct Quantized {
  at::Tensor q, scales, error;
};

Quantized quantize_cpu(const at::Tensor& src, at::Tensor error, int64_t block) {
  const int64_t n = src.numel();
  at::Tensor q = at::empty({n}, at::kChar);
  at::Tensor scales = at::empty({mk::int8_num_blocks(n, block)}, at::kFloat);
  mk::int8_quantize_cpu(src.data_ptr<float>(), error.defined() ? error.data_ptr<float>() : nullptr,
                        q.data_ptr<int8_t>(), scales.data_ptr<float>(), n, block);
  return {q, scales, error};
}

}  // namespace

TEST_CASE("int8_num_blocks rounds up and handles n = 0", "[kernels][quantize]") {
  CHECK(mk::int8_num_blocks(0, 64) == 0);
  CHECK(mk::int8_num_blocks(1, 64) == 1);
  CHECK(mk::int8_num_blocks(64, 64) == 1);
  CHECK(mk::int8_num_blocks(65, 64) == 2);
  CHECK(mk::int8_num_blocks(1000003, 256) == 3907);
}

TEST_CASE("int8 quantize/dequantize match the ATen formula", "[kernels][quantize]") {
  at::manual_seed(1);
  for (int64_t block : {1, 7, 64, 256}) {
    for (int64_t n : {0, 1, 2, 13, 64, 65, 127, 1000, 4099}) {
      INFO("n=" << n << " block=" << block);
      at::Tensor src = randn(n, 3.0);
      for (bool with_error : {false, true}) {
        at::Tensor err = with_error ? randn(n, 0.05) : at::Tensor();
        QuantRef ref = quantize_ref(src, err, block);
        Quantized got = quantize_cpu(src, with_error ? err.clone() : at::Tensor(), block);
        REQUIRE(got.scales.numel() == ref.scales.numel());
        CHECK(at::equal(got.scales, ref.scales));
        CHECK(at::equal(got.q, ref.q));
        if (with_error) CHECK(at::equal(got.error, ref.error));
        // dequantize, plain and accumulating
        at::Tensor deq_ref = n ? (ref.q.to(at::kFloat) *
                                  ref.scales.repeat_interleave(block).narrow(0, 0, n))
                               : at::empty({0});
        at::Tensor dst = at::full({n}, 123.0f);
        mk::int8_dequantize_cpu(got.q.data_ptr<int8_t>(), got.scales.data_ptr<float>(),
                                dst.data_ptr<float>(), n, block, false);
        CHECK(at::equal(dst, deq_ref));
        at::Tensor acc = randn(n);
        at::Tensor acc_ref = acc + deq_ref;
        mk::int8_dequantize_cpu(got.q.data_ptr<int8_t>(), got.scales.data_ptr<float>(),
                                acc.data_ptr<float>(), n, block, true);
        CHECK(at::equal(acc, acc_ref));
        if (with_error && n) {
          // the residual plus the dequantized value give back the corrected input exactly
          // enough (one rounding), and |residual| <= scale / 2 per block
          CHECK(at::allclose(deq_ref + got.error, src + err, 1e-6, 1e-6));
          at::Tensor bound = ref.scales.repeat_interleave(block).narrow(0, 0, n) * 0.5f * 1.0001f;
          CHECK((got.error.abs() <= bound + 1e-12).all().item<bool>());
        }
      }
    }
  }
}

TEST_CASE("int8 quantize: all-zero blocks, ties, clamping and q range", "[kernels][quantize]") {
  // block 4: [0 0 0 0] [1 -2 0.5 3] [0 0] (short last block)
  std::vector<float> src = {0, 0, 0, 0, 1.0f, -2.0f, 0.5f, 127.0f, 0, 0};
  std::vector<float> err(src.size(), 0.0f);
  std::vector<int8_t> q(src.size(), 99);
  std::vector<float> scales(3, -1.0f);
  mk::int8_quantize_cpu(src.data(), err.data(), q.data(), scales.data(), 10, 4);
  CHECK(scales[0] == 0.0f);
  CHECK(scales[1] == 1.0f);  // max|x| = 127
  CHECK(scales[2] == 0.0f);
  for (int i : {0, 1, 2, 3, 8, 9}) {
    CHECK(q[i] == 0);
    CHECK(err[i] == 0.0f);
  }
  CHECK(q[4] == 1);
  CHECK(q[5] == -2);
  CHECK(q[6] == 1);  // 0.5 rounds away from zero
  CHECK(q[7] == 127);
  CHECK(err[6] == -0.5f);
  // -0.5 rounds to -1
  std::vector<float> neg = {-0.5f, 127.0f};
  int8_t q2[2];
  float s2;
  mk::int8_quantize_cpu(neg.data(), nullptr, q2, &s2, 2, 2);
  CHECK(q2[0] == -1);
  CHECK(q2[1] == 127);
  // n = 0 writes nothing
  mk::int8_quantize_cpu(nullptr, nullptr, nullptr, nullptr, 0, 16);
  mk::int8_dequantize_cpu(nullptr, nullptr, nullptr, 0, 16, true);
  // random data: |q| <= 127 and every non-empty block reaches 127 in magnitude
  at::manual_seed(2);
  at::Tensor x = randn(1031, 10.0);
  Quantized got = quantize_cpu(x, at::Tensor(), 100);
  CHECK(got.q.abs().max().item<int>() == 127);
  CHECK(got.q.to(at::kInt).min().item<int>() >= -127);
}

TEST_CASE("int8 error feedback: the running mean of dequantized values converges",
          "[kernels][quantize]") {
  at::manual_seed(3);
  const int64_t n = 997, block = 64;
  // heavy-tailed values so most elements are small relative to their block's scale
  at::Tensor x = randn(n) * at::exp(randn(n, 1.5));
  at::Tensor err = at::zeros({n});
  at::Tensor sum = at::zeros({n}), sum_plain = at::zeros({n});
  at::Tensor q = at::empty({n}, at::kChar), deq = at::empty({n});
  at::Tensor scales = at::empty({mk::int8_num_blocks(n, block)});
  float max_scale = 0.0f;
  const int steps = 400;
  for (int t = 1; t <= steps; ++t) {
    mk::int8_quantize_cpu(x.data_ptr<float>(), err.data_ptr<float>(), q.data_ptr<int8_t>(),
                          scales.data_ptr<float>(), n, block);
    max_scale = std::max(max_scale, scales.max().item<float>());
    mk::int8_dequantize_cpu(q.data_ptr<int8_t>(), scales.data_ptr<float>(), sum.data_ptr<float>(),
                            n, block, true);
    mk::int8_quantize_cpu(x.data_ptr<float>(), nullptr, q.data_ptr<int8_t>(),
                          scales.data_ptr<float>(), n, block);
    mk::int8_dequantize_cpu(q.data_ptr<int8_t>(), scales.data_ptr<float>(),
                            sum_plain.data_ptr<float>(), n, block, true);
    if (t == 10 || t == 100 || t == steps) {
      // sum_t deq_t = t x - e_t, |e_t| <= scale / 2: the mean is within scale / (2 t) of x
      // (plus float summation error)
      const float dev = ((sum / t) - x).abs().max().item<float>();
      const float bound = 0.5f * max_scale / t * 1.01f + 1e-5f * x.abs().max().item<float>();
      INFO("t=" << t << " max deviation " << dev << " bound " << bound);
      CHECK(dev <= bound);
    }
  }
  // without error feedback the bias never shrinks
  const float dev_fb = ((sum / steps) - x).abs().max().item<float>();
  const float dev_plain = ((sum_plain / steps) - x).abs().max().item<float>();
  INFO("with feedback " << dev_fb << ", without " << dev_plain);
  CHECK(dev_plain > 20 * dev_fb);
}
