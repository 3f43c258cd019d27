#include "monarch/parallelize.h"
#include "monarch/runtime/recompute.h"

#include <ATen/core/grad_mode.h>

#include <torch/csrc/jit/api/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>

#include <fnmatch.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

namespace monarch {
namespace {

const void* id_of(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }

int64_t unique_numel(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  std::set<const void*> seen;
  int64_t n = 0;
  for (const auto& [name, t] : params) {
    if (seen.insert(id_of(t)).second) n += t.numel();
  }
  return n;
}

std::string join(const std::vector<std::string>& items) {
  std::ostringstream out;
  for (size_t i = 0; i < items.size(); ++i) out << (i ? "; " : "") << items[i];
  return out.str();
}

std::string prefixed(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : name.empty() ? prefix : prefix + "." + name;
}

// Every module's training flag, in modules()' order (the module first, then its children's
// subtrees), and setting them back in that order: train(on) sets a whole subtree, so a module
// set after its parent keeps its own flag.
void remember_modes(ChainModel& out, std::shared_ptr<torch::nn::Module> model) {
  out.training_modes = [model]() {
    std::vector<bool> modes;
    for (const auto& m : model->modules(/*include_self=*/true)) modes.push_back(m->is_training());
    return modes;
  };
  out.restore_training_modes = [model](const std::vector<bool>& modes) {
    const auto all = model->modules(/*include_self=*/true);
    TORCH_CHECK(all.size() == modes.size(), "monarch: the model has ", all.size(), " modules, ", modes.size(),
                " training flags were saved");
    for (size_t i = 0; i < all.size(); ++i) all[i]->train(modes[i]);
  };
}

// The model's CachedDecoder, or why it has none.
void remember_decoder(ChainModel& out, const std::shared_ptr<torch::nn::Module>& model, const std::string& how) {
  out.decoder = std::dynamic_pointer_cast<CachedDecoder>(model);
  if (!out.decoder) {
    out.decoder_missing = model->name() + " (read by " + how + ") does not implement monarch::CachedDecoder "
                          "(forward_cached(tokens, cache): its forward over a KV cache, monarch/generate.h)";
  }
}

}  // namespace

// ---- reading C++ models ------------------------------------------------------------------

namespace {

// Children of a Sequential as pieces; a child that is itself a Sequential (a body of blocks)
// contributes its own children, so its blocks can be cut between.
void add_sequential(ChainModel& out, torch::nn::Sequential seq, const std::string& prefix) {
  auto children = seq->named_children();
  TORCH_CHECK(static_cast<size_t>(children.size()) == seq->size(),
              "monarch: a Sequential whose registered children differ from its modules cannot be cut");
  for (size_t i = 0; i < seq->size(); ++i) {
    const auto& item = children[i];
    const std::string name = prefixed(prefix, item.key());
    if (auto inner = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(item.value())) {
      add_sequential(out, torch::nn::Sequential(inner), name);
      continue;
    }
    Piece p;
    p.name = name;
    p.type = item.value()->name();
    for (const auto& prm : item.value()->named_parameters(true)) p.parameters.emplace_back(prefixed(name, prm.key()), prm.value());
    for (const auto& buf : item.value()->named_buffers(true)) p.buffers.emplace_back(prefixed(name, buf.key()), buf.value());
    p.forward = [seq, i](const at::Tensor& x) mutable { return (seq->begin() + i)->forward<at::Tensor>(x); };
    p.modules = {{name, item.value()}};
    out.pieces.push_back(std::move(p));
  }
}

bool is_sequential(const torch::jit::Module& m) {
  const std::string type = m.type()->name() ? m.type()->name()->qualifiedName() : "";
  return type.size() >= 10 && type.compare(type.size() - 10, 10, "Sequential") == 0;
}

void add_script_module(ChainModel& out, const std::string& name, torch::jit::Module piece) {
  if (is_sequential(piece)) {
    for (const auto& child : piece.named_children()) add_script_module(out, prefixed(name, child.name), child.value);
    return;
  }
  Piece p;
  p.name = name;
  p.type = piece.type()->name() ? piece.type()->name()->qualifiedName() : "";
  for (const auto& prm : piece.named_parameters(true)) {
    prm.value.requires_grad_(true);
    p.parameters.emplace_back(prefixed(name, prm.name), prm.value);
  }
  for (const auto& buf : piece.named_buffers(true)) p.buffers.emplace_back(prefixed(name, buf.name), buf.value);
  p.forward = [piece](const at::Tensor& x) mutable { return piece.forward({x}).toTensor(); };
  out.pieces.push_back(std::move(p));
}

// The leaf pieces of a TorchScript model, in the order add_script_module lists them.
void script_pieces(std::vector<torch::jit::Module>& out, torch::jit::Module piece) {
  if (is_sequential(piece)) {
    for (const auto& child : piece.named_children()) script_pieces(out, child.value);
    return;
  }
  out.push_back(piece);
}

// A TorchScript chain whose attention blocks have a forward_cached method (parallelize.h,
// ChainModel::decoder): those run over the cache, one layer each in order; the other pieces run
// their forward.
class ScriptDecoder : public CachedDecoder {
 public:
  explicit ScriptDecoder(std::vector<torch::jit::Module> pieces) : pieces_(std::move(pieces)) {}
  at::Tensor forward_cached(const at::Tensor& tokens, KVCache& cache) override {
    at::Tensor h = tokens;
    int64_t layer = 0;
    for (auto& piece : pieces_) {
      auto method = piece.find_method("forward_cached");
      if (!method) {
        h = piece.forward({h}).toTensor();
        continue;
      }
      const int64_t past = cache.length(layer), now = h.size(1);
      const at::Tensor none = at::empty({0}, h.options());
      auto out = (*method)({h, past > 0 ? cache.keys(layer) : none, past > 0 ? cache.values(layer) : none,
                            cache.allowed(now, past + now), cache.positions});
      TORCH_CHECK(out.isTuple() && out.toTupleRef().elements().size() == 3, "monarch: generate: ",
                  piece.type()->name() ? piece.type()->name()->qualifiedName() : std::string("a block"),
                  ".forward_cached must return (output, keys, values): this forward's keys and values");
      const auto& parts = out.toTupleRef().elements();
      cache.update(layer++, parts[1].toTensor(), parts[2].toTensor());
      h = parts[0].toTensor();
    }
    return h;
  }

