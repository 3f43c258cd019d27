#pragma once
// The CUDA kernels (target monarch_kernels_cuda, built when MONARCH_HAVE_CUDA). Same
// arguments and results as the CPU references in quantize.h, pack.h, adamw.h and
// cross_entropy.h, on device pointers, enqueued on `stream` (asynchronous; host-side arrays
// of pointers/counts are read before the call returns). Launch errors throw
// std::runtime_error. Including this header does not need cuda_runtime.h: cudaStream_t is
// declared here exactly as the CUDA headers declare it.
#include <cstdint>

#include "monarch/kernels/adamw.h"
#include "monarch/kernels/cross_entropy.h"
#include "monarch/kernels/pack.h"
#include "monarch/kernels/quantize.h"

typedef struct CUstream_st* cudaStream_t;

namespace monarch::kernels {

void int8_quantize_cuda(const float* src, float* error, int8_t* q, float* scales, int64_t n,
                        int64_t block, cudaStream_t stream);
void int8_dequantize_cuda(const int8_t* q, const float* scales, float* dst, int64_t n,
                          int64_t block, bool accumulate, cudaStream_t stream);

void bucket_pack_cuda(const PackSource* srcs, int64_t num, void* wire, DType wire_dtype,
                      float scale, cudaStream_t stream);
void bucket_unpack_cuda(const void* wire, DType wire_dtype, const UnpackDest* dsts, int64_t num,
                        float scale, bool accumulate, cudaStream_t stream);

void adamw_cuda(float* const* params, const float* const* grads, float* const* exp_avg,
                float* const* exp_avg_sq, uint16_t* const* bf16_params, const int64_t* counts,
                int64_t num, const AdamWHyper& h, cudaStream_t stream);

void ce_local_max_cuda(const float* logits, int64_t rows, int64_t vocab_shard, float* local_max,
                       cudaStream_t stream);
void ce_local_sumexp_cuda(const float* logits, const int64_t* targets, int64_t rows,
                          int64_t vocab_shard, int64_t vocab_start, const float* global_max,
                          float* sum_exp, float* target_logit, cudaStream_t stream);
void ce_loss_grad_cuda(const float* logits, const int64_t* targets, int64_t rows,
                       int64_t vocab_shard, int64_t vocab_start, const float* global_max,
                       const float* global_sum_exp, const float* global_target_logit,
                       float grad_scale, int64_t ignore_index, float* loss, float* dlogits,
                       cudaStream_t stream);

}  // namespace monarch::kernels
