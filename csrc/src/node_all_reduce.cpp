#include "monarch/runtime/node_all_reduce.h"

#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include "monarch/runtime/communicator.h"
#include "monarch/runtime/shared_memory.h"

namespace monarch {

namespace {

// The path's own tensor operations (the slots' setup, views of them, the sum) are the runtime's,
// not the caller's: a Python dispatch mode the caller runs under (a TorchDispatchMode counting
// or watching operators, as torch.compile's tracing and the tests' width watch do) does not see
// them, as it does not see Gloo's. What torch._C._DisableTorchDispatch excludes.
struct HiddenFromPythonModes {
  c10::impl::ExcludeDispatchKeyGuard guard{
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot})};
};

// Each member's slot: a control page, then two data areas used by alternate calls. Call m
// writes area m % 2: a member can only start call m + 2 after every member announced call
// m + 1, which each does only after it finished reading call m's areas, so one announcement
// per call is the only synchronisation needed.
constexpr int64_t kControl = 4096;
constexpr int64_t kSeq = 0;       // int64: the last call this member announced
constexpr int64_t kPid = 64;      // int64: this member's process id (for the liveness check)
constexpr int64_t kEpoch = 128;   // uint32, member 0's slot only: bumped by every announcement (the futex word)
constexpr int64_t kSleepers = 192;  // int32, member 0's slot only: members waiting on the futex

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

uint8_t* base_of(const NodeSharedBuffer& shared, int member) {
  return static_cast<uint8_t*>(shared.slot(member).data_ptr());
}
int64_t* seq_of(const NodeSharedBuffer& shared, int member) {
  return reinterpret_cast<int64_t*>(base_of(shared, member) + kSeq);
}
uint32_t* epoch_of(const NodeSharedBuffer& shared) { return reinterpret_cast<uint32_t*>(base_of(shared, 0) + kEpoch); }
int32_t* sleepers_of(const NodeSharedBuffer& shared) {
  return reinterpret_cast<int32_t*>(base_of(shared, 0) + kSleepers);
}

// FUTEX_WAIT without FUTEX_PRIVATE_FLAG: the word is shared between processes.
void futex_wait(uint32_t* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout_ns / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout_ns % 1000000000);
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void futex_wake_all(uint32_t* word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

int cores_available() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

// Whether process `pid` has exited: gone, or a zombie its parent has not reaped yet (a
// launcher that polls its children reaps late).
bool process_gone(pid_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos || close + 2 >= text.size()) return false;
  const char state = text[close + 2];
  return state == 'Z' || state == 'X';
}

}  // namespace