 private:
  std::vector<torch::jit::Module> pieces_;
};

}  // namespace

ChainModel chain_of(const torch::nn::Sequential& model) {
  ChainModel out;
  torch::nn::Sequential seq = model;  // a shared handle: the pieces keep the model alive
  add_sequential(out, seq, "");
  out.set_training = [seq](bool on) mutable { seq->train(on); };
  remember_modes(out, seq.ptr());
  out.decoder_missing = "a torch::nn::Sequential has no KV cache interface (its children run one after the other); "
                        "write the model as a module implementing monarch::CachedDecoder (forward_cached(tokens, "
                        "cache), monarch/generate.h) and read it with chain_of_blocks or chain_of(module, forward)";
  return out;
}

ChainModel chain_of(const torch::jit::Module& model) {
  ChainModel out;
  torch::jit::Module m = model;  // shares the module object
  add_script_module(out, "", m);
  out.set_training = [m](bool on) mutable { m.train(on); };
  out.training_modes = [m]() {
    std::vector<bool> modes;
    for (const auto& sub : m.modules()) modes.push_back(sub.is_training());
    return modes;
  };
  out.restore_training_modes = [m](const std::vector<bool>& modes) {
    size_t i = 0;
    for (auto sub : m.modules()) {
      TORCH_CHECK(i < modes.size(), "monarch: the TorchScript model has more modules than training flags saved");
      sub.train(modes[i++]);
    }
  };
  std::vector<torch::jit::Module> pieces;
  script_pieces(pieces, m);
  for (const auto& piece : pieces) {
    if (piece.find_method("forward_cached")) {
      out.decoder = std::make_shared<ScriptDecoder>(pieces);
      break;
    }
  }
  if (!out.decoder) {
    out.decoder_missing = "this TorchScript model has no KV cache interface: none of its pieces has a method "
                          "forward_cached(x, past_keys, past_values, allowed, positions) -> (output, keys, values) "
                          "(its attention blocks over the cache, as examples/python/export_gpt_torchscript.py "
                          "scripts them)";
  }
  return out;
}

ChainModel chain_of(std::shared_ptr<torch::nn::Module> model, std::function<at::Tensor(const at::Tensor&)> forward) {
  ChainModel out;
  Piece p;
  p.type = model->name();
  for (const auto& prm : model->named_parameters(true)) p.parameters.emplace_back(prm.key(), prm.value());
  for (const auto& buf : model->named_buffers(true)) p.buffers.emplace_back(buf.key(), buf.value());
  p.forward = std::move(forward);
  p.modules = {{"", model}};
  out.pieces.push_back(std::move(p));
  out.set_training = [model](bool on) { model->train(on); };
  remember_modes(out, model);
  remember_decoder(out, model, "chain_of(module, forward)");
  return out;
}

ChainModel chain_of_blocks(std::shared_ptr<torch::nn::Module> model) {
  auto* stack = dynamic_cast<BlockStack*>(model.get());
  TORCH_CHECK(stack != nullptr, "monarch::chain_of_blocks: ", model->name(), " does not implement monarch::BlockStack");
  TORCH_CHECK(model->named_parameters(/*recurse=*/false).is_empty(), "monarch::chain_of_blocks: ", model->name(),
              " holds parameters of its own (", model->named_parameters(false).keys(),
              "): a pipeline cannot tell which stage uses them; move them into a child module");
  const std::string blocks_name = stack->blocks_name();
  const auto children = model->named_children();
  const auto* list_entry = children.find(blocks_name);
  TORCH_CHECK(list_entry != nullptr, "monarch::chain_of_blocks: ", model->name(), " has no child '", blocks_name,
              "' (its blocks_name)");
  auto list = std::dynamic_pointer_cast<torch::nn::ModuleListImpl>(*list_entry);
  TORCH_CHECK(list != nullptr, "monarch::chain_of_blocks: ", blocks_name, " is a ", (*list_entry)->name(),
              ", not a torch::nn::ModuleList");
  std::set<std::string> before;
  for (const auto& name : stack->before_names()) {
    TORCH_CHECK(name != blocks_name && children.contains(name), "monarch::chain_of_blocks: before_names() lists '",
                name, "', which is not a child of ", model->name(), " outside the blocks");
    before.insert(name);
  }
  auto side = [&](const std::string& name, bool is_before, std::function<at::Tensor(const at::Tensor&)> forward) {
    Piece p;
    p.name = name;
    p.type = name;
    for (const auto& child : children) {
      if (child.key() == blocks_name || static_cast<bool>(before.count(child.key())) != is_before) continue;
      for (const auto& prm : child.value()->named_parameters(true)) {
        p.parameters.emplace_back(prefixed(child.key(), prm.key()), prm.value());
      }
      for (const auto& buf : child.value()->named_buffers(true)) {
        p.buffers.emplace_back(prefixed(child.key(), buf.key()), buf.value());
      }
      p.modules.emplace_back(child.key(), child.value());
    }
    p.forward = std::move(forward);
    return p;
  };
  ChainModel out;
  out.pieces.push_back(side("before", true, [model, stack](const at::Tensor& x) { return stack->forward_before(x); }));
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string name = prefixed(blocks_name, std::to_string(i));
    auto block = list->ptr(i);
    Piece p;
    p.name = name;
    p.type = block->name();
    for (const auto& prm : block->named_parameters(true)) p.parameters.emplace_back(prefixed(name, prm.key()), prm.value());
    for (const auto& buf : block->named_buffers(true)) p.buffers.emplace_back(prefixed(name, buf.key()), buf.value());
    p.modules = {{name, block}};
    const auto index = static_cast<int64_t>(i);
    p.forward = [model, stack, index](const at::Tensor& x) { return stack->forward_block(index, x); };
    out.pieces.push_back(std::move(p));
  }
  out.pieces.push_back(side("after", false, [model, stack](const at::Tensor& x) { return stack->forward_after(x); }));
  out.set_training = [model](bool on) { model->train(on); };
  remember_modes(out, model);
  remember_decoder(out, model, "chain_of_blocks");
  return out;
}

