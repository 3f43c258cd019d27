// The CPU references in kernels/cpu (the torch-free kernels) against ATen on random shapes,
// odd sizes, empty inputs and all-zero blocks.
#include "catch_with_torch.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "monarch/kernels/adamw.h"
#include "monarch/runtime/compat.h"
#include "monarch/kernels/cross_entropy.h"
#include "monarch/kernels/pack.h"
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

TEST_CASE("int8 quantize: a NaN or Inf block dequantizes to NaN and drops its residual", "[kernels][quantize]") {
  // block 3: [1 NaN 2] [inf 1 1] [3 -3 1]
  std::vector<float> src = {1.0f, NAN, 2.0f, INFINITY, 1.0f, 1.0f, 3.0f, -3.0f, 1.0f};
  std::vector<float> err = {0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.0f, 0.0f, 0.0f};
  std::vector<int8_t> q(src.size(), 99);
  std::vector<float> scales(3, -1.0f);
  mk::int8_quantize_cpu(src.data(), err.data(), q.data(), scales.data(), 9, 3);
  CHECK(std::isnan(scales[0]));
  CHECK(std::isnan(scales[1]));
  CHECK(scales[2] == 3.0f / 127.0f);
  for (int i = 0; i < 6; ++i) {
    CHECK(q[i] == 0);
    CHECK(err[i] == 0.0f);  // the next step starts clean
  }
  std::vector<float> out(9, 0.0f);
  mk::int8_dequantize_cpu(q.data(), scales.data(), out.data(), 9, 3, false);
  for (int i = 0; i < 6; ++i) CHECK(std::isnan(out[i]));
  CHECK(out[6] == Approx(3.0f));
  CHECK(out[7] == Approx(-3.0f));
  // The next step with finite values quantizes normally.
  std::vector<float> good = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  mk::int8_quantize_cpu(good.data(), err.data(), q.data(), scales.data(), 9, 3);
  for (int b = 0; b < 3; ++b) CHECK(std::isfinite(scales[b]));
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

// ---- bf16 conversion and bucket pack/unpack ----------------------------------------------------

namespace {

at::Tensor bits_as_bf16(const at::Tensor& u16) {  // int16 tensor of bf16 bit patterns
  return u16.view(at::kBFloat16);
}

mk::DType kdtype(at::ScalarType t) { return t == at::kFloat ? mk::DType::Float32 : mk::DType::BFloat16; }

}  // namespace

TEST_CASE("bf16 conversion matches c10::BFloat16 bit for bit, NaN preserved", "[kernels][pack]") {
  at::manual_seed(4);
  std::vector<float> special = {0.0f, -0.0f, 1.0f, -1.0f, 1.00390625f /* tie */, 1.01171875f,
                                3.4028235e38f, -3.4028235e38f, 1e-40f, -1e-45f,
                                std::numeric_limits<float>::infinity(),
                                -std::numeric_limits<float>::infinity(),
                                std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN()};
  at::Tensor x = at::cat({at::from_blob(special.data(), {(int64_t)special.size()}, at::kFloat).clone(),
                          randn(5000, 100.0), randn(3000, 1e-3),
                          // every tie pattern: low 16 bits 0x8000 with both parities of bit 16
                          (at::randint(0, 1 << 15, {2000}, at::kInt) * 65536 + 0x8000).view(at::kFloat)});
  const int64_t n = x.numel();
  at::Tensor got = at::empty({n}, at::kShort);
  mk::float_to_bf16_cpu(x.data_ptr<float>(), reinterpret_cast<uint16_t*>(got.data_ptr<int16_t>()), n);
  at::Tensor ref = x.to(at::kBFloat16);
  at::Tensor nan = x.isnan();
  CHECK(at::equal(bits_as_bf16(got).isnan(), nan));
  CHECK(at::equal(got.masked_select(~nan), ref.view(at::kShort).masked_select(~nan)));
  CHECK(at::equal(got.masked_select(nan), at::full({nan.sum().item<int64_t>()}, 0x7FC0, at::kShort)));
  at::Tensor back = at::empty({n}, at::kFloat);
  mk::bf16_to_float_cpu(reinterpret_cast<const uint16_t*>(got.data_ptr<int16_t>()), back.data_ptr<float>(), n);
  CHECK(at::equal(back.masked_select(~nan), ref.to(at::kFloat).masked_select(~nan)));
  CHECK(back.isnan().equal(nan));
}

TEST_CASE("bucket pack/unpack match at::cat / .to with scale, both wire dtypes", "[kernels][pack]") {
  at::manual_seed(5);
  for (auto wire_t : {at::kFloat, at::kBFloat16}) {
    for (std::vector<int64_t> sizes : {std::vector<int64_t>{}, {0}, {1}, {7, 0, 13}, {1000, 1, 257, 3, 4099}}) {
      INFO("wire " << wire_t << " tensors " << sizes.size());
      std::vector<at::Tensor> src;
      std::vector<mk::PackSource> ps;
      int64_t i = 0;
      for (int64_t n : sizes) {
        at::Tensor t = randn(n, 5.0);
        if (i++ % 2) t = t.to(at::kBFloat16);
        src.push_back(t);
        ps.push_back({t.data_ptr(), n, kdtype(t.scalar_type())});
      }
      const float scale = 0.125f + 1.0f / 3.0f;
      const int64_t total = mk::bucket_numel(ps.data(), (int64_t)ps.size());
      at::Tensor wire = at::empty({total}, wire_t);
      mk::bucket_pack_cpu(ps.data(), (int64_t)ps.size(), wire.data_ptr(), kdtype(wire_t), scale);
      std::vector<at::Tensor> scaled;
      for (auto& t : src) scaled.push_back(t.to(at::kFloat) * scale);
      at::Tensor ref = scaled.empty() ? at::empty({0}, wire_t) : at::cat(scaled).to(wire_t);
      REQUIRE(total == ref.numel());
      CHECK(at::equal(wire, ref));
      // unpack into fresh tensors (plain) and into existing ones (accumulate)
      for (bool accumulate : {false, true}) {
        std::vector<at::Tensor> dst;
        std::vector<mk::UnpackDest> ds;
        for (auto& t : src) {
          at::Tensor d = randn(t.numel()).to(t.scalar_type());
          dst.push_back(d);
          ds.push_back({d.data_ptr(), d.numel(), kdtype(d.scalar_type())});
        }
        std::vector<at::Tensor> before;
        for (auto& d : dst) before.push_back(d.clone());
        const float uscale = 0.5f;
        mk::bucket_unpack_cpu(wire.data_ptr(), kdtype(wire_t), ds.data(), (int64_t)ds.size(), uscale, accumulate);
        int64_t off = 0;
        for (size_t k = 0; k < dst.size(); ++k) {
          at::Tensor v = wire.narrow(0, off, dst[k].numel()).to(at::kFloat) * uscale;
          at::Tensor expect = (accumulate ? before[k].to(at::kFloat) + v : v).to(dst[k].scalar_type());
          CHECK(at::equal(dst[k], expect));
          off += dst[k].numel();
        }
      }
    }
  }
}

TEST_CASE("bf16 rounding with error feedback matches the ATen formula; non-finite residuals dropped",
          "[kernels][pack]") {
  at::manual_seed(6);
  for (int64_t n : {0, 1, 7, 4099}) {
    INFO("n " << n);
    at::Tensor src = randn(n, 3.0);
    at::Tensor error = randn(n, 1e-3);
    if (n > 2) {
      src[0] = std::numeric_limits<float>::infinity();
      src[1] = std::numeric_limits<float>::quiet_NaN();
    }
    at::Tensor corrected = src + error;
    at::Tensor ref_wire = corrected.to(at::kBFloat16);
    at::Tensor ref_error = corrected - ref_wire.to(at::kFloat);
    ref_error.masked_fill_(ref_error.isfinite().logical_not(), 0.0);
    at::Tensor wire = at::empty({n}, at::kShort);
    mk::bf16_round_with_feedback_cpu(src.data_ptr<float>(), error.data_ptr<float>(),
                                     reinterpret_cast<uint16_t*>(wire.data_ptr<int16_t>()), n);
    at::Tensor finite = corrected.isnan().logical_not();
    CHECK(at::equal(wire.masked_select(finite), ref_wire.view(at::kShort).masked_select(finite)));
    CHECK(bits_as_bf16(wire).isnan().equal(corrected.isnan()));
    CHECK(at::equal(error, ref_error));
    // The Inf and NaN elements leave no residual for the next step.
    if (n > 2) CHECK(error.narrow(0, 0, 2).abs().sum().item<float>() == 0.0f);
  }
}

// ---- AdamW -------------------------------------------------------------------------------------

TEST_CASE("fused AdamW matches torch::optim::AdamW over several steps, bf16 copies exact",
          "[kernels][adamw]") {
  at::manual_seed(6);
  const std::vector<int64_t> sizes = {1, 0, 17, 1000, 4099};
  for (double wd : {0.0, 0.1}) {
    std::vector<at::Tensor> ref_params, p, m, v, out;
    for (int64_t n : sizes) {
      at::Tensor t = randn(n);
      ref_params.push_back(t.clone().requires_grad_(true));
      p.push_back(t.clone());
      m.push_back(at::zeros({n}));
      v.push_back(at::zeros({n}));
      out.push_back(at::zeros({n}, at::kShort));
    }
    torch::optim::AdamWOptions opts(3e-2);
    opts.betas({0.9, 0.95}).eps(1e-8).weight_decay(wd);
    torch::optim::AdamW opt(ref_params, opts);
    mk::AdamWHyper h;
    h.lr = 3e-2f;
    h.beta1 = 0.9f;
    h.beta2 = 0.95f;
    h.eps = 1e-8f;
    h.weight_decay = static_cast<float>(wd);
    for (int step = 1; step <= 6; ++step) {
      std::vector<at::Tensor> g;
      for (int64_t n : sizes) g.push_back(randn(n, step % 2 ? 1.0 : 1e-3));
      for (size_t k = 0; k < sizes.size(); ++k) ref_params[k].mutable_grad() = g[k].clone();
      opt.step();
      std::vector<float*> pp, mp, vp;
      std::vector<const float*> gp;
      std::vector<uint16_t*> op;
      std::vector<int64_t> counts;
      for (size_t k = 0; k < sizes.size(); ++k) {
        pp.push_back(p[k].data_ptr<float>());
        gp.push_back(g[k].data_ptr<float>());
        mp.push_back(m[k].data_ptr<float>());
        vp.push_back(v[k].data_ptr<float>());
        // tensor 2 without a bf16 copy
        op.push_back(k == 2 ? nullptr : reinterpret_cast<uint16_t*>(out[k].data_ptr<int16_t>()));
        counts.push_back(sizes[k]);
      }
      h.step = step;
      mk::adamw_cpu(pp.data(), gp.data(), mp.data(), vp.data(), op.data(), counts.data(),
                    (int64_t)sizes.size(), h);
      for (size_t k = 0; k < sizes.size(); ++k) {
        INFO("wd " << wd << " step " << step << " tensor " << k);
        at::Tensor r = ref_params[k].detach();
        auto& st = static_cast<torch::optim::AdamWParamState&>(
            monarch::compat::optimizer_state(opt, ref_params[k]));
        CHECK(at::allclose(p[k], r, 1e-6, 1e-7));
        CHECK(at::allclose(m[k], st.exp_avg(), 1e-6, 1e-7));  // ulps of terms that cancel
        CHECK(at::allclose(v[k], st.exp_avg_sq(), 1e-6, 1e-12));
        if (k == 2)
          CHECK(out[k].abs().sum().item<int64_t>() == 0);
        else
          CHECK(at::equal(out[k].view(at::kBFloat16), p[k].to(at::kBFloat16)));
      }
    }
    // no bf16 copies at all
    std::vector<float*> pp = {p[4].data_ptr<float>()}, mp = {m[4].data_ptr<float>()}, vp = {v[4].data_ptr<float>()};
    at::Tensor g = randn(sizes[4]);
    std::vector<const float*> gp = {g.data_ptr<float>()};
    h.step = 7;
    mk::adamw_cpu(pp.data(), gp.data(), mp.data(), vp.data(), nullptr, &sizes[4], 1, h);
    CHECK(p[4].isfinite().all().item<bool>());
  }
}

TEST_CASE("fused AdamW follows the formula with at:: ops exactly (one step, odd hyperparameters)",
          "[kernels][adamw]") {
  at::manual_seed(7);
  const int64_t n = 1013;
  at::Tensor p = randn(n), g = randn(n), m = randn(n, 0.1), v = randn(n, 0.1).abs();
  mk::AdamWHyper h;
  h.lr = 1e-3f;
  h.beta1 = 0.8f;
  h.beta2 = 0.99f;
  h.eps = 1e-6f;
  h.weight_decay = 0.05f;
  h.step = 11;
  const double bc1 = 1 - std::pow(double(h.beta1), 11.0), bc2 = 1 - std::pow(double(h.beta2), 11.0);
  at::Tensor rp = p.clone().mul_(1 - double(h.lr) * double(h.weight_decay));
  at::Tensor rm = m.clone().mul_(double(h.beta1)).add_(g, 1 - double(h.beta1));
  at::Tensor rv = v.clone().mul_(double(h.beta2)).addcmul_(g, g, 1 - double(h.beta2));
  at::Tensor denom = (rv.sqrt() / std::sqrt(bc2)).add_(double(h.eps));
  rp.addcdiv_(rm, denom, -double(h.lr) / bc1);
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  mk::adamw_cpu(&pp, &gp, &mp, &vp, nullptr, &n, 1, h);
  CHECK(at::allclose(p, rp, 1e-6, 1e-8));
  CHECK(at::allclose(m, rm, 1e-6, 1e-9));
  CHECK(at::allclose(v, rv, 1e-6, 1e-9));
}

// ---- vocab-parallel cross-entropy ----------------------------------------------------------------

TEST_CASE("vocab-parallel cross-entropy over 1-3 shards matches at::cross_entropy_loss and autograd",
          "[kernels][cross_entropy]") {
  at::manual_seed(8);
  const int64_t vocab = 1009;  // prime
  for (int64_t rows : {1, 5, 37}) {
    for (std::vector<int64_t> shard_sizes : {std::vector<int64_t>{vocab}, {500, 509}, {331, 1, 677}}) {
      INFO("rows " << rows << " shards " << shard_sizes.size());
      at::Tensor logits = randn(rows * vocab, 4.0).view({rows, vocab});
      at::Tensor targets = at::randint(0, vocab, {rows}, at::kLong);
      if (rows > 1) targets[1] = mk::kIgnoreIndex;
      if (rows > 2) targets[2] = shard_sizes.size() > 1 ? shard_sizes[0] : 0;  // first id of a shard
      if (rows > 3) targets[3] = vocab - 1;
      const int64_t valid = (targets != mk::kIgnoreIndex).sum().item<int64_t>();
      const float grad_scale = 1.0f / static_cast<float>(std::max<int64_t>(valid, 1));
      // reference: mean loss over non-ignored rows, per-row losses, and autograd's gradient
      at::Tensor lref = logits.clone().requires_grad_(true);
      at::Tensor per_row = at::cross_entropy_loss(lref, targets, {}, at::Reduction::None, mk::kIgnoreIndex);
      at::Tensor mean = at::cross_entropy_loss(lref, targets, {}, at::Reduction::Mean, mk::kIgnoreIndex);
      mean.backward();
      at::Tensor grad_ref = lref.grad();
      // the split: pass 1 per shard, MAX "all-reduce", pass 2 per shard, SUM "all-reduce", pass 3
      std::vector<at::Tensor> shards;
      std::vector<int64_t> starts;
      int64_t start = 0;
      for (int64_t s : shard_sizes) {
        shards.push_back(logits.narrow(1, start, s).contiguous());
        starts.push_back(start);
        start += s;
      }
      at::Tensor gmax = at::full({rows}, -std::numeric_limits<float>::infinity());
      for (auto& sh : shards) {
        at::Tensor lm = at::empty({rows});
        mk::ce_local_max_cpu(sh.data_ptr<float>(), rows, sh.size(1), lm.data_ptr<float>());
        CHECK(at::equal(lm, std::get<0>(sh.max(1))));
        gmax = at::maximum(gmax, lm);
      }
      at::Tensor gsum = at::zeros({rows}), gtarget = at::zeros({rows});
      for (size_t k = 0; k < shards.size(); ++k) {
        at::Tensor se = at::empty({rows}), tl = at::empty({rows});
        mk::ce_local_sumexp_cpu(shards[k].data_ptr<float>(), targets.data_ptr<int64_t>(), rows,
                                shards[k].size(1), starts[k], gmax.data_ptr<float>(),
                                se.data_ptr<float>(), tl.data_ptr<float>());
        CHECK(at::allclose(se, (shards[k] - gmax.unsqueeze(1)).exp().sum(1), 1e-5, 1e-7));
        gsum += se;
        gtarget += tl;
      }
      at::Tensor loss_total = at::zeros({rows});
      std::vector<at::Tensor> grads;
      for (size_t k = 0; k < shards.size(); ++k) {
        at::Tensor loss = at::empty({rows});
        const bool in_place = k % 2 == 1;
        at::Tensor grad = in_place ? shards[k].clone() : at::empty_like(shards[k]);
        mk::ce_loss_grad_cpu(shards[k].data_ptr<float>(), targets.data_ptr<int64_t>(), rows,
                             shards[k].size(1), starts[k], gmax.data_ptr<float>(), gsum.data_ptr<float>(),
                             gtarget.data_ptr<float>(), grad_scale, mk::kIgnoreIndex, loss.data_ptr<float>(),
                             in_place ? grad.data_ptr<float>() : grad.data_ptr<float>());
        if (in_place) {
          // in place: the logits buffer itself becomes the gradient
          at::Tensor buf = shards[k].clone();
          mk::ce_loss_grad_cpu(buf.data_ptr<float>(), targets.data_ptr<int64_t>(), rows, buf.size(1),
                               starts[k], gmax.data_ptr<float>(), gsum.data_ptr<float>(),
                               gtarget.data_ptr<float>(), grad_scale, mk::kIgnoreIndex, nullptr,
                               buf.data_ptr<float>());
          CHECK(at::equal(buf, grad));
        }
        if (k == 0) loss_total = loss;
        else CHECK(at::equal(loss, loss_total));  // every rank computes the same loss
        grads.push_back(grad);
      }
      CHECK(at::allclose(loss_total, per_row.detach(), 1e-5, 1e-5));
      CHECK(at::allclose(loss_total.sum() * grad_scale, mean.detach(), 1e-5, 1e-6));
      at::Tensor grad = at::cat(grads, 1);
      CHECK(at::allclose(grad, grad_ref, 1e-5, 1e-7));
      if (rows > 1) {
        CHECK(loss_total[1].item<float>() == 0.0f);
        CHECK(grad[1].abs().sum().item<float>() == 0.0f);
      }
    }
  }
  // rows = 0: nothing read or written
  mk::ce_local_max_cpu(nullptr, 0, 10, nullptr);
  mk::ce_local_sumexp_cpu(nullptr, nullptr, 0, 10, 0, nullptr, nullptr, nullptr);
  mk::ce_loss_grad_cpu(nullptr, nullptr, 0, 10, 0, nullptr, nullptr, nullptr, 1.0f, -100, nullptr, nullptr);
}
