#pragma once
// Two-level (hierarchical) all-reduce for a group that spans nodes: reduce-scatter among
// the group's ranks on this node (fast link), all-reduce of this rank's shard with the ranks
// at the same place on the other nodes (slow link: 1/L of the bytes, L = ranks per node),
// all-gather inside the node. The slow hop may be compressed (bf16, or int8 with one scale
// per block), with error feedback. Same decomposition as the planner's cost model
// (planner/collectives.h); see docs/communication.md.
#include <ATen/ATen.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "monarch/planner/training_config.h"
#include "monarch/runtime/communicator.h"

namespace monarch {

// The Plan's inter_node_compression (none, bf16, int8); planner::to_string and
// planner::compression_from_string convert it.
using WireCompression = planner::Compression;

// Values per int8 scale on the slow hop (the planner's cost model counts the same).
constexpr int64_t kInt8Block = 256;

// Runs closures one after another on its own thread (a group's collectives must be issued in
// the same order on every rank: one queue per group keeps them ordered across engines).
class SerialWorker {
 public:
  SerialWorker();
  ~SerialWorker();
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;
  // The future holds the closure's exception, if it throws.
  std::shared_future<void> submit(std::function<void()> job);

 private:
  void run();
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::packaged_task<void()>> jobs_;
  bool stopping_ = false;
  std::thread thread_;
};

// Working buffers of one reduction, kept between steps (one set per worker: its jobs run one
// at a time). Reusing them matters on CPU: a fresh buffer of tens of MB costs a page fault
// per 4 KiB page at every step.
struct HierarchicalScratch {
  at::Tensor shard;     // this rank's shard (collective path, no shared slots)
  at::Tensor sum;       // the node's sum of this rank's chunk (shared slots)
  at::Tensor values;    // fp32 copy of a low-precision shard (compressed hop)
  at::Tensor send;      // the rounded shard, once per node (all-to-all input)
  at::Tensor gathered;  // every node's rounded shard
};

// A group split by node: `intra` holds the group's ranks on this rank's node, `inter` the
// group's ranks with this rank's index on every node. Made by DeviceMesh::node_groups.
struct NodeGroups {
  std::unique_ptr<Communicator> intra;
  std::unique_ptr<Communicator> inter;
  HierarchicalScratch scratch;  // used by the worker's jobs only
  SerialWorker worker;          // last: joined before the rest is destroyed  // issues the two groups' collectives in order, off the caller's thread
};

// Per-buffer state of a compressed slow hop: the error of the last rounding of this rank's
// shard, added back before the next one (Seide et al. 2014; Karimireddy et al. 2019).
struct ErrorFeedback {
  at::Tensor error;  // fp32, the shard's size
};

class NodeSharedBuffer;  // shared_memory.h

// In-place sum of `flat` (a CPU floating-point buffer, numel a multiple of intra.size())
// over intra x inter, blocking. Every rank ends with bitwise the same values (the compressed
// hop gathers every node's rounded shard and each rank sums the same values in the same
// order). With `shared` (the node's shared slots, `flat` being this rank's), the intra-node
// steps read the other ranks' slots instead of going through `intra`'s collectives (same
// sums, same order); `intra` then only carries the barriers.
void hierarchical_all_reduce(Communicator& intra, Communicator& inter, at::Tensor flat, WireCompression compression,
                             ErrorFeedback& feedback, HierarchicalScratch& scratch,
                             const NodeSharedBuffer* shared = nullptr);

// Bytes this rank sends on the slow hop for a buffer of `numel` fp32 values (what the
// planner predicts): uncompressed ring all-reduce of the shard, or an all-gather of the
// rounded shard (and its scales).
double inter_node_bytes_per_rank(int64_t numel, int64_t ranks_per_node, int64_t nodes, WireCompression compression);

}  // namespace monarch
