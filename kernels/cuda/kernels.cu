// The CUDA kernels of monarch_kernels_cuda (one translation unit, to keep the CUDA compile
// small). Each computes what its CPU reference in ../cpu computes; elementwise arithmetic
// uses explicitly rounded ops (__fmul_rn, __fadd_rn, ...) so that nvcc does not contract
// into FMAs and the results match the CPU references (built with -ffp-contract=off) bit for
// bit, except where a reduction order or expf/logf differ (cross-entropy sums: ~1e-6 relative).
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "monarch/kernels/cuda.h"

namespace monarch::kernels {

namespace {

void check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

constexpr int kThreads = 256;

unsigned grid_for(int64_t n, int64_t cap = 65535) {
  int64_t g = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(g, cap)));
}

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
};

// Reduces v over the thread block; every thread gets the result. blockDim.x: multiple of 32.
template <typename Op>
__device__ float block_reduce(float v, Op op, float identity) {
  __shared__ float warp_vals[32];
  __shared__ float result;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) warp_vals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = blockDim.x >> 5;
    float w = lane < nwarps ? warp_vals[lane] : identity;
    for (int o = 16; o > 0; o >>= 1) w = op(w, __shfl_xor_sync(0xffffffffu, w, o));
    if (lane == 0) result = w;
  }
  __syncthreads();
  const float r = result;
  __syncthreads();  // result may be reused by a later call
  return r;
}

__device__ __forceinline__ uint16_t d_float_to_bf16(float f) {
  if (isnan(f)) return 0x7FC0u;
  const uint32_t u = __float_as_uint(f);
  const uint32_t rounding_bias = ((u >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

__device__ __forceinline__ float d_bf16_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

__device__ __forceinline__ float d_load(const void* p, int32_t d, int64_t i) {
  return d == 0 ? static_cast<const float*>(p)[i] : d_bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}

__device__ __forceinline__ void d_store(void* p, int32_t d, int64_t i, float v) {
  if (d == 0)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = d_float_to_bf16(v);
}

// ---- int8 quantization ---------------------------------------------------------------------

__global__ void int8_quantize_kernel(const float* src, float* error, int8_t* q,
                                     float* scales, int64_t n, int64_t block) {
  const int64_t b = blockIdx.x;
  const int64_t lo = b * block;
  const int64_t hi = min(lo + block, n);
  float amax = 0.0f;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float c = error ? __fadd_rn(src[i], error[i]) : src[i];
    amax = isfinite(c) ? fmaxf(amax, fabsf(c)) : INFINITY;  // a NaN or Inf marks the block
  }
  amax = block_reduce(amax, MaxOp{}, 0.0f);
  if (isinf(amax)) {  // as the CPU reference: NaN scale, residual dropped
    if (threadIdx.x == 0) scales[b] = NAN;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      q[i] = 0;
      if (error) error[i] = 0.0f;
    }
    return;
  }
  const float scale = __fdiv_rn(amax, 127.0f);
  if (threadIdx.x == 0) scales[b] = scale;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float c = error ? __fadd_rn(src[i], error[i]) : src[i];
    int8_t v = 0;
    if (scale != 0.0f) v = static_cast<int8_t>(fminf(127.0f, fmaxf(-127.0f, roundf(__fdiv_rn(c, scale)))));
    q[i] = v;
    if (error) error[i] = __fsub_rn(c, __fmul_rn(static_cast<float>(v), scale));
  }
}

__global__ void int8_dequantize_kernel(const int8_t* __restrict__ q, const float* __restrict__ scales,
                                       float* dst, int64_t n, int64_t block, bool accumulate) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = __fmul_rn(static_cast<float>(q[i]), scales[i / block]);
    dst[i] = accumulate ? __fadd_rn(dst[i], v) : v;
  }
}

// ---- bucket pack / unpack ------------------------------------------------------------------

constexpr int kMaxListTensors = 32;  // per launch (kernel argument space)

struct TensorList {
  void* ptr[kMaxListTensors];
  int64_t count[kMaxListTensors];
  int64_t offset[kMaxListTensors];
  int32_t dtype[kMaxListTensors];
};

__global__ void pack_kernel(TensorList tl, void* wire, int32_t wire_dtype, float scale) {
  const int k = blockIdx.y;
  const int64_t count = tl.count[k], off = tl.offset[k];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x)
    d_store(wire, wire_dtype, off + i, __fmul_rn(d_load(tl.ptr[k], tl.dtype[k], i), scale));
}

__global__ void unpack_kernel(TensorList tl, const void* wire, int32_t wire_dtype, float scale,
                              bool accumulate) {
  const int k = blockIdx.y;
  const int64_t count = tl.count[k], off = tl.offset[k];
  void* p = tl.ptr[k];
  const int32_t d = tl.dtype[k];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = __fmul_rn(d_load(wire, wire_dtype, off + i), scale);
    d_store(p, d, i, accumulate ? __fadd_rn(d_load(p, d, i), v) : v);
  }
}

