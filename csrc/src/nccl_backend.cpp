#include "monarch/runtime/nccl_backend.h"

#include <cstring>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <c10/util/Exception.h>

namespace monarch {

namespace {

[[noreturn]] void fail(const std::string& where, const std::string& call, const std::string& error) {
  TORCH_CHECK(false, "monarch: ", where, ": ", call, " failed: ", error);
}

void check_cuda(cudaError_t status, const char* call, const std::string& where) {
  if (status != cudaSuccess) {
    fail(where, call, std::string(cudaGetErrorString(status)) + " (" + cudaGetErrorName(status) + ")");
  }
}

void check_nccl(ncclResult_t status, const char* call, const std::string& where) {
  if (status != ncclSuccess) {
    std::string detail = ncclGetErrorString(status);
    const char* last = ncclGetLastError(nullptr);
    if (last != nullptr && *last != '\0') detail += std::string(" (") + last + ")";
    fail(where, call, detail);
  }
}

#define MONARCH_CUDA(call, where) check_cuda((call), #call, (where))
#define MONARCH_NCCL(call, where) check_nccl((call), #call, (where))

// Makes `device` current for a scope, restoring the previous one.
class DeviceScope {
 public:
  DeviceScope(int device, const std::string& where) {
    MONARCH_CUDA(cudaGetDevice(&previous_), where);
    if (previous_ != device) MONARCH_CUDA(cudaSetDevice(device), where);
    changed_ = previous_ != device;
  }
  ~DeviceScope() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace

ncclDataType_t nccl_dtype(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return ncclFloat32;
    case c10::ScalarType::Double: return ncclFloat64;
    case c10::ScalarType::Half: return ncclFloat16;
    case c10::ScalarType::BFloat16: return ncclBfloat16;
    case c10::ScalarType::Char: return ncclInt8;
    case c10::ScalarType::Byte: return ncclUint8;
    case c10::ScalarType::Int: return ncclInt32;
    case c10::ScalarType::Long: return ncclInt64;
    default: break;
  }
  TORCH_CHECK(false, "monarch: NCCL has no data type for ", type,
              " (supported: Float, Double, Half, BFloat16, Char, Byte, Int, Long)");
  return ncclFloat32;  // not reached
}

int nccl_version() {
  int version = 0;
  MONARCH_NCCL(ncclGetVersion(&version), "nccl_version");
  return version;
}

// ---- NcclWork --------------------------------------------------------------------------

NcclWork::NcclWork(std::shared_ptr<NcclBackend> backend, cudaEvent_t event, cudaStream_t caller, std::string op)
    : backend_(std::move(backend)), event_(event), caller_(caller), op_(std::move(op)) {}

NcclWork::~NcclWork() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

bool NcclWork::ready() const {
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaSuccess) return true;
  if (status == cudaErrorNotReady) return false;
  check_cuda(status, "cudaEventQuery", backend_->describe(op_));
  return false;
}

void NcclWork::wait() {
  NcclBackend& b = *backend_;
  const std::string where = b.describe(op_);
  DeviceScope device(b.device_, where);
  const auto deadline = std::chrono::steady_clock::now() + b.timeout_;
  auto pause = std::chrono::microseconds(1);
  while (true) {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaSuccess) break;
    if (status != cudaErrorNotReady) check_cuda(status, "cudaEventQuery", where);
    {
      std::lock_guard<std::mutex> lock(b.mutex_);
      if (!b.aborted_.empty()) {
        TORCH_CHECK(false, "monarch: ", where, " failed: the NCCL communicator was aborted: ", b.aborted_);
      }
      ncclResult_t async = ncclSuccess;
      MONARCH_NCCL(ncclCommGetAsyncError(b.comm_, &async), where);
      if (async != ncclSuccess && async != ncclInProgress) {
        std::string error = std::string("NCCL asynchronous error: ") + ncclGetErrorString(async);
        b.abort_locked(error);
        TORCH_CHECK(false, "monarch: ", where, " failed: ", error, " (communicator aborted)");
      }
      if (std::chrono::steady_clock::now() > deadline) {
        std::ostringstream error;
        error << "timed out after " << b.timeout_.count() / 1000.0
              << " s (a peer died, hangs, or never made this call)";
        b.abort_locked(error.str());
        TORCH_CHECK(false, "monarch: ", where, " ", error.str(), "; the NCCL communicator was aborted");
      }
    }
    std::this_thread::sleep_for(pause);
    if (pause < std::chrono::milliseconds(1)) pause *= 2;
  }
  MONARCH_CUDA(cudaStreamWaitEvent(caller_, event_, 0), where);
}

// ---- NcclBackend -----------------------------------------------------------------------

NcclBackend::NcclBackend(std::vector<int> ranks, int group_rank, int device, std::string name,
                         std::chrono::milliseconds timeout)
    : ranks_(std::move(ranks)), group_rank_(group_rank), device_(device), name_(std::move(name)), timeout_(timeout) {}

