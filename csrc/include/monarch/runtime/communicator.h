#pragma once
// Collectives on flat buffers over one process group, asynchronous, with byte counters.
#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "monarch/runtime/compat.h"

namespace monarch {

enum class CollectiveKind { all_reduce, reduce_scatter, all_gather, broadcast, send, recv, all_to_all };
constexpr size_t kCollectiveKinds = 7;
std::string to_string(CollectiveKind kind);

// Bytes this rank sent, per collective kind, counted as the ring algorithm sends them
// (all-reduce 2(n-1)/n S, reduce-scatter / all-gather (n-1)/n S, broadcast / send S): the
// same volumes the planner's cost model uses, so predictions and runs compare directly.
class ByteCounters {
 public:
  void add(CollectiveKind kind, double bytes) {
    auto& slot = bytes_[static_cast<size_t>(kind)];
    double old = slot.load();
    while (!slot.compare_exchange_weak(old, old + bytes)) {
    }
  }
  double bytes(CollectiveKind kind) const { return bytes_[static_cast<size_t>(kind)].load(); }
  double total() const;
  void reset();

 private:
  std::array<std::atomic<double>, kCollectiveKinds> bytes_{};
};

class NcclBackend;  // nccl_backend.h (MONARCH_WITH_NCCL builds)
class NodeAllReduce;  // node_all_reduce.h
namespace flight {
struct GroupInfo;  // flight_recorder.h
struct CallGroup;
}

// A collective in flight. Contract: until wait() returns, the input and output buffers
// belong to the collective (do not read the output, do not modify the input). wait()
// returns once the output holds the result, or throws an error naming the rank, the
// group and the collective (including a timeout when a peer died or never joined).
class Handle {
 public:
  Handle() = default;
  // `failure`: the group's failure latch (see Communicator): the first collective that fails
  // writes its error there; once set, wait() fails at once with it instead of waiting.
  Handle(compat::WorkPtr work, std::string what, std::function<void()> finish = {},
         std::shared_ptr<std::string> failure = {});
  // A collective that is not a c10d Work (the NCCL path): `waiter` blocks until it
  // completed or throws; otherwise the same contract, latch and tracing.
  static Handle completion(std::function<void()> waiter, std::string what, std::function<void()> finish = {},
                           std::shared_ptr<std::string> failure = {});
  void wait();
  bool done() const { return waited_ || (!work_ && !waiter_); }
  // Records the collective in the trace (trace.h) once wait() succeeds, from now until then:
  // `kind` a string literal, `bytes` what this rank sent, `group` the group's name.
  Handle traced(const char* kind, double bytes, const std::string& group) &&;
  // The group it runs on: a failure then says what the group's other members announced
  // (flight_recorder.h) and dumps the flight recorder.
  void set_group(std::shared_ptr<const flight::GroupInfo> group) { group_ = std::move(group); }

 private:
  std::shared_ptr<const flight::GroupInfo> group_;
  compat::WorkPtr work_;
  std::function<void()> waiter_;  // instead of work_
  std::string what_;
  std::function<void()> finish_;
  std::shared_ptr<std::string> failure_;
  bool waited_ = false;
  const char* trace_kind_ = nullptr;
  double trace_bytes_ = 0;
  std::string trace_group_;
  int64_t trace_start_ns_ = 0;
};

// Collective agreement. Gloo aborts the process (an uncatchable enforce in its I/O thread)
// when ranks pair collectives of different sizes, and silently pairs a rank's step 4 with
// another's step 3 when one of them skipped a call. So, before each collective (not
// point-to-point: the pipeline's messages carry their own headers), the group's members
// exchange a 128-byte fingerprint of what they are about to do: the collective's number on
// this group, the caller's step counter and phase (set by the engines: forward, backward,
// state_dict, ...), the operation, dtype, element count and root. Any difference is an
// error on every member naming each rank's side, and the group is then unusable (its
// members are at different points of the program). One extra small collective per
// collective (about 0.6 ms at tp=2 on this 2-core VM, docs/runtime.md). MONARCH_CHECK_COLLECTIVES=off turns
// it off (then a mismatch aborts, as plain Gloo does).
//
// CUDA tensors: in a build with NCCL (MONARCH_WITH_NCCL), collectives and point-to-point
// calls on CUDA tensors run over NCCL (nccl_backend.h), on a communicator created the first
// time a CUDA tensor reaches this group (every member must reach that call: for collectives
// the fingerprint, which records the device type, checks it; the fingerprint exchange stays
// on Gloo). Same byte counters, tracing, failure latch and errors; wait() blocks the host
// until the device finished (deadline: the Gloo group's timeout), then orders the stream set
// by set_cuda_stream after it. Tensors of one call must all be CPU or all CUDA. Built without
// NCCL, a CUDA tensor is an error.
class Communicator {
 public:
  // `ranks`: the group's global ranks in group order; `rank`: this process's global rank.
  // `store` / `key`: the job's store and a key prefix unique to this group (for
  // expect_all); without them expect_all is a no-op.
  Communicator(compat::BackendPtr group, std::vector<int> ranks, int rank, std::string name,
               c10::intrusive_ptr<c10d::Store> store = {}, std::string key = {});

