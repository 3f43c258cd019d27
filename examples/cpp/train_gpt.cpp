// A small GPT written with torch::nn, planned by the planner for this job and trained over
// the ranks the launcher started, then checked against the same model trained in one
// process. Launch it as users launch jobs:
//
//   torchrun --no-python --nproc-per-node 4 build/bin/train_gpt
//   torchrun --no-python --nproc-per-node 4 build/bin/train_gpt --pp 2 --zero 3
//   torchrun --no-python --nproc-per-node 4 build/bin/train_gpt --tp 2 --pp 2
//   build/bin/train_gpt --save-plan plan.json ...   then   --plan plan.json (edited or not)
//
// Flags (an unknown one is an error): --plan FILE (use a saved plan), --save-plan FILE, --tp N, --pp N --dp N --zero S
// --micro-batch N --schedule NAME --recompute none|selective|full (pins for the planner), --steps N, --layers N,
// --hidden N, --heads N, --batch N (the global batch; a wider model on a small batch is where the planner
// picks tensor parallelism by itself: --hidden 256 --batch 4 on 4 ranks),
// --trace FILE (every rank's measured timeline as a Chrome trace: monarch-plan report --trace),
// --torchscript FILE (train a TorchScript nn.Sequential instead of the torch::nn model;
// parity is then checked against the same file trained in one process), --module-list 1 (the
// same GPT with its blocks in a torch::nn::ModuleList driven by its own forward: BlockStack),
// --save DIR --save-at N (a checkpoint after N steps, monarch/checkpoint.h, in the format Python's
// torch_monarch.checkpoint reads), --resume DIR (load one, from C++ or Python, saved in any layout,
// and go on from its step; parity is then checked on the steps this run trained).
//
// Generation (monarch/generate.h): --generate N, after the training steps (--steps 0: none),
// generates N tokens greedily from 4 fixed left-padded prompts of 5, 11, 3 and 8 tokens (each dp
// rank its share) with the GptStack model (its blocks in a ModuleList; it implements
// monarch::CachedDecoder), and rank 0 runs the same prompts, each alone, through one process
// without a cache (the whole sequence again for every token), from the same weights. Also
// --temperature T (with --top-k K --top-p P --seed S): the same prompts sampled; --eos ID:
// greedy again, each sequence stopping at ID. Without --pp the planner is pinned to pp=1
// (generate runs no pipeline). Every rank prints its rows:
//   generated prompt <i> (rank <r>): <new tokens>     (sampled ..., eos ...)
//   reference prompt <i>: <new tokens>                (rank 0, from the weights the parallel
//                                                      model holds; reference margin: the
//                                                      smallest gap between the two best logits)
//   kv cache bytes per rank: <n>
#include <torch/script.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <string>

#include "monarch/checkpoint.h"
#include "monarch/generate.h"
#include "monarch/parallelize.h"
#include "monarch/runtime/attention.h"
#include "monarch/planner/search.h"
#include "monarch/runtime/world.h"

namespace {

// AdamW with parameter groups as GPT training scripts make them: weight decay on matrices
// only, none on 1-D tensors (biases, norm weights). By name and shape, so it works the same
// on the plain model and on parallelize's parameters (ZeRO shards keep both). eps 1e-6, not
// 1e-8: Adam's first steps move an element by about lr * g / (|g| + eps), so with 1e-8 an
// element whose gradient is below fp32 summation noise (a unit GELU has switched off) moves by
// a noise-decided fraction of lr, and parity of the parameters would measure that noise
// (measured at --hidden 256, tp 2: 1.9e-3 with 1e-8, 1.3e-4 with 1e-6; losses 2e-7 either way).
torch::optim::AdamW make_optimizer(const std::vector<std::pair<std::string, at::Tensor>>& named, double lr) {
  std::vector<at::Tensor> decay, flat;
  for (const auto& [name, t] : named) (t.dim() < 2 || name.find("bias") != std::string::npos ? flat : decay).push_back(t);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decay.empty()) groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(lr).weight_decay(0.05).eps(1e-6)));
  if (!flat.empty()) groups.emplace_back(flat, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(lr).weight_decay(0.0).eps(1e-6)));
  return torch::optim::AdamW(groups, torch::optim::AdamWOptions(lr));
}

