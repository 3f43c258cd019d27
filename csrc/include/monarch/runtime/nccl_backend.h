#pragma once
// NCCL collectives for one group, on raw device pointers (built only when MONARCH_WITH_NCCL:
// CMake found the CUDA toolkit and NCCL). The Communicator (communicator.h) creates one per
// group, lazily, the first time a CUDA tensor reaches it; nothing else needs to include this.
//
// Streams: every operation runs on the group's own stream (non-blocking, created with the
// communicator), ordered after the caller's work by an event recorded on `caller` and waited
// on by the group's stream. `caller` is the stream the caller's kernels run on; nullptr is
// the legacy default stream (torch's current stream unless the caller switched streams: this
// LibTorch build has no c10::cuda to ask, so the Communicator takes it from set_cuda_stream).
// Each operation records an event after it; NcclWork::wait() polls that event until it
// completes (host-blocking), checking ncclCommGetAsyncError, and on a deadline aborts the
// communicator and throws; then it makes `caller` wait on the event.
//
// Never run on a GPU so far: compiled and linked only (see docs/communication.md).
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace monarch {

// fp32, fp64, fp16, bf16, int8, uint8, int32, int64; anything else throws naming the dtype.
ncclDataType_t nccl_dtype(c10::ScalarType type);
// ncclGetVersion of the linked library (e.g. 22809 for 2.28.9); needs no GPU.
int nccl_version();

class NcclBackend;

// One operation in flight on the group's stream.
class NcclWork {
 public:
  NcclWork(std::shared_ptr<NcclBackend> backend, cudaEvent_t event, cudaStream_t caller, std::string op);
  ~NcclWork();
  NcclWork(const NcclWork&) = delete;
  NcclWork& operator=(const NcclWork&) = delete;
  // Blocks until the operation has completed on the device, or throws (an NCCL asynchronous
  // error, a CUDA error, or the deadline: then the communicator is aborted), naming the rank,
  // the group and the operation. Then orders the caller's stream after it.
  void wait();
  // cudaEventQuery: true once the operation completed (throws on a CUDA error).
  bool ready() const;

 private:
  std::shared_ptr<NcclBackend> backend_;
  cudaEvent_t event_;
  cudaStream_t caller_;
  std::string op_;
};
using NcclWorkPtr = std::shared_ptr<NcclWork>;

// One send or receive of a grouped point-to-point call (send_recv_group).
struct NcclP2P {
  bool send = true;
  void* buffer = nullptr;  // read for a send, written for a receive
  size_t count = 0;
  ncclDataType_t dtype = ncclFloat32;
  int peer = 0;  // group rank
};

class NcclBackend : public std::enable_shared_from_this<NcclBackend> {
 public:
  // Collective over the group: `ranks` global ranks in group order, `group_rank` this
  // process's index in it, `device` the CUDA device its tensors live on. Group rank 0 makes
  // the unique id and publishes it at `key` + "/nccl_id" in `store`; the others read it (the
  // store's get waits, up to the store's timeout); then ncclCommInitRank. `name` names the
  // group in errors; `timeout` bounds every wait().
  static std::shared_ptr<NcclBackend> create(std::vector<int> ranks, int group_rank, int device,
                                             const c10::intrusive_ptr<c10d::Store>& store, const std::string& key,
                                             std::string name, std::chrono::milliseconds timeout);
  ~NcclBackend();
  NcclBackend(const NcclBackend&) = delete;
  NcclBackend& operator=(const NcclBackend&) = delete;

  int size() const { return static_cast<int>(ranks_.size()); }
  int group_rank() const { return group_rank_; }
  int device() const { return device_; }
  const std::string& name() const { return name_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  bool aborted() const;

  // In place (`send` may equal `recv`): `op` ncclSum, ncclAvg or ncclMax.
  NcclWorkPtr all_reduce(const void* send, void* recv, size_t count, ncclDataType_t dtype, ncclRedOp_t op,
                         cudaStream_t caller);
  // `send` holds size() chunks of `recv_count`; `recv` gets the sum of chunk group_rank().
  NcclWorkPtr reduce_scatter(const void* send, void* recv, size_t recv_count, ncclDataType_t dtype,
                             ncclRedOp_t op, cudaStream_t caller);
  // `recv` (size() x `send_count`) gets every rank's `send`, in group order.
  NcclWorkPtr all_gather(const void* send, void* recv, size_t send_count, ncclDataType_t dtype, cudaStream_t caller);
  NcclWorkPtr broadcast(void* buffer, size_t count, ncclDataType_t dtype, int root, cudaStream_t caller);
  NcclWorkPtr send(const void* buffer, size_t count, ncclDataType_t dtype, int peer, cudaStream_t caller);
  NcclWorkPtr recv(void* buffer, size_t count, ncclDataType_t dtype, int peer, cudaStream_t caller);
  // Equal splits of `chunk` elements: chunk j of `send` to rank j, chunk j of `recv` from rank
  // j; grouped ncclSend/ncclRecv (the own chunk goes through NCCL too).
  NcclWorkPtr all_to_all(const void* send, void* recv, size_t chunk, ncclDataType_t dtype, cudaStream_t caller);
  // Several sends and receives in one ncclGroupStart/ncclGroupEnd (the pipeline's grouped
  // point-to-point: a stage's send to the next and receive from the previous together).
  // A peer may be this rank (NCCL pairs a send and a receive to self inside a group).
  NcclWorkPtr send_recv_group(const std::vector<NcclP2P>& ops, cudaStream_t caller);

  // "rank R: OP on group 'NAME' (ranks ...)": how errors name an operation.
  std::string describe(const std::string& op) const;

 private:
  friend class NcclWork;
  NcclBackend(std::vector<int> ranks, int group_rank, int device, std::string name, std::chrono::milliseconds timeout);
  void init(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key);
  // Orders the group's stream after `caller`, runs `enqueue` (the NCCL calls) under the lock
  // and the device, records an event after it.
  template <class F>
  NcclWorkPtr run(const std::string& op, cudaStream_t caller, F&& enqueue);
  void abort_locked(const std::string& why);
  void check_usable_locked(const std::string& what) const;

  std::vector<int> ranks_;
  int group_rank_;
  int device_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;  // recorded on the caller's stream before each operation
  mutable std::mutex mutex_;
  std::string aborted_;  // why, once aborted
};

}  // namespace monarch
