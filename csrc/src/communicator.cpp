#include "monarch/runtime/communicator.h"

#include "monarch/runtime/flight_recorder.h"


#include "monarch/runtime/gloo_group.h"
#include "monarch/runtime/log.h"
#include "monarch/runtime/node_all_reduce.h"
#include "monarch/runtime/shared_memory.h"
#include "monarch/runtime/trace.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#include <c10/util/Exception.h>

#ifdef MONARCH_WITH_NCCL
#include "monarch/runtime/nccl_backend.h"
#endif

namespace monarch {

std::string to_string(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::all_reduce: return "all_reduce";
    case CollectiveKind::reduce_scatter: return "reduce_scatter";
    case CollectiveKind::all_gather: return "all_gather";
    case CollectiveKind::broadcast: return "broadcast";
    case CollectiveKind::send: return "send";
    case CollectiveKind::recv: return "recv";
    case CollectiveKind::all_to_all: return "all_to_all";
  }
  return "?";
}

double ByteCounters::total() const {
  double sum = 0;
  for (const auto& b : bytes_) sum += b.load();
  return sum;
}

void ByteCounters::reset() {
  for (auto& b : bytes_) b.store(0);
}

Handle::Handle(compat::WorkPtr work, std::string what, std::function<void()> finish,
               std::shared_ptr<std::string> failure)
    : work_(std::move(work)), what_(std::move(what)), finish_(std::move(finish)), failure_(std::move(failure)) {}

Handle Handle::completion(std::function<void()> waiter, std::string what, std::function<void()> finish,
                          std::shared_ptr<std::string> failure) {
  Handle handle(compat::WorkPtr(), std::move(what), std::move(finish), std::move(failure));
  handle.waiter_ = std::move(waiter);
  return handle;
}