struct Config {
  int64_t vocab = 64, hidden = 32, heads = 4, layers = 4, seq = 16, global_batch = 16, steps = 5;
  double lr = 1e-2;
  // None: parity is checked against one process, which splits the batch otherwise and so draws
  // other dropout masks (recompute's dropout masks are tested in test_recompute.cpp).
  double dropout = 0.0;
};

// Pre-norm decoder block with the parameters planner::build_transformer counts: q, k, v and
// output projections and a 4h MLP without biases, two layer norms. Its linears are
// monarch::Linear (torch::nn::Linear until tensor parallelism splits them, kTpPlan), and it
// reports its heads (monarch::AttentionHeads) so a split block computes its share of them.
struct BlockImpl : torch::nn::Module, monarch::AttentionHeads {
  BlockImpl(int64_t h, int64_t heads, double dropout) : heads(heads), head_dim(h / heads), dropout(dropout) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({h})));
    q = register_module("q", monarch::Linear(h, h, /*bias=*/false));
    k = register_module("k", monarch::Linear(h, h, false));
    v = register_module("v", monarch::Linear(h, h, false));
    o = register_module("o", monarch::Linear(h, h, false));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({h})));
    up = register_module("up", monarch::Linear(h, 4 * h, false));
    down = register_module("down", monarch::Linear(4 * h, h, false));
  }
  int64_t attention_heads() const override { return total_heads; }
  void set_local_heads(int64_t local, int64_t) override { heads = local; }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), s = x.size(1), d = head_dim;
    auto y = ln1(x);
    auto split = [&](const torch::Tensor& t) { return t.view({b, s, heads, d}).transpose(1, 2); };
    auto qh = split(q(y)), kh = split(k(y)), vh = split(v(y));
    // The core through monarch::attention_core: what recompute=selective re-runs in backward.
    monarch::AttentionOptions core;
    core.causal = true;
    core.dropout = dropout;
    core.training = is_training();
    auto attn = monarch::attention_core(qh, kh, vh, core).transpose(1, 2).reshape({b, s, heads * d});
    auto x1 = x + o(attn);
    return x1 + down(torch::gelu(up(ln2(x1))));
  }
  // The same block over a KV cache (generation): this call's keys and values are appended to
  // layer `layer`'s, and the queries attend to every cached token they may see (causal, not the
  // left padding). This model has no position embedding (its order comes from the causal mask
  // alone), so cache.positions is unused.
  torch::Tensor forward_cached(const torch::Tensor& x, monarch::KVCache& cache, int64_t layer) {
    const int64_t b = x.size(0), s = x.size(1), d = head_dim;
    auto y = ln1(x);
    auto split = [&](const torch::Tensor& t) { return t.view({b, s, heads, d}).transpose(1, 2); };
    monarch::AttentionOptions core;
    core.training = false;
    auto attn = cache.attend(layer, split(q(y)), split(k(y)), split(v(y)), core).transpose(1, 2).reshape({b, s, heads * d});
    auto x1 = x + o(attn);
    return x1 + down(torch::gelu(up(ln2(x1))));
  }
  int64_t heads;  // this rank's (all of them until tensor parallelism splits the block)
  const int64_t total_heads = heads, head_dim;
  double dropout;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  monarch::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, up{nullptr}, down{nullptr};
};
TORCH_MODULE(Block);

// Megatron's split of this model (Python: parallelize(tp_plan=...)): attention and MLP inputs
// by column, their outputs by row, the vocabulary of the embedding and of the output head
// tied to it.
const std::vector<monarch::TpRule> kTpPlan = {
    {"*.q", monarch::TpStyle::colwise},        {"*.k", monarch::TpStyle::colwise},
    {"*.v", monarch::TpStyle::colwise},        {"*.o", monarch::TpStyle::rowwise},
    {"*.up", monarch::TpStyle::colwise},       {"*.down", monarch::TpStyle::rowwise},
    {"embedding", monarch::TpStyle::vocab_embedding}, {"lm_head", monarch::TpStyle::vocab_head}};

