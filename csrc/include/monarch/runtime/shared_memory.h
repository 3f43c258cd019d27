#pragma once
// Buffers shared by the ranks of one node (POSIX shared memory), for the intra-node steps of
// the hierarchical reduction: each rank owns one slot; the others read it directly instead
// of receiving it over loopback TCP. On CPU ranks that share cores, every byte Gloo moves
// over loopback costs two copies, a socket round trip and (for fresh receive buffers) page
// faults on the cores that compute; a shared slot costs one read. See docs/communication.md.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "monarch/runtime/communicator.h"

namespace monarch {

class NodeSharedBuffer {
 public:
  // Collective over `intra` (the group's ranks on this node): rank 0 of the group creates an
  // anonymous memory file (memfd_create; no name, so nothing outlives the processes) of
  // intra.size() slots of `numel` elements of `dtype`, the others open it through
  // /proc/<pid>/fd and map it, and all agree that every rank mapped the same one (a random tag
  // written by the creator). Returns nullptr on every rank alike when any rank could not map
  // it (too little shared memory, no access to the creator's /proc, ranks on different hosts)
  // or when MONARCH_SHARED_MEMORY=off: the caller then uses the group's collectives. Slots
  // start zeroed.
  static std::shared_ptr<NodeSharedBuffer> create(Communicator& intra, int64_t numel, at::ScalarType dtype);

  ~NodeSharedBuffer();
  NodeSharedBuffer(const NodeSharedBuffer&) = delete;
  NodeSharedBuffer& operator=(const NodeSharedBuffer&) = delete;

  int slots() const { return static_cast<int>(slots_.size()); }
  int64_t numel() const { return numel_; }
  // Rank i's slot (group order): a CPU tensor over the shared mapping (it keeps the mapping
  // alive). Only rank i writes it; the others read it between barriers.
  const at::Tensor& slot(int i) const { return slots_.at(static_cast<size_t>(i)); }
  const at::Tensor& mine() const { return slots_.at(static_cast<size_t>(me_)); }

  // The creator's random tag (the same on every rank of the node; one per buffer).
  uint64_t tag() const { return tag_; }

  // Whether MONARCH_SHARED_MEMORY allows shared buffers (default on; "off"/"0" disables).
  static bool enabled();

 private:
  struct Mapping;
  NodeSharedBuffer() = default;
  std::shared_ptr<Mapping> mapping_;
  std::vector<at::Tensor> slots_;
  int64_t numel_ = 0;
  int me_ = 0;
  uint64_t tag_ = 0;
};

// The intra-node steps of the hierarchical all-reduce over shared slots (every rank's
// gradients are in its slot, `shared.mine()`): reduce-scatter (each rank sums chunk
// group_rank() of every slot into its own slot's chunk, as Communicator::reduce_scatter sums
// what it receives: bitwise the same values; `sum_scratch` is a kept buffer for the sum),
// then `between_nodes` on that
// chunk, then all-gather (each rank copies the other chunks from their owners' slots).
// Barriers on `intra` separate the phases (each checks that every rank is at the same buffer
// and phase), and a last one keeps a rank from overwriting its slot while another still reads
// it.
void shared_reduce_scatter_all_gather(Communicator& intra, const NodeSharedBuffer& shared, at::Tensor& sum_scratch,
                                      const std::function<void(at::Tensor shard)>& between_nodes);

}  // namespace monarch
