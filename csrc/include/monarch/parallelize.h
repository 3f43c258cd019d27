#pragma once
// C++ frontend of parallelize: lays a LibTorch model out as a plan (or hand pins) says and
// trains it, over the same composition engine torch_monarch.parallelize uses
// (monarch/runtime/composition.h).
//
//   auto world = monarch::World::init();                       // torchrun's environment
//   auto plan = monarch::planner::load_plan("plan.json");      // or planner::search(...)
//   auto model = monarch::parallelize(gpt, plan);              // torch::nn::Sequential
//   torch::optim::AdamW opt(model->parameters(), ...);         // this rank's tensors / shards
//   double loss = model->train_step(model->local_batch(x), model->local_batch(y), loss_fn);
//
// What a C++ model offers the frontend is a chain of pieces run one after the other: the
// children of a torch::nn::Sequential, or of a TorchScript module saved from an
// nn.Sequential (a child that is itself a Sequential, such as a body of blocks, is opened);
// any other module is one piece (data parallelism and ZeRO, no pipeline cut). A model whose
// blocks sit in a torch::nn::ModuleList (which has no forward of its own) declares the loop
// its forward runs (monarch::BlockStack, chain_of_blocks) and is cut between those blocks.
// The blocks (the units pipelines are cut between and ZeRO-3 gathers one at a time) are the
// longest run of consecutive pieces of one type. Tensor parallelism (tp > 1) splits the layers
// ParallelizeOptions::tp_plan names, which must be monarch::Linear / monarch::Embedding
// (monarch/nn.h: a LibTorch module calls its children through its own members, so a child
// cannot be swapped from outside); modules implementing monarch::AttentionHeads are told
// their local head counts. Sequence parallelism and TorchScript models are not split (refused
// by name). recompute=full re-runs each block in
// backward (monarch/runtime/recompute.h); selective re-runs the attention cores the blocks
// compute with monarch::attention_core (monarch/runtime/attention.h), and refuses, at the
// first training forward, a block that computed none (its attention written inline, or a
// TorchScript block): LibTorch has no C++ hook to find the core among a block's operators.
//
// Generation (ParallelModule::generate, monarch/generate.h): a model that implements
// monarch::CachedDecoder (a forward over a KV cache) generates token by token with the
// semantics of Python's generate, laid out with tp, dp and any ZeRO stage (pp = 1).
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "monarch/generate.h"
#include "monarch/nn.h"
#include "monarch/planner/plan.h"
#include "monarch/runtime/composition.h"
#include "monarch/runtime/data_parallel.h"
#include "monarch/runtime/fully_shard.h"
#include "monarch/runtime/trace.h"
#include "monarch/runtime/world.h"

namespace torch::jit {
struct Module;
}