torch::nn::Sequential make_gpt(const Config& c) {
  torch::manual_seed(1234);  // every rank and the reference build the same weights
  torch::nn::Sequential gpt;
  monarch::Embedding embedding(c.vocab, c.hidden);
  {
    torch::NoGradGuard no_grad;
    embedding->weight.normal_(0, 0.02);  // GPT-2's initialization: logits start near uniform
  }
  gpt->push_back("embedding", embedding);
  for (int64_t i = 0; i < c.layers; ++i) gpt->push_back("block" + std::to_string(i), Block(c.hidden, c.heads, c.dropout));
  gpt->push_back("final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden})));
  gpt->push_back("lm_head", monarch::Linear(embedding->weight));  // tied to the embedding (GPT-2 style)
  return gpt;
}

// The same GPT written the other common way: its blocks in a torch::nn::ModuleList that its own
// forward loops over. It declares that loop (monarch::BlockStack) so pipelines can cut it; the
// weights and their initialization are make_gpt's, under the names embedding.*, blocks.<i>.*,
// final_norm.*, lm_head.*. It also generates (monarch::CachedDecoder): its forward over a KV
// cache runs the same layers, the head on the last position only (all generate reads).
struct GptStackImpl : torch::nn::Module, monarch::BlockStack, monarch::CachedDecoder {
  explicit GptStackImpl(const Config& c) {
    torch::manual_seed(1234);
    embedding = register_module("embedding", monarch::Embedding(c.vocab, c.hidden));
    {
      torch::NoGradGuard no_grad;
      embedding->weight.normal_(0, 0.02);
    }
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(Block(c.hidden, c.heads, c.dropout));
    final_norm = register_module("final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden})));
    lm_head = register_module("lm_head", monarch::Linear(embedding->weight));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto h = forward_before(tokens);
    for (size_t i = 0; i < blocks->size(); ++i) h = forward_block(static_cast<int64_t>(i), h);
    return forward_after(h);
  }
  std::string blocks_name() const override { return "blocks"; }
  std::vector<std::string> before_names() const override { return {"embedding"}; }
  torch::Tensor forward_before(const torch::Tensor& tokens) override { return embedding(tokens); }
  torch::Tensor forward_block(int64_t i, const torch::Tensor& h) override { return blocks[i]->as<Block>()->forward(h); }
  torch::Tensor forward_after(const torch::Tensor& h) override { return lm_head(final_norm(h)); }
  torch::Tensor forward_cached(const torch::Tensor& tokens, monarch::KVCache& cache) override {
    auto h = embedding(tokens);
    for (size_t i = 0; i < blocks->size(); ++i) {
      h = blocks[i]->as<Block>()->forward_cached(h, cache, static_cast<int64_t>(i));
    }
    return lm_head(final_norm(h.narrow(1, h.size(1) - 1, 1)));  // [batch, 1, vocab] (vocab / tp split)
  }

  monarch::Embedding embedding{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm final_norm{nullptr};
  monarch::Linear lm_head{nullptr};
};
TORCH_MODULE(GptStack);

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape(-1));
}

// The global batch of step `step`: one of two fixed batches of random tokens (learnable by
// heart, so the loss falls), targets the next token.
std::pair<torch::Tensor, torch::Tensor> batch(const Config& c, int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step % 2);
  auto tokens = torch::randint(c.vocab, {c.global_batch, c.seq + 1}, gen, torch::kLong);
  return {tokens.narrow(1, 0, c.seq).contiguous(), tokens.narrow(1, 1, c.seq).contiguous()};
}

// The prompts --generate runs: 4 of 5, 11, 3 and 8 random tokens, left-padded to 11 (token 0
// under mask 0), and each prompt alone.
struct Prompts {
  torch::Tensor ids, mask;
  std::vector<torch::Tensor> alone;
};
Prompts make_prompts(const Config& c) {
  const std::vector<int64_t> lengths = {5, 11, 3, 8};
  const int64_t longest = 11;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
  Prompts p{torch::zeros({4, longest}, torch::kLong), torch::zeros({4, longest}, torch::kLong), {}};
  for (size_t i = 0; i < lengths.size(); ++i) {
    auto tokens = torch::randint(c.vocab, {lengths[i]}, gen, torch::kLong);
    const auto row = static_cast<int64_t>(i);
    p.ids[row].narrow(0, longest - lengths[i], lengths[i]).copy_(tokens);
    p.mask[row].narrow(0, longest - lengths[i], lengths[i]).fill_(1);
    p.alone.push_back(tokens);
  }
  return p;
}

