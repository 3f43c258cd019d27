#include "monarch/kernels/quantize.h"

#include <cmath>
#include <stdexcept>

namespace monarch::kernels {

int64_t int8_num_blocks(int64_t n, int64_t block) {
  if (block <= 0) throw std::invalid_argument("int8_num_blocks: block must be > 0");
  if (n <= 0) return 0;
  return (n + block - 1) / block;
}

void int8_quantize_cpu(const float* src, float* error, int8_t* q, float* scales, int64_t n,
                       int64_t block) {
  const int64_t nb = int8_num_blocks(n, block);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block;
    const int64_t hi = lo + block < n ? lo + block : n;
    float amax = 0.0f;
    for (int64_t i = lo; i < hi; ++i) {
      const float c = error ? src[i] + error[i] : src[i];
      // A NaN or Inf marks the block (fmax would skip a NaN).
      amax = std::isfinite(c) ? std::fmax(amax, std::fabs(c)) : INFINITY;
    }
    if (std::isinf(amax)) {
      // Non-finite input: the block's scale is NaN (every value dequantizes to NaN, as an
      // uncompressed sum would propagate it) and its residual is dropped, so one bad step
      // does not poison the error feedback of the steps after it.
      scales[b] = NAN;
      for (int64_t i = lo; i < hi; ++i) {
        q[i] = 0;
        if (error) error[i] = 0.0f;
      }
      continue;
    }
    const float scale = amax / 127.0f;
    scales[b] = scale;
    for (int64_t i = lo; i < hi; ++i) {
      const float c = error ? src[i] + error[i] : src[i];
      int8_t v = 0;
      if (scale != 0.0f) {
        float r = std::round(c / scale);  // half away from zero
        r = std::fmin(127.0f, std::fmax(-127.0f, r));
        v = static_cast<int8_t>(r);
      }
      q[i] = v;
      if (error) {
        // Two separately rounded ops (built with -ffp-contract=off; the CUDA kernel uses
        // __fmul_rn/__fsub_rn), so CPU and GPU residuals agree bit for bit.
        error[i] = c - static_cast<float>(v) * scale;
      }
    }
  }
}

void int8_dequantize_cpu(const int8_t* q, const float* scales, float* dst, int64_t n,
                         int64_t block, bool accumulate) {
  if (block <= 0) throw std::invalid_argument("int8_dequantize_cpu: block must be > 0");
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(q[i]) * scales[i / block];
    dst[i] = accumulate ? dst[i] + v : v;
  }
}

}  // namespace monarch::kernels
