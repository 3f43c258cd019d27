#include "monarch/kernels/quantize.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

namespace monarch::kernels {

int64_t int8_num_blocks(int64_t n, int64_t block) {
  if (block <= 0) throw std::invalid_argument("int8_num_blocks: block must be > 0");
  if (n <= 0) return 0;
  return (n + block - 1) / block;
}

namespace {

// round-half-away-from-zero of |x| < 2^31, as std::round, in operations SSE2 has (truncating
// conversion, exact subtraction, compares), so the loops below vectorize; same values as
// std::round (checked on every 7th float pattern in [-128, 128]).
inline int32_t round_half_away(float x) {
  const int32_t t = static_cast<int32_t>(x);
  const float f = x - static_cast<float>(t);  // exact: t is x's integer part
  return t + (f >= 0.5f ? 1 : 0) - (f <= -0.5f ? 1 : 0);
}

}  // namespace

namespace {

// One block [lo, hi). kError: with error feedback (a template, so that the loops have no
// branch and vectorize).
template <bool kError>
void quantize_block(const float* src, float* error, int8_t* q, float* scale_out, int64_t lo, int64_t hi) {
  // Branch-free scan for the largest magnitude, on the bit patterns: for non-negative floats
  // they order as integers, and NaN and Inf are the patterns from 0x7F800000 up (an integer
  // max vectorizes; a float one, without -ffinite-math-only, does not).
  uint32_t amax_bits = 0;
  for (int64_t i = lo; i < hi; ++i) {
    const float c = kError ? src[i] + error[i] : src[i];
    uint32_t u;
    std::memcpy(&u, &c, sizeof u);
    u &= UINT32_C(0x7FFFFFFF);
    amax_bits = u > amax_bits ? u : amax_bits;
  }
  if (amax_bits >= UINT32_C(0x7F800000)) {
    // Non-finite input: the block's scale is NaN (every value dequantizes to NaN, as an
    // uncompressed sum would propagate it) and its residual is dropped, so one bad step
    // does not poison the error feedback of the steps after it.
    *scale_out = NAN;
    for (int64_t i = lo; i < hi; ++i) {
      q[i] = 0;
      if (kError) error[i] = 0.0f;
    }
    return;
  }
  float amax;
  std::memcpy(&amax, &amax_bits, sizeof amax);
  const float scale = amax / 127.0f;
  *scale_out = scale;
  if (scale == 0.0f) {
    for (int64_t i = lo; i < hi; ++i) {
      q[i] = 0;
      if (kError) error[i] = src[i] + error[i];  // c - 0 * 0: the corrected value
    }
    return;
  }
  for (int64_t i = lo; i < hi; ++i) {
    const float c = kError ? src[i] + error[i] : src[i];
    int32_t v = round_half_away(c / scale);
    v = v > 127 ? 127 : (v < -127 ? -127 : v);
    q[i] = static_cast<int8_t>(v);
    const float r = static_cast<float>(v);
    // Two separately rounded ops (built with -ffp-contract=off; the CUDA kernel uses
    // __fmul_rn/__fsub_rn), so CPU and GPU residuals agree bit for bit.
    if (kError) error[i] = c - r * scale;
  }
}

}  // namespace

void int8_quantize_cpu(const float* src, float* error, int8_t* q, float* scales, int64_t n,
                       int64_t block) {
  const int64_t nb = int8_num_blocks(n, block);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block;
    const int64_t hi = lo + block < n ? lo + block : n;
    if (error) {
      quantize_block<true>(src, error, q, scales + b, lo, hi);
    } else {
      quantize_block<false>(src, nullptr, q, scales + b, lo, hi);
    }
  }
}

void int8_dequantize_cpu(const int8_t* q, const float* scales, float* dst, int64_t n,
                         int64_t block, bool accumulate) {
  if (block <= 0) throw std::invalid_argument("int8_dequantize_cpu: block must be > 0");
  for (int64_t lo = 0; lo < n; lo += block) {
    const int64_t hi = lo + block < n ? lo + block : n;
    const float scale = scales[lo / block];
    if (accumulate) {
      for (int64_t i = lo; i < hi; ++i) dst[i] = dst[i] + static_cast<float>(q[i]) * scale;
    } else {
      for (int64_t i = lo; i < hi; ++i) dst[i] = static_cast<float>(q[i]) * scale;
    }
  }
}

}  // namespace monarch::kernels
