#include "monarch/runtime/hierarchical.h"

#include <cstring>

#include <c10/util/Exception.h>

#include "monarch/kernels/quantize.h"

namespace monarch {

SerialWorker::SerialWorker() : thread_([this] { run(); }) {}

SerialWorker::~SerialWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  ready_.notify_one();
  thread_.join();
}

std::shared_future<void> SerialWorker::submit(std::function<void()> job) {
  std::packaged_task<void()> task(std::move(job));
  std::shared_future<void> done = task.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(task));
  }
  ready_.notify_one();
  return done;
}

void SerialWorker::run() {
  for (;;) {
    std::packaged_task<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      // Drain what was queued before stopping: a destructor never abandons a submitted job.
      if (jobs_.empty()) return;
      task = std::move(jobs_.front());
      jobs_.pop_front();
    }
    task();
  }
}

namespace {

// The slow hop, compressed: every node's rounded shard is gathered and each rank sums the
// same N values in node order, so the result is identical everywhere. Rounding works on an
// fp32 copy of the shard (bf16 gradients round from their fp32 sum); a residual that is not
// finite (a NaN or Inf gradient) is dropped so it does not poison the next steps.
void gather_bf16(Communicator& inter, at::Tensor shard, ErrorFeedback& feedback) {
  const int64_t n = shard.numel();
  if (!feedback.error.defined() || feedback.error.numel() != n) feedback.error = at::zeros({n}, shard.options().dtype(at::kFloat));
  auto corrected = shard.to(at::kFloat) + feedback.error;
  auto wire = corrected.to(at::kBFloat16);
  feedback.error.copy_(corrected - wire.to(at::kFloat));
  feedback.error.masked_fill_(feedback.error.isfinite().logical_not(), 0.0);
  auto gathered = at::empty({inter.size() * n}, wire.options());
  inter.all_gather(gathered, wire).wait();
  shard.copy_(gathered.view({inter.size(), n}).to(at::kFloat).sum(0));
}

void gather_int8(Communicator& inter, at::Tensor shard, ErrorFeedback& feedback) {
  const int64_t n = shard.numel();
  if (!feedback.error.defined() || feedback.error.numel() != n) feedback.error = at::zeros({n}, shard.options().dtype(at::kFloat));
  at::Tensor values = shard.to(at::kFloat).contiguous();  // shard itself when it is fp32
  const int64_t blocks = kernels::int8_num_blocks(n, kInt8Block);
  // One message per node: n int8 values, then `blocks` fp32 scales.
  const int64_t message = n + blocks * static_cast<int64_t>(sizeof(float));
  auto wire = at::empty({message}, shard.options().dtype(at::kByte));
  auto* bytes = wire.data_ptr<uint8_t>();
  std::vector<float> scales(static_cast<size_t>(blocks));
  kernels::int8_quantize_cpu(values.data_ptr<float>(), feedback.error.data_ptr<float>(),
                             reinterpret_cast<int8_t*>(bytes), scales.data(), n, kInt8Block);
  if (blocks > 0) std::memcpy(bytes + n, scales.data(), scales.size() * sizeof(float));
  auto gathered = at::empty({inter.size() * message}, wire.options());
  inter.all_gather(gathered, wire).wait();
  values.zero_();
  const auto* all = gathered.data_ptr<uint8_t>();
  for (int j = 0; j < inter.size(); ++j) {
    const uint8_t* node = all + j * message;
    std::memcpy(scales.data(), node + n, scales.size() * sizeof(float));
    kernels::int8_dequantize_cpu(reinterpret_cast<const int8_t*>(node), scales.data(), values.data_ptr<float>(), n,
                                 kInt8Block, /*accumulate=*/true);
  }
  if (!values.is_same(shard)) shard.copy_(values);
}

}  // namespace

void hierarchical_all_reduce(Communicator& intra, Communicator& inter, at::Tensor flat, WireCompression compression,
                             ErrorFeedback& feedback) {
  TORCH_CHECK(flat.is_floating_point() && flat.is_contiguous() && flat.dim() == 1,
              "monarch: hierarchical all-reduce needs a flat contiguous floating-point buffer, got ", flat.sizes(), " ",
              flat.scalar_type());
  // The steps run on a worker thread, and the rounding on the host: CUDA buffers would need
  // the CUDA quantizer and one launch order for every NCCL group on each rank.
  TORCH_CHECK(flat.is_cpu(), "monarch: the hierarchical all-reduce runs on CPU (Gloo) buffers; got one on ",
              flat.device(), " (use dp_reduction flat on CUDA for now)");
  const int64_t local = intra.size();
  TORCH_CHECK(flat.numel() % local == 0, "monarch: hierarchical all-reduce of ", flat.numel(),
              " values over ", local, " ranks per node: pad the buffer to a multiple of ", local);
  const int64_t n = flat.numel() / local;
  auto shard = at::empty({n}, flat.options());
  {
    Communicator::Phase phase(intra, "hierarchical all-reduce: reduce-scatter inside the node");
    intra.reduce_scatter(shard, flat).wait();
  }
  if (inter.size() > 1) {
    Communicator::Phase phase(inter, "hierarchical all-reduce: between nodes");
    switch (compression) {
      case WireCompression::none: inter.all_reduce(shard).wait(); break;
      case WireCompression::bf16: gather_bf16(inter, shard, feedback); break;
      case WireCompression::int8: gather_int8(inter, shard, feedback); break;
    }
  }
  Communicator::Phase phase(intra, "hierarchical all-reduce: all-gather inside the node");
  intra.all_gather(flat, shard).wait();
}

double inter_node_bytes_per_rank(int64_t numel, int64_t ranks_per_node, int64_t nodes, WireCompression compression) {
  if (nodes <= 1) return 0;
  const double shard = static_cast<double>(numel) / static_cast<double>(ranks_per_node);
  const double n = static_cast<double>(nodes);
  switch (compression) {
    case WireCompression::none: return 2 * (n - 1) / n * shard * 4;
    case WireCompression::bf16: return (n - 1) * shard * 2;
    case WireCompression::int8: {
      const double blocks = static_cast<double>(kernels::int8_num_blocks(static_cast<int64_t>(shard), kInt8Block));
      return (n - 1) * (shard + 4 * blocks);
    }
  }
  return 0;
}

}  // namespace monarch
