#include "monarch/runtime/communicator.h"

#include <sstream>

#include <c10/util/Exception.h>

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

void Handle::wait() {
  if (waited_ || !work_) return;
  waited_ = true;
  if (failure_ && !failure_->empty()) {
    TORCH_CHECK(false, what_, " abandoned: the group failed earlier: ", *failure_);
  }
  std::string error;
  try {
    work_->wait();
    if (finish_) finish_();  // may run a second phase (bf16 all-reduce)
    return;
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::string message = what_ + " failed: " + error;
  if (failure_ && failure_->empty()) *failure_ = message;
  TORCH_CHECK(false, message);
}

void Communicator::check_usable() const {
  TORCH_CHECK(failure_->empty(), "monarch: rank ", global_rank(), ": group '", name_,
              "' cannot be used after a failed collective (every later call fails the same way): ", *failure_);
}

Communicator::Communicator(compat::GlooPtr group, std::vector<int> ranks, int rank, std::string name)
    : group_(std::move(group)), ranks_(std::move(ranks)), name_(std::move(name)) {
  group_rank_ = -1;
  for (size_t i = 0; i < ranks_.size(); ++i) {
    if (ranks_[i] == rank) group_rank_ = static_cast<int>(i);
  }
  TORCH_INTERNAL_ASSERT(group_rank_ >= 0, "rank ", rank, " not in group ", name_);
}

std::string Communicator::describe(CollectiveKind kind, const at::Tensor& t) const {
  std::ostringstream out;
  out << "rank " << global_rank() << ": " << to_string(kind) << " of " << t.numel() << " "
      << t.scalar_type() << " on group '" << name_ << "' (ranks";
  for (int r : ranks_) out << " " << r;
  out << ")";
  return out.str();
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
// active exception", seen on rank 0 after training had finished). Gloo (LibTorch 1.13) also
// knows no bf16: operations that only move bytes carry bf16 as fp16 bit patterns.
at::Tensor transport(const at::Tensor& t) {
  at::Tensor alias = t.detach();
  return alias.scalar_type() == at::kBFloat16 ? alias.view(at::kHalf) : alias;
}

}  // namespace

Handle Communicator::all_reduce(at::Tensor buffer, bool average) {
  check_usable();
  require_flat(buffer, "all_reduce buffer");
  const double n = size();
  counters_.add(CollectiveKind::all_reduce, 2 * (n - 1) / n * bytes_of(buffer));
  if (size() == 1) return {};
  if (buffer.scalar_type() == at::kBFloat16) return all_reduce_bf16(buffer, average);
  std::vector<at::Tensor> tensors{buffer.detach()};
  auto work = group_->allreduce(tensors);
  std::function<void()> finish;
  if (average) finish = [buffer, n]() mutable { buffer.div_(n); };
  return make(work, describe(CollectiveKind::all_reduce, buffer), std::move(finish));
}

Handle Communicator::all_reduce_max(at::Tensor buffer) {
  check_usable();
  require_flat(buffer, "all_reduce_max buffer");
  TORCH_CHECK(buffer.scalar_type() == at::kFloat || buffer.scalar_type() == at::kDouble,
              "monarch: all_reduce_max takes fp32 or fp64 buffers, got ", buffer.scalar_type());
  const double n = size();
  counters_.add(CollectiveKind::all_reduce, 2 * (n - 1) / n * bytes_of(buffer));
  if (size() == 1) return {};
  std::vector<at::Tensor> tensors{buffer.detach()};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  return make(group_->allreduce(tensors, options), describe(CollectiveKind::all_reduce, buffer));
}

// Gloo (LibTorch 1.13) cannot reduce bf16. Same bytes as a ring all-reduce of the bf16
// buffer: an all-to-all of 2-byte chunks (moved as fp16 bit patterns, no arithmetic), an fp32
// sum of this rank's chunk, and an all-gather of the reduced bf16 chunks. The second phase
// runs inside wait().
Handle Communicator::all_reduce_bf16(at::Tensor buffer, bool average) {
  const int64_t n = size();
  const int64_t chunk = (buffer.numel() + n - 1) / n;
  auto padded = at::zeros({n * chunk}, buffer.options());
  padded.narrow(0, 0, buffer.numel()).copy_(buffer);
  auto received = at::empty_like(padded);
  std::vector<int64_t> splits(n, chunk);
  auto send_bits = padded.view(at::kHalf);
  auto recv_bits = received.view(at::kHalf);
  auto work = group_->alltoall_base(recv_bits, send_bits, splits, splits);
  const std::string what = describe(CollectiveKind::all_reduce, buffer);
  auto group = group_;
  return make(work, what, [=]() mutable {
    auto mine = received.view({n, chunk}).to(at::kFloat).sum(0);
    if (average) mine.div_(static_cast<double>(n));
    auto reduced = mine.to(at::kBFloat16);
    auto gathered = at::empty({n * chunk}, buffer.options());
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (const auto& c : gathered.view(at::kHalf).chunk(n)) outputs[0].push_back(c);
    std::vector<at::Tensor> inputs{reduced.view(at::kHalf)};
    Handle(group->allgather(outputs, inputs), what + " (all-gather phase)").wait();
    buffer.copy_(gathered.narrow(0, 0, buffer.numel()));
  });
}

Handle Communicator::reduce_scatter(at::Tensor output, at::Tensor input) {
  check_usable();
  require_flat(output, "reduce_scatter output");
  require_flat(input, "reduce_scatter input");
  TORCH_CHECK(input.numel() == output.numel() * size(), "monarch: reduce_scatter input has ",
              input.numel(), " elements, expected ", size(), " x ", output.numel());
  const double n = size();
  counters_.add(CollectiveKind::reduce_scatter, (n - 1) / n * bytes_of(input));
  if (size() == 1) {
    output.copy_(input.view(output.sizes()));
    return {};
  }
  // Split sizes count rows of dim 0: move flat views so they count elements.
  auto flat_input = input.detach().view({-1});
  auto received = at::empty_like(flat_input);
  std::vector<int64_t> splits(size(), output.numel());
  auto recv_bytes = transport(received);
  auto send_bytes = transport(flat_input);
  auto work = group_->alltoall_base(recv_bytes, send_bytes, splits, splits);
  const int64_t chunk = output.numel();
  const int64_t parts = size();
  return make(work, describe(CollectiveKind::reduce_scatter, input),
                [output, received, chunk, parts]() mutable {
                  // Low-precision sums in fp32; fp64 stays fp64.
                  auto wide = at::promote_types(received.scalar_type(), at::kFloat);
                  output.view({-1}).copy_(received.view({parts, chunk}).to(wide).sum(0));
                });
}

Handle Communicator::all_gather(at::Tensor output, at::Tensor input) {
  check_usable();
  require_flat(output, "all_gather output");
  require_flat(input, "all_gather input");
  TORCH_CHECK(output.numel() == input.numel() * size(), "monarch: all_gather output has ",
              output.numel(), " elements, expected ", size(), " x ", input.numel());
  const double n = size();
  counters_.add(CollectiveKind::all_gather, (n - 1) / n * bytes_of(output));
  if (size() == 1) {
    output.view({-1}).copy_(input.view({-1}));
    return {};
  }
  std::vector<std::vector<at::Tensor>> outputs(1);
  const auto chunks = transport(output.detach().view({-1})).chunk(size());
  outputs[0].assign(chunks.begin(), chunks.end());
  std::vector<at::Tensor> inputs{transport(input.detach().view({-1}))};
  auto work = group_->allgather(outputs, inputs);
  return make(work, describe(CollectiveKind::all_gather, output));
}

Handle Communicator::broadcast(at::Tensor buffer, int root) {
  check_usable();
  require_flat(buffer, "broadcast buffer");
  TORCH_CHECK(root >= 0 && root < size(), "monarch: broadcast root ", root, " not in group '", name_, "'");
  if (group_rank_ == root) counters_.add(CollectiveKind::broadcast, bytes_of(buffer));
  if (size() == 1) return {};
  std::vector<at::Tensor> tensors{transport(buffer)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  return make(group_->broadcast(tensors, opts), describe(CollectiveKind::broadcast, buffer));
}

Handle Communicator::send(at::Tensor buffer, int peer, int tag) {
  check_usable();
  require_flat(buffer, "send buffer");
  TORCH_CHECK(peer >= 0 && peer < size() && peer != group_rank_, "monarch: bad send peer ", peer);
  counters_.add(CollectiveKind::send, bytes_of(buffer));
  std::vector<at::Tensor> tensors{transport(buffer)};
  return make(group_->send(tensors, peer, tag), describe(CollectiveKind::send, buffer));
}

Handle Communicator::recv(at::Tensor buffer, int peer, int tag) {
  check_usable();
  require_flat(buffer, "recv buffer");
  TORCH_CHECK(peer >= 0 && peer < size() && peer != group_rank_, "monarch: bad recv peer ", peer);
  std::vector<at::Tensor> tensors{transport(buffer)};
  return make(group_->recv(tensors, peer, tag), describe(CollectiveKind::recv, buffer));
}

Handle Communicator::all_to_all(at::Tensor output, at::Tensor input) {
  check_usable();
  require_flat(output, "all_to_all output");
  require_flat(input, "all_to_all input");
  TORCH_CHECK(input.numel() == output.numel() && input.numel() % size() == 0,
              "monarch: all_to_all needs equal input and output sizes divisible by the group size");
  const double n = size();
  counters_.add(CollectiveKind::all_to_all, (n - 1) / n * bytes_of(input));
  if (size() == 1) {
    output.copy_(input);
    return {};
  }
  std::vector<int64_t> splits(size(), input.numel() / size());
  auto out_bytes = transport(output.detach().view({-1}));  // split sizes count elements of flat views
  auto in_bytes = transport(input.detach().view({-1}));
  return make(group_->alltoall_base(out_bytes, in_bytes, splits, splits),
                describe(CollectiveKind::all_to_all, input));
}

void Communicator::barrier() {
  check_usable();
  if (size() == 1) return;
  make(group_->barrier(), "rank " + std::to_string(global_rank()) + ": barrier on group '" + name_ + "'").wait();
}

}  // namespace monarch
