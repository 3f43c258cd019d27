// C ABI over monarch_kernels (and monarch_kernels_cuda when built with MONARCH_KERNELS_CUDA)
// for ctypes: pointers are intptr_t (tensor.data_ptr()), the stream is an intptr_t
// (torch.cuda.current_stream().cuda_stream). Lists are host arrays: pointers (intptr_t),
// counts (int64) and dtypes (int32: 0 fp32, 1 bf16). Every function returns 0, or -1 with
// the message in mk_last_error().
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "monarch/kernels/adamw.h"
#include "monarch/kernels/cross_entropy.h"
#include "monarch/kernels/pack.h"
#include "monarch/kernels/quantize.h"
#ifdef MONARCH_KERNELS_CUDA
#include "monarch/kernels/cuda.h"
#endif

namespace mk = monarch::kernels;

namespace {
thread_local std::string g_error;

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
  } catch (...) {
    g_error = "unknown error";
  }
  return -1;
}

template <typename T>
T* P(intptr_t p) {
  return reinterpret_cast<T*>(p);
}

std::vector<mk::PackSource> sources(const intptr_t* ptrs, const int64_t* counts, const int32_t* dtypes, int64_t num) {
  std::vector<mk::PackSource> v(static_cast<size_t>(num));
  for (int64_t k = 0; k < num; ++k) v[k] = {P<const void>(ptrs[k]), counts[k], static_cast<mk::DType>(dtypes[k])};
  return v;
}

std::vector<mk::UnpackDest> dests(const intptr_t* ptrs, const int64_t* counts, const int32_t* dtypes, int64_t num) {
  std::vector<mk::UnpackDest> v(static_cast<size_t>(num));
  for (int64_t k = 0; k < num; ++k) v[k] = {P<void>(ptrs[k]), counts[k], static_cast<mk::DType>(dtypes[k])};
  return v;
}

template <typename T>
std::vector<T*> ptr_list(const intptr_t* ptrs, int64_t num) {
  std::vector<T*> v(static_cast<size_t>(num), nullptr);
  if (ptrs)
    for (int64_t k = 0; k < num; ++k) v[k] = P<T>(ptrs[k]);
  return v;
}

mk::AdamWHyper hyper(float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step) {
  mk::AdamWHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.step = step;
  return h;
}
}  // namespace

// The argument lists, shared by the CPU and CUDA entry points.
#define MK_QUANT_ARGS intptr_t src, intptr_t error, intptr_t q, intptr_t scales, int64_t n, int64_t block
#define MK_QUANT_CALL P<const float>(src), P<float>(error), P<int8_t>(q), P<float>(scales), n, block
#define MK_DEQUANT_ARGS intptr_t q, intptr_t scales, intptr_t dst, int64_t n, int64_t block, int32_t accumulate
#define MK_DEQUANT_CALL P<const int8_t>(q), P<const float>(scales), P<float>(dst), n, block, accumulate != 0
#define MK_PACK_ARGS const intptr_t *ptrs, const int64_t *counts, const int32_t *dtypes, int64_t num, \
                     intptr_t wire, int32_t wire_dtype, float scale
#define MK_UNPACK_ARGS intptr_t wire, int32_t wire_dtype, const intptr_t *ptrs, const int64_t *counts, \
                       const int32_t *dtypes, int64_t num, float scale, int32_t accumulate
#define MK_ADAMW_ARGS const intptr_t *params, const intptr_t *grads, const intptr_t *exp_avg,            \
                      const intptr_t *exp_avg_sq, const intptr_t *bf16_params, const int64_t *counts, \
                      int64_t num, float lr, float beta1, float beta2, float eps, float weight_decay,    \
                      int64_t step
#define MK_ADAMW_CALL ptr_list<float>(params, num).data(), ptr_list<const float>(grads, num).data(),   \
                      ptr_list<float>(exp_avg, num).data(), ptr_list<float>(exp_avg_sq, num).data(),  \
                      bf16_params ? ptr_list<uint16_t>(bf16_params, num).data() : nullptr, counts, num, \
                      hyper(lr, beta1, beta2, eps, weight_decay, step)
#define MK_CEMAX_ARGS intptr_t logits, int64_t rows, int64_t vocab_shard, intptr_t local_max
#define MK_CEMAX_CALL P<const float>(logits), rows, vocab_shard, P<float>(local_max)
#define MK_CESUM_ARGS intptr_t logits, intptr_t targets, int64_t rows, int64_t vocab_shard, int64_t vocab_start, \
                      intptr_t global_max, intptr_t sum_exp, intptr_t target_logit
#define MK_CESUM_CALL P<const float>(logits), P<const int64_t>(targets), rows, vocab_shard, vocab_start, \
                      P<const float>(global_max), P<float>(sum_exp), P<float>(target_logit)
