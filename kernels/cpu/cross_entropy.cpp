#include "monarch/kernels/cross_entropy.h"

#include <cmath>
#include <limits>

namespace monarch::kernels {

void ce_local_max_cpu(const float* logits, int64_t rows, int64_t vocab_shard, float* local_max) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * vocab_shard;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < vocab_shard; ++j) mx = std::fmax(mx, x[j]);
    local_max[r] = mx;
  }
}

void ce_local_sumexp_cpu(const float* logits, const int64_t* targets, int64_t rows,
                         int64_t vocab_shard, int64_t vocab_start, const float* global_max,
                         float* sum_exp, float* target_logit) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * vocab_shard;
    const float mx = global_max[r];
    double s = 0.0;  // double accumulation: the reference for the CUDA tree sum
    for (int64_t j = 0; j < vocab_shard; ++j) s += std::exp(x[j] - mx);
    sum_exp[r] = static_cast<float>(s);
    const int64_t t = targets[r] - vocab_start;
    target_logit[r] = (t >= 0 && t < vocab_shard) ? x[t] : 0.0f;
  }
}

void ce_loss_grad_cpu(const float* logits, const int64_t* targets, int64_t rows,
                      int64_t vocab_shard, int64_t vocab_start, const float* global_max,
                      const float* global_sum_exp, const float* global_target_logit,
                      float grad_scale, int64_t ignore_index, float* loss, float* dlogits) {
  for (int64_t r = 0; r < rows; ++r) {
    const bool ignored = targets[r] == ignore_index;
    const float mx = global_max[r];
    const float se = global_sum_exp[r];
    if (loss) loss[r] = ignored ? 0.0f : std::log(se) + mx - global_target_logit[r];
    if (!dlogits) continue;
    const float* x = logits + r * vocab_shard;
    float* d = dlogits + r * vocab_shard;
    if (ignored) {
      for (int64_t j = 0; j < vocab_shard; ++j) d[j] = 0.0f;
      continue;
    }
    const float inv = 1.0f / se;
    const int64_t t = targets[r] - vocab_start;
    for (int64_t j = 0; j < vocab_shard; ++j) {
      const float p = std::exp(x[j] - mx) * inv;
      d[j] = ((j == t) ? p - 1.0f : p) * grad_scale;
    }
  }
}

}  // namespace monarch::kernels