std::vector<int64_t> find_blocks(const ChainModel& model) {
  const auto& pieces = model.pieces;
  size_t best_start = 0, best_len = 0;
  for (size_t i = 0; i < pieces.size();) {
    size_t j = i;
    while (j < pieces.size() && pieces[j].type == pieces[i].type && !pieces[j].parameters.empty()) ++j;
    if (j - i > best_len) {
      best_start = i;
      best_len = j - i;
    }
    i = std::max(j, i + 1);
  }
  std::vector<int64_t> out;
  if (best_len < 2) return out;
  for (size_t k = best_start; k < best_start + best_len; ++k) out.push_back(static_cast<int64_t>(k));
  return out;
}

std::vector<std::string> plan_differences(const planner::Plan& plan, const ChainModel& model,
                                          const std::vector<int64_t>& blocks) {
  std::vector<std::string> out;
  const std::set<int64_t> is_block(blocks.begin(), blocks.end());
  if (plan.layers.size() == model.pieces.size()) {
    for (size_t i = 0; i < plan.layers.size(); ++i) {
      const auto& layer = plan.layers[i];
      const auto& piece = model.pieces[i];
      const std::string where = "layer " + std::to_string(i) + " (plan: " + layer.name + ", model: " +
                                (piece.name.empty() ? piece.type : piece.name) + ")";
      const int64_t n = unique_numel(piece.parameters);
      if (layer.params != n) {
        out.push_back(where + " has " + std::to_string(layer.params) + " parameters in the plan, " +
                      std::to_string(n) + " in the model");
      }
      const bool plan_block = layer.kind == planner::LayerKind::block;
      if (plan_block != static_cast<bool>(is_block.count(static_cast<int64_t>(i)))) {
        out.push_back(where + (plan_block ? " is a block in the plan, not in the model"
                                          : " is a block in the model, not in the plan"));
      }
    }
    return out;
  }
  int64_t plan_blocks = 0;
  for (const auto& layer : plan.layers) plan_blocks += layer.kind == planner::LayerKind::block;
  if (plan_blocks != static_cast<int64_t>(blocks.size())) {
    out.push_back("the plan has " + std::to_string(plan_blocks) + " blocks, the model " +
                  std::to_string(blocks.size()));
  }
  std::vector<std::pair<std::string, at::Tensor>> all;
  for (const auto& p : model.pieces) all.insert(all.end(), p.parameters.begin(), p.parameters.end());
  const int64_t total = unique_numel(all);
  if (plan.model_params > 0 && plan.model_params != total) {
    out.push_back("the plan is for " + std::to_string(plan.model_params) + " parameters, the model has " +
                  std::to_string(total));
  }
  return out;
}

// ---- tensor parallelism ------------------------------------------------------------------

