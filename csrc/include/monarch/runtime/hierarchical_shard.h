#pragma once
// ZeRO-3's collectives in two hops over a group split by node (ZeRO++: Wang et al. 2023,
// "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training"):
//
//   forward gather (qwZ):  all-gather of each rank's shard among the ranks at the same place
//                          on every node (slow link), then of that bundle inside the node;
//                          with compression the shard crosses both hops rounded (int8 blocks
//                          with one fp32 scale each, or bf16), decoded on arrival;
//   secondary shard (hpZ): what the first hop brought (this rank's node-local part of the
//                          unit, as it arrived) is kept until the unit's backward, whose
//                          re-gather then stays inside the node;
//   gradients (qgZ):       reduce-scatter inside the node (fast link: each rank gets its
//                          node's sum of the chunks its peers on the other nodes own), then
//                          across nodes; compressed, each rank rounds the chunks it sends to
//                          other nodes with error feedback (the residual is added back next
//                          step: Seide et al. 2014; Karimireddy et al. 2019) and sums what it
//                          receives in fp32.
//
// Group rank g = node * L + local (L ranks of the group per node, M nodes; the layout
// DeviceMesh::node_groups makes); buffers are in the fully-shard engine's padded rank-major
// layout: N = L * M slots of S elements. Blocking: the engine runs these on the node
// groups' worker thread.
#include <ATen/ATen.h>

#include <cstdint>

#include "monarch/runtime/hierarchical.h"

namespace monarch {

// Bytes of one rank's shard of S values on the wire (compressed: rounded values, and for
// int8 one fp32 scale per kInt8Block values).
int64_t shard_message_bytes(int64_t shard_numel, WireCompression compression, at::ScalarType dtype);

// Every rank's shard into `padded` (N * S, the compute dtype). `shard` is this rank's fp32
// shard (S values). Returns the secondary shard: the M shards of this rank's place on every
// node, as they crossed the slow link (the compute dtype, or encoded bytes).
at::Tensor gather_unit_two_hops(NodeGroups& nodes, const at::Tensor& shard, const at::Tensor& padded,
                                WireCompression compression);

// The backward re-gather: the node's secondary shards into `padded`, inside the node only.
void gather_unit_from_secondary(NodeGroups& nodes, const at::Tensor& secondary, const at::Tensor& padded,
                                WireCompression compression);

// Sum over the group of `grads` (N * S, fp32 or the reduce dtype), this rank's chunk into
// `out` (S fp32). `feedback` holds the residuals of the chunks this rank sends to other nodes
// ((M - 1) * S, made on first use).
void reduce_scatter_unit_two_hops(NodeGroups& nodes, const at::Tensor& grads, const at::Tensor& out,
                                  WireCompression compression, ErrorFeedback& feedback);

}  // namespace monarch