bool NodeAllReduce::summable(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

int64_t NodeAllReduce::limit_bytes() {
  const char* value = std::getenv("MONARCH_NODE_ALL_REDUCE_BYTES");
  // Unset: 256 KiB, what a tp decode or a small model's activations all-reduce (a [4, 512]
  // fp32 step is 8 KiB); larger messages keep Gloo's ring (docs/communication.md).
  if (value == nullptr || *value == '\0') return 256 * 1024;
  char* end = nullptr;
  const long long v = std::strtoll(value, &end, 10);
  TORCH_CHECK(*end == '\0' && v >= 0, "monarch: MONARCH_NODE_ALL_REDUCE_BYTES='", value,
              "' is not a byte count (0 turns the shared-memory all-reduce off)");
  return static_cast<int64_t>(v);
}

bool NodeAllReduce::fits(const at::Tensor& buffer) const {
  return buffer.device().is_cpu() && buffer.is_contiguous() && summable(buffer.scalar_type()) &&
         buffer.numel() * static_cast<int64_t>(buffer.element_size()) <= capacity_;
}

std::unique_ptr<NodeAllReduce> NodeAllReduce::create(Communicator& group, int64_t capacity_bytes,
                                                     std::chrono::milliseconds timeout) {
  TORCH_CHECK(capacity_bytes > 0, "monarch: shared-memory all-reduce of ", capacity_bytes, " bytes");
  const HiddenFromPythonModes hidden;
  const int64_t stride = round_up(capacity_bytes, 4096);  // each data area page-aligned
  auto shared = NodeSharedBuffer::create(group, kControl + 2 * stride, at::kByte);
  if (!shared) return nullptr;
  std::unique_ptr<NodeAllReduce> out(new NodeAllReduce());
  out->shared_ = std::move(shared);
  out->capacity_ = capacity_bytes;  // not the rounded size: the limit stays the limit
  out->stride_ = stride;
  out->me_ = group.group_rank();
  out->size_ = group.size();
  out->spin_ = group.size() <= cores_available();
  out->timeout_ = timeout;
  out->group_name_ = group.name();
  out->ranks_ = group.ranks();
  *reinterpret_cast<int64_t*>(base_of(*out->shared_, out->me_) + kPid) = static_cast<int64_t>(getpid());
  group.barrier();  // every member's pid is written before anyone may need it
  return out;
}

NodeAllReduce::~NodeAllReduce() = default;

void NodeAllReduce::wait_for_all(int64_t call) {
  const NodeSharedBuffer& shared = *shared_;
  const auto arrived = [&] {
    for (int j = 0; j < size_; ++j) {
      if (__atomic_load_n(seq_of(shared, j), __ATOMIC_ACQUIRE) < call) return false;
    }
    return true;
  };
  // Members doing the same work arrive within microseconds of each other. When every member
  // has a core of its own, poll (busy, then yielding) before sleeping on the futex. With more
  // members than cores, a polling member holds a core a late member needs for the rest of
  // its time slice (sched_yield does not hand it over: measured 4 ranks on 2 cores, 4-7 ms
  // per 1 KiB all-reduce with 0.5 ms of yielding first): sleep at once, freeing the core.
  const auto start = std::chrono::steady_clock::now();
  if (spin_) {
    for (int i = 0; i < 4000; ++i) {
      if (arrived()) return;
      cpu_relax();
    }
    while (std::chrono::steady_clock::now() - start < std::chrono::microseconds(500)) {
      if (arrived()) return;
      sched_yield();
    }
  }
  uint32_t* epoch = epoch_of(shared);
  int32_t* sleepers = sleepers_of(shared);
  auto next_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  const auto deadline = start + timeout_;
  while (true) {
    const uint32_t seen = __atomic_load_n(epoch, __ATOMIC_SEQ_CST);
    if (arrived()) return;
    __atomic_fetch_add(sleepers, 1, __ATOMIC_SEQ_CST);
    futex_wait(epoch, seen, 10'000'000);
    __atomic_fetch_sub(sleepers, 1, __ATOMIC_SEQ_CST);
    if (arrived()) return;
    const auto now = std::chrono::steady_clock::now();
    if (now < next_check && now < deadline) continue;
    next_check = now + std::chrono::milliseconds(100);
    std::ostringstream missing, exited;
    for (int j = 0; j < size_; ++j) {
      if (__atomic_load_n(seq_of(shared, j), __ATOMIC_ACQUIRE) >= call) continue;
      const auto pid = static_cast<pid_t>(*reinterpret_cast<const int64_t*>(base_of(shared, j) + kPid));
      missing << (missing.tellp() > 0 ? ", " : "") << "rank " << ranks_[j];
      if (process_gone(pid)) {
        exited << (exited.tellp() > 0 ? ", " : "") << "rank " << ranks_[j] << " (pid " << pid << ")";
      }
    }
    TORCH_CHECK(exited.tellp() == 0, "shared-memory all-reduce #", call, " on group ", group_name_, ": ",
                exited.str(), " exited before arriving");
    TORCH_CHECK(now < deadline, "shared-memory all-reduce #", call, " on group ", group_name_, ": ", missing.str(),
                " did not arrive within ", timeout_.count() / 1000.0, " s (the group's timeout)");
  }
}

void NodeAllReduce::all_reduce(at::Tensor& buffer, bool average) {
  TORCH_CHECK(fits(buffer), "monarch: shared-memory all-reduce on group ", group_name_, " cannot take a ",
              buffer.scalar_type(), " buffer of ", buffer.numel(), " elements (capacity ", capacity_, " bytes)");
  const HiddenFromPythonModes hidden;
  const int64_t call = ++calls_;
  const int64_t area = kControl + (call % 2) * stride_;
  const int64_t bytes = buffer.numel() * static_cast<int64_t>(buffer.element_size());
  std::memcpy(base_of(*shared_, me_) + area, buffer.data_ptr(), static_cast<size_t>(bytes));
  __atomic_store_n(seq_of(*shared_, me_), call, __ATOMIC_SEQ_CST);
  __atomic_fetch_add(epoch_of(*shared_), 1u, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(sleepers_of(*shared_), __ATOMIC_SEQ_CST) > 0) futex_wake_all(epoch_of(*shared_));
  wait_for_all(call);
  // Everyone's data is in: sum in group order (the same operations on every member, so the
  // same bits), narrow types in fp32.
  const at::ScalarType dtype = buffer.scalar_type();
  const auto part = [&](int j) {
    return shared_->slot(j).narrow(0, area, bytes).view(dtype).view(buffer.sizes());
  };
  at::NoGradGuard no_grad;
  const bool narrow = dtype == at::kBFloat16 || dtype == at::kHalf;
  at::Tensor sum = narrow ? part(0).to(at::kFloat) : buffer;
  if (!narrow) sum.copy_(part(0));
  for (int j = 1; j < size_; ++j) sum.add_(part(j));
  if (average) {
    if (at::isIntegralType(dtype, false)) {
      sum.div_(size_, "floor");
    } else {
      sum.div_(size_);
    }
  }
  if (narrow) buffer.copy_(sum);
}

}  // namespace monarch