namespace {

// A layer the tp plan splits.
struct TpTarget {
  size_t piece;
  std::string name;
  std::shared_ptr<torch::nn::Module> module;
  TpRule rule;
};

struct TpLayout {
  std::vector<TpTarget> targets;
  std::map<const void*, TpSpec> specs;                          // how each split tensor is cut
  std::vector<std::pair<std::string, AttentionHeads*>> heads;   // modules told their local heads
};

const TpRule* match_rule(const std::vector<TpRule>& plan, const std::string& name) {
  for (const auto& r : plan) {
    if (::fnmatch(r.pattern.c_str(), name.c_str(), 0) == 0) return &r;
  }
  return nullptr;
}

// What tensor parallelism splits in `model`, checked whole: every problem in one error.
TpLayout plan_tensor_parallel(const ChainModel& model, const Layout& layout, const std::vector<TpRule>& tp_plan) {
  const int64_t tp = layout.mesh.tp;
  const std::string tps = std::to_string(tp);
  TpLayout out;
  std::vector<std::string> problems;
  if (layout.sequence_parallel) {
    problems.push_back("sequence parallelism is not built in the C++ frontend (plan with sequence_parallel off)");
  }
  if (tp_plan.empty()) {
    problems.push_back("ParallelizeOptions::tp_plan is empty: name the layers to split (module name or glob -> "
                       "colwise, rowwise, vocab_embedding or vocab_head)");
  }
  std::set<const TpRule*> used;
  auto record = [&](const at::Tensor& t, TpSpec spec, const std::string& what) {
    auto [it, inserted] = out.specs.emplace(id_of(t), spec);
    if (!inserted && (it->second.dim != spec.dim || it->second.fused_parts != spec.fused_parts)) {
      problems.push_back(what + " is shared with a layer split another way (dim " + std::to_string(it->second.dim) +
                         " and dim " + std::to_string(spec.dim) + ")");
    }
  };
  auto divides = [&](int64_t n, int64_t parts, const std::string& what, const std::string& dim) {
    if (n % (tp * parts) != 0) {
      problems.push_back(what + ": " + dim + " " + std::to_string(n) + " is not divisible by tp=" + tps +
                         (parts > 1 ? " x " + std::to_string(parts) + " fused parts" : ""));
    }
  };
  for (size_t i = 0; i < model.pieces.size(); ++i) {
    const Piece& piece = model.pieces[i];
    if (piece.modules.empty()) {
      if (!piece.parameters.empty()) {
        problems.push_back((piece.name.empty() ? piece.type : piece.name) +
                           " is a TorchScript module: its layers cannot be split (script a model with tp=1, or "
                           "build it from torch::nn with monarch::Linear)");
      }
      continue;
    }
    for (const auto& [prefix, root] : piece.modules) {
      for (const auto& item : root->named_modules("", /*include_self=*/true)) {
        const std::string name = prefixed(prefix, item.key());
        if (auto* heads = dynamic_cast<AttentionHeads*>(item.value().get())) {
          const int64_t h = heads->attention_heads(), kv = heads->attention_kv_heads();
          if (h % tp != 0 || kv % tp != 0) {
            problems.push_back(name + ": " + std::to_string(h) + " attention heads and " + std::to_string(kv) +
                               " key/value heads; tp=" + tps + " must divide both");
          }
          out.heads.emplace_back(name, heads);
        }
        const TpRule* rule = match_rule(tp_plan, name);
        if (rule == nullptr) continue;
        used.insert(rule);
        if (rule->style == TpStyle::replicate) continue;
        const std::string as = " matches '" + rule->pattern + "' (" + to_string(rule->style) + ")";
        if (rule->style == TpStyle::vocab_embedding) {
          auto* embedding = dynamic_cast<EmbeddingImpl*>(item.value().get());
          if (embedding == nullptr) {
            problems.push_back(name + " (" + item.value()->name() + ")" + as + " but is not a monarch::Embedding");
            continue;
          }
          divides(embedding->options.num_embeddings(), 1, name, "the vocabulary");
          if (embedding->options.max_norm() || embedding->options.scale_grad_by_freq() || embedding->options.sparse()) {
            problems.push_back(name + " uses max_norm, scale_grad_by_freq or sparse gradients, which the "
                               "vocabulary-split lookup does not");
          }
          record(embedding->weight, {0, 1}, name + ".weight");
        } else {
          auto* linear = dynamic_cast<LinearImpl*>(item.value().get());
          if (linear == nullptr) {
            problems.push_back(name + " (" + item.value()->name() + ")" + as +
                               " but is not a monarch::Linear (a torch::nn::Linear is called through its owner's "
                               "member and cannot be redirected; declare it as monarch::Linear)");
            continue;
          }
          if (rule->style == TpStyle::rowwise) {
            if (rule->fused_parts != 1) problems.push_back(name + ": a row-split layer has no fused parts");
            divides(linear->options.in_features(), 1, name, "in_features");
            record(linear->weight, {1, 1}, name + ".weight");
          } else {
            divides(linear->options.out_features(), rule->fused_parts, name, "out_features");
            record(linear->weight, {0, rule->fused_parts}, name + ".weight");
            if (linear->bias.defined()) record(linear->bias, {0, rule->fused_parts}, name + ".bias");
          }
        }
        out.targets.push_back({i, name, item.value(), *rule});
      }
    }
  }
  for (const auto& r : tp_plan) {
    if (!used.count(&r)) problems.push_back("tp_plan rule '" + r.pattern + "' matches no module (a typo?)");
  }
  // A split tensor must be split wherever it is used: a module that reads it whole (an
  // embedding left whole beside its tied, vocab-split head) would compute with the slice.
  std::set<const torch::nn::Module*> split_modules;
  for (const auto& t : out.targets) split_modules.insert(t.module.get());
  std::set<std::string> reported;
  for (const auto& piece : model.pieces) {
    for (const auto& [prefix, root] : piece.modules) {
      for (const auto& item : root->named_modules("", /*include_self=*/true)) {
        if (split_modules.count(item.value().get())) continue;
        for (const auto& prm : item.value()->named_parameters(/*recurse=*/false)) {
          const std::string name = prefixed(prefixed(prefix, item.key()), prm.key());
          if (out.specs.count(id_of(prm.value())) && reported.insert(name).second) {
            problems.push_back(name + " is a tensor another layer splits, but " + prefixed(prefix, item.key()) +
                               " uses it whole: split it too (the same style), or neither");
          }
        }
      }
    }
  }
  if (out.targets.empty() && problems.empty()) problems.push_back("tp_plan splits no layer");
  if (!problems.empty()) {
    throw std::invalid_argument("monarch::parallelize: tensor parallelism over tp=" + tps + ": " + join(problems));
  }
  return out;
}

}  // namespace

// ---- the parallel module -----------------------------------------------------------------

struct ParallelModule::Stage {
  int64_t id = 0;
  std::vector<size_t> pieces;
  std::vector<int64_t> unit;                 // per piece: 0 (root) or its ZeRO unit
  std::vector<bool> is_block;                // per piece: a block (what recompute re-runs)
  std::vector<std::vector<at::Tensor>> block_params;  // per piece: its parameters needing gradients
  std::vector<at::Tensor> owned;             // parameters the dp wrapper handles (not tied), each once
  std::vector<at::Tensor> all;               // + tied: what ZB-H1's weight pass differentiates
  std::vector<const void*> zero_order;       // parameters in the ZeRO engine's order
  std::vector<std::string> zero_names;       // the engine's shards(), by name
  std::unique_ptr<DataParallelEngine> dp;
  std::unique_ptr<FullyShardEngine> zero;
};