std::shared_ptr<NcclBackend> NcclBackend::create(std::vector<int> ranks, int group_rank, int device,
                                                 const c10::intrusive_ptr<c10d::Store>& store, const std::string& key,
                                                 std::string name, std::chrono::milliseconds timeout) {
  TORCH_CHECK(group_rank >= 0 && group_rank < static_cast<int>(ranks.size()), "monarch: NCCL group '", name,
              "': group rank ", group_rank, " out of range");
  std::shared_ptr<NcclBackend> backend(
      new NcclBackend(std::move(ranks), group_rank, device, std::move(name), timeout));
  backend->init(store, key);
  return backend;
}

std::string NcclBackend::describe(const std::string& op) const {
  std::ostringstream out;
  out << "rank " << ranks_[group_rank_] << ": " << op << " on group '" << name_ << "' (ranks";
  for (int r : ranks_) out << " " << r;
  out << ", NCCL, cuda:" << device_ << ")";
  return out.str();
}

void NcclBackend::init(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key) {
  const std::string where = describe("creating the NCCL communicator");
  int devices = 0;
  MONARCH_CUDA(cudaGetDeviceCount(&devices), where);
  TORCH_CHECK(device_ >= 0 && device_ < devices, "monarch: ", where, ": device cuda:", device_,
              " does not exist (", devices, " CUDA devices)");
  TORCH_CHECK(store, "monarch: ", where, ": the group has no store to exchange the NCCL unique id through");
  DeviceScope scope(device_, where);
  ncclUniqueId id;
  const std::string id_key = key + "/nccl_id";
  if (group_rank_ == 0) {
    MONARCH_NCCL(ncclGetUniqueId(&id), where);
    std::vector<uint8_t> bytes(sizeof(id));
    std::memcpy(bytes.data(), &id, sizeof(id));
    store->set(id_key, bytes);
  } else {
    const std::vector<uint8_t> bytes = store->get(id_key);  // waits for rank 0 (store timeout)
    TORCH_CHECK(bytes.size() == sizeof(id), "monarch: ", where, ": the store's ", id_key, " holds ", bytes.size(),
                " bytes, an ncclUniqueId has ", sizeof(id));
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  MONARCH_NCCL(ncclCommInitRank(&comm_, size(), id, group_rank_), where);
  MONARCH_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), where);
  MONARCH_CUDA(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), where);
}

NcclBackend::~NcclBackend() {
  // Nothing may throw here. Works hold the backend alive, so an operation can only still be
  // in flight when its work was dropped without wait(): give it the timeout to finish, then
  // abort rather than hang (ncclCommDestroy waits for outstanding operations).
  int previous = 0;
  const bool restore = cudaGetDevice(&previous) == cudaSuccess && previous != device_;
  if (restore) cudaSetDevice(device_);
  if (comm_ != nullptr) {  // null once aborted (ncclCommAbort frees it)
    bool finished = stream_ == nullptr;
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (!finished && std::chrono::steady_clock::now() < deadline) {
      const cudaError_t status = cudaStreamQuery(stream_);
      finished = status != cudaErrorNotReady;  // done, or an error that waiting will not fix
      if (!finished) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (finished && (stream_ == nullptr || cudaStreamQuery(stream_) == cudaSuccess)) {
      ncclCommDestroy(comm_);
    } else {
      ncclCommAbort(comm_);
    }
  }
  if (ready_ != nullptr) cudaEventDestroy(ready_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (restore) cudaSetDevice(previous);
}

bool NcclBackend::aborted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !aborted_.empty();
}

void NcclBackend::abort_locked(const std::string& why) {
  if (!aborted_.empty()) return;
  aborted_ = why;
  // ncclCommAbort frees the communicator: the destructor must not touch it again.
  if (comm_ != nullptr) ncclCommAbort(comm_);
  comm_ = nullptr;
}

void NcclBackend::check_usable_locked(const std::string& what) const {
  TORCH_CHECK(aborted_.empty(), "monarch: ", what, ": the NCCL communicator was aborted earlier: ", aborted_);
}

template <class F>
NcclWorkPtr NcclBackend::run(const std::string& op, cudaStream_t caller, F&& enqueue) {
  const std::string where = describe(op);
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable_locked(where);
  DeviceScope scope(device_, where);
  // The caller's pending work (e.g. the kernels that wrote the input) comes first.
  MONARCH_CUDA(cudaEventRecord(ready_, caller), where);
  MONARCH_CUDA(cudaStreamWaitEvent(stream_, ready_, 0), where);
  enqueue(where);
  cudaEvent_t done = nullptr;
  MONARCH_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), where);
  const cudaError_t recorded = cudaEventRecord(done, stream_);
  if (recorded != cudaSuccess) cudaEventDestroy(done);
  check_cuda(recorded, "cudaEventRecord", where);
  return std::make_shared<NcclWork>(shared_from_this(), done, caller, op);
}