  const std::string& name() const { return name_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  int group_rank() const { return group_rank_; }
  int global_rank() const { return ranks_[group_rank_]; }
  const std::vector<int>& ranks() const { return ranks_; }

  // Sum (or average) in place. bf16 buffers are summed in fp32 (see all_reduce_bf16).
  Handle all_reduce(at::Tensor buffer, bool average = false);
  // Element-wise maximum in place (fp32/fp64; e.g. the vocab-parallel softmax's row max).
  Handle all_reduce_max(at::Tensor buffer);
  // `input` holds size() equal chunks; `output` receives the sum of every rank's chunk
  // group_rank(), summed in fp32 (fp64 stays fp64) and stored in output's dtype, which may
  // be wider than input's (bf16 on the wire, an fp32 result). Over Gloo it runs as an all-to-all
  // plus a local sum, which sends the same (n-1)/n S bytes as a ring reduce-scatter.
  Handle reduce_scatter(at::Tensor output, at::Tensor input);
  // `output` (size() x input's numel) receives every rank's `input`, in group order.
  Handle all_gather(at::Tensor output, at::Tensor input);
  Handle broadcast(at::Tensor buffer, int root_group_rank);
  Handle send(at::Tensor buffer, int peer_group_rank, int tag = 0);
  Handle recv(at::Tensor buffer, int peer_group_rank, int tag = 0);
  // `send_buffer` to one peer and `recv_buffer` from another (maybe the same), started
  // together: over NCCL one grouped ncclSend/ncclRecv (two separate calls deadlock once a
  // message outgrows NCCL's buffers: every rank's send waits for a receive its peer queued
  // behind its own send, as in a ring); over Gloo two asynchronous operations. Wait on every
  // returned handle.
  std::vector<Handle> send_recv(at::Tensor send_buffer, int send_peer, at::Tensor recv_buffer, int recv_peer,
                                int tag = 0);
  // Equal splits: chunk j of `input` goes to rank j; chunk j of `output` comes from rank j.
  Handle all_to_all(at::Tensor output, at::Tensor input);
  // Uneven splits: input_splits[j] elements of the flat `input` go to rank j (in order);
  // output_splits[j] elements of the flat `output` come from rank j. Each rank's
  // output_splits[j] must equal rank j's input_splits[this rank] (the caller exchanges counts
  // first). The byte counter adds what this rank sends to the others.
  Handle all_to_all_v(at::Tensor output, at::Tensor input, const std::vector<int64_t>& output_splits,
                      const std::vector<int64_t>& input_splits);
  void barrier();

  // The CUDA stream the caller's kernels run on (a cudaStream_t), which NCCL operations are
  // ordered after and which waits for them. Default nullptr: the legacy default stream,
  // torch's current stream unless the caller switched streams (with torch's CUDA API:
  // set_cuda_stream(at::cuda::getCurrentCUDAStream().stream()) before the call).
  void set_cuda_stream(void* stream) { cuda_stream_ = stream; }
  void* cuda_stream() const { return cuda_stream_; }
  // Whether this group has created its NCCL communicator (a CUDA tensor reached it).
  bool uses_nccl() const { return static_cast<bool>(nccl_); }

  ByteCounters& counters() { return counters_; }
  const ByteCounters& counters() const { return counters_; }

  // After a collective fails (a peer died, a timeout, mismatched sizes) the group is in an
  // unknown state, as an aborted NCCL communicator is: every later collective on it, and
  // every wait on one in flight, fails at once with the first error (which names the rank,
  // the collective and the group), never with a misleading later one.
  bool failed() const { return !failure_->empty(); }
  const std::string& failure() const { return *failure_; }

  // What the caller is doing, carried in every fingerprint. The step counts the forwards
  // and train steps the engines on this group started (each engine advances it: a rank that
  // gave up a step after a local error is caught at its next collective); the phase is a
  // string literal naming the operation (a Phase scope sets it).
  void advance_step() { ++step_; }
  int64_t step() const { return step_; }
  const char* phase() const { return phase_; }
  class Phase {
   public:
    Phase(Communicator& group, const char* phase) : group_(group), previous_(group.phase_) { group.phase_ = phase; }
    ~Phase() { group_.phase_ = previous_; }
    Phase(const Phase&) = delete;
    Phase& operator=(const Phase&) = delete;

   private:
    Communicator& group_;
    const char* previous_;
  };
  bool checks_collectives() const { return check_; }
  // Marks this group's members as running on one node (the mesh does so for tp groups, by
  // LOCAL_WORLD_SIZE; members mark alike): small CPU all-reduces then run through shared
  // memory in the caller's thread (node_all_reduce.h), up to MONARCH_NODE_ALL_REDUCE_BYTES,
  // not through Gloo's threads and sockets. Slots are made at the first such call (a
  // collective) and regrown for a larger message; without shared memory Gloo stays. It is
  // synchronous (done when it returns): members must reach it in the same order relative to
  // their other groups' calls, as tensor parallelism's members (one program) do.
  void set_node_local(bool on) { node_local_ = on; }
  bool node_local() const { return node_local_; }
  // All-reduces that took the shared-memory path so far.
  int64_t node_all_reduces() const { return node_all_reduces_; }
  // Turns the agreement check off (or back on) for this rank's later collectives on this
  // group. Every member must switch between the same two collectives (a checked collective
  // on one side and an unchecked one on the other pair a fingerprint exchange with the data):
  // for a loop that runs the same collectives on every member, once it has run checked
  // (generate's decode steps after the first two: torch_monarch/generate.py).
  void set_checks_collectives(bool on) { check_ = on; }
  // Collectives checked so far (the fingerprint exchanges this group made).
  int64_t collectives_checked() const { return checked_; }

  // For operations only some ranks might call (a state dict on rank 0): every member
  // announces `what` through the store and waits, at most `deadline`, for the others'
  // announcements of the same call; if some never come it throws, naming them and saying
  // that every rank must call it, instead of entering a collective that would wait out the
  // whole timeout. The store wait leaves nothing pending, so the group stays usable.
  // While it waits, this rank's call is announced in the store (flight_recorder.h): a member
  // whose own collective fails meanwhile names it. The default deadline is entry_timeout()
  // of this group's collective timeout (the job's).
  void expect_all(const std::string& what);
  void expect_all(const std::string& what, std::chrono::milliseconds deadline);
  // The entry checks' deadline: MONARCH_ENTRY_TIMEOUT_S when set, else half of `job_timeout`
  // (so that the precise message of an entry check comes before any collective of the job
  // times out).
  static std::chrono::milliseconds entry_timeout(std::chrono::milliseconds job_timeout);

 private:
  enum class Op : int64_t { all_reduce = 1, all_reduce_average, all_reduce_max, reduce_scatter, all_gather,
                            broadcast, all_to_all, barrier, all_to_all_v };
  std::string describe(CollectiveKind kind, const at::Tensor& t) const;
  void check_usable() const;
  // The fingerprint exchange (see the class comment); throws on a mismatch.
  // `cuda`: the call's tensors are CUDA tensors (t.is_cuda() also counts), recorded in the
  // fingerprint so that a rank on CUDA and one on CPU fail here instead of hanging.
  void agree(Op op, const at::Tensor& t, int64_t root = -1, bool cuda = false);
  Handle make(compat::WorkPtr work, std::string what, std::function<void()> finish = {}) const {
    Handle handle(std::move(work), std::move(what), std::move(finish), failure_);
    handle.set_group(info_);
    return handle;
  }
  Handle all_reduce_bf16(at::Tensor buffer, bool average);
  // CUDA path (communicator.cpp). on_cuda: whether the call's tensors are CUDA tensors
  // (throws, naming `op`, when CPU and CUDA are mixed, or on a build without NCCL).
  bool on_cuda(const char* op, std::initializer_list<const at::Tensor*> tensors) const;
  std::shared_ptr<NcclBackend> nccl(const at::Tensor& t, const std::string& what);
  // The shared-memory path for this call, or nullptr (node_local_ off, the buffer does not
  // qualify, or the members cannot share memory). Makes or regrows the slots (collective).
  NodeAllReduce* node_path(const at::Tensor& buffer);
  std::shared_ptr<NcclBackend> nccl_;
  bool node_local_ = false;
  bool node_unavailable_ = false;  // a try to make the slots found no shared memory
  std::shared_ptr<NodeAllReduce> node_;
  int64_t node_all_reduces_ = 0;
  void* cuda_stream_ = nullptr;
  compat::BackendPtr group_;
  std::vector<int> ranks_;
  int group_rank_ = 0;
  std::string name_;
  ByteCounters counters_;
  std::shared_ptr<std::string> failure_ = std::make_shared<std::string>();
  c10::intrusive_ptr<c10d::Store> store_;
  std::string key_;
  bool check_ = true;
  int64_t checked_ = 0;
  int64_t step_ = 0;
  const char* phase_ = "a direct call";  // static strings only: the flight recorder keeps the pointer
  std::shared_ptr<const flight::CallGroup> call_group_;  // what the flight recorder's records share
  std::map<std::string, int64_t> expected_;  // expect_all calls per `what`
  int64_t issued_ = 0;                        // collectives issued (the flight recorder's numbers)
  // All-gathers and reduce-scatters over Gloo (point-to-point, communicator.cpp): each takes
  // its own tag, this count's, in [kCollectiveTags, 2 kCollectiveTags), above the pipeline's
  // and context parallelism's tags; members count alike (they issue collectives in one order).
  static constexpr int kCollectiveTags = 1 << 29;
  int64_t tagged_collectives_ = 0;
  int next_collective_tag() { return kCollectiveTags + static_cast<int>(tagged_collectives_++ % kCollectiveTags); }
  bool announced_ = false;                    // a failed entry check's note is still in the store
  std::shared_ptr<flight::GroupInfo> info_;   // announcements (with a store)
};

}  // namespace monarch