ParallelModule::Stage& ParallelModule::stage(int64_t s) {
  for (auto& st : stages_) {
    if (st->id == s) return *st;
  }
  TORCH_CHECK(false, "monarch: this rank does not run stage ", s);
}

ParallelModule::ParallelModule(ChainModel model, Layout layout, ParallelizeOptions options)
    : model_(std::move(model)) {
  // The plan is the contract: a layout this frontend cannot run is refused, never ignored.
  TORCH_CHECK(layout.mesh.cp == 1 && layout.mesh.ep == 1, "monarch::parallelize: the plan's mesh ",
              planner::mesh_summary(layout.mesh),
              " uses context or expert parallelism, which the C++ frontend does not apply yet (the engine's "
              "monarch::cp::ring_attention and monarch::experts are there for a model to call; "
              "torch_monarch.parallelize applies both)");
  recompute_ = layout.recompute == planner::Recompute::full;
  selective_ = layout.recompute == planner::Recompute::selective;
  std::vector<int64_t> blocks = options.blocks.empty() ? find_blocks(model_) : options.blocks;
  TORCH_CHECK(layout.block_stage.size() == blocks.size(), "monarch::parallelize: the layout places ",
              layout.block_stage.size(), " blocks, the model has ", blocks.size());
  const int64_t num_stages = layout.num_stages();
  const auto& pieces = model_.pieces;

  // Stage of every piece: a block's from the layout; code before the first block joins
  // stage 0, anything after a block joins that block's stage (after the last: the last stage).
  std::vector<int64_t> piece_stage(pieces.size(), 0);
  std::map<int64_t, int64_t> block_index;  // piece -> block
  for (size_t b = 0; b < blocks.size(); ++b) {
    TORCH_CHECK(blocks[b] >= 0 && blocks[b] < static_cast<int64_t>(pieces.size()) && (b == 0 || blocks[b] > blocks[b - 1]),
                "monarch::parallelize: blocks must be increasing piece indices");
    block_index[blocks[b]] = static_cast<int64_t>(b);
  }
  int64_t current = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    auto it = block_index.find(static_cast<int64_t>(i));
    if (it != block_index.end()) current = layout.block_stage[it->second];
    piece_stage[i] = current;
  }
  if (!blocks.empty()) {
    for (size_t i = blocks.back() + 1; i < pieces.size(); ++i) piece_stage[i] = num_stages - 1;
  }
  TORCH_CHECK(num_stages == 1 || !blocks.empty(), "monarch::parallelize: pp > 1 needs blocks to cut between (a "
              "Sequential with repeated children)");

  // Tensor parallelism: what it splits, checked before anything changes.
  const int64_t tp = layout.mesh.tp;
  TpLayout tp_layout;
  if (tp > 1) tp_layout = plan_tensor_parallel(model_, layout, options.tp_plan);

  // Whole-model state entries: each rank's shapes (after tp), taken before anything is
  // freed or sharded.
  std::vector<StateEntry> entries;
  std::set<std::string> seen_names;
  for (size_t i = 0; i < pieces.size(); ++i) {
    auto add = [&](const std::vector<std::pair<std::string, at::Tensor>>& items) {
      for (const auto& [name, t] : items) {
        if (!seen_names.insert(name).second) continue;
        std::vector<int64_t> shape = t.sizes().vec();
        std::optional<TpSpec> spec;
        auto it = tp_layout.specs.find(id_of(t));
        if (it != tp_layout.specs.end()) {
          spec = it->second;
          shape[spec->dim] /= tp;
        }
        entries.push_back({name, shape, t.scalar_type(), piece_stage[i], spec});
      }
    };
    add(pieces[i].parameters);
    add(pieces[i].buffers);
  }

  // Weights read by several stages: only ties between the first and the last stage.
  std::map<const void*, std::set<int64_t>> users;
  std::vector<std::pair<const void*, at::Tensor>> param_order;  // first appearance, the same on every rank
  std::map<const void*, std::string> first_name;
  for (size_t i = 0; i < pieces.size(); ++i) {
    for (const auto& [name, t] : pieces[i].parameters) {
      if (!users.count(id_of(t))) {
        param_order.emplace_back(id_of(t), t);
        first_name[id_of(t)] = name;
      }
      users[id_of(t)].insert(piece_stage[i]);
    }
  }
  std::set<const void*> tied_ids;
  for (const auto& [id, stages] : users) {
    if (stages.size() < 2) continue;
    TORCH_CHECK(stages.size() == 2 && *stages.begin() == 0 && *stages.rbegin() == num_stages - 1,
                "monarch::parallelize: ", first_name[id], " is shared by stages ",
                std::vector<int64_t>(stages.begin(), stages.end()),
                "; only weights tied between the first and the last stage are supported");
    tied_ids.insert(id);
  }

  auto world = options.world ? options.world : World::init();
  auto mesh = std::make_shared<DeviceMesh>(world, layout.mesh);
  const int pp_rank = mesh->coordinate("pp");
  const int64_t dp = layout.mesh.dp;

  // Split the layers of this rank's stages in place (the tensors keep their identity: the
  // pieces' lists and weights tied between layers stay valid); the other stages' are freed
  // below. Attention modules learn their local head counts.
  if (tp > 1) {
    const auto mine = layout.stages_of(pp_rank);
    const std::set<int64_t> my_stages(mine.begin(), mine.end());
    Communicator& group = mesh->group("tp");
    for (const auto& target : tp_layout.targets) {
      if (!my_stages.count(piece_stage[target.piece])) continue;
      if (target.rule.style == TpStyle::vocab_embedding) {
        dynamic_cast<EmbeddingImpl&>(*target.module).parallelize(group, target.name);
      } else {
        dynamic_cast<LinearImpl&>(*target.module).parallelize(group, target.rule.style, target.rule.fused_parts,
                                                               target.name);
      }
    }
    for (const auto& [name, heads] : tp_layout.heads) {
      heads->set_local_heads(heads->attention_heads() / tp, heads->attention_kv_heads() / tp);
    }
  }

  std::vector<LocalStage> local;
  std::set<const void*> local_ids;
  std::vector<at::Tensor> tied_local;
  std::set<const void*> tied_local_ids;
  for (int64_t s : layout.stages_of(pp_rank)) {
    auto st = std::make_unique<Stage>();
    st->id = s;
    std::set<const void*> seen;
    int64_t units = 1;
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (piece_stage[i] != s) continue;
      st->pieces.push_back(i);
      const bool block = block_index.count(static_cast<int64_t>(i)) > 0;
      int64_t unit = 0;
      if (block && layout.zero_stage > 0 && dp > 1) unit = units++;  // ZeRO: one unit per block
      st->unit.push_back(unit);
      st->is_block.push_back(block);
      st->block_params.emplace_back();
      for (const auto& [name, t] : pieces[i].parameters) {
        if (block && t.requires_grad()) st->block_params.back().push_back(t);
        if (!seen.insert(id_of(t)).second) continue;
        local_ids.insert(id_of(t));
        st->all.push_back(t);
        if (tied_ids.count(id_of(t))) {
          if (tied_local_ids.insert(id_of(t)).second) tied_local.push_back(t);
          continue;
        }
        st->owned.push_back(t);
      }
    }
    stages_.push_back(std::move(st));
  }
  // Tied weights in first-appearance order, the same at both ends.
  std::vector<at::Tensor> tied_ordered;
  for (const auto& [id, t] : param_order) {
    if (tied_local_ids.count(id)) tied_ordered.push_back(t);
  }

  // Parameters of stages this rank does not run: freed (their shapes are in the entries).
  if (options.free_other_stages && num_stages > 1) {
    at::NoGradGuard no_grad;
    for (const auto& [id, t] : param_order) {
      if (!local_ids.count(id)) t.set_data(at::empty({0}, t.options()));
    }
  }

  // The engine first (replicas agree before ZeRO takes its shards), then data parallelism
  // wraps each local stage.
  for (auto& st : stages_) local.push_back({st->id, st->all, nullptr});
  mesh_ = mesh;
  for (const auto& e : entries) entries_[e.name] = e;
  composition_ = std::make_unique<Composition>(layout, mesh, std::move(local), std::move(entries), tied_ordered);
  for (auto& st : stages_) {
    if (dp > 1 && layout.zero_stage == 0) {
      std::vector<at::Tensor> buffers;
      for (size_t i : st->pieces) {
        for (const auto& b : pieces[i].buffers) buffers.push_back(b.second);
      }
      DataParallelOptions o;
      o.bucket_bytes = layout.bucket_bytes;
      o.hierarchical = layout.dp_reduction == planner::DpReduction::hierarchical;
      o.inter_node_compression = layout.inter_node_compression;
      st->dp = std::make_unique<DataParallelEngine>(st->owned, buffers, mesh->group("dp"), o,
                                                    o.hierarchical ? &mesh->node_groups("dp") : nullptr);
      composition_->set_data_parallel(st->id, st->dp.get());
    } else if (dp > 1) {
      std::vector<std::vector<at::Tensor>> units(1);
      // Unit 0: parameters of non-block pieces; then one unit per block, in order.
      for (size_t k = 0; k < st->pieces.size(); ++k) {
        if (st->unit[k] > 0) units.emplace_back();
      }
      // A parameter used by pieces of different units (shared between blocks) joins the root
      // unit, gathered throughout, as fully_shard does: one unit freeing it would leave the
      // other without it.
      std::map<const void*, std::set<int64_t>> units_using;
      for (size_t k = 0; k < st->pieces.size(); ++k) {
        for (const auto& [name, t] : pieces[st->pieces[k]].parameters) units_using[id_of(t)].insert(st->unit[k]);
      }
      std::set<const void*> placed;
      for (size_t k = 0; k < st->pieces.size(); ++k) {
        for (const auto& [name, t] : pieces[st->pieces[k]].parameters) {
          if (tied_ids.count(id_of(t)) || !placed.insert(id_of(t)).second) continue;
          units[units_using[id_of(t)].size() > 1 ? 0 : st->unit[k]].push_back(t);
        }
      }
      for (const auto& u : units) {
        int64_t numel = 0;
        for (const auto& t : u) numel += t.numel();
        for (const auto& t : u) st->zero_names.push_back(first_name.at(id_of(t)));  // shards()' order
        if (numel == 0) continue;  // full_parameters() skips empty units
        for (const auto& t : u) st->zero_order.push_back(id_of(t));
      }
      FullyShardOptions o;
      o.zero_stage = layout.zero_stage;
      o.overlap = layout.zero_overlap;
      o.hierarchical = layout.dp_reduction == planner::DpReduction::hierarchical;
      o.inter_node_compression = layout.inter_node_compression;
      st->zero = std::make_unique<FullyShardEngine>(units, mesh->group("dp"), o, FullyShardEngine::Materialize{},
                                                    o.hierarchical ? &mesh->node_groups("dp") : nullptr);
      composition_->set_fully_shard(st->id, st->zero.get());
    }
  }

  std::set<const void*> given;
  for (auto& st : stages_) {
    const auto params = st->zero ? st->zero->shards() : st->owned;
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& t = params[i];
      if (!given.insert(id_of(t)).second) continue;
      optimizer_parameters_.push_back(t);
      optimizer_names_.push_back(st->zero ? st->zero_names.at(i) : first_name.at(id_of(t)));
      if (st->zero) zero_shards_.insert(id_of(t));
    }
  }
  for (const auto& t : tied_ordered) {
    if (!given.insert(id_of(t)).second) continue;
    optimizer_parameters_.push_back(t);
    optimizer_names_.push_back(first_name.at(id_of(t)));
  }
}

