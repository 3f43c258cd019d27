#pragma once
// Gradient bucket pack/unpack with a dtype cast and a scale (one flat wire buffer per bucket).
// Torch-free. bf16 values are uint16_t bit patterns, converted exactly as c10::BFloat16
// (round to nearest even; every NaN becomes the quiet NaN 0x7FC0, so NaN stays NaN).
#include <cmath>
#include <cstdint>
#include <cstring>

namespace monarch::kernels {

enum class DType : int32_t { Float32 = 0, BFloat16 = 1 };

inline int64_t dtype_size(DType d) { return d == DType::Float32 ? 4 : 2; }

inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return UINT16_C(0x7FC0);
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounding_bias = ((u >> 16) & 1) + UINT32_C(0x7FFF);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct PackSource {
  const void* ptr;  // count elements of dtype
  int64_t count;
  DType dtype;
};

struct UnpackDest {
  void* ptr;  // count elements of dtype
  int64_t count;
  DType dtype;
};

// Sum of the counts: the wire buffer's length in elements.
int64_t bucket_numel(const PackSource* srcs, int64_t num);

// wire[off_k + i] = to_wire(float(srcs[k][i]) * scale), sources laid out back to back in order
// (off_k = sum of the earlier counts). wire: Float32 or BFloat16.
// torch: at::cat({s.to(kFloat) * scale ...}).to(wire)
void bucket_pack_cpu(const PackSource* srcs, int64_t num, void* wire, DType wire_dtype,
                     float scale);

// The reverse: v = float(wire[off_k + i]) * scale; dst = to_dst(v), or with accumulate
// dst = to_dst(float(dst) + v).
void bucket_unpack_cpu(const void* wire, DType wire_dtype, const UnpackDest* dsts, int64_t num,
                       float scale, bool accumulate);

// Plain conversions (n elements).
void float_to_bf16_cpu(const float* src, uint16_t* dst, int64_t n);
void bf16_to_float_cpu(const uint16_t* src, float* dst, int64_t n);

// bf16 rounding with error feedback, in one pass: c = src + error; wire = bf16(c);
// error = c - float(wire), or 0 where that is not finite (a NaN/Inf gradient's residual is
// dropped so it does not poison later steps). src must not alias error. CPU only: the
// hierarchical reduction's compressed slow hop runs on host buffers.
// torch: c = src + e; w = c.to(bf16); e = (c - w.float()).nan_to_num(0, 0, 0)
void bf16_round_with_feedback_cpu(const float* src, float* error, uint16_t* wire, int64_t n);

}  // namespace monarch::kernels