#define MK_CEGRAD_ARGS intptr_t logits, intptr_t targets, int64_t rows, int64_t vocab_shard, int64_t vocab_start, \
                       intptr_t global_max, intptr_t global_sum_exp, intptr_t global_target_logit,             \
                       float grad_scale, int64_t ignore_index, intptr_t loss, intptr_t dlogits
#define MK_CEGRAD_CALL P<const float>(logits), P<const int64_t>(targets), rows, vocab_shard, vocab_start,     \
                       P<const float>(global_max), P<const float>(global_sum_exp),                          \
                       P<const float>(global_target_logit), grad_scale, ignore_index, P<float>(loss), P<float>(dlogits)

extern "C" {

const char* mk_last_error() { return g_error.c_str(); }

int32_t mk_has_cuda() {
#ifdef MONARCH_KERNELS_CUDA
  return 1;
#else
  return 0;
#endif
}

int64_t mk_int8_num_blocks(int64_t n, int64_t block) {
  int64_t r = -1;
  guarded([&] { r = mk::int8_num_blocks(n, block); });
  return r;
}

int mk_int8_quantize_cpu(MK_QUANT_ARGS) { return guarded([&] { mk::int8_quantize_cpu(MK_QUANT_CALL); }); }
int mk_int8_dequantize_cpu(MK_DEQUANT_ARGS) { return guarded([&] { mk::int8_dequantize_cpu(MK_DEQUANT_CALL); }); }
int mk_bucket_pack_cpu(MK_PACK_ARGS) {
  return guarded([&] {
    auto s = sources(ptrs, counts, dtypes, num);
    mk::bucket_pack_cpu(s.data(), num, P<void>(wire), static_cast<mk::DType>(wire_dtype), scale);
  });
}
int mk_bucket_unpack_cpu(MK_UNPACK_ARGS) {
  return guarded([&] {
    auto d = dests(ptrs, counts, dtypes, num);
    mk::bucket_unpack_cpu(P<const void>(wire), static_cast<mk::DType>(wire_dtype), d.data(), num, scale, accumulate != 0);
  });
}
int mk_adamw_cpu(MK_ADAMW_ARGS) { return guarded([&] { mk::adamw_cpu(MK_ADAMW_CALL); }); }
int mk_ce_local_max_cpu(MK_CEMAX_ARGS) { return guarded([&] { mk::ce_local_max_cpu(MK_CEMAX_CALL); }); }
int mk_ce_local_sumexp_cpu(MK_CESUM_ARGS) { return guarded([&] { mk::ce_local_sumexp_cpu(MK_CESUM_CALL); }); }
int mk_ce_loss_grad_cpu(MK_CEGRAD_ARGS) { return guarded([&] { mk::ce_loss_grad_cpu(MK_CEGRAD_CALL); }); }

#ifdef MONARCH_KERNELS_CUDA
#define MK_STREAM P<CUstream_st>(stream)
int mk_int8_quantize_cuda(MK_QUANT_ARGS, intptr_t stream) {
  return guarded([&] { mk::int8_quantize_cuda(MK_QUANT_CALL, MK_STREAM); });
}
int mk_int8_dequantize_cuda(MK_DEQUANT_ARGS, intptr_t stream) {
  return guarded([&] { mk::int8_dequantize_cuda(MK_DEQUANT_CALL, MK_STREAM); });
}
int mk_bucket_pack_cuda(MK_PACK_ARGS, intptr_t stream) {
  return guarded([&] {
    auto s = sources(ptrs, counts, dtypes, num);
    mk::bucket_pack_cuda(s.data(), num, P<void>(wire), static_cast<mk::DType>(wire_dtype), scale, MK_STREAM);
  });
}
int mk_bucket_unpack_cuda(MK_UNPACK_ARGS, intptr_t stream) {
  return guarded([&] {
    auto d = dests(ptrs, counts, dtypes, num);
    mk::bucket_unpack_cuda(P<const void>(wire), static_cast<mk::DType>(wire_dtype), d.data(), num, scale,
                           accumulate != 0, MK_STREAM);
  });
}
int mk_adamw_cuda(MK_ADAMW_ARGS, intptr_t stream) {
  return guarded([&] { mk::adamw_cuda(MK_ADAMW_CALL, MK_STREAM); });
}
int mk_ce_local_max_cuda(MK_CEMAX_ARGS, intptr_t stream) {
  return guarded([&] { mk::ce_local_max_cuda(MK_CEMAX_CALL, MK_STREAM); });
}
int mk_ce_local_sumexp_cuda(MK_CESUM_ARGS, intptr_t stream) {
  return guarded([&] { mk::ce_local_sumexp_cuda(MK_CESUM_CALL, MK_STREAM); });
}
int mk_ce_loss_grad_cuda(MK_CEGRAD_ARGS, intptr_t stream) {
  return guarded([&] { mk::ce_loss_grad_cuda(MK_CEGRAD_CALL, MK_STREAM); });
}
#endif

}  // extern "C"