ParallelModule::~ParallelModule() = default;

void ParallelModule::hold_parameters(bool hold) {
  TORCH_CHECK(!at::GradMode::is_enabled(), "monarch: internal: hold_parameters runs without autograd");
  for (auto& st : stages_) {
    if (!st->zero) continue;
    // Stages 1-2: unit 0's before_forward refreshes the whole parameters from the shards, the
    // others do nothing. Stage 3: each unit gathered (the next one prefetched), and without
    // autograd after_forward frees it.
    for (int64_t unit = 0; unit < st->zero->num_units(); ++unit) {
      if (hold) {
        st->zero->before_forward(unit);
      } else {
        st->zero->after_forward(unit, {});
      }
    }
  }
}

int64_t ParallelModule::split_vocabulary() const {
  int64_t vocab = 0;
  for (const auto& st : stages_) {
    for (size_t i : st->pieces) {
      for (const auto& [prefix, root] : model_.pieces[i].modules) {
        for (const auto& m : root->modules(/*include_self=*/true)) {
          if (auto* linear = dynamic_cast<const LinearImpl*>(m.get()); linear && linear->style() == TpStyle::vocab_head) {
            vocab = std::max(vocab, linear->options.out_features());
          } else if (auto* embedding = dynamic_cast<const EmbeddingImpl*>(m.get()); embedding && embedding->split()) {
            vocab = std::max(vocab, embedding->options.num_embeddings());
          }
        }
      }
    }
  }
  return vocab;
}

