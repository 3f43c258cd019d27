#pragma once
// Costs of context parallelism (docs/cost_model.md, "Context parallelism"): ring attention's
// key/value exchange, overlapped with blockwise attention.
#include <cstdint>

#include "monarch/planner/model_graph.h"
#include "monarch/planner/training_config.h"

namespace monarch::planner {

struct Layout;  // cost_model.h

// Bytes one rank sends in one ring step of `layer`'s forward for one micro-batch: its local
// keys and values, 2 x b x s/cp x kv_heads x head_dim x bytes (kv_elements_per_token holds the
// 2 kv_heads head_dim), divided by tp (heads are split over tp). Ring attention (Liu et al.
// 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"): cp - 1 such
// steps per forward; the backward sends k, v and their gradients dk, dv: twice the bytes.
// 0 without attention or with cp = 1. `seq` is the model's sequence length.
double cp_ring_step_bytes(const Layer& layer, const TrainingConfig& training, const Layout& layout, int64_t seq);

// Exposed time of a ring of `steps` steps, each sending for `comm_step_s` while it computes
// the block of attention that arrived before for `compute_step_s`: a step takes
// max(compute, comm) (no contention assumed between them), so what shows beyond the
// attention's own compute is steps x max(0, comm - compute).
double ring_exposed_seconds(int64_t steps, double comm_step_s, double compute_step_s);

}  // namespace monarch::planner
