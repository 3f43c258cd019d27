#pragma once
// Distributed checkpoints from C++, in the format torch_monarch.checkpoint writes and reads
// (docs/checkpoints.md): a job saved here resumes in Python and back, in any layout and at
// any world size.
//
//   auto model = monarch::parallelize(gpt, plan);
//   torch::optim::AdamW opt(model->parameters(), ...);
//   ...
//   monarch::checkpoint::save(*model, &opt, "ckpt/step_100", {100});
//   auto info = monarch::checkpoint::load(*model, &opt, "ckpt/step_100");   // any layout
//
// Save: every rank writes only the slices it holds (its stages, its tp shard, its ZeRO rows),
// each slice once over all replicas (the lowest rank holding it), to <path>.partial; rank 0
// writes index.json and renames the directory into place once every rank wrote its file (a
// checkpoint already at `path` goes to <path>.old first, then is removed): a crash at any
// moment leaves a complete checkpoint. Load: every rank reads, memory-mapped, the stored
// slices overlapping its own, checks their CRC-32C, stages everything, and only when every
// rank read all it needs overwrites parameters and optimizer state. A failure on any rank is
// one CheckpointError on every rank naming the ranks, files and tensors; nothing is replaced
// or changed. Optimizer state (torch::optim Adam, AdamW, SGD, Adagrad, RMSprop) is stored
// under the parameters' names with Python's keys: optimizer.<param>.exp_avg, ...
//
// Both are collective on a ParallelModule: every rank calls them. The overloads taking a
// torch::nn::Module are for one process (the whole model, named as in its state dict).
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace monarch {

class ParallelModule;

namespace checkpoint {

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct SaveOptions {
  int64_t step = 0;
  std::string extra_json = "null";  // JSON stored in the index and returned by load (data position, ...)
};

struct LoadOptions {
  bool strict = true;       // every parameter and buffer must be in the checkpoint
  bool restore_rng = true;  // the CPU generator's state, when the world size is the one that saved
};

struct LoadResult {
  int64_t step = 0;
  std::string extra_json = "null";
  int64_t world_size = 0;    // of the job that saved it
  std::string plan_json = "null";
  std::string path;          // the directory read (path, or path.old after an interrupted replace)
};

// Returns the checkpoint's path.
std::string save(ParallelModule& model, torch::optim::Optimizer* optimizer, const std::string& path,
                 const SaveOptions& options = {});
LoadResult load(ParallelModule& model, torch::optim::Optimizer* optimizer, const std::string& path,
                const LoadOptions& options = {});

std::string save(torch::nn::Module& model, torch::optim::Optimizer* optimizer, const std::string& path,
                 const SaveOptions& options = {});
LoadResult load(torch::nn::Module& model, torch::optim::Optimizer* optimizer, const std::string& path,
                const LoadOptions& options = {});

// The newest complete checkpoint under `root` (highest step), or "" when there is none.
std::string latest(const std::string& root);

}  // namespace checkpoint
}  // namespace monarch
