#pragma once
// Fused multi-tensor AdamW over fp32 shards (Loshchilov & Hutter, "Decoupled Weight Decay
// Regularization", ICLR 2019), exactly as torch.optim.AdamW with amsgrad=False,
// maximize=False. For each element, with t = step (1-based, already incremented):
//   p   = p * (1 - lr * weight_decay)
//   m   = beta1 * m + (1 - beta1) * g
//   v   = beta2 * v + (1 - beta2) * g * g
//   p   = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   bf16[i] = bf16(p)   (round to nearest even, as param.to(torch.bfloat16)), if requested
// The scalar factors are computed in double and rounded to float once, as torch does.
// Torch-free.
#include <cstdint>

namespace monarch::kernels {

struct AdamWHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
  int64_t step = 1;  // the step being taken, 1 for the first
};

// The per-step scalars (double, rounded to float once), shared by the CPU and CUDA versions.
struct AdamWScalars {
  float decay, beta1, beta2, one_minus_beta1, one_minus_beta2, neg_step_size, bc2_sqrt, eps;
};
AdamWScalars adamw_scalars(const AdamWHyper& h);

// num tensors; tensor k has counts[k] elements at params[k], grads[k], exp_avg[k],
// exp_avg_sq[k]. bf16_params may be nullptr (no copies) or hold nullptr entries.
void adamw_cpu(float* const* params, const float* const* grads, float* const* exp_avg,
               float* const* exp_avg_sq, uint16_t* const* bf16_params, const int64_t* counts,
               int64_t num, const AdamWHyper& h);

}  // namespace monarch::kernels
