#pragma once
// Context parallelism: attention with the sequence split over the mesh's cp ranks.
//
// Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): each rank
// keeps its queries and passes its keys and values around the cp ring, one hop per step;
// every step computes one block of attention (this rank's queries against the keys/values
// it holds) and folds it into the running output with the online softmax (Milakov &
// Gimelshein 2018; the log-sum-exp form of FlashAttention-2, Dao 2023). Only the output and
// the per-row log-sum-exp are kept for backward; backward recomputes each block's scores
// and passes the keys/values around the ring again, together with the accumulators of their
// gradients, so that each rank ends with its own chunk's dk / dv.
//
// Causal masks use the load-balanced layout (Megatron-Core's and torchtitan's context
// parallelism): the sequence is cut into 2*cp equal chunks and rank i holds chunks i and
// 2cp-1-i, in that order. Every rank then does the same work: at each ring step after the
// first, half of its (query, key) block is visible and the rest is skipped, never computed.
//
//   auto qs = monarch::cp::shard_sequence(q_full, /*dim=*/2, group.group_rank(), group.size());
//   auto out = monarch::cp::ring_attention(q, k, v, group);   // q, k, v: this rank's chunks
//
// Shapes: q [b, heads, s_local, d], k [b, kv_heads, s_local, d], v [b, kv_heads, s_local, d_v];
// kv_heads divides heads (grouped-query attention: kv head j serves the heads / kv_heads
// consecutive query heads from j * heads / kv_heads, as Llama's repeat_kv). Scores, softmax
// and accumulators are float32 (float64 inputs stay float64); bf16 / fp16 inputs travel the
// ring in their own dtype and their gradient accumulators travel in float32.
//
// The group must outlive every autograd graph built through it (it is the mesh's).
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "monarch/runtime/communicator.h"

namespace monarch::cp {

struct RingAttentionOptions {
  bool causal = true;            // causal over global positions (load-balanced layout above)
  std::optional<double> scale;   // default 1 / sqrt(d)
  // Query rows per tile of a block (the scores of one tile are the largest temporaries):
  // 0 picks tiles of about 2^21 scores (8 MiB in fp32; at least 16 rows) whatever the sequence
  // length, so the attention's temporaries do not grow with (s/cp)^2.
  int64_t block_rows = 0;
};

// Attention of this rank's queries over the whole sequence's keys and values, whose chunks
// the cp ranks of `group` hold (every member calls it with the same shapes: checked, one
// error naming every rank's shapes). Returns [b, heads, s_local, d_v] in q's dtype.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Communicator& group,
                          const RingAttentionOptions& options = {});

// The load-balanced layout. `rank`'s part of `x` along `dim`: chunks rank and 2*size-1-rank
// of 2*size equal chunks, concatenated (differentiable: the gradient lands in those chunks).
// The length along `dim` must be divisible by 2*size (error otherwise, naming both).
at::Tensor shard_sequence(const at::Tensor& x, int64_t dim, int64_t rank, int64_t size);
// The global positions (int64) of the tokens `rank` holds, for a global length `seq_len`.
at::Tensor sequence_positions(int64_t seq_len, int64_t rank, int64_t size);
// The same from the local length (s_local = seq_len / size): what a module that sees only
// its chunk (a rotary or learned position embedding) computes.
at::Tensor local_sequence_positions(int64_t local_len, int64_t rank, int64_t size);
// The inverse of shard_sequence, given every rank's part in rank order.
at::Tensor unshard_sequence(const std::vector<at::Tensor>& shards, int64_t dim);
// Every rank's part all-gathered and put back in sequence order along `dim`. Backward keeps
// this rank's chunks of the gradient (as tp's gather_from_group: the code after the gather
// must run alike on every cp rank, e.g. a loss over the whole sequence computed everywhere).
at::Tensor gather_sequence(const at::Tensor& x, Communicator& group, int64_t dim);

// The same block steps as ring_attention in one process standing in for cp = qs.size()
// ranks: rank r's keys/values at step t are taken from ks/vs[(r - t) mod cp] instead of the
// ring. Given every rank's output gradient (`douts`, may be empty: forward only), also the
// backward. The C++ tests check the block math with it against attention_core.
struct SimulatedRing {
  std::vector<at::Tensor> out, dq, dk, dv;
};
SimulatedRing simulate_ring_attention(const std::vector<at::Tensor>& qs, const std::vector<at::Tensor>& ks,
                                      const std::vector<at::Tensor>& vs, const std::vector<at::Tensor>& douts,
                                      const RingAttentionOptions& options = {});

// Bytes one rank sends per ring_attention call (forward and backward), as the runtime sends
// them: forward (cp-1) hops of this rank's k and v in their dtype; backward (cp-1) hops of k
// and v again plus (cp-1) hops of their gradient accumulators (float32 for bf16 / fp16 / fp32,
// float64 for float64). With float32 inputs backward sends exactly twice forward.
struct RingBytes {
  double forward = 0;
  double backward = 0;
};
RingBytes ring_attention_bytes(int64_t batch, int64_t local_len, int64_t kv_heads, int64_t head_dim,
                               int64_t v_head_dim, int64_t cp, at::ScalarType dtype);

}  // namespace monarch::cp