std::vector<at::Tensor> ParallelModule::run_stage(int64_t s, const at::Tensor& input) {
  Stage& st = stage(s);
  at::Tensor x = input;
  if (st.zero) st.zero->before_forward(0);
  for (size_t k = 0; k < st.pieces.size(); ++k) {
    const int64_t unit = st.unit[k];
    if (st.zero && unit > 0) st.zero->before_forward(unit);
    const Piece& piece = model_.pieces[st.pieces[k]];
    if (recompute_ && st.is_block[k]) {
      x = recompute_full(piece.forward, x, st.block_params[k]);
    } else if (selective_ && st.is_block[k] && at::GradMode::is_enabled()) {
      SelectiveRecompute scope;  // the block's monarch::attention_core calls recompute their core
      x = piece.forward(x);
      TORCH_CHECK(scope.cores() > 0, "monarch::parallelize: recompute=selective: block '", piece.name, "' (", piece.type,
                  ") computed its attention without monarch::attention_core, so nothing would be recomputed: the C++ "
                  "frontend cannot find an attention core among a block's operators (the Python frontend can). Compute "
                  "it with monarch::attention_core (monarch/runtime/attention.h), or plan with recompute=full or none");
    } else {
      x = piece.forward(x);
    }
    if (st.zero && unit > 0) st.zero->after_forward(unit, {x});
  }
  if (st.zero) st.zero->after_forward(0, {x});
  return {x};
}

double ParallelModule::train_step(const at::Tensor& inputs, const at::Tensor& targets, const LossFn& loss_fn) {
  auto xs = composition_->micro_batches(inputs, "inputs");
  auto ys = composition_->micro_batches(targets, "targets");
  return composition_->train_step(
      [&](int64_t s, int64_t mb, const std::vector<at::Tensor>& received) {
        if (s == 0) return run_stage(0, xs[mb]);
        TORCH_CHECK(received.size() == 1, "monarch: stage ", s, " received ", received.size(), " tensors, expected 1");
        return run_stage(s, received[0]);
      },
      [&](int64_t mb, const std::vector<at::Tensor>& outputs) { return loss_fn(outputs.at(0), ys[mb]); },
      inputs.size(0));
}

at::Tensor ParallelModule::forward(const at::Tensor& inputs) {
  TORCH_CHECK(layout().mesh.pp == 1, "monarch: a pipelined model runs through train_step() or predict(), not "
              "forward()");
  return run_stage(0, inputs)[0];
}

at::Tensor ParallelModule::predict(const at::Tensor& inputs) {
  at::NoGradGuard no_grad;
  auto xs = composition_->micro_batches(inputs, "inputs");
  const int64_t last = layout().num_stages() - 1;
  std::map<int64_t, at::Tensor> outputs;
  composition_->predict([&](int64_t s, int64_t mb, const std::vector<at::Tensor>& received) {
    auto out = run_stage(s, s == 0 ? xs[mb] : received.at(0));
    if (s == last) outputs[mb] = out[0];
    return out;
  });
  if (outputs.empty()) return {};
  std::vector<at::Tensor> parts;
  for (auto& [mb, t] : outputs) parts.push_back(t);
  return at::cat(parts, 0);
}

