#pragma once
// Training loops for parity tests: the single-process reference and the distributed
// worker scenarios (run in child processes started by harness.h).
#include <torch/torch.h>

#include <string>
#include <vector>

#include "tiny_gpt.h"

namespace monarch::testing {

struct TrainOptions {
  int steps = 10;
  int64_t global_batch = 8;
  int accumulation = 1;  // micro-steps per optimizer step (no_sync on all but the last)
  double lr = 3e-3;
};

struct TrainRecord {
  std::vector<double> losses;      // global mean loss of each step
  std::vector<torch::Tensor> params;  // final parameters, module order
};

// One process, the whole global batch per step. AdamW, dropout off, fp32.
TrainRecord train_reference(const TrainOptions& options);

// Results files written by workers: rank<r>.pt holds [losses, params...].
void save_record(const TrainRecord& record, const std::string& path);
TrainRecord load_record(const std::string& path);

// Runs the worker scenario named by MONARCH_TEST_SCENARIO; returns the exit status.
int run_worker(const std::string& scenario);

}  // namespace monarch::testing
