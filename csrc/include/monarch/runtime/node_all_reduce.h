#pragma once
// Small all-reduces among the ranks of one node through shared memory, in the caller's
// thread (Communicator::all_reduce takes this path for groups the mesh marks node-local).
//
// Why: a Gloo all-reduce of a few KiB crosses three threads per rank (the caller hands it to
// c10d's Gloo worker, which sends and receives through the transport's epoll loop thread,
// then wakes the caller). Measured on 2 shared cores (tensor-parallel decode, tp=2,
// 8 KiB per all-reduce): 2.0-2.5 ms each, 18 ms user + 14 ms system CPU per token per rank,
// about 260 context switches per token, and the loop threads took a third of the CPU the
// matmuls needed (docs/communication.md). Here each rank copies its buffer into its own
// slot, announces it with one atomic store, waits (spin, yield, then futex) until every rank
// has announced, and sums the slots in group order: no thread hop, no socket, and every rank
// computes the same bits.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace monarch {

class Communicator;
class NodeSharedBuffer;

class NodeAllReduce {
 public:
  // Collective over `group` (every member calls it with the same arguments): shared slots
  // for messages of up to `capacity_bytes`. nullptr on every member alike when the members
  // cannot share memory (another host, MONARCH_SHARED_MEMORY=off, too little shared memory).
  // `timeout`: how long a member waits for the others before the call fails.
  static std::unique_ptr<NodeAllReduce> create(Communicator& group, int64_t capacity_bytes,
                                               std::chrono::milliseconds timeout);
  ~NodeAllReduce();
  NodeAllReduce(const NodeAllReduce&) = delete;
  NodeAllReduce& operator=(const NodeAllReduce&) = delete;

  // The most bytes one call takes (the slots' size).
  int64_t capacity_bytes() const { return capacity_; }
  // Whether `buffer` can take this path: a contiguous CPU tensor of a summable dtype (fp32,
  // fp64, bf16, fp16, int32, int64) of at most capacity_bytes().
  bool fits(const at::Tensor& buffer) const;
  // What the path takes at most (MONARCH_NODE_ALL_REDUCE_BYTES; unset: 262144; 0 turns the
  // path off; docs/communication.md): larger messages keep the group's Gloo all-reduce, whose ring moves 2(n-1)/n of the
  // buffer per rank where this path reads n buffers per rank.
  static int64_t limit_bytes();
  static bool summable(at::ScalarType dtype);

  // Sum (or average) over the group, in place, in the caller's thread. The sum runs in group
  // order on every member (bf16 / fp16 accumulated in fp32, as Communicator::all_reduce does),
  // so every member gets the same bits. Throws, naming the missing members, when one has
  // exited (checked every 100 ms) or has not arrived within the timeout.
  void all_reduce(at::Tensor& buffer, bool average);


 private:
  NodeAllReduce() = default;
  void wait_for_all(int64_t call);
  std::shared_ptr<NodeSharedBuffer> shared_;
  int64_t capacity_ = 0;  // bytes one call takes
  int64_t stride_ = 0;    // bytes between the two data areas (capacity_ rounded up to pages)
  int me_ = 0;
  int size_ = 0;
  int64_t calls_ = 0;
  bool spin_ = true;  // members <= this process's cores: busy-wait briefly before yielding
  std::chrono::milliseconds timeout_{0};
  std::string group_name_;
  std::vector<int> ranks_;
};

}  // namespace monarch