void Handle::wait() {
  if (waited_ || (!work_ && !waiter_)) return;
  waited_ = true;
  if (failure_ && !failure_->empty()) {
    TORCH_CHECK(false, what_, " abandoned: the group failed earlier: ", *failure_);
  }
  std::string error;
  try {
    if (work_) {
      work_->wait();
    } else {
      waiter_();
    }
    if (finish_) finish_();  // may run a second phase (bf16 all-reduce)
    if (trace_kind_ != nullptr) {
      trace::Event e;
      e.name = trace_kind_;
      e.category = "collective";
      e.start_ns = trace_start_ns_;
      e.end_ns = trace::now_ns();
      e.bytes = trace_bytes_;
      e.group = trace_group_;
      trace::record(std::move(e));
    }
    return;
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::string message = what_ + " failed: " + error;
  const bool first = failure_ && failure_->empty();
  if (first) flight::dump(message);  // before reading the store, which may be slow or gone
  if (group_) {
    const std::string others = flight::others(*group_);
    if (!others.empty()) message += "\n  meanwhile " + others;
  }
  if (first) {
    *failure_ = message;
    log::error("comm", message);  // once per group: later calls repeat it
  }
  TORCH_CHECK(false, message);
}

Handle Handle::traced(const char* kind, double bytes, const std::string& group) && {
  if ((work_ || waiter_) && trace::Recorder::instance().enabled()) {
    trace_kind_ = kind;
    trace_bytes_ = bytes;
    trace_group_ = group;
    trace_start_ns_ = trace::now_ns();
  }
  return std::move(*this);
}

void Communicator::check_usable() const {
  TORCH_CHECK(failure_->empty(), "monarch: rank ", global_rank(), ": group '", name_,
              "' cannot be used after a failed collective (every later call fails the same way): ", *failure_);
}

namespace {

bool checks_from_environment() {
  const char* value = std::getenv("MONARCH_CHECK_COLLECTIVES");
  if (value == nullptr || *value == '\0') return true;
  const std::string v(value);
  if (v == "off" || v == "0") return false;
  TORCH_CHECK(v == "all" || v == "1", "monarch: MONARCH_CHECK_COLLECTIVES must be 'all' or 'off', got '", v, "'");
  return true;
}

}  // namespace

Communicator::Communicator(compat::BackendPtr group, std::vector<int> ranks, int rank, std::string name,
                           c10::intrusive_ptr<c10d::Store> store, std::string key)
    : group_(std::move(group)),
      ranks_(std::move(ranks)),
      name_(std::move(name)),
      store_(std::move(store)),
      key_(std::move(key)),
      check_(checks_from_environment()) {
  group_rank_ = -1;
  for (size_t i = 0; i < ranks_.size(); ++i) {
    if (ranks_[i] == rank) group_rank_ = static_cast<int>(i);
  }
  TORCH_INTERNAL_ASSERT(group_rank_ >= 0, "rank ", rank, " not in group ", name_);
  flight::set_rank(rank);
  call_group_ = std::make_shared<const flight::CallGroup>(flight::CallGroup{name_, key_, ranks_});
  if (store_ && size() > 1) {
    auto info = std::make_shared<flight::GroupInfo>();
    info->name = name_;
    info->key = key_;
    info->ranks = ranks_;
    info->global_rank = rank;
    auto store = store_;
    info->check = [store](const std::string& k) { return store->check({k}); };
    info->get = [store](const std::string& k) {
      const auto bytes = store->get(k);
      return std::string(bytes.begin(), bytes.end());
    };
    info->set = [store](const std::string& k, const std::string& v) {
      store->set(k, std::vector<uint8_t>(v.begin(), v.end()));
    };
    flight::register_group(info);
    info_ = std::move(info);
  }
}

std::string Communicator::describe(CollectiveKind kind, const at::Tensor& t) const {
  std::ostringstream out;
  out << "rank " << global_rank() << ": " << to_string(kind) << " of " << t.numel() << " "
      << t.scalar_type() << " on group '" << name_ << "' (ranks";
  for (int r : ranks_) out << " " << r;
  out << ") in " << phase_ << ", step " << step_;
  return out.str();
}

namespace {

// Fingerprint layout (int64 words): what must agree, then the phase's text for messages.
constexpr int64_t kMagic = 0x4d4f4e4152434821;  // tells a fingerprint from garbage
constexpr int kWords = 16;
constexpr int kCompared = 8;  // magic, collective number, step, op, dtype, numel, root, phase hash
constexpr int kTextBytes = (kWords - kCompared) * 8;
constexpr int64_t kCudaFlag = int64_t{1} << 16;  // or-ed into the dtype word for CUDA tensors

int64_t phase_hash(const char* text) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (const char* c = text; *c; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
  return static_cast<int64_t>(h >> 1);
}

const char* op_name(int64_t op) {
  switch (op) {
    case 1: return "all_reduce (sum)";
    case 2: return "all_reduce (average)";
    case 3: return "all_reduce (max)";
    case 4: return "reduce_scatter";
    case 5: return "all_gather";
    case 6: return "broadcast";
    case 7: return "all_to_all";
    case 8: return "barrier";
    case 9: return "all_to_all_v";
  }
  return "an unknown operation";
}

std::string describe_fingerprint(const int64_t* w) {
  if (w[0] != kMagic) return "sent something that is not a collective fingerprint (a call outside monarch on this group?)";
  std::ostringstream out;
  out << op_name(w[3]);
  if (w[3] != 8) {
    out << " of " << w[5] << " " << c10::toString(static_cast<at::ScalarType>(w[4] & (kCudaFlag - 1)));
    if (w[4] >= 0 && (w[4] & kCudaFlag) != 0) out << " on CUDA";
  }
  if (w[3] == 6) out << " from group rank " << w[6];
  char text[kTextBytes + 1] = {};
  std::memcpy(text, w + kCompared, kTextBytes);
  out << " in " << text << ", step " << w[2] << " (collective #" << w[1] << " on this group)";
  return out.str();
}

}  // namespace

void Communicator::agree(Op op, const at::Tensor& t, int64_t root, bool cuda) {
  if (size() == 1) return;
  {
    flight::Call call;
    call.group = call_group_;
    call.seq = issued_++;
    call.op = op_name(static_cast<int64_t>(op));
    call.numel = t.defined() ? t.numel() : 0;
    call.dtype = t.defined() ? c10::toString(t.scalar_type()) : "";
    call.phase = phase_;  // a static string (Phase's argument)
    call.step = step_;
    call.time_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::system_clock::now().time_since_epoch()).count();
    flight::record(call);
  }
  if (announced_ && info_) {
    // An entry check that gave up left its note for the peers; this rank went on (it caught
    // the error): the note no longer says where it is.
    flight::withdraw(*info_);
    announced_ = false;
  }
  if (!check_) return;
  auto mine = at::zeros({kWords}, at::kLong);
  int64_t* w = mine.data_ptr<int64_t>();
  w[0] = kMagic;
  w[1] = checked_++;
  w[2] = step_;
  w[3] = static_cast<int64_t>(op);
  w[4] = t.defined() ? static_cast<int64_t>(t.scalar_type()) | ((cuda || t.is_cuda()) ? kCudaFlag : 0) : -1;
  w[5] = t.defined() ? t.numel() : 0;
  w[6] = root;
  w[7] = phase_hash(phase_);
  std::strncpy(reinterpret_cast<char*>(w + kCompared), phase_, kTextBytes - 1);
  auto all = at::empty({size(), kWords}, at::kLong);
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (const auto& row : all.unbind(0)) outputs[0].push_back(row);
  std::vector<at::Tensor> inputs{mine};
  std::ostringstream what;
  what << "rank " << global_rank() << ": agreement check before " << op_name(w[3]) << " of " << w[5]
       << " elements on group '" << name_ << "' (ranks";
  for (int r : ranks_) what << " " << r;
  what << ") in " << phase_ << ", step " << step_;
  make(group_->allgather(outputs, inputs), what.str()).wait();
  const int64_t* got = all.data_ptr<int64_t>();
  bool same = true;
  for (int r = 1; r < size() && same; ++r) {
    same = std::equal(got, got + kCompared, got + r * kWords);
  }
  if (same) return;
  std::ostringstream msg;
  msg << "monarch: rank " << global_rank() << ": the ranks of group '" << name_
      << "' are not making the same collective call:";
  bool state_dict = false;
  for (int r = 0; r < size(); ++r) {
    msg << "\n  rank " << ranks_[r] << ": " << describe_fingerprint(got + r * kWords);
    char text[kTextBytes + 1] = {};
    std::memcpy(text, got + r * kWords + kCompared, kTextBytes);
    state_dict = state_dict || std::strstr(text, "state_dict") != nullptr;
  }
  msg << "\nEvery rank must make the same collectives in the same order, with the same sizes: a rank "
         "skipped or added a call (an exception caught on one rank only, a call made on some ranks), "
         "or the ranks were given different batch sizes or options.";
  if (state_dict) msg << " A sharded model's state_dict() / load_state_dict() is collective: call it on every rank.";
  *failure_ = msg.str();
  flight::dump(msg.str());
  TORCH_CHECK(false, msg.str());
}

