#pragma once
// Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism
// (Korthikanti et al. 2022) as autograd-aware collectives over one group (the mesh's `tp`
// axis), plus the sharding arithmetic both frontends use to cut full weights into shards.
//
// Every function is differentiable; the backward runs the conjugate collective:
//   copy_to_group            f: identity              b: all-reduce     (Megatron's "f")
//   reduce_from_group        f: all-reduce            b: identity       (Megatron's "g")
//   gather_from_group(dim)   f: all-gather along dim  b: keep own chunk
//   scatter_to_group(dim)    f: keep own chunk        b: all-gather
//   sequence_gather(dim)     f: all-gather along dim  b: reduce-scatter (SP "g")
//   sequence_reduce_scatter  f: reduce-scatter        b: all-gather     (SP "g-bar")
// The group must outlive every autograd graph built through it (it is the mesh's).
#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "monarch/runtime/communicator.h"

namespace monarch::tp {

at::Tensor copy_to_group(const at::Tensor& x, Communicator& group);
at::Tensor reduce_from_group(const at::Tensor& x, Communicator& group);
at::Tensor gather_from_group(const at::Tensor& x, Communicator& group, int64_t dim);
at::Tensor scatter_to_group(const at::Tensor& x, Communicator& group, int64_t dim);
at::Tensor sequence_gather(const at::Tensor& x, Communicator& group, int64_t dim);
at::Tensor sequence_reduce_scatter(const at::Tensor& x, Communicator& group, int64_t dim);

// The embedding of `tokens` through this rank's rows [vocab_start, vocab_start + rows) of
// the table: tokens outside the range give zeros, and the partial results are summed over
// the group (all-reduce), or reduce-scattered along `sequence_dim` (>= 0) under sequence
// parallelism. `padding_idx` (>= 0): that token's row gets no gradient, as nn.Embedding.
at::Tensor vocab_parallel_embedding(const at::Tensor& tokens, const at::Tensor& weight_shard,
                                    int64_t vocab_start, Communicator& group,
                                    int64_t sequence_dim = -1, int64_t padding_idx = -1);

// Per-token cross-entropy of logits split along the vocabulary (last dim: this rank's
// columns [vocab_start, vocab_start + local)), without ever forming full-vocabulary rows:
// the row max (an all-reduce-max of one number per token), then the sum of exponentials
// and the target logit (one all-reduce of two numbers per token). Computed in fp32 (fp64
// logits stay fp64). Targets equal to `ignore_index` give loss 0 and no gradient. Returns
// a tensor shaped like `targets`.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_shard, const at::Tensor& targets,
                                        int64_t vocab_start, Communicator& group,
                                        int64_t ignore_index = -100);

// This rank's slice of `full` along `dim` for a group of `size`. `fused_parts` > 1 cuts a
// fused weight (e.g. q|k|v stacked along dim) part by part, so every rank gets its slice of
// each part, concatenated. `what` names the module in the error when size does not divide.
at::Tensor shard_tensor(const at::Tensor& full, int64_t dim, int64_t rank, int64_t size,
                        int64_t fused_parts = 1, const std::string& what = "tensor");

// The inverse of shard_tensor given every rank's shard in group order.
at::Tensor unshard_tensor(const std::vector<at::Tensor>& shards, int64_t dim,
                          int64_t fused_parts = 1);

}  // namespace monarch::tp
