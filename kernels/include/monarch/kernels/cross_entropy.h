#pragma once
// Vocab-parallel cross-entropy, forward and backward, over this rank's shard of the logits:
// logits [rows, vocab_shard] fp32 row-major holding global vocab ids
// [vocab_start, vocab_start + vocab_shard); targets [rows] int64 global ids (ignore_index
// rows give loss 0 and gradient 0). Torch-free. The computation is split around two
// all-reduces the caller does between the passes:
//
//   1. ce_local_max:    local_max[r] = max_j x[r, j]                 (-inf if vocab_shard == 0)
//      caller: global_max = all_reduce(local_max, MAX)
//   2. ce_local_sumexp: sum_exp[r] = sum_j exp(x[r, j] - global_max[r]);
//                       target_logit[r] = x[r, t_r - vocab_start] if t_r is in this shard,
//                       else 0
//      caller: all_reduce([sum_exp; target_logit], SUM)   (one rank holds each target)
//   3. ce_loss_grad:    loss[r] = log(sum_exp[r]) + global_max[r] - target_logit[r]
//                       dlogits[r, j] = (exp(x[r, j] - global_max[r]) / sum_exp[r]
//                                        - [vocab_start + j == t_r]) * grad_scale
//      loss and dlogits are each optional (nullptr); dlogits may equal logits (in place).
//      grad_scale is dL/dloss[r] for every row (1 / number of non-ignored rows for a mean).
#include <cstdint>

namespace monarch::kernels {

constexpr int64_t kIgnoreIndex = -100;

void ce_local_max_cpu(const float* logits, int64_t rows, int64_t vocab_shard, float* local_max);

void ce_local_sumexp_cpu(const float* logits, const int64_t* targets, int64_t rows,
                         int64_t vocab_shard, int64_t vocab_start, const float* global_max,
                         float* sum_exp, float* target_logit);

void ce_loss_grad_cpu(const float* logits, const int64_t* targets, int64_t rows,
                      int64_t vocab_shard, int64_t vocab_start, const float* global_max,
                      const float* global_sum_exp, const float* global_target_logit,
                      float grad_scale, int64_t ignore_index, float* loss, float* dlogits);

}  // namespace monarch::kernels
