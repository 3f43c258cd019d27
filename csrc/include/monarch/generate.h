#pragma once
// Token-by-token generation with a KV cache for C++ models: the interface a decoder implements
// so that ParallelModule::generate (monarch/parallelize.h) can drive it, with the semantics of
// Python's ParallelModel.generate (torch_monarch/generate.py).
//
//   struct GptImpl : torch::nn::Module, monarch::BlockStack, monarch::CachedDecoder {
//     at::Tensor forward_cached(const at::Tensor& tokens, monarch::KVCache& cache) override {
//       auto h = embedding(tokens);                      // cache.positions: for position embeddings
//       for (int64_t i = 0; i < n; ++i) h = block(i)->forward_cached(h, cache, i);
//       return lm_head(final_norm(h));                   // [batch, tokens, vocab]
//     }
//   };
//   // in a block: q, k, v [batch, heads, tokens, head_dim] of the tokens fed now
//   auto ctx = cache.attend(layer, q, k, v);             // appends k, v; masked attention over the cache
//
//   auto model = monarch::parallelize(monarch::chain_of_blocks(gpt.ptr()), plan, options);
//   monarch::GenerateOptions g;
//   g.max_new_tokens = 32;
//   g.attention_mask = mask;                              // 0 on the left padding
//   at::Tensor out = model->generate(model->local_batch(prompts), g);   // [batch, prompt + new]
//
// chain_of_blocks and chain_of(module, forward) remember a model that implements
// CachedDecoder; generate calls its forward_cached, never the pieces (the parameters it reads
// are the ones training steps: tensor-parallel slices, ZeRO-1/2's whole tensors refreshed from
// the shards, ZeRO-3's gathered for the call). A TorchScript chain generates through its
// blocks' forward_cached methods (chain_of(jit::Module), monarch/parallelize.h).
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "monarch/runtime/attention.h"

namespace monarch {

// Keys and values of every token seen so far, per layer. Whoever drives the loop (generate)
// sets attention_mask and positions before each forward; each attention layer appends its keys
// and values [batch, kv_heads (this rank's under tensor parallelism), tokens, head_dim].
class KVCache {
 public:
  // [batch, every token so far, those fed now included] int64: 1 a real token, 0 left padding.
  at::Tensor attention_mask;
  // [batch, tokens fed now] int64: each token's position counted over real tokens only
  // (cumsum(mask) - 1; a padding token's is 1), for position embeddings.
  at::Tensor positions;

  // Appends this forward's keys and values [batch, kv_heads, tokens, head_dim] to `layer`'s and
  // returns every one so far (views into the cache's storage, valid until the next update of
  // that layer). Throws, naming the layer, when batch, heads or head_dim differ from what the
  // layer holds.
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& keys, const at::Tensor& values);
  // Room for `tokens` per layer from the next allocation on (generate reserves prompt +
  // max_new_tokens), so appending writes in place instead of copying what is cached; without
  // it a full layer doubles its room.
  void reserve(int64_t tokens) { reserve_ = tokens; }
  // Every layer emptied (the mask and positions too).
  void clear();

  // Layers that hold entries (a layer index is whatever the model passes to update).
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool has_layer(int64_t layer) const;
  // Tokens cached in `layer` (0 for a layer without entries).
  int64_t length(int64_t layer) const;
  at::Tensor keys(int64_t layer) const;
  at::Tensor values(int64_t layer) const;
  // Bytes of keys and values held (the room reserved, every layer).
  int64_t bytes() const;

  // [batch, 1, queries, keys] bool, true where a query may attend to a key: the queries are the
  // last `queries` of `keys` tokens (the keys being the last `keys` columns of attention_mask);
  // a query sees the real keys at or before its own place, and always itself, so a padding
  // query's row stays finite (it would otherwise see nothing). For attention_core, whose mask
  // is true where attention is NOT allowed, pass ~allowed(...).
  at::Tensor allowed(int64_t queries, int64_t keys) const;
  // Causal attention over the cache: appends k, v to `layer` (update), then attention_core(q,
  // every cached key and value) masked by allowed() (options.mask and options.causal are set
  // here; scale, dropout and training are the caller's). q [batch, heads, tokens fed now,
  // head_dim]; kv_heads may divide heads (grouped-query attention). Returns [batch, heads,
  // tokens fed now, head_dim].
  at::Tensor attend(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    AttentionOptions options = {});

 private:
  struct Layer {
    at::Tensor keys, values;  // [batch, kv_heads, room, head_dim]
    int64_t length = 0;
  };
  std::vector<Layer> layers_;
  int64_t reserve_ = 0;
};

// What a model implements to generate: one forward over the tokens fed now (the whole prompt
// first, then one token per step) that reads and extends `cache`.
class CachedDecoder {
 public:
  virtual ~CachedDecoder() = default;
  // tokens [batch, tokens fed now] int64, with cache.attention_mask and cache.positions set.
  // Returns logits [batch, tokens, vocab], or vocab / tp columns from a vocabulary-split head
  // (monarch::Linear split as vocab_head returns its own columns during generate, which
  // gathers the last position's only). Generate reads the last position only, so a model may
  // return [batch, 1, vocab] (its head run on the last hidden state).
  virtual at::Tensor forward_cached(const at::Tensor& tokens, KVCache& cache) = 0;
  // The positions the model has (a prompt plus max_new_tokens longer is refused); 0: no limit.
  virtual int64_t max_positions() const { return 0; }
};

// ParallelModule::generate's settings (Python: generate's keywords).
struct GenerateOptions {
  int64_t max_new_tokens = -1;  // required: >= 0
  // [batch, prompt_len], 1 for real tokens, 0 on the left padding (prompts of different lengths
  // are left-padded, Hugging Face's convention for decoders); undefined: every token real.
  at::Tensor attention_mask;
  double temperature = 0.0;      // 0: greedy (argmax); > 0: sampled
  std::optional<int64_t> top_k;  // sampling: keep the k most likely (ties at the k-th kept)
  std::optional<double> top_p;   // sampling: keep the smallest set whose probability exceeds p
  // A sequence stops at its first one of these and emits pad_token_id afterwards; generation
  // ends when every sequence stopped, or after max_new_tokens.
  std::vector<int64_t> eos_token_ids;
  std::optional<int64_t> pad_token_id;  // default: the first EOS id, else 0
  uint64_t seed = 0;                    // the sampling generator's
  // When set, generate fills this cache (cleared first) and leaves it holding every token's
  // keys and values (for inspection: bytes per rank, kv heads); otherwise one of its own.
  KVCache* cache = nullptr;
};

namespace generation {
// Hugging Face's TopKLogitsWarper then TopPLogitsWarper on logits [batch, vocab]: the others
// set to -inf (ties at the k-th value kept; the most likely token always kept by top-p).
at::Tensor filter_top_k_top_p(at::Tensor logits, std::optional<int64_t> top_k, std::optional<double> top_p);
// The next token of each row from logits [batch, vocab]: argmax at temperature 0; otherwise
// temperature, top-k, top-p, then one multinomial draw per row from `generator` (a CPU
// generator: the logits are moved to the CPU for the draw, so the draw is the same whatever
// the device).
at::Tensor choose(const at::Tensor& logits, double temperature, std::optional<int64_t> top_k,
                  std::optional<double> top_p, at::Generator* generator);
}  // namespace generation

}  // namespace monarch