// Greedy decoding without a cache, one prompt alone: the whole sequence through the model's
// pieces (its training forward) for every token. `margin`: the smallest gap seen between the
// two best logits (how far the choices were from a tie).
std::vector<int64_t> greedy_without_cache(monarch::ChainModel& model, const torch::Tensor& prompt, int64_t n,
                                          double& margin) {
  torch::NoGradGuard no_grad;
  auto sequence = prompt.unsqueeze(0);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    torch::Tensor x = sequence;
    for (auto& p : model.pieces) x = p.forward(x);
    auto last = x[0][x.size(1) - 1];
    auto best = std::get<0>(last.topk(2));
    margin = std::min(margin, (best[0] - best[1]).item<double>());
    const int64_t token = last.argmax().item<int64_t>();
    out.push_back(token);
    sequence = torch::cat({sequence, torch::full({1, 1}, token, torch::kLong)}, 1);
  }
  return out;
}

std::string joined(const std::vector<int64_t>& tokens) {
  std::string out;
  for (int64_t t : tokens) out += " " + std::to_string(t);
  return out;
}

std::string arg(std::map<std::string, std::string>& args, const std::string& key, const std::string& fallback = "") {
  auto it = args.find(key);
  return it == args.end() ? fallback : it->second;
}

// A flag's integer value; an error naming the flag when it is not one.
int64_t int_arg(std::map<std::string, std::string>& args, const std::string& key, const std::string& fallback) {
  const std::string text = arg(args, key, fallback);
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) {
    throw std::invalid_argument("train_gpt: --" + key + " takes an integer, got '" + text + "'");
  }
  return value;
}

// A flag's number; an error naming the flag when it is not one.
double double_arg(std::map<std::string, std::string>& args, const std::string& key, const std::string& fallback) {
  const std::string text = arg(args, key, fallback);
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) {
    throw std::invalid_argument("train_gpt: --" + key + " takes a number, got '" + text + "'");
  }
  return value;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

