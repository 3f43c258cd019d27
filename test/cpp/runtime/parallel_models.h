#pragma once
// Small models for the C++ tensor- and pipeline-parallel tests, each with a single-process
// reference the test driver computes and a worker scenario run under the harness.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "training.h"

namespace monarch::testing {

// Token model: embedding -> column-parallel up (gelu) -> row-parallel down -> vocabulary
// head; trained 5 steps with SGD. Parameters in the order
// embedding, up.weight, up.bias, down.weight, down.bias, head.weight.
struct TpModelConfig {
  int64_t vocab = 32, hidden = 16, ffn = 64, batch = 4, seq = 8;
  int steps = 5;
  double lr = 0.5;
};
TrainRecord train_tp_reference(const TpModelConfig& config);
// How each reference parameter is split on rank `rank` of `size` (same order as above).
std::vector<torch::Tensor> tp_expected_shards(const TrainRecord& reference, int64_t rank, int64_t size);

// Chain of 4 Linear+tanh layers (width 8) with an MSE loss, cut into 2 pipeline stages,
// trained 4 steps with SGD over `micro_batches`.
TrainRecord train_chain_reference();

// Worker scenarios: "tp_mlp", "tp_mlp_sp", "pp_chain_<schedule>", "pp_bad_schedule".
// Returns -1 when `scenario` is not one of them.
int run_parallel_worker(const std::string& scenario, const std::string& out_path);

}  // namespace monarch::testing