template <typename Desc, typename Launch>
void for_each_chunk(const Desc* descs, int64_t num, Launch launch) {
  int64_t off = 0;
  for (int64_t base = 0; base < num; base += kMaxListTensors) {
    TensorList tl{};
    const int m = static_cast<int>(std::min<int64_t>(kMaxListTensors, num - base));
    int64_t max_count = 0;
    for (int j = 0; j < m; ++j) {
      const Desc& d = descs[base + j];
      tl.ptr[j] = const_cast<void*>(static_cast<const void*>(d.ptr));
      tl.count[j] = d.count;
      tl.offset[j] = off;
      tl.dtype[j] = static_cast<int32_t>(d.dtype);
      off += d.count;
      max_count = std::max(max_count, d.count);
    }
    if (max_count > 0) launch(tl, m, max_count);
  }
}

// ---- AdamW ---------------------------------------------------------------------------------

constexpr int kMaxAdamTensors = 24;

struct AdamList {
  float* p[kMaxAdamTensors];
  const float* g[kMaxAdamTensors];
  float* m[kMaxAdamTensors];
  float* v[kMaxAdamTensors];
  uint16_t* out[kMaxAdamTensors];
  int64_t count[kMaxAdamTensors];
};

__global__ void adamw_kernel(AdamList l, AdamWScalars s) {
  const int k = blockIdx.y;
  const int64_t count = l.count[k];
  float* __restrict__ p = l.p[k];
  const float* __restrict__ g = l.g[k];
  float* __restrict__ m = l.m[k];
  float* __restrict__ v = l.v[k];
  uint16_t* out = l.out[k];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    const float gi = g[i];
    const float pi = __fmul_rn(p[i], s.decay);
    const float mi = __fadd_rn(__fmul_rn(m[i], s.beta1), __fmul_rn(s.one_minus_beta1, gi));
    const float vi = __fadd_rn(__fmul_rn(v[i], s.beta2), __fmul_rn(__fmul_rn(s.one_minus_beta2, gi), gi));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
    const float pn = __fadd_rn(pi, __fdiv_rn(__fmul_rn(s.neg_step_size, mi), denom));
    m[i] = mi;
    v[i] = vi;
    p[i] = pn;
    if (out) out[i] = d_float_to_bf16(pn);
  }
}

// ---- cross-entropy -------------------------------------------------------------------------

__global__ void ce_local_max_kernel(const float* __restrict__ logits, int64_t vocab_shard, float* local_max) {
  const float* x = logits + blockIdx.x * vocab_shard;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < vocab_shard; j += blockDim.x) mx = fmaxf(mx, x[j]);
  mx = block_reduce(mx, MaxOp{}, -INFINITY);
  if (threadIdx.x == 0) local_max[blockIdx.x] = mx;
}

__global__ void ce_local_sumexp_kernel(const float* __restrict__ logits, const int64_t* targets,
                                       int64_t vocab_shard, int64_t vocab_start,
                                       const float* global_max, float* sum_exp, float* target_logit) {
  const int64_t r = blockIdx.x;
  const float* x = logits + r * vocab_shard;
  const float mx = global_max[r];
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < vocab_shard; j += blockDim.x) s = __fadd_rn(s, expf(__fsub_rn(x[j], mx)));
  s = block_reduce(s, SumOp{}, 0.0f);
  if (threadIdx.x == 0) {
    sum_exp[r] = s;
    const int64_t t = targets[r] - vocab_start;
    target_logit[r] = (t >= 0 && t < vocab_shard) ? x[t] : 0.0f;
  }
}

__global__ void ce_loss_grad_kernel(const float* logits, const int64_t* targets, int64_t vocab_shard,
                                    int64_t vocab_start, const float* global_max,
                                    const float* global_sum_exp, const float* global_target_logit,
                                    float grad_scale, int64_t ignore_index, float* loss, float* dlogits) {
  const int64_t r = blockIdx.x;
  const bool ignored = targets[r] == ignore_index;
  const float mx = global_max[r];
  const float se = global_sum_exp[r];
  if (loss && threadIdx.x == 0)
    loss[r] = ignored ? 0.0f : __fsub_rn(__fadd_rn(logf(se), mx), global_target_logit[r]);
  if (!dlogits) return;
  const float* x = logits + r * vocab_shard;
  float* d = dlogits + r * vocab_shard;
  if (ignored) {
    for (int64_t j = threadIdx.x; j < vocab_shard; j += blockDim.x) d[j] = 0.0f;
    return;
  }
  const float inv = __fdiv_rn(1.0f, se);
  const int64_t t = targets[r] - vocab_start;
  for (int64_t j = threadIdx.x; j < vocab_shard; j += blockDim.x) {
    const float p = __fmul_rn(expf(__fsub_rn(x[j], mx)), inv);
    d[j] = __fmul_rn(j == t ? __fsub_rn(p, 1.0f) : p, grad_scale);
  }
}

}  // namespace