const std::set<std::string> kFlags = {"plan", "save-plan", "tp", "pp", "dp", "zero", "micro-batch", "schedule",
                                      "recompute", "steps", "layers", "hidden", "heads", "batch", "trace",
                                      "torchscript", "module-list",
                                      "save", "save-at", "resume",
                                      "generate", "temperature", "top-k", "top-p", "seed", "eos"};

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string key = argv[i];
    if (key.rfind("--", 0) != 0) {
      std::cerr << "train_gpt: unexpected argument " << key << " (flags are --name value)\n";
      return 2;
    }
    args[key.substr(2)] = argv[i + 1];
  }
  if (argc % 2 == 0) {
    std::cerr << "train_gpt: flag " << argv[argc - 1] << " has no value\n";
    return 2;
  }
  // An unknown flag is an error, not ignored (a mistyped pin would run another layout).
  for (const auto& [key, value] : args) {
    if (kFlags.count(key) == 0) {
      std::cerr << "train_gpt: unknown flag --" << key << " (known:";
      for (const auto& f : kFlags) std::cerr << " --" << f;
      std::cerr << ")\n";
      return 2;
    }
  }
  Config c;
  try {
    c.steps = int_arg(args, "steps", "5");
    c.layers = int_arg(args, "layers", "4");
    c.hidden = int_arg(args, "hidden", std::to_string(c.hidden));
    c.heads = int_arg(args, "heads", std::to_string(c.heads));
    c.global_batch = int_arg(args, "batch", std::to_string(c.global_batch));
    // Adam's step is about lr per element whatever the width; a wider model takes a smaller one
    // (lr ~ 1 / width, as muP prescribes for hidden matrices) or its loss jumps around.
    c.lr *= std::min(1.0, 32.0 / static_cast<double>(c.hidden));
    if (c.hidden <= 0 || c.heads <= 0 || c.hidden % c.heads != 0 || c.global_batch <= 0 || c.layers <= 0) {
      throw std::invalid_argument("train_gpt: --hidden must be a positive multiple of --heads, --batch and --layers "
                                  "positive");
    }
    for (const char* key : {"tp", "pp", "dp", "zero", "micro-batch", "save-at", "generate", "top-k", "seed", "eos"}) {
      if (!arg(args, key).empty()) int_arg(args, key, "");
    }
    for (const char* key : {"temperature", "top-p"}) {
      if (!arg(args, key).empty()) double_arg(args, key, "");
    }
  } catch (const std::invalid_argument& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  const std::string torchscript = arg(args, "torchscript");
  const int64_t new_tokens = arg(args, "generate").empty() ? -1 : int_arg(args, "generate", "");
  // Generation runs the GptStack model (a monarch::CachedDecoder) unless told otherwise.
  const bool module_list = arg(args, "module-list", new_tokens >= 0 && torchscript.empty() ? "1" : "0") == "1";

  try {
    auto world = monarch::World::init();
    const bool lead = world->rank() == 0;
    auto build = [&]() -> monarch::ChainModel {
      if (module_list) return monarch::chain_of_blocks(GptStack(c).ptr());
      if (torchscript.empty()) return monarch::chain_of(make_gpt(c));
      auto m = torch::jit::load(torchscript);
      m.train();
      return monarch::chain_of(m);
    };

    // The plan: loaded, or made here by the planner for this model and this job.
    monarch::planner::Plan plan;
    if (!arg(args, "plan").empty()) {
      plan = monarch::planner::load_plan(arg(args, "plan"));
    } else {
      monarch::planner::TransformerConfig tc;
      tc.name = "cpp-gpt";
      tc.layers = c.layers;
      tc.hidden = c.hidden;
      tc.heads = c.heads;
      tc.seq = c.seq;
      tc.vocab = c.vocab;
      tc.tied_embeddings = torchscript.empty();  // the TorchScript model's head is its own
      tc.attention = monarch::planner::AttentionKernel::materialized;  // scores are kept (no fused kernel)
      tc.dtype = monarch::planner::DType::fp32;
      auto graph = monarch::planner::build_transformer(tc);
      monarch::planner::restrict_cuts_to_blocks(graph);
      monarch::planner::TrainingConfig training;
      training.global_batch = c.global_batch;
      training.compute_dtype = monarch::planner::DType::fp32;
      training.param_bytes = training.grad_bytes = training.activation_bytes = 4;
      training.optimizer_bytes = 8;  // Adam's two fp32 moments
      // A TorchScript model's layers cannot be split (parallelize refuses tp > 1 for it).
      training.allow_tensor_parallel = torchscript.empty();
      // Selective re-runs the cores computed with monarch::attention_core, which this model's
      // blocks use; a TorchScript model's blocks compute theirs inline (selective is refused).
      training.recompute_modes = {monarch::planner::Recompute::none, monarch::planner::Recompute::full};
      if (torchscript.empty()) training.recompute_modes.push_back(monarch::planner::Recompute::selective);
      training.allow_sequence_parallel = false;
      monarch::planner::SearchOptions options;
      auto& pins = options.pins;
      if (!arg(args, "tp").empty()) pins.tp = int_arg(args, "tp", "");
      if (!arg(args, "pp").empty()) pins.pp = int_arg(args, "pp", "");
      if (new_tokens >= 0 && arg(args, "pp").empty()) pins.pp = 1;  // generate runs no pipeline
      if (!arg(args, "dp").empty()) pins.dp = int_arg(args, "dp", "");
      if (!arg(args, "zero").empty()) pins.zero_stage = int_arg(args, "zero", "");
      if (!arg(args, "micro-batch").empty()) pins.micro_batch_size = int_arg(args, "micro-batch", "");
      if (!arg(args, "recompute").empty()) pins.recompute = monarch::planner::recompute_from_string(arg(args, "recompute"));
      if (!arg(args, "schedule").empty()) pins.schedule = monarch::planner::schedule_from_string(arg(args, "schedule"));
      plan = monarch::planner::search(graph, monarch::planner::cluster_preset("cpu", world->size()), training,
                                      options);
    }
    if (lead) std::cout << "plan: " << plan.summary() << "\n";
    if (lead && !arg(args, "save-plan").empty()) monarch::planner::save_plan(plan, arg(args, "save-plan"));

    monarch::ParallelizeOptions popts;
    popts.world = world;
    if (plan.mesh.tp > 1) popts.tp_plan = kTpPlan;
    auto model = monarch::parallelize(build(), plan, popts);
    auto opt = make_optimizer(model->named_parameters(), c.lr);
    // Resuming: parameters, AdamW's moments and step counts, learning rates, from a checkpoint
    // any layout wrote (C++ or Python); training goes on from the step it saved.
    int64_t first = 0;
    if (!arg(args, "resume").empty()) {
      auto info = monarch::checkpoint::load(*model, &opt, arg(args, "resume"));
      first = info.step;
      if (lead) {
        std::printf("resumed from %s at step %lld (saved by %lld ranks)\n", info.path.c_str(),
                    static_cast<long long>(first), static_cast<long long>(info.world_size));
      }
    }
    const std::string save_dir = arg(args, "save");
    const int64_t save_at = save_dir.empty() ? -1 : int_arg(args, "save-at", std::to_string(c.steps));
    std::vector<double> losses;
    for (int64_t step = first; step < c.steps; ++step) {
      auto [x, y] = batch(c, step);
      opt.zero_grad();
      const double loss = model->train_step(model->local_batch(x), model->local_batch(y), lm_loss);
      opt.step();
      losses.push_back(loss);
      if (lead) std::printf("step %lld  loss %.6f\n", static_cast<long long>(step), loss);
      if (step + 1 == save_at) {
        monarch::checkpoint::SaveOptions so;
        so.step = step + 1;
        monarch::checkpoint::save(*model, &opt, save_dir, so);  // collective
        if (lead) std::printf("saved %s at step %lld\n", save_dir.c_str(), static_cast<long long>(step + 1));
      }
    }
    // Bytes this rank sent along dp per step (gradient reduction, ZeRO gathers).
    const double dp_bytes =
        model->mesh().group("dp").counters().total() / static_cast<double>(std::max<int64_t>(1, c.steps - first));
    if (lead) std::printf("dp bytes per step: %.0f\n", dp_bytes);
    if (!arg(args, "trace").empty()) model->trace(arg(args, "trace"));  // collective: rank 0 writes it

    // Generation from the weights training stepped: each dp rank its share of the prompts.
    const Prompts prompts = make_prompts(c);
    if (new_tokens >= 0) {
      const auto ids = model->local_batch(prompts.ids), mask = model->local_batch(prompts.mask);
      const int64_t first_row = model->mesh().coordinate("dp") * ids.size(0), prompt_len = ids.size(1);
      auto run = [&](const std::string& what, monarch::GenerateOptions g) {
        g.max_new_tokens = new_tokens;
        g.attention_mask = mask;
        monarch::KVCache cache;
        g.cache = &cache;
        const auto start = std::chrono::steady_clock::now();
        const auto out = model->generate(ids, g);
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        for (int64_t i = 0; i < out.size(0); ++i) {
          const auto row = out[i].narrow(0, prompt_len, out.size(1) - prompt_len).contiguous();
          const std::vector<int64_t> tokens(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
          std::cout << (what + " prompt " + std::to_string(first_row + i) + " (rank " + std::to_string(world->rank()) +
                        "):" + joined(tokens) + "\n")
                    << std::flush;
        }
        if (lead) {
          std::printf("%s: %lld new tokens x %lld prompts in %.3f s\n", what.c_str(),
                      static_cast<long long>(out.size(1) - prompt_len), static_cast<long long>(out.size(0)), seconds);
        }
        return cache.bytes();
      };
      const int64_t bytes = run("generated", {});
      if (lead) std::printf("kv cache bytes per rank: %lld\n", static_cast<long long>(bytes));
      if (!arg(args, "temperature").empty()) {
        monarch::GenerateOptions g;
        g.temperature = double_arg(args, "temperature", "");
        if (!arg(args, "top-k").empty()) g.top_k = int_arg(args, "top-k", "");
        if (!arg(args, "top-p").empty()) g.top_p = double_arg(args, "top-p", "");
        g.seed = static_cast<uint64_t>(int_arg(args, "seed", "0"));
        run("sampled", g);
      }
      if (!arg(args, "eos").empty()) {
        monarch::GenerateOptions g;
        g.eos_token_ids = {int_arg(args, "eos", "")};
        run("eos", g);
      }
    }
    auto trained = model->state_dict();  // collective: the whole model on every rank

    // The same model, data and optimizer in one process (rank 0).
    int status = 0;
    if (lead) {
      auto reference = build();
      std::vector<std::pair<std::string, at::Tensor>> params;
      std::set<const void*> seen;
      for (auto& p : reference.pieces) {
        for (auto& [name, t] : p.parameters) {
          if (seen.insert(t.unsafeGetTensorImpl()).second) params.emplace_back(name, t);
        }
      }
      auto ref_opt = make_optimizer(params, c.lr);
      double worst_loss = 0, worst_param = 0;
      std::string worst_name;
      for (int64_t step = 0; step < c.steps; ++step) {
        auto [x, y] = batch(c, step);
        ref_opt.zero_grad();
        at::Tensor out = x;
        for (auto& p : reference.pieces) out = p.forward(out);
        auto loss = lm_loss(out, y);
        loss.backward();
        ref_opt.step();
        if (step >= first) worst_loss = std::max(worst_loss, rel(losses[step - first], loss.item<double>()));
      }
      std::map<std::string, at::Tensor> expected;
      for (auto& p : reference.pieces) {
        for (auto& [name, t] : p.parameters) expected[name] = t.detach();
      }
      for (auto& [name, t] : trained) {
        auto it = expected.find(name);
        if (it == expected.end()) continue;  // buffers
        const double diff = (t - it->second).abs().max().item<double>();
        const double scale = it->second.abs().max().item<double>();
        if (diff / std::max(scale, 1e-12) > worst_param) {
          worst_param = diff / std::max(scale, 1e-12);
          worst_name = name;
        }
      }
      // fp32 sums in another order (micro-batches, all-reduce): agreement to ~1e-6 relative;
      // Adam amplifies tiny gradient differences a little over the steps.
      const bool ok = worst_loss < 1e-4 && worst_param < 1e-3 && trained.size() >= expected.size();
      std::printf("parity with 1 process (%s, %lld steps): %s, worst relative difference %.2e (losses), "
                  "%.2e (parameters, %s)\n",
                  model->layout().summary().c_str(), static_cast<long long>(c.steps - first), ok ? "ok" : "FAILED",
                  worst_loss, worst_param, worst_name.c_str());
      status = ok ? 0 : 1;
      // The prompts generated above, each alone, through one process without a cache: the
      // model built again with the weights the parallel model generated from (its state dict),
      // so the comparison does not depend on how closely the two trainings agree.
      if (new_tokens >= 0) {
        auto alone = build();
        std::map<std::string, at::Tensor> weights(trained.begin(), trained.end());
        torch::NoGradGuard no_grad;
        for (auto& p : alone.pieces) {
          for (auto& [name, t] : p.parameters) t.copy_(weights.at(name));
          for (auto& [name, t] : p.buffers) t.copy_(weights.at(name));
        }
        alone.set_training(false);
        double margin = std::numeric_limits<double>::infinity();
        for (size_t i = 0; i < prompts.alone.size(); ++i) {
          std::printf("reference prompt %zu:%s\n", i,
                      joined(greedy_without_cache(alone, prompts.alone[i], new_tokens, margin)).c_str());
        }
        std::printf("reference margin: %.3g\n", margin);
      }
    }
    return status;
  } catch (const std::exception& e) {
    // One write per line: the ranks share the launcher's stderr, and pieces written apart interleave.
    std::cerr << (std::string("train_gpt: ") + e.what() + "\n") << std::flush;
    return 1;
  }
}
