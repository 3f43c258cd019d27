#pragma once
// int8 block quantization with error feedback (compressed gradient all-reduce).
// Torch-free: raw pointers and sizes. The CPU functions here are the reference the tests
// check and what the CPU runtime calls; the CUDA versions (cuda.h) compute the same values.
#include <cstdint>

namespace monarch::kernels {

// Blocks of `block` consecutive elements (the last may be shorter). For each block:
// corrected = src + error (error may be nullptr: zero), scale = max|corrected| / 127
// (0 for an all-zero block), q = round-half-away-from-zero(corrected / scale) clamped to
// [-127, 127] (0 where scale == 0), and, if error != nullptr, error = corrected - q * scale.
// scales has int8_num_blocks(n, block) entries. n may be 0. block must be > 0.
// A block holding a NaN or Inf gets scale NaN, q = 0 and error = 0: it dequantizes to NaN
// (the failure stays visible, as in an uncompressed sum) and its residual is dropped.
// src and error may alias (src == error) only if the caller wants the residual in place.
int64_t int8_num_blocks(int64_t n, int64_t block);
void int8_quantize_cpu(const float* src, float* error, int8_t* q, float* scales, int64_t n,
                       int64_t block);
// dst[i] = q[i] * scales[i / block]  (accumulate: dst[i] += ...)
void int8_dequantize_cpu(const int8_t* q, const float* scales, float* dst, int64_t n,
                         int64_t block, bool accumulate);

}  // namespace monarch::kernels