namespace monarch {

// One link of a chain model.
struct Piece {
  std::string name;  // prefix of its entries in the model's state dict ("0", "3")
  std::string type;  // module type (blocks are the repeated one)
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::vector<std::pair<std::string, at::Tensor>> parameters;  // full names in the model
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  // The torch::nn modules it runs, under their names in the model: what tensor parallelism
  // walks. Empty for TorchScript.
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> modules;
};

struct ChainModel {
  std::vector<Piece> pieces;
  std::function<void(bool)> set_training;  // train() / eval() on the whole model
  // Every module's training flag in a fixed order, and setting them back (generate switches
  // the model to eval for the call, then restores each module's own mode).
  std::function<std::vector<bool>()> training_modes;
  std::function<void(const std::vector<bool>&)> restore_training_modes;
  // The model's generation interface (ParallelModule::generate), when it has one: a torch::nn
  // model implementing monarch::CachedDecoder (chain_of_blocks, chain_of(module, forward)), or
  // a TorchScript chain whose blocks have forward_cached methods (chain_of(jit::Module)).
  std::shared_ptr<CachedDecoder> decoder;
  std::string decoder_missing;  // why there is none (generate's error)
};

// The children of `model` in order (nested Sequentials opened).
ChainModel chain_of(const torch::nn::Sequential& model);
// A TorchScript module whose type is a Sequential: its children in order (nested Sequentials
// opened); any other: one piece. It generates (ParallelModule::generate) when its attention
// blocks have a method
//   forward_cached(x, past_keys, past_values, allowed, positions) -> (output, keys, values)
// x [batch, tokens fed now, hidden]; past_keys / past_values what the cache holds for that block
// ([batch, kv_heads, past, head_dim], a tensor of 0 elements at the prompt); allowed
// [batch, 1, tokens fed now, past + tokens fed now] bool (KVCache::allowed); positions
// [batch, tokens fed now]; it returns its output and this forward's keys and values, which the
// cache appends. Such blocks are the cache's layers 0, 1, ... in order; the other pieces run
// their forward.
ChainModel chain_of(const torch::jit::Module& model);
// Any module with its own forward: one piece (a model implementing monarch::CachedDecoder
// generates).
ChainModel chain_of(std::shared_ptr<torch::nn::Module> model, std::function<at::Tensor(const at::Tensor&)> forward);

// A model whose blocks sit in a torch::nn::ModuleList that its own forward drives (a
// ModuleList has no forward, so the model says how it runs): pipelines cut between the
// blocks, ZeRO-3 gathers one at a time, tensor parallelism splits as in a chain. The model's
// forward must be forward_before, then forward_block for each block in order, then
// forward_after, each one tensor in and out.
class BlockStack {
 public:
  virtual ~BlockStack() = default;
  // The ModuleList child holding the blocks (its name in the model).
  virtual std::string blocks_name() const = 0;
  // The children forward_before uses (their parameters run on the first stage); every other
  // child outside the blocks belongs to forward_after (the last stage). A weight shared by
  // both sides (an output head tied to the embedding) is tied between the two stages.
  virtual std::vector<std::string> before_names() const = 0;
  virtual at::Tensor forward_before(const at::Tensor& input) = 0;
  virtual at::Tensor forward_block(int64_t index, const at::Tensor& hidden) = 0;
  virtual at::Tensor forward_after(const at::Tensor& hidden) = 0;
};
// Pieces "before", each block ("<blocks_name>.<i>"), "after". Throws naming what does not fit
// (no such ModuleList, a before name that is no child, a parameter of the model itself). A
// model that also implements monarch::CachedDecoder generates (ParallelModule::generate).
ChainModel chain_of_blocks(std::shared_ptr<torch::nn::Module> model);

// Indices (into pieces) of the blocks: the longest run of consecutive pieces of one type
// holding parameters (at least two); none when there is no such run.
std::vector<int64_t> find_blocks(const ChainModel& model);

// Every way `plan` does not describe `model` (layer count and per-layer parameter counts when
// the plan lists one layer per piece, otherwise block count and the parameter total); empty
// when it does.
std::vector<std::string> plan_differences(const planner::Plan& plan, const ChainModel& model,
                                          const std::vector<int64_t>& blocks);

// One rule of a tensor-parallel plan: modules whose full name (as in the state dict, e.g.
// "block3.q") matches `pattern` (fnmatch: `*` matches any characters, dots included) are split
// as `style`; `fused_parts` > 1 splits a fused weight part by part (q|k|v: 3). The first
// matching rule wins (Python: parallelize(tp_plan={name or glob: style})).
struct TpRule {
  std::string pattern;
  TpStyle style = TpStyle::replicate;
  int64_t fused_parts = 1;
};

struct ParallelizeOptions {
  std::shared_ptr<World> world;       // default: World::init() (torchrun's environment)
  // With tp > 1: which layers to split and how (required; a rule naming no monarch::Linear /
  // Embedding, and a plan whose tp divides no head count, are refused by name).
  std::vector<TpRule> tp_plan;
  std::vector<int64_t> blocks;        // default: find_blocks
  // Parameters of stages this rank does not run are freed (their storage emptied in the
  // model) once the layout is built.
  bool free_other_stages = true;
};

class ParallelModule {
 public:
  using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
  ParallelModule(ChainModel model, Layout layout, ParallelizeOptions options);
  ~ParallelModule();

  // What this rank's optimizer steps on: its stages' parameters, ZeRO shards in place of
  // sharded ones, each tied weight once.
  std::vector<at::Tensor> parameters() const { return optimizer_parameters_; }
  // The same under the model's names (ZeRO shards keep their parameter's name and number of
  // dimensions), for optimizer parameter groups by name or shape.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (size_t i = 0; i < optimizer_parameters_.size(); ++i) out.emplace_back(optimizer_names_[i], optimizer_parameters_[i]);
    return out;
  }
  // Forward and backward of this dp rank's batch (split into the layout's micro-batches);
  // returns the global batch's mean loss on every rank.
  double train_step(const at::Tensor& inputs, const at::Tensor& targets, const LossFn& loss_fn);
  // Without a pipeline: the model's forward on this rank's inputs (autograd as usual).
  at::Tensor forward(const at::Tensor& inputs);
  // Forward only through the pipeline; the outputs on ranks of the last stage, undefined elsewhere.
  at::Tensor predict(const at::Tensor& inputs);
  // Token-by-token generation with a KV cache (monarch/generate.h; Python's generate):
  // input_ids [batch, prompt_len] (int64 or int32; this dp rank's prompts, e.g. local_batch of
  // the global ones; the same on the tp ranks of a group, which is checked), left-padded with
  // options.attention_mask 0 on the padding. Returns [batch, prompt_len + generated] int64: the
  // prompt as given, then the new tokens (fewer than max_new_tokens when every sequence stopped
  // at EOS). Greedy or sampled (temperature, then top-k, then top-p, one generator seeded with
  // options.seed); the tp group's rank 0 chooses and broadcasts the ids; a vocabulary-split
  // head's logits are all-gathered over tp for the last position only. The model runs in eval
  // (each module's mode restored after) without autograd, from the weights training stepped.
  // Layouts: dp, tp, any ZeRO stage: every rank calls it (the dp ranks with their own prompts),
  // since ZeRO-1/2 refresh the whole parameters from the shards first and ZeRO-3 gathers every
  // unit for the call (the whole model on each rank while it generates; freed after). Refused
  // by name (std::invalid_argument): pp > 1, a model without the interface, max_new_tokens < 0,
  // a mask of another shape, bad sampling settings, a prompt plus max_new_tokens beyond the
  // model's max_positions().
  at::Tensor generate(const at::Tensor& input_ids, const GenerateOptions& options);
  // This dp rank's share (dim 0) of a global-batch tensor.
  at::Tensor local_batch(const at::Tensor& global) const { return composition_->local_batch(global); }

