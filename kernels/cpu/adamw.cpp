#include "monarch/kernels/adamw.h"

#include <cmath>

#include "monarch/kernels/pack.h"

namespace monarch::kernels {

AdamWScalars adamw_scalars(const AdamWHyper& h) {
  // As torch computes them: Python floats (double), rounded to float when applied.
  const double t = static_cast<double>(h.step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), t);
  const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), t);
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - static_cast<double>(h.lr) * h.weight_decay);
  s.beta1 = h.beta1;
  s.beta2 = h.beta2;
  s.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(h.beta1));
  s.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(h.beta2));
  s.neg_step_size = static_cast<float>(-(static_cast<double>(h.lr) / bc1));
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.eps = h.eps;
  return s;
}

void adamw_cpu(float* const* params, const float* const* grads, float* const* exp_avg,
               float* const* exp_avg_sq, uint16_t* const* bf16_params, const int64_t* counts,
               int64_t num, const AdamWHyper& h) {
  const AdamWScalars s = adamw_scalars(h);
  const float decay = s.decay, b1 = s.beta1, b2 = s.beta2, one_minus_b1 = s.one_minus_beta1,
              one_minus_b2 = s.one_minus_beta2, neg_step_size = s.neg_step_size,
              bc2_sqrt = s.bc2_sqrt, eps = s.eps;
  for (int64_t k = 0; k < num; ++k) {
    float* p = params[k];
    const float* g = grads[k];
    float* m = exp_avg[k];
    float* v = exp_avg_sq[k];
    uint16_t* out = bf16_params ? bf16_params[k] : nullptr;
    for (int64_t i = 0; i < counts[k]; ++i) {
      // The order of ATen's ops: mul_, add_(alpha), addcmul_(value), sqrt / bc2 + eps,
      // addcdiv_(value) = p + (value * m) / denom.
      const float gi = g[i];
      const float pi = p[i] * decay;
      const float mi = m[i] * b1 + one_minus_b1 * gi;
      const float vi = v[i] * b2 + one_minus_b2 * gi * gi;
      const float denom = std::sqrt(vi) / bc2_sqrt + eps;
      const float pn = pi + (neg_step_size * mi) / denom;
      m[i] = mi;
      v[i] = vi;
      p[i] = pn;
      if (out) out[i] = float_to_bf16(pn);
    }
  }
}

}  // namespace monarch::kernels
