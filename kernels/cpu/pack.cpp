#include "monarch/kernels/pack.h"

namespace monarch::kernels {

namespace {

inline float load(const void* p, DType d, int64_t i) {
  return d == DType::Float32 ? static_cast<const float*>(p)[i]
                             : bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}

inline void store(void* p, DType d, int64_t i, float v) {
  if (d == DType::Float32)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
}

}  // namespace

int64_t bucket_numel(const PackSource* srcs, int64_t num) {
  int64_t total = 0;
  for (int64_t k = 0; k < num; ++k) total += srcs[k].count;
  return total;
}

void bucket_pack_cpu(const PackSource* srcs, int64_t num, void* wire, DType wire_dtype,
                     float scale) {
  int64_t off = 0;
  for (int64_t k = 0; k < num; ++k) {
    const PackSource& s = srcs[k];
    for (int64_t i = 0; i < s.count; ++i) store(wire, wire_dtype, off + i, load(s.ptr, s.dtype, i) * scale);
    off += s.count;
  }
}

void bucket_unpack_cpu(const void* wire, DType wire_dtype, const UnpackDest* dsts, int64_t num,
                       float scale, bool accumulate) {
  int64_t off = 0;
  for (int64_t k = 0; k < num; ++k) {
    const UnpackDest& d = dsts[k];
    for (int64_t i = 0; i < d.count; ++i) {
      const float v = load(wire, wire_dtype, off + i) * scale;
      store(d.ptr, d.dtype, i, accumulate ? load(d.ptr, d.dtype, i) + v : v);
    }
    off += d.count;
  }
}

void float_to_bf16_cpu(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

void bf16_to_float_cpu(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

void bf16_round_with_feedback_cpu(const float* src, float* error, uint16_t* wire, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float c = src[i] + error[i];
    const uint16_t w = float_to_bf16(c);
    wire[i] = w;
    const float r = c - bf16_to_float(w);
    error[i] = std::isfinite(r) ? r : 0.0f;
  }
}

}  // namespace monarch::kernels