std::chrono::milliseconds Communicator::entry_timeout(std::chrono::milliseconds job_timeout) {
  const char* value = std::getenv("MONARCH_ENTRY_TIMEOUT_S");
  double seconds = job_timeout.count() / 2000.0;
  if (value != nullptr && *value != '\0') {
    char* end = nullptr;
    seconds = std::strtod(value, &end);
    TORCH_CHECK(end != value && *end == '\0' && seconds > 0, "monarch: MONARCH_ENTRY_TIMEOUT_S must be a positive "
                "number of seconds, got '", value, "'");
  }
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

void Communicator::expect_all(const std::string& what) {
  expect_all(what, entry_timeout(gloo_group::timeout(group_)));
}

void Communicator::expect_all(const std::string& what, std::chrono::milliseconds deadline) {
  if (size() == 1 || !store_) return;
  check_usable();
  const int64_t call = expected_[what];
  const std::string prefix = key_ + "/expect/" + what + "/" + std::to_string(call) + "/";
  const std::string mine = prefix + std::to_string(global_rank());
  store_->set(mine, std::vector<uint8_t>{1});
  if (info_) {
    flight::announce(*info_, what + " (call #" + std::to_string(call) + " on group '" + name_ + "', step " +
                                 std::to_string(step_) + ")");
  }
  // Polled with check(), not a store wait with a timeout: nothing stays pending in the
  // store after a deadline passes.
  const auto start = std::chrono::steady_clock::now();
  std::vector<int> missing;
  for (int r : ranks_) {
    if (r != global_rank()) missing.push_back(r);
  }
  while (!missing.empty()) {
    std::vector<int> still;
    for (int r : missing) {
      if (!store_->check({prefix + std::to_string(r)})) still.push_back(r);
    }
    missing = std::move(still);
    if (missing.empty() || std::chrono::steady_clock::now() - start > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (missing.empty()) {
    ++expected_[what];
    if (info_) flight::withdraw(*info_);
    return;
  }
  // Withdrawn, and the call number not used up: a later call on this rank pairs with the
  // peers' first one, and a peer arriving late does not pass on this rank's stale key.
  store_->deleteKey(mine);
  std::ostringstream msg;
  msg << "monarch: rank " << global_rank() << " called " << what << " (call #" << call << " on group '" << name_
      << "', ranks";
  for (int r : ranks_) msg << " " << r;
  msg << ") but rank" << (missing.size() > 1 ? "s" : "");
  for (int r : missing) msg << " " << r;
  const char* env = std::getenv("MONARCH_ENTRY_TIMEOUT_S");
  announced_ = info_ != nullptr;  // left for the peers to read; withdrawn at this rank's next collective
  msg << " did not call it within " << deadline.count() / 1000.0 << " s ("
      << ((env != nullptr && *env != '\0') ? "MONARCH_ENTRY_TIMEOUT_S"
                                            : "half the job's timeout; MONARCH_ENTRY_TIMEOUT_S sets it")
      << "): " << what
      << " is collective on a sharded or parallel model, so every rank must call it (for a checkpoint: call it on "
         "every rank, then save on rank 0 only).";
  flight::dump(msg.str());
  TORCH_CHECK(false, msg.str());
}

namespace {

void require_flat(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined() && t.is_contiguous(), "monarch: ", what, " must be a defined contiguous tensor");
}

double bytes_of(const at::Tensor& t) { return static_cast<double>(t.numel() * t.element_size()); }

// What Gloo is handed: a detached alias (same storage, no autograd history, no Python
// object). Gloo's worker thread drops its references after the work completes; if the last
// reference to a Python-owned tensor went with it, freeing it would take the GIL from that
// thread, and at interpreter exit that aborts the process ("terminate called without an
// active exception", seen on rank 0 after training had finished). Operations that only move
// bytes carry bf16 as fp16 bit patterns (Gloo's bf16 support differs between torch versions;
// moving bits needs none).
at::Tensor transport(const at::Tensor& t) {
  at::Tensor alias = t.detach();
  return alias.scalar_type() == at::kBFloat16 ? alias.view(at::kHalf) : alias;
}

// Latches the group's failure (once) with `message`, as Handle::wait() does.
[[maybe_unused]] void latch(const std::shared_ptr<std::string>& failure, const std::string& message) {
  if (failure && failure->empty()) {
    *failure = message;
    log::error("comm", message);
  }
}

[[maybe_unused]] std::string error_text(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

}  // namespace

// ---- CUDA tensors: NCCL ------------------------------------------------------------------

bool Communicator::on_cuda(const char* op, std::initializer_list<const at::Tensor*> tensors) const {
  int cuda = 0, cpu = 0;
  at::Device device(at::kCPU);
  for (const at::Tensor* t : tensors) {
    if (!t->defined()) continue;
    if (t->is_cuda()) {
      if (cuda > 0) {
        TORCH_CHECK(t->device() == device, "monarch: rank ", global_rank(), ": ", op, " on group '", name_,
                    "' got tensors on ", device, " and ", t->device(), ": one call's tensors must share a device");
      }
      device = t->device();
      ++cuda;
    } else {
      ++cpu;
    }
  }
  TORCH_CHECK(cuda == 0 || cpu == 0, "monarch: rank ", global_rank(), ": ", op, " on group '", name_,
              "' got both CPU and CUDA tensors: one call's tensors must be all CPU (Gloo) or all CUDA (NCCL)");
#ifndef MONARCH_WITH_NCCL
  TORCH_CHECK(cuda == 0, "monarch: rank ", global_rank(), ": ", op, " on group '", name_,
              "' got CUDA tensors, but torch_monarch was built without NCCL: rebuild with CUDA and NCCL "
              "(MONARCH_WITH_CUDA=ON, nccl.h and libnccl found), or move the tensors to the CPU");
#endif
  return cuda > 0;
}

std::shared_ptr<NcclBackend> Communicator::nccl(const at::Tensor& t, const std::string& what) {
#ifdef MONARCH_WITH_NCCL
  const int device = t.device().has_index() ? t.device().index() : 0;
  if (nccl_) {
    TORCH_CHECK(nccl_->device() == device, "monarch: ", what, ": the tensors are on cuda:", device,
                " but this group's NCCL communicator is on cuda:", nccl_->device(),
                " (one device per process and group)");
    return nccl_;
  }
  try {
    TORCH_CHECK(store_, "monarch: ", what, ": group '", name_, "' was created without a store, which NCCL needs "
                "to exchange its unique id");
    nccl_ = NcclBackend::create(ranks_, group_rank_, device, store_, key_ + "/nccl", name_,
                                gloo_group::timeout(group_));
  } catch (const std::exception& e) {
    // Some members may have their communicator and others not: the group is unusable.
    const std::string message = what + " failed: " + error_text(e);
    latch(failure_, message);
    TORCH_CHECK(false, message);
  }
  return nccl_;
#else
  TORCH_CHECK(false, "monarch: ", what, ": built without NCCL");
  return nullptr;
#endif
}

#ifdef MONARCH_WITH_NCCL
namespace {

// Enqueues an NCCL operation (`enqueue` returns its NcclWorkPtr) and wraps it in a Handle:
// an error while enqueueing latches the group like a failed wait.
template <class F>
Handle nccl_handle(const std::shared_ptr<std::string>& failure, const std::string& what, F&& enqueue,
                   std::function<void()> finish = {}) {
  NcclWorkPtr work;
  try {
    work = enqueue();
  } catch (const std::exception& e) {
    latch(failure, what + " failed: " + error_text(e));
    throw;
  }
  return Handle::completion([work]() { work->wait(); }, what, std::move(finish), failure);
}

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace
#endif

Handle Communicator::all_reduce(at::Tensor buffer, bool average) {
  check_usable();
  require_flat(buffer, "all_reduce buffer");
  [[maybe_unused]] const bool cuda = on_cuda("all_reduce", {&buffer});
  agree(average ? Op::all_reduce_average : Op::all_reduce, buffer);
  const double n = size();
  const double sent = 2 * (n - 1) / n * bytes_of(buffer);
  counters_.add(CollectiveKind::all_reduce, sent);
  if (size() == 1) return {};
#ifdef MONARCH_WITH_NCCL
  if (cuda) {
    // bf16 is reduced by NCCL natively (each hop adds in fp32 and rounds to bf16).
    const std::string what = describe(CollectiveKind::all_reduce, buffer);
    auto backend = nccl(buffer, what);
    return nccl_handle(failure_, what, [&] {
             return backend->all_reduce(buffer.data_ptr(), buffer.data_ptr(), buffer.numel(),
                                        nccl_dtype(buffer.scalar_type()), average ? ncclAvg : ncclSum,
                                        as_stream(cuda_stream_));
           }).traced("all_reduce", sent, name_);
  }
#endif
  if (NodeAllReduce* node = node_path(buffer)) {
    // Runs here, through a Handle so that a failure takes the same path (latch, flight
    // recorder, the others' announcements) and the trace records it.
    ++node_all_reduces_;
    const std::string what = describe(CollectiveKind::all_reduce, buffer) + " (shared memory)";
    Handle handle = Handle::completion([node, buffer, average]() mutable { node->all_reduce(buffer, average); },
                                       what, {}, failure_);
    handle.set_group(info_);
    handle = std::move(handle).traced("all_reduce", sent, name_);
    handle.wait();
    return {};
  }
  if (buffer.scalar_type() == at::kBFloat16) return all_reduce_bf16(buffer, average).traced("all_reduce", sent, name_);
  std::vector<at::Tensor> tensors{buffer.detach()};
  auto work = group_->allreduce(tensors);
  std::function<void()> finish;
  if (average) finish = [buffer, n]() mutable { buffer.div_(n); };
  return make(work, describe(CollectiveKind::all_reduce, buffer), std::move(finish)).traced("all_reduce", sent, name_);
}

NodeAllReduce* Communicator::node_path(const at::Tensor& buffer) {
  if (!node_local_ || node_unavailable_ || size() == 1 || !buffer.device().is_cpu() ||
      !NodeAllReduce::summable(buffer.scalar_type())) {
    return nullptr;
  }
  if (node_ && node_->fits(buffer)) return node_.get();
  // Every member decides alike from here on: same element count and dtype (the fingerprint
  // checked them), same environment (the mesh's agreement covers MONARCH_* settings).
  const int64_t bytes = buffer.numel() * static_cast<int64_t>(buffer.element_size());
  const int64_t limit = NodeAllReduce::limit_bytes();
  if (limit <= 0 || bytes > limit || !NodeSharedBuffer::enabled()) return nullptr;
  // Start at 64 KiB and double (at most to the limit) so a few growths cover a run.
  int64_t capacity = node_ ? node_->capacity_bytes() : 64 * 1024;
  while (capacity < bytes) capacity *= 2;
  capacity = std::min(capacity, limit);
  Phase phase(*this, "shared-memory all-reduce setup");
  node_.reset();  // free the old slots first
  // The setup's own small collectives are not the caller's: the byte counters stay as they
  // were (the planner's byte predictions compare with them), and they run unchecked (this
  // call's fingerprint, just exchanged, covers them; every member is here), so the count of
  // checked collectives does not depend on when the slots were made.
  std::array<double, kCollectiveKinds> before{};
  for (size_t k = 0; k < kCollectiveKinds; ++k) before[k] = counters_.bytes(static_cast<CollectiveKind>(k));
  const bool checks = check_;
  check_ = false;
  try {
    node_ = NodeAllReduce::create(*this, capacity, gloo_group::timeout(group_));
  } catch (...) {
    check_ = checks;
    throw;
  }
  check_ = checks;
  counters_.reset();
  for (size_t k = 0; k < kCollectiveKinds; ++k) counters_.add(static_cast<CollectiveKind>(k), before[k]);
  if (!node_) {
    node_unavailable_ = true;
    return nullptr;
  }
  return node_.get();
}

Handle Communicator::all_reduce_max(at::Tensor buffer) {
  check_usable();
  require_flat(buffer, "all_reduce_max buffer");
  TORCH_CHECK(buffer.scalar_type() == at::kFloat || buffer.scalar_type() == at::kDouble,
              "monarch: all_reduce_max takes fp32 or fp64 buffers, got ", buffer.scalar_type());
  [[maybe_unused]] const bool cuda = on_cuda("all_reduce_max", {&buffer});
  agree(Op::all_reduce_max, buffer);
  const double n = size();
  const double sent = 2 * (n - 1) / n * bytes_of(buffer);
  counters_.add(CollectiveKind::all_reduce, sent);
  if (size() == 1) return {};
#ifdef MONARCH_WITH_NCCL
  if (cuda) {
    const std::string what = describe(CollectiveKind::all_reduce, buffer);
    auto backend = nccl(buffer, what);
    return nccl_handle(failure_, what, [&] {
             return backend->all_reduce(buffer.data_ptr(), buffer.data_ptr(), buffer.numel(),
                                        nccl_dtype(buffer.scalar_type()), ncclMax, as_stream(cuda_stream_));
           }).traced("all_reduce", sent, name_);
  }
#endif
  std::vector<at::Tensor> tensors{buffer.detach()};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  return make(group_->allreduce(tensors, options), describe(CollectiveKind::all_reduce, buffer))
      .traced("all_reduce", sent, name_);
}

// bf16 summed in fp32 (Gloo's own bf16 sum, where a torch version has one, adds in bf16 and
// rounds at every step). Same bytes as a ring all-reduce of the bf16
// buffer: an all-to-all of 2-byte chunks (moved as fp16 bit patterns, no arithmetic), an fp32
// sum of this rank's chunk, and an all-gather of the reduced bf16 chunks. The second phase
// runs inside wait().
Handle Communicator::all_reduce_bf16(at::Tensor buffer, bool average) {
  const int64_t n = size();
  const int64_t chunk = (buffer.numel() + n - 1) / n;
  // The buffer itself is sent when it splits evenly (the data-parallel engine pads its bf16
  // buckets so): no copy held while the collective runs. Otherwise a zero-padded copy.
  at::Tensor padded;
  if (buffer.numel() == n * chunk && buffer.is_contiguous()) {
    padded = buffer.detach().view({-1});  // (detached: Gloo's thread holds no autograd state)
  } else {
    padded = at::zeros({n * chunk}, buffer.options());
    padded.narrow(0, 0, buffer.numel()).copy_(buffer.reshape({-1}));  // any shape (activations too)
  }
  auto received = at::empty_like(padded);
  std::vector<int64_t> splits(n, chunk);
  auto send_bits = padded.view(at::kHalf);
  auto recv_bits = received.view(at::kHalf);
  auto work = group_->alltoall_base(recv_bits, send_bits, splits, splits);
  const std::string what = describe(CollectiveKind::all_reduce, buffer);
  auto group = group_;
  Communicator* self = this;  // the group outlives its handles' waits
  return make(work, what, [=]() mutable {
    auto mine = received.view({n, chunk}).to(at::kFloat).sum(0);
    if (average) mine.div_(static_cast<double>(n));
    auto reduced = mine.to(at::kBFloat16);
    auto gathered = at::empty({n * chunk}, buffer.options());
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (const auto& c : gathered.view(at::kHalf).chunk(n)) outputs[0].push_back(c);
    std::vector<at::Tensor> inputs{reduced.view(at::kHalf)};
    // The second phase is a collective too: checked like any other, so a rank waiting here
    // while a peer starts something else gets the mismatch error, not a Gloo abort.
    Phase phase(*self, "the all-gather phase of a bf16 all-reduce");
    self->agree(Op::all_gather, reduced);
    self->make(group->allgather(outputs, inputs), what + " (all-gather phase)").wait();
    buffer.copy_(gathered.narrow(0, 0, buffer.numel()).view(buffer.sizes()));
  });
}

namespace {

// The handle of a collective made of point-to-point works (Gloo's all-gather and
// reduce-scatter here): waits for every one of them, then runs `finish`.
Handle joined(std::shared_ptr<std::vector<compat::WorkPtr>> works, std::string what, std::function<void()> finish,
              std::shared_ptr<std::string> failure, std::shared_ptr<const flight::GroupInfo> group) {
  Handle handle = Handle::completion([works] { for (auto& w : *works) w->wait(); }, std::move(what),
                                     std::move(finish), std::move(failure));
  handle.set_group(std::move(group));
  return handle;
}

}  // namespace

Handle Communicator::reduce_scatter(at::Tensor output, at::Tensor input) {
  check_usable();
  require_flat(output, "reduce_scatter output");
  require_flat(input, "reduce_scatter input");
  TORCH_CHECK(input.numel() == output.numel() * size(), "monarch: reduce_scatter input has ",
              input.numel(), " elements, expected ", size(), " x ", output.numel());
  [[maybe_unused]] const bool cuda = on_cuda("reduce_scatter", {&output, &input});
  agree(Op::reduce_scatter, input);
  const double n = size();
  const double sent = (n - 1) / n * bytes_of(input);
  counters_.add(CollectiveKind::reduce_scatter, sent);
  if (size() == 1) {
    output.copy_(input.view(output.sizes()));
    return {};
  }
#ifdef MONARCH_WITH_NCCL
  if (cuda) {
    // NCCL reduces in the input's dtype (low precision: each hop adds in fp32 and rounds);
    // a wider output receives the reduced chunk cast after the wait.
    const std::string what = describe(CollectiveKind::reduce_scatter, input);
    auto backend = nccl(input, what);
    const bool same = output.scalar_type() == input.scalar_type();
    at::Tensor target = same ? output : at::empty({output.numel()}, input.options());
    std::function<void()> finish;
    if (!same) finish = [output, target]() mutable { output.view({-1}).copy_(target); };
    return nccl_handle(failure_, what, [&] {
             return backend->reduce_scatter(input.data_ptr(), target.data_ptr(), output.numel(),
                                            nccl_dtype(input.scalar_type()), ncclSum, as_stream(cuda_stream_));
           }, std::move(finish)).traced("reduce_scatter", sent, name_);
  }
#endif
  // Over Gloo: this rank sends member j its chunk j and receives every other member's chunk
  // of its own (point-to-point, all posted at once), into a buffer of n-1 chunks; its own
  // chunk is read from the input where it lies. c10d's all-to-all would receive n chunks,
  // this rank's own included: the buffer is 1/n smaller (half of it on 2 ranks) while the
  // reduction runs. Same bytes per rank, (n-1)/n of the input, in one round of messages.
  const int64_t chunk = output.numel();
  if (chunk == 0) return {};  // sizes are agreed: every member returns here
  const int64_t parts = size();
  const int64_t me = group_rank_;
  auto flat_input = input.detach().view({-1});
  auto received = at::empty({(parts - 1) * chunk}, flat_input.options());
  const auto in = transport(flat_input);
  const auto into = transport(received);
  const int tag = next_collective_tag();
  auto works = std::make_shared<std::vector<compat::WorkPtr>>();
  for (int64_t k = 1; k < parts; ++k) {
    const int64_t from = (me + parts - k) % parts, to = (me + k) % parts;
    const int64_t slot = from < me ? from : from - 1;
    std::vector<at::Tensor> arriving{into.narrow(0, slot * chunk, chunk)};
    works->push_back(group_->recv(arriving, static_cast<int>(from), tag));
    std::vector<at::Tensor> leaving{in.narrow(0, to * chunk, chunk)};
    works->push_back(group_->send(leaving, static_cast<int>(to), tag));
  }
  auto finish = [output, flat_input, received, chunk, parts, me]() mutable {
    // This rank's own chunk, copied first when the output lies in the input (written below
    // before the chunk is read otherwise).
    at::Tensor own = flat_input.narrow(0, me * chunk, chunk);
    if (output.is_alias_of(flat_input)) own = own.clone();
    // Member p's contribution to this rank's chunk, summed in member order as before.
    auto part = [&](int64_t p) { return p == me ? own : received.narrow(0, (p < me ? p : p - 1) * chunk, chunk); };
    // Low-precision sums in fp32; fp64 stays fp64.
    auto wide = at::promote_types(received.scalar_type(), at::kFloat);
    if (output.scalar_type() != wide) {
      auto rows = at::empty({parts, chunk}, received.options().dtype(wide));
      for (int64_t p = 0; p < parts; ++p) rows[p].copy_(part(p));
      output.view({-1}).copy_(rows.sum(0));
      return;
    }
    // Summed in the output, part after part: the bits of the widened sum over dim 0 (which
    // adds the rows in order), without a widened copy of all the parts (bf16 gradients:
    // twice what arrived) or a separate result.
    auto out = output.view({-1});
    out.copy_(part(0));
    for (int64_t p = 1; p < parts; ++p) out.add_(part(p));
  };
  return joined(works, describe(CollectiveKind::reduce_scatter, input), std::move(finish), failure_, info_)
      .traced("reduce_scatter", sent, name_);
}

Handle Communicator::all_gather(at::Tensor output, at::Tensor input) {
  check_usable();
  require_flat(output, "all_gather output");
  require_flat(input, "all_gather input");
  TORCH_CHECK(output.numel() == input.numel() * size(), "monarch: all_gather output has ",
              output.numel(), " elements, expected ", size(), " x ", input.numel());
  [[maybe_unused]] const bool cuda = on_cuda("all_gather", {&output, &input});
  agree(Op::all_gather, input);
  const double n = size();
  const double sent = (n - 1) / n * bytes_of(output);
  counters_.add(CollectiveKind::all_gather, sent);
  if (size() == 1) {
    output.view({-1}).copy_(input.view({-1}));
    return {};
  }
#ifdef MONARCH_WITH_NCCL
  if (cuda) {
    const std::string what = describe(CollectiveKind::all_gather, output);
    TORCH_CHECK(output.scalar_type() == input.scalar_type(), "monarch: ", what, ": input is ", input.scalar_type(),
                ", output ", output.scalar_type(), " (NCCL all-gather moves one dtype)");
    auto backend = nccl(input, what);
    return nccl_handle(failure_, what, [&] {
             return backend->all_gather(input.data_ptr(), output.data_ptr(), input.numel(),
                                        nccl_dtype(input.scalar_type()), as_stream(cuda_stream_));
           }).traced("all_gather", sent, name_);
  }
#endif
  // Over Gloo: this rank's input goes to every other member and each member's lands straight
  // in its chunk of `output` (point-to-point, all posted at once). c10d's Gloo all-gather
  // gathers into a flat temporary the size of the output and copies it out afterwards
  // (ProcessGroupGloo's allgather work): a second copy of every gathered ZeRO-3 unit or
  // sequence-parallel activation while it runs, and one more pass over it. Same bytes per
  // rank, (n-1)/n of the output; one round of messages instead of a ring's n-1.
  if (input.numel() == 0) return {};
  const int members = size();
  const auto out = transport(output.detach().view({-1}));
  const auto in = transport(input.detach().view({-1}));
  const auto chunks = out.chunk(members);
  const int tag = next_collective_tag();
  auto works = std::make_shared<std::vector<compat::WorkPtr>>();
  for (int k = 1; k < members; ++k) {
    const int from = (group_rank_ + members - k) % members, to = (group_rank_ + k) % members;
    std::vector<at::Tensor> received{chunks[from]};
    works->push_back(group_->recv(received, from, tag));
    std::vector<at::Tensor> sent_tensor{in};
    works->push_back(group_->send(sent_tensor, to, tag));
  }
  if (chunks[group_rank_].data_ptr() != in.data_ptr()) chunks[group_rank_].copy_(in);
  return joined(works, describe(CollectiveKind::all_gather, output), {}, failure_, info_)
      .traced("all_gather", sent, name_);
}

Handle Communicator::broadcast(at::Tensor buffer, int root) {
  check_usable();
  require_flat(buffer, "broadcast buffer");
  TORCH_CHECK(root >= 0 && root < size(), "monarch: broadcast root ", root, " not in group '", name_, "'");
  [[maybe_unused]] const bool cuda = on_cuda("broadcast", {&buffer});
  agree(Op::broadcast, buffer, root);
  if (group_rank_ == root) counters_.add(CollectiveKind::broadcast, bytes_of(buffer));
  if (size() == 1) return {};
#ifdef MONARCH_WITH_NCCL
  if (cuda) {
    const std::string what = describe(CollectiveKind::broadcast, buffer);
    auto backend = nccl(buffer, what);
    return nccl_handle(failure_, what, [&] {
             return backend->broadcast(buffer.data_ptr(), buffer.numel(), nccl_dtype(buffer.scalar_type()), root,
                                       as_stream(cuda_stream_));
           }).traced("broadcast", group_rank_ == root ? bytes_of(buffer) : 0.0, name_);
  }
#endif
  std::vector<at::Tensor> tensors{transport(buffer)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  return make(group_->broadcast(tensors, opts), describe(CollectiveKind::broadcast, buffer))
      .traced("broadcast", group_rank_ == root ? bytes_of(buffer) : 0.0, name_);
}

Handle Communicator::send(at::Tensor buffer, int peer, int tag) {
  check_usable();
  require_flat(buffer, "send buffer");
  TORCH_CHECK(peer >= 0 && peer < size() && peer != group_rank_, "monarch: bad send peer ", peer);
  [[maybe_unused]] const bool cuda = on_cuda("send", {&buffer});
  counters_.add(CollectiveKind::send, bytes_of(buffer));
#ifdef MONARCH_WITH_NCCL
  if (cuda) {
    // NCCL has no tags: sends and receives between two ranks pair in the order they are made.
    const std::string what = describe(CollectiveKind::send, buffer);
    auto backend = nccl(buffer, what);
    return nccl_handle(failure_, what, [&] {
             return backend->send(buffer.data_ptr(), buffer.numel(), nccl_dtype(buffer.scalar_type()), peer,
                                  as_stream(cuda_stream_));
           }).traced("send", bytes_of(buffer), name_);
  }
#endif
  std::vector<at::Tensor> tensors{transport(buffer)};
  return make(group_->send(tensors, peer, tag), describe(CollectiveKind::send, buffer))
      .traced("send", bytes_of(buffer), name_);
}

Handle Communicator::recv(at::Tensor buffer, int peer, int tag) {
  check_usable();
  require_flat(buffer, "recv buffer");
  TORCH_CHECK(peer >= 0 && peer < size() && peer != group_rank_, "monarch: bad recv peer ", peer);
  [[maybe_unused]] const bool cuda = on_cuda("recv", {&buffer});
#ifdef MONARCH_WITH_NCCL
  if (cuda) {
    const std::string what = describe(CollectiveKind::recv, buffer);
    auto backend = nccl(buffer, what);
    return nccl_handle(failure_, what, [&] {
             return backend->recv(buffer.data_ptr(), buffer.numel(), nccl_dtype(buffer.scalar_type()), peer,
                                  as_stream(cuda_stream_));
           }).traced("recv", 0, name_);
  }
#endif
  std::vector<at::Tensor> tensors{transport(buffer)};
  return make(group_->recv(tensors, peer, tag), describe(CollectiveKind::recv, buffer)).traced("recv", 0, name_);
}

std::vector<Handle> Communicator::send_recv(at::Tensor send_buffer, int send_peer, at::Tensor recv_buffer,
                                            int recv_peer, int tag) {
#ifdef MONARCH_WITH_NCCL
  if (send_buffer.is_cuda() || recv_buffer.is_cuda()) {
    check_usable();
    require_flat(send_buffer, "send buffer");
    require_flat(recv_buffer, "recv buffer");
    TORCH_CHECK(send_peer >= 0 && send_peer < size() && send_peer != group_rank_ && recv_peer >= 0 &&
                    recv_peer < size() && recv_peer != group_rank_,
                "monarch: bad send_recv peers ", send_peer, " / ", recv_peer);
    on_cuda("send_recv", {&send_buffer, &recv_buffer});
    counters_.add(CollectiveKind::send, bytes_of(send_buffer));
    const std::string what = describe(CollectiveKind::send, send_buffer);
    auto backend = nccl(send_buffer, what);
    std::vector<NcclP2P> ops{
        {true, send_buffer.data_ptr(), static_cast<size_t>(send_buffer.numel()), nccl_dtype(send_buffer.scalar_type()),
         send_peer},
        {false, recv_buffer.data_ptr(), static_cast<size_t>(recv_buffer.numel()), nccl_dtype(recv_buffer.scalar_type()),
         recv_peer}};
    std::vector<Handle> out;
    out.push_back(nccl_handle(failure_, what, [&] { return backend->send_recv_group(ops, as_stream(cuda_stream_)); })
                      .traced("send", bytes_of(send_buffer), name_));
    return out;
  }
#endif
  std::vector<Handle> out;
  out.push_back(send(std::move(send_buffer), send_peer, tag));
  out.push_back(recv(std::move(recv_buffer), recv_peer, tag));
  return out;
}

Handle Communicator::all_to_all(at::Tensor output, at::Tensor input) {
  check_usable();
  require_flat(output, "all_to_all output");
  require_flat(input, "all_to_all input");
  TORCH_CHECK(input.numel() == output.numel() && input.numel() % size() == 0,
              "monarch: all_to_all needs equal input and output sizes divisible by the group size");
  [[maybe_unused]] const bool cuda = on_cuda("all_to_all", {&output, &input});
  agree(Op::all_to_all, input);
  const double n = size();
  const double sent = (n - 1) / n * bytes_of(input);
  counters_.add(CollectiveKind::all_to_all, sent);
  if (size() == 1) {
    output.copy_(input);
    return {};
  }
#ifdef MONARCH_WITH_NCCL
  if (cuda) {
    const std::string what = describe(CollectiveKind::all_to_all, input);
    TORCH_CHECK(output.scalar_type() == input.scalar_type(), "monarch: ", what, ": input and output dtypes differ");
    auto backend = nccl(input, what);
    return nccl_handle(failure_, what, [&] {
             return backend->all_to_all(input.data_ptr(), output.data_ptr(), input.numel() / size(),
                                        nccl_dtype(input.scalar_type()), as_stream(cuda_stream_));
           }).traced("all_to_all", sent, name_);
  }
#endif
  std::vector<int64_t> splits(size(), input.numel() / size());
  auto out_bytes = transport(output.detach().view({-1}));  // split sizes count elements of flat views
  auto in_bytes = transport(input.detach().view({-1}));
  return make(group_->alltoall_base(out_bytes, in_bytes, splits, splits),
              describe(CollectiveKind::all_to_all, input))
      .traced("all_to_all", sent, name_);
}

Handle Communicator::all_to_all_v(at::Tensor output, at::Tensor input, const std::vector<int64_t>& output_splits,
                                  const std::vector<int64_t>& input_splits) {
  check_usable();
  require_flat(output, "all_to_all_v output");
  require_flat(input, "all_to_all_v input");
  TORCH_CHECK(static_cast<int>(output_splits.size()) == size() && static_cast<int>(input_splits.size()) == size(),
              "monarch: all_to_all_v needs one split per rank of group '", name_, "' (", size(), ")");
  int64_t in_total = 0, out_total = 0;
  for (int j = 0; j < size(); ++j) {
    TORCH_CHECK(input_splits[j] >= 0 && output_splits[j] >= 0, "monarch: all_to_all_v: negative split");
    in_total += input_splits[j];
    out_total += output_splits[j];
  }
  TORCH_CHECK(in_total == input.numel() && out_total == output.numel(), "monarch: all_to_all_v: splits sum to ",
              in_total, " in / ", out_total, " out, the tensors hold ", input.numel(), " / ", output.numel());
  TORCH_CHECK(input.scalar_type() == output.scalar_type(), "monarch: all_to_all_v: input and output dtypes differ");
  [[maybe_unused]] const bool cuda = on_cuda("all_to_all_v", {&output, &input});
  // Sizes differ by rank: the agreement compares the operation, dtype and device only.
  agree(Op::all_to_all_v, at::empty({0}, input.options().device(at::kCPU)), -1, cuda);
  const double element = static_cast<double>(input.element_size());
  const double sent = static_cast<double>(in_total - input_splits[group_rank()]) * element;
  counters_.add(CollectiveKind::all_to_all, sent);
  if (size() == 1) {
    output.copy_(input);
    return {};
  }
#ifdef MONARCH_WITH_NCCL
  if (cuda) {
    // Grouped ncclSend/ncclRecv with uneven counts (the own chunk included: NCCL sends to self).
    const std::string what = describe(CollectiveKind::all_to_all, input);
    auto backend = nccl(input, what);
    const ncclDataType_t dtype = nccl_dtype(input.scalar_type());
    const int64_t bytes = input.element_size();
    std::vector<NcclP2P> ops;
    int64_t in_offset = 0, out_offset = 0;
    for (int j = 0; j < size(); ++j) {
      if (input_splits[j] > 0) {
        ops.push_back({true, static_cast<char*>(input.data_ptr()) + in_offset * bytes,
                       static_cast<size_t>(input_splits[j]), dtype, j});
      }
      if (output_splits[j] > 0) {
        ops.push_back({false, static_cast<char*>(output.data_ptr()) + out_offset * bytes,
                       static_cast<size_t>(output_splits[j]), dtype, j});
      }
      in_offset += input_splits[j];
      out_offset += output_splits[j];
    }
    return nccl_handle(failure_, what, [&] { return backend->send_recv_group(ops, as_stream(cuda_stream_)); })
        .traced("all_to_all", sent, name_);
  }
#endif
  auto out_bytes = transport(output.detach().view({-1}));
  auto in_bytes = transport(input.detach().view({-1}));
  return make(group_->alltoall_base(out_bytes, in_bytes, const_cast<std::vector<int64_t>&>(output_splits),
                                    const_cast<std::vector<int64_t>&>(input_splits)),
              describe(CollectiveKind::all_to_all, input))
      .traced("all_to_all", sent, name_);
}

void Communicator::barrier() {
  check_usable();
  if (size() == 1) return;
  agree(Op::barrier, at::Tensor());
  make(group_->barrier(), "rank " + std::to_string(global_rank()) + ": barrier on group '" + name_ + "'").wait();
}

}  // namespace monarch