std::map<std::string, at::Tensor> ParallelModule::local_state() {
  std::map<std::string, at::Tensor> out;
  for (auto& st : stages_) {
    std::map<const void*, at::Tensor> gathered;
    if (st->zero) {
      auto full = st->zero->full_parameters();  // collective over dp
      TORCH_CHECK(full.size() == st->zero_order.size(), "monarch: internal: ZeRO parameter order");
      for (size_t k = 0; k < full.size(); ++k) gathered[st->zero_order[k]] = full[k];
    }
    for (size_t i : st->pieces) {
      for (const auto& [name, t] : model_.pieces[i].parameters) {
        auto it = gathered.find(id_of(t));
        out[name] = it != gathered.end() ? it->second : t.detach();
      }
      for (const auto& [name, t] : model_.pieces[i].buffers) out[name] = t.detach();
    }
  }
  return out;
}

std::vector<ParallelModule::HeldTensor> ParallelModule::held_tensors() const {
  std::vector<HeldTensor> out;
  for (size_t i = 0; i < optimizer_parameters_.size(); ++i) {
    const auto& entry = entries_.at(optimizer_names_[i]);
    const at::Tensor& t = optimizer_parameters_[i];
    out.push_back({optimizer_names_[i], t, entry.shape, entry.tp, zero_shards_.count(id_of(t)) > 0, false});
  }
  std::set<const void*> seen;
  for (const auto& st : stages_) {
    for (size_t i : st->pieces) {
      for (const auto& [name, b] : model_.pieces[i].buffers) {
        if (!seen.insert(id_of(b)).second) continue;
        const auto& entry = entries_.at(name);
        out.push_back({name, b, entry.shape, entry.tp, false, true});
      }
    }
  }
  return out;
}

Communicator& ParallelModule::world_group() {
  if (!world_mesh_) {
    planner::Mesh flat;
    flat.dp = mesh().size();
    world_mesh_ = std::make_unique<DeviceMesh>(mesh().world(), flat);
  }
  return world_mesh_->group("dp");
}

std::vector<std::pair<std::string, at::Tensor>> ParallelModule::state_dict() {
  composition_->expect_all("state_dict()");
  return composition_->full_state_dict(local_state());
}

void ParallelModule::load_state_dict(const std::map<std::string, at::Tensor>& state, bool strict) {
  std::vector<std::string> keys;
  for (const auto& [k, v] : state) keys.push_back(k);
  auto [missing, unexpected] = composition_->compare_keys(keys);
  if (strict && (!missing.empty() || !unexpected.empty())) {
    throw std::invalid_argument("monarch: load_state_dict: missing [" + join(missing) + "], unexpected [" +
                                join(unexpected) + "]");
  }
  std::vector<std::string> names;
  for (auto& st : stages_) {
    for (size_t i : st->pieces) {
      for (const auto& p : model_.pieces[i].parameters) names.push_back(p.first);
      for (const auto& b : model_.pieces[i].buffers) names.push_back(b.first);
    }
  }
  auto slices = composition_->local_slices(state, names);  // checks every shape first
  at::NoGradGuard no_grad;
  for (auto& st : stages_) {
    std::map<const void*, at::Tensor> by_id;
    for (size_t i : st->pieces) {
      for (const auto& [name, t] : model_.pieces[i].parameters) {
        auto it = slices.find(name);
        if (it != slices.end()) by_id[id_of(t)] = it->second;
      }
    }
    std::set<const void*> sharded(st->zero_order.begin(), st->zero_order.end());
    if (st->zero) {
      std::vector<at::Tensor> values;
      for (const void* id : st->zero_order) {
        auto it = by_id.find(id);
        values.push_back(it != by_id.end() ? it->second : at::Tensor());
      }
      st->zero->load_full_parameters(values);
    }
    for (size_t i : st->pieces) {
      for (const auto& [name, t] : model_.pieces[i].parameters) {
        auto it = slices.find(name);
        if (it != slices.end() && !sharded.count(id_of(t))) t.detach().copy_(it->second);
      }
      for (const auto& [name, t] : model_.pieces[i].buffers) {
        auto it = slices.find(name);
        if (it != slices.end()) t.detach().copy_(it->second);
      }
    }
  }
}

std::unique_ptr<ParallelModule> parallelize(ChainModel model, const planner::Plan& plan, ParallelizeOptions options) {
  const auto blocks = options.blocks.empty() ? find_blocks(model) : options.blocks;
  auto world = options.world ? options.world : World::init();
  options.world = world;
  std::vector<std::string> names;
  for (int64_t b : blocks) names.push_back(model.pieces.at(b).name);
  // Every difference at once, before any process group exists.
  std::vector<std::string> problems = plan_differences(plan, model, blocks), more;
  Layout layout = layout_from_plan(plan, static_cast<int64_t>(blocks.size()), world->size(), names, more);
  for (auto& p : more) {
    if (std::find(problems.begin(), problems.end(), p) == problems.end()) problems.push_back(p);
  }
  if (!problems.empty()) {
    throw std::invalid_argument("monarch::parallelize: the plan (" + plan.summary() +
                                ") does not match this model or job: " + join(problems));
  }
  auto out = std::make_unique<ParallelModule>(std::move(model), std::move(layout), options);
  out->set_plan(plan);
  return out;
}

std::unique_ptr<ParallelModule> parallelize(ChainModel model, const LayoutPins& pins, ParallelizeOptions options) {
  const auto blocks = options.blocks.empty() ? find_blocks(model) : options.blocks;
  auto world = options.world ? options.world : World::init();
  options.world = world;
  std::vector<std::string> names;
  for (int64_t b : blocks) names.push_back(model.pieces.at(b).name);
  Layout layout = layout_from_pins(pins, static_cast<int64_t>(blocks.size()), world->size(), names);
  return std::make_unique<ParallelModule>(std::move(model), std::move(layout), options);
}

}  // namespace monarch