  // The whole model's state dict on every rank, under the model's names (loads into the
  // unwrapped model). Collective.
  std::vector<std::pair<std::string, at::Tensor>> state_dict();
  // Loads a whole-model state dict: every rank keeps its slice. Throws naming missing and
  // unexpected keys (strict) and wrong shapes.
  void load_state_dict(const std::map<std::string, at::Tensor>& state, bool strict = true);

  // Every rank's measured timeline (pipeline actions and collectives) as one Chrome trace
  // JSON file written by rank 0 (monarch/runtime/trace.h; monarch-plan report --trace draws
  // it under the plan's prediction). Collective.
  void trace(const std::string& path) { trace::save(path, mesh()); }

  // What this rank holds of every parameter (as its optimizer steps on it: a ZeRO shard, a
  // tp shard, a whole tensor) and of every buffer of its stages, each once, for checkpoints
  // (monarch/checkpoint.h).
  struct HeldTensor {
    std::string name;
    at::Tensor tensor;
    std::vector<int64_t> shape;  // the tp-local whole tensor's
    std::optional<TpSpec> tp;    // how tensor parallelism split it
    bool zero_shard = false;     // rows of dim 0 over dp, as FullyShardEngine cuts them
    bool buffer = false;
  };
  std::vector<HeldTensor> held_tensors() const;
  // A group of every rank, created the first time (collective), for the checkpoints' exchanges.
  Communicator& world_group();
  // The plan the model was laid out from (none for hand pins).
  const std::optional<planner::Plan>& plan() const { return plan_; }
  void set_plan(planner::Plan plan) { plan_ = std::move(plan); }

  const Layout& layout() const { return composition_->layout(); }
  DeviceMesh& mesh() { return composition_->mesh(); }
  Composition& composition() { return *composition_; }
  std::vector<int64_t> local_stages() const { return composition_->local_stages(); }

 private:
  struct Stage;
  std::vector<at::Tensor> run_stage(int64_t stage, const at::Tensor& input);
  std::map<std::string, at::Tensor> local_state();
  Stage& stage(int64_t s);
  // Every parameter whole on this rank until hold_parameters(false), without autograd: ZeRO-1/2
  // refresh them from the shards an optimizer step updated, ZeRO-3 gathers every unit (then
  // frees them). Collective over dp.
  void hold_parameters(bool hold);
  // The vocabulary a vocabulary-split head or embedding covers (0: none is split).
  int64_t split_vocabulary() const;

  ChainModel model_;
  std::shared_ptr<DeviceMesh> mesh_;  // outlives the engines below, which use its groups
  std::vector<std::unique_ptr<Stage>> stages_;
  std::unique_ptr<Composition> composition_;
  std::vector<at::Tensor> optimizer_parameters_;
  bool recompute_ = false;  // blocks keep only their input and re-run in backward (recompute=full)
  bool selective_ = false;  // blocks' attention cores keep q, k, v and re-run in backward (selective)
  std::vector<std::string> optimizer_names_;
  std::map<std::string, StateEntry> entries_;  // by name: tp-local shapes and splits
  std::set<const void*> zero_shards_;          // optimizer parameters that are ZeRO shards
  std::unique_ptr<DeviceMesh> world_mesh_;     // world_group()
  std::optional<planner::Plan> plan_;
};

// The plan's layout (checked against the model and the world: every difference in one
// error, before any group is created).
std::unique_ptr<ParallelModule> parallelize(ChainModel model, const planner::Plan& plan,
                                            ParallelizeOptions options = {});
// A layout by hand.
std::unique_ptr<ParallelModule> parallelize(ChainModel model, const LayoutPins& pins,
                                             ParallelizeOptions options = {});
inline std::unique_ptr<ParallelModule> parallelize(const torch::nn::Sequential& model, const planner::Plan& plan,
                                                   ParallelizeOptions options = {}) {
  return parallelize(chain_of(model), plan, std::move(options));
}
inline std::unique_ptr<ParallelModule> parallelize(const torch::nn::Sequential& model, const LayoutPins& pins,
                                                   ParallelizeOptions options = {}) {
  return parallelize(chain_of(model), pins, std::move(options));
}

}  // namespace monarch