void int8_quantize_cuda(const float* src, float* error, int8_t* q, float* scales, int64_t n,
                        int64_t block, cudaStream_t stream) {
  const int64_t nb = int8_num_blocks(n, block);
  if (nb == 0) return;
  const int threads = block >= 256 ? 256 : block > 64 ? 128 : 64;
  int8_quantize_kernel<<<static_cast<unsigned>(nb), threads, 0, stream>>>(src, error, q, scales, n, block);
  check_launch("int8_quantize_cuda");
}

void int8_dequantize_cuda(const int8_t* q, const float* scales, float* dst, int64_t n,
                          int64_t block, bool accumulate, cudaStream_t stream) {
  if (block <= 0) throw std::invalid_argument("int8_dequantize_cuda: block must be > 0");
  if (n <= 0) return;
  int8_dequantize_kernel<<<grid_for(n), kThreads, 0, stream>>>(q, scales, dst, n, block, accumulate);
  check_launch("int8_dequantize_cuda");
}

void bucket_pack_cuda(const PackSource* srcs, int64_t num, void* wire, DType wire_dtype,
                      float scale, cudaStream_t stream) {
  for_each_chunk(srcs, num, [&](const TensorList& tl, int m, int64_t max_count) {
    pack_kernel<<<dim3(grid_for(max_count, 4096), m), kThreads, 0, stream>>>(
        tl, wire, static_cast<int32_t>(wire_dtype), scale);
    check_launch("bucket_pack_cuda");
  });
}

void bucket_unpack_cuda(const void* wire, DType wire_dtype, const UnpackDest* dsts, int64_t num,
                        float scale, bool accumulate, cudaStream_t stream) {
  for_each_chunk(dsts, num, [&](const TensorList& tl, int m, int64_t max_count) {
    unpack_kernel<<<dim3(grid_for(max_count, 4096), m), kThreads, 0, stream>>>(
        tl, wire, static_cast<int32_t>(wire_dtype), scale, accumulate);
    check_launch("bucket_unpack_cuda");
  });
}

void adamw_cuda(float* const* params, const float* const* grads, float* const* exp_avg,
                float* const* exp_avg_sq, uint16_t* const* bf16_params, const int64_t* counts,
                int64_t num, const AdamWHyper& h, cudaStream_t stream) {
  const AdamWScalars s = adamw_scalars(h);
  for (int64_t base = 0; base < num; base += kMaxAdamTensors) {
    AdamList l{};
    const int m = static_cast<int>(std::min<int64_t>(kMaxAdamTensors, num - base));
    int64_t max_count = 0;
    for (int j = 0; j < m; ++j) {
      l.p[j] = params[base + j];
      l.g[j] = grads[base + j];
      l.m[j] = exp_avg[base + j];
      l.v[j] = exp_avg_sq[base + j];
      l.out[j] = bf16_params ? bf16_params[base + j] : nullptr;
      l.count[j] = counts[base + j];
      max_count = std::max(max_count, counts[base + j]);
    }
    if (max_count == 0) continue;
    adamw_kernel<<<dim3(grid_for(max_count, 4096), m), kThreads, 0, stream>>>(l, s);
    check_launch("adamw_cuda");
  }
}

void ce_local_max_cuda(const float* logits, int64_t rows, int64_t vocab_shard, float* local_max,
                       cudaStream_t stream) {
  if (rows <= 0) return;
  ce_local_max_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, vocab_shard, local_max);
  check_launch("ce_local_max_cuda");
}

void ce_local_sumexp_cuda(const float* logits, const int64_t* targets, int64_t rows,
                          int64_t vocab_shard, int64_t vocab_start, const float* global_max,
                          float* sum_exp, float* target_logit, cudaStream_t stream) {
  if (rows <= 0) return;
  ce_local_sumexp_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      logits, targets, vocab_shard, vocab_start, global_max, sum_exp, target_logit);
  check_launch("ce_local_sumexp_cuda");
}

void ce_loss_grad_cuda(const float* logits, const int64_t* targets, int64_t rows,
                       int64_t vocab_shard, int64_t vocab_start, const float* global_max,
                       const float* global_sum_exp, const float* global_target_logit,
                       float grad_scale, int64_t ignore_index, float* loss, float* dlogits,
                       cudaStream_t stream) {
  if (rows <= 0) return;
  ce_loss_grad_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      logits, targets, vocab_shard, vocab_start, global_max, global_sum_exp, global_target_logit,
      grad_scale, ignore_index, loss, dlogits);
  check_launch("ce_loss_grad_cuda");
}

}  // namespace monarch::kernels