NcclWorkPtr NcclBackend::all_reduce(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                                    ncclRedOp_t op, cudaStream_t caller) {
  return run("all_reduce", caller, [&](const std::string& where) {
    MONARCH_NCCL(ncclAllReduce(send, recv, count, dtype, op, comm_, stream_), where);
  });
}

NcclWorkPtr NcclBackend::reduce_scatter(const void* send, void* recv, size_t recv_count, ncclDataType_t dtype,
                                        ncclRedOp_t op, cudaStream_t caller) {
  return run("reduce_scatter", caller, [&](const std::string& where) {
    MONARCH_NCCL(ncclReduceScatter(send, recv, recv_count, dtype, op, comm_, stream_), where);
  });
}

NcclWorkPtr NcclBackend::all_gather(const void* send, void* recv, size_t send_count, ncclDataType_t dtype,
                                    cudaStream_t caller) {
  return run("all_gather", caller, [&](const std::string& where) {
    MONARCH_NCCL(ncclAllGather(send, recv, send_count, dtype, comm_, stream_), where);
  });
}

NcclWorkPtr NcclBackend::broadcast(void* buffer, size_t count, ncclDataType_t dtype, int root, cudaStream_t caller) {
  TORCH_CHECK(root >= 0 && root < size(), "monarch: ", describe("broadcast"), ": root ", root, " not in the group");
  return run("broadcast", caller, [&](const std::string& where) {
    MONARCH_NCCL(ncclBroadcast(buffer, buffer, count, dtype, root, comm_, stream_), where);
  });
}

NcclWorkPtr NcclBackend::send(const void* buffer, size_t count, ncclDataType_t dtype, int peer, cudaStream_t caller) {
  TORCH_CHECK(peer >= 0 && peer < size() && peer != group_rank_, "monarch: ", describe("send"), ": bad peer ", peer);
  return run("send to group rank " + std::to_string(peer), caller, [&](const std::string& where) {
    MONARCH_NCCL(ncclSend(buffer, count, dtype, peer, comm_, stream_), where);
  });
}

NcclWorkPtr NcclBackend::recv(void* buffer, size_t count, ncclDataType_t dtype, int peer, cudaStream_t caller) {
  TORCH_CHECK(peer >= 0 && peer < size() && peer != group_rank_, "monarch: ", describe("recv"), ": bad peer ", peer);
  return run("recv from group rank " + std::to_string(peer), caller, [&](const std::string& where) {
    MONARCH_NCCL(ncclRecv(buffer, count, dtype, peer, comm_, stream_), where);
  });
}

namespace {

size_t element_bytes(ncclDataType_t dtype) {
  switch (dtype) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default: break;
  }
  TORCH_CHECK(false, "monarch: unexpected ncclDataType_t ", static_cast<int>(dtype));
  return 0;  // not reached
}

// Grouped calls: ncclGroupEnd is reached even when a call inside fails (NCCL requires the
// group to be closed), and the first error is reported.
template <class F>
void grouped(const std::string& where, F&& calls) {
  MONARCH_NCCL(ncclGroupStart(), where);
  try {
    calls();
  } catch (...) {
    ncclGroupEnd();
    throw;
  }
  MONARCH_NCCL(ncclGroupEnd(), where);
}

}  // namespace

NcclWorkPtr NcclBackend::all_to_all(const void* send, void* recv, size_t chunk, ncclDataType_t dtype,
                                    cudaStream_t caller) {
  const size_t bytes = chunk * element_bytes(dtype);
  return run("all_to_all", caller, [&](const std::string& where) {
    grouped(where, [&] {
      for (int peer = 0; peer < size(); ++peer) {
        MONARCH_NCCL(ncclSend(static_cast<const char*>(send) + peer * bytes, chunk, dtype, peer, comm_, stream_), where);
        MONARCH_NCCL(ncclRecv(static_cast<char*>(recv) + peer * bytes, chunk, dtype, peer, comm_, stream_), where);
      }
    });
  });
}

NcclWorkPtr NcclBackend::send_recv_group(const std::vector<NcclP2P>& ops, cudaStream_t caller) {
  std::ostringstream op;
  op << "grouped send/recv (";
  for (size_t i = 0; i < ops.size(); ++i) {
    TORCH_CHECK(ops[i].peer >= 0 && ops[i].peer < size(), "monarch: ",
                describe("send_recv_group"), ": bad peer ", ops[i].peer);
    op << (i ? ", " : "") << (ops[i].send ? "send to " : "recv from ") << ops[i].peer;
  }
  op << ")";
  return run(op.str(), caller, [&](const std::string& where) {
    grouped(where, [&] {
      for (const NcclP2P& p : ops) {
        if (p.send) {
          MONARCH_NCCL(ncclSend(p.buffer, p.count, p.dtype, p.peer, comm_, stream_), where);
        } else {
          MONARCH_NCCL(ncclRecv(p.buffer, p.count, p.dtype, p.peer, comm_, stream_), where);
        }
      }
    });
  });
}

}  // namespace monarch
