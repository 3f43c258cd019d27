// Token-by-token generation for the C++ frontend (monarch/generate.h): the KV cache, the
// sampling warpers and ParallelModule::generate, with the semantics of torch_monarch/generate.py.
#include "monarch/generate.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>

#include "monarch/nn.h"
#include "monarch/parallelize.h"

namespace monarch {

// ---- KVCache -------------------------------------------------------------------------------

namespace {

std::string shape_of(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

}  // namespace

std::pair<at::Tensor, at::Tensor> KVCache::update(int64_t layer, const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(layer >= 0, "monarch::KVCache: layer ", layer, " is negative");
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && keys.size(0) == values.size(0) &&
                  keys.size(1) == values.size(1) && keys.size(2) == values.size(2),
              "monarch::KVCache: layer ", layer, ": keys ", shape_of(keys), " and values ", shape_of(values),
              " must be [batch, kv_heads, tokens, head_dim] with the same batch, heads and tokens");
  if (layer >= num_layers()) layers_.resize(static_cast<size_t>(layer) + 1);
  Layer& l = layers_[static_cast<size_t>(layer)];
  const int64_t tokens = keys.size(2);
  auto allocate = [&](int64_t room) {
    auto room_for = [&](const at::Tensor& t) {
      return at::empty({t.size(0), t.size(1), room, t.size(3)}, t.options());
    };
    Layer grown{room_for(keys), room_for(values), l.length};
    if (l.length > 0) {
      grown.keys.narrow(2, 0, l.length).copy_(l.keys.narrow(2, 0, l.length));
      grown.values.narrow(2, 0, l.length).copy_(l.values.narrow(2, 0, l.length));
    }
    l = std::move(grown);
  };
  if (!l.keys.defined()) {
    allocate(std::max(reserve_, tokens));
  } else {
    auto same = [](const at::Tensor& held, const at::Tensor& t) {
      return held.size(0) == t.size(0) && held.size(1) == t.size(1) && held.size(3) == t.size(3) &&
             held.scalar_type() == t.scalar_type() && held.device() == t.device();
    };
    TORCH_CHECK(same(l.keys, keys) && same(l.values, values), "monarch::KVCache: layer ", layer, " holds keys ",
                shape_of(l.keys.narrow(2, 0, l.length)), " (", l.keys.scalar_type(), "); this forward appends ",
                shape_of(keys), " (", keys.scalar_type(), "): batch, kv heads, head_dim and dtype must match");
    const int64_t room = l.keys.size(2);
    if (l.length + tokens > room) allocate(std::max(l.length + tokens, 2 * room));
  }
  l.keys.narrow(2, l.length, tokens).copy_(keys);
  l.values.narrow(2, l.length, tokens).copy_(values);
  l.length += tokens;
  return {l.keys.narrow(2, 0, l.length), l.values.narrow(2, 0, l.length)};
}

void KVCache::clear() {
  layers_.clear();
  attention_mask = at::Tensor();
  positions = at::Tensor();
}

bool KVCache::has_layer(int64_t layer) const {
  return layer >= 0 && layer < num_layers() && layers_[static_cast<size_t>(layer)].length > 0;
}

int64_t KVCache::length(int64_t layer) const { return has_layer(layer) ? layers_[static_cast<size_t>(layer)].length : 0; }

at::Tensor KVCache::keys(int64_t layer) const {
  TORCH_CHECK(has_layer(layer), "monarch::KVCache: layer ", layer, " holds nothing");
  const Layer& l = layers_[static_cast<size_t>(layer)];
  return l.keys.narrow(2, 0, l.length);
}

at::Tensor KVCache::values(int64_t layer) const {
  TORCH_CHECK(has_layer(layer), "monarch::KVCache: layer ", layer, " holds nothing");
  const Layer& l = layers_[static_cast<size_t>(layer)];
  return l.values.narrow(2, 0, l.length);
}

int64_t KVCache::bytes() const {
  int64_t n = 0;
  for (const auto& l : layers_) {
    if (l.keys.defined()) n += static_cast<int64_t>(l.keys.nbytes() + l.values.nbytes());
  }
  return n;
}

at::Tensor KVCache::allowed(int64_t queries, int64_t keys) const {
  TORCH_CHECK(attention_mask.defined() && attention_mask.dim() == 2,
              "monarch::KVCache: attention_mask is not set ([batch, tokens so far]; generate sets it before each "
              "forward)");
  TORCH_CHECK(queries >= 1 && queries <= keys && keys <= attention_mask.size(1), "monarch::KVCache: ", queries,
              " queries over ", keys, " keys, with an attention_mask of ", attention_mask.size(1),
              " tokens (queries <= keys <= the mask's tokens)");
  const auto options = at::TensorOptions().dtype(at::kLong).device(attention_mask.device());
  const at::Tensor q = at::arange(keys - queries, keys, options).unsqueeze(1);  // [queries, 1]: their places
  const at::Tensor k = at::arange(keys, options).unsqueeze(0);                  // [1, keys]
  const at::Tensor real = attention_mask.narrow(1, attention_mask.size(1) - keys, keys).ne(0).unsqueeze(1).unsqueeze(1);
  return k.le(q).logical_and(real).logical_or(k.eq(q));  // [batch, 1, queries, keys]
}

at::Tensor KVCache::attend(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           AttentionOptions options) {
  auto [keys, values] = update(layer, k, v);
  options.causal = false;  // in the mask
  options.mask = allowed(q.size(2), keys.size(2)).logical_not();
  return attention_core(q, keys, values, options);
}

// ---- choosing tokens -----------------------------------------------------------------------

namespace generation {

at::Tensor filter_top_k_top_p(at::Tensor logits, std::optional<int64_t> top_k, std::optional<double> top_p) {
  const double inf = std::numeric_limits<double>::infinity();
  if (top_k && *top_k > 0) {
    const int64_t k = std::min(*top_k, logits.size(-1));
    const at::Tensor kth = std::get<0>(at::topk(logits, k, -1)).narrow(-1, k - 1, 1);
    logits = logits.masked_fill(logits.lt(kth), -inf);
  }
  if (top_p && *top_p < 1.0) {
    auto [sorted, order] = at::sort(logits, /*dim=*/-1, /*descending=*/false);
    const at::Tensor cumulative = sorted.softmax(-1).cumsum(-1);
    at::Tensor remove_sorted = cumulative.le(1 - *top_p);
    remove_sorted.narrow(-1, remove_sorted.size(-1) - 1, 1).fill_(false);  // the most likely token stays
    const at::Tensor remove = remove_sorted.scatter(-1, order, remove_sorted);
    logits = logits.masked_fill(remove, -inf);
  }
  return logits;
}

at::Tensor choose(const at::Tensor& logits, double temperature, std::optional<int64_t> top_k,
                  std::optional<double> top_p, at::Generator* generator) {
  if (temperature == 0) return logits.argmax(-1);
  TORCH_CHECK(generator != nullptr, "monarch: generate: sampling needs a generator");
  const at::Tensor scores = filter_top_k_top_p(logits.to(at::kCPU) / temperature, top_k, top_p);
  return at::multinomial(scores.softmax(-1), 1, /*replacement=*/false, *generator).select(1, 0).to(logits.device());
}

}  // namespace generation

// ---- ParallelModule::generate --------------------------------------------------------------

namespace {

[[noreturn]] void refuse(const std::string& why) { throw std::invalid_argument("monarch: generate: " + why); }

// The last position's logits whole: a vocabulary-split head's columns gathered over tp (tp rank
// r holds vocabulary rows [r * V/tp, (r + 1) * V/tp)).
at::Tensor whole_logits(const at::Tensor& logits, int64_t vocab, Communicator* tp) {
  if (tp == nullptr || vocab == 0 || logits.size(-1) == vocab) return logits;
  if (logits.size(-1) * tp->size() != vocab) {
    throw std::runtime_error("monarch: generate: the model's logits have " + std::to_string(logits.size(-1)) +
                             " columns per rank, neither the vocabulary (" + std::to_string(vocab) +
                             ") nor its 1/" + std::to_string(tp->size()) + " share");
  }
  const at::Tensor mine = logits.contiguous();
  at::Tensor parts = at::empty({tp->size(), mine.size(0), mine.size(1)}, mine.options());
  tp->all_gather(parts.view({-1}), mine.view({-1})).wait();
  return parts.permute({1, 0, 2}).reshape({mine.size(0), -1});
}

// Restores each module's training flag when the call ends, however it ends.
struct ModesGuard {
  const ChainModel& model;
  std::vector<bool> modes;
  explicit ModesGuard(const ChainModel& m) : model(m) {
    if (model.training_modes) modes = model.training_modes();
    if (model.set_training) model.set_training(false);
  }
  ~ModesGuard() {
    try {
      if (model.restore_training_modes) model.restore_training_modes(modes);
    } catch (...) {
    }
  }
};

}  // namespace

at::Tensor ParallelModule::generate(const at::Tensor& input_ids, const GenerateOptions& o) {
  const Layout& lay = layout();
  const int64_t tp = lay.mesh.tp;
  // What this frontend does not run, refused before anything runs.
  if (!model_.decoder) refuse(model_.decoder_missing.empty() ? "the model has no KV cache interface" : model_.decoder_missing);
  if (lay.num_stages() > 1) {
    refuse("pp=" + std::to_string(lay.mesh.pp) + " (" + std::to_string(lay.num_stages()) +
           " stages) is not supported by the C++ frontend's generate (the Python frontend's pipelines it); lay the "
           "model out with pp=1 (tp, dp, ZeRO-1/2)");
  }
  if (o.max_new_tokens < 0) {
    refuse("max_new_tokens must be >= 0, got " + std::to_string(o.max_new_tokens) +
           (o.max_new_tokens == -1 ? " (GenerateOptions::max_new_tokens is required)" : ""));
  }
  if (!input_ids.defined() || input_ids.dim() != 2 ||
      (input_ids.scalar_type() != at::kLong && input_ids.scalar_type() != at::kInt)) {
    refuse("input_ids must be an integer tensor [batch, prompt_len], got " +
           (input_ids.defined() ? shape_of(input_ids) + " " + std::string(c10::toString(input_ids.scalar_type()))
                                : std::string("an undefined tensor")));
  }
  const int64_t batch = input_ids.size(0), prompt_len = input_ids.size(1);
  if (prompt_len == 0) refuse("the prompt is empty (input_ids has 0 columns)");
  if (o.attention_mask.defined() && o.attention_mask.sizes() != input_ids.sizes()) {
    refuse("attention_mask has shape " + shape_of(o.attention_mask) + ", input_ids " + shape_of(input_ids));
  }
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature)) {
    refuse("temperature must be >= 0 (0: greedy), got " + std::to_string(o.temperature));
  }
  if (o.top_k && *o.top_k < 1) refuse("top_k must be >= 1 or unset, got " + std::to_string(*o.top_k));
  if (o.top_p && !(*o.top_p > 0.0 && *o.top_p <= 1.0)) {
    refuse("top_p must be in (0, 1] or unset, got " + std::to_string(*o.top_p));
  }
  const int64_t limit = model_.decoder->max_positions();
  if (limit > 0 && prompt_len + o.max_new_tokens > limit) {
    refuse("the prompt (" + std::to_string(prompt_len) + " tokens) and max_new_tokens=" +
           std::to_string(o.max_new_tokens) + " need " + std::to_string(prompt_len + o.max_new_tokens) +
           " positions; the model has " + std::to_string(limit) + " (max_positions())");
  }

  at::NoGradGuard no_grad;
  Communicator* tp_group = tp > 1 ? &mesh().group("tp") : nullptr;
  const at::Tensor ids = input_ids.to(at::kLong);
  at::Tensor mask = o.attention_mask.defined() ? o.attention_mask.to(ids.device(), at::kLong) : at::ones_like(ids);
  const std::vector<int64_t>& eos = o.eos_token_ids;
  const int64_t pad = o.pad_token_id ? *o.pad_token_id : (eos.empty() ? 0 : eos.front());
  // The tp ranks of a group run one forward together: they must have been given the same
  // prompts and lengths (a difference would hang in a collective or decode garbage).
  if (tp_group != nullptr) {
    const at::Tensor where = at::arange(1, prompt_len + 1, ids.options()).unsqueeze(0);
    const double eos_sum = static_cast<double>(std::accumulate(eos.begin(), eos.end(), int64_t{0}));
    const std::vector<double> mine = {static_cast<double>(batch), static_cast<double>(prompt_len),
                                      static_cast<double>(o.max_new_tokens),
                                      ids.mul(where).sum().to(at::kDouble).item<double>(),
                                      mask.mul(where).sum().to(at::kDouble).item<double>(),
                                      static_cast<double>(eos.size()), eos_sum};
    at::Tensor both = at::empty({2 * static_cast<int64_t>(mine.size())}, at::kDouble);
    for (size_t i = 0; i < mine.size(); ++i) {
      both[static_cast<int64_t>(i)] = mine[i];
      both[static_cast<int64_t>(i + mine.size())] = -mine[i];
    }
    tp_group->all_reduce_max(both).wait();
    for (size_t i = 0; i < mine.size(); ++i) {
      if (both[static_cast<int64_t>(i)].item<double>() != -both[static_cast<int64_t>(i + mine.size())].item<double>()) {
        refuse("the tp ranks of one group were given different prompts or settings (batch, prompt_len, "
               "max_new_tokens, the tokens, the mask or the EOS ids differ; tp rank " +
               std::to_string(tp_group->group_rank()) + " has batch " + std::to_string(batch) + ", prompt_len " +
               std::to_string(prompt_len) + "): give every rank of a tp group the same prompts, e.g. "
               "local_batch of the global ones");
      }
    }
  }

  // ZeRO: whole parameters for the call (1-2: refreshed from the shards the last optimizer step
  // updated; 3: every unit gathered, freed when the call ends). Collective over dp, once per
  // call: the dp ranks then decode on their own, each stopping when its sequences did.
  struct Hold {
    ParallelModule& pm;
    explicit Hold(ParallelModule& m) : pm(m) { pm.hold_parameters(true); }
    ~Hold() {
      try {
        pm.hold_parameters(false);
      } catch (...) {
      }
    }
  } hold(*this);
  const int64_t vocab = tp > 1 ? split_vocabulary() : 0;
  at::Generator generator;
  if (o.temperature > 0) generator = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  const at::Tensor eos_t = at::tensor(eos, ids.options());

  ModesGuard modes(model_);  // eval for the call, each module's mode restored after
  LocalVocabLogits local_vocab;  // a vocabulary-split head gives its own columns; gathered below
  KVCache own;
  KVCache& cache = o.cache != nullptr ? *o.cache : own;
  cache.clear();
  cache.reserve(prompt_len + o.max_new_tokens);
  at::Tensor positions = (mask.cumsum(-1) - 1).masked_fill(mask.eq(0), 1);
  at::Tensor finished = at::zeros({batch}, ids.options().dtype(at::kBool));
  at::Tensor step_ids = ids;
  std::vector<at::Tensor> tokens;
  for (int64_t step = 0; step < o.max_new_tokens; ++step) {
    cache.attention_mask = mask;
    cache.positions = positions;
    const at::Tensor logits = model_.decoder->forward_cached(step_ids, cache);
    if (!logits.defined() || logits.dim() != 3 || logits.size(0) != batch || logits.size(1) < 1) {
      throw std::runtime_error("monarch: generate: forward_cached returned " +
                               (logits.defined() ? shape_of(logits) : std::string("an undefined tensor")) +
                               "; expected logits [batch=" + std::to_string(batch) + ", tokens, vocab]");
    }
    const at::Tensor last = whole_logits(logits.select(1, logits.size(1) - 1).to(at::kFloat), vocab, tp_group);
    at::Tensor token;
    if (tp_group == nullptr || tp_group->group_rank() == 0) {
      token = generation::choose(last, o.temperature, o.top_k, o.top_p, generator.defined() ? &generator : nullptr)
                  .to(at::kLong)
                  .contiguous();
    } else {
      token = at::empty({batch}, ids.options());
    }
    if (tp_group != nullptr) tp_group->broadcast(token, 0).wait();
    if (!eos.empty()) {
      token = at::where(finished, at::full_like(token, pad), token);
      finished = finished.logical_or(at::isin(token, eos_t));
    }
    tokens.push_back(token);
    if (step == o.max_new_tokens - 1 || (!eos.empty() && finished.all().item<bool>())) break;
    step_ids = token.unsqueeze(1);
    mask = at::cat({mask, at::ones({batch, 1}, mask.options())}, 1);
    positions = positions.narrow(1, positions.size(1) - 1, 1) + 1;
  }
  if (tokens.empty()) return ids;
  return at::cat({ids, at::stack(tokens, 1)}, 1);
}

}  // namespace monarch
