#include "monarch/runtime/hierarchical.h"

#include <cstring>

#include <c10/util/Exception.h>

#include "monarch/kernels/pack.h"
#include "monarch/kernels/quantize.h"
#include "monarch/runtime/shared_memory.h"

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

// The first `numel` elements of a kept buffer, which only grows (buckets of different sizes
// share it; reallocated only when a larger one or another dtype comes).
at::Tensor reuse(at::Tensor& t, int64_t numel, const at::TensorOptions& options) {
  if (!t.defined() || t.numel() < numel || t.scalar_type() != options.dtype().toScalarType()) {
    t = at::empty({numel}, options);
  }
  return t.narrow(0, 0, numel);
}

// Every node's message: `message` holds this rank's; the all-to-all sends it to each node
// (an all-gather that writes into the kept `gathered` buffer; Gloo's all-gather would
// allocate its own output at every call).
const uint8_t* gather_messages(Communicator& inter, HierarchicalScratch& buffers, int64_t message_bytes,
                               const std::function<void(uint8_t*)>& write_message) {
  const int64_t nodes = inter.size();
  const auto bytes = at::TensorOptions().dtype(at::kByte);
  at::Tensor send = reuse(buffers.send, nodes * message_bytes, bytes);
  auto* out = send.data_ptr<uint8_t>();
  write_message(out);
  for (int64_t j = 1; j < nodes; ++j) std::memcpy(out + j * message_bytes, out, static_cast<size_t>(message_bytes));
  at::Tensor gathered = reuse(buffers.gathered, nodes * message_bytes, bytes);
  inter.all_to_all(gathered, send).wait();
  return gathered.data_ptr<uint8_t>();
}

// The fp32 values of the shard: the shard itself, or a kept fp32 copy of a bf16 one.
at::Tensor fp32_values(at::Tensor shard, HierarchicalScratch& buffers) {
  if (shard.scalar_type() == at::kFloat) return shard;
  return reuse(buffers.values, shard.numel(), shard.options().dtype(at::kFloat)).copy_(shard);
}

void feedback_buffer(at::Tensor shard, ErrorFeedback& feedback) {
  if (!feedback.error.defined() || feedback.error.numel() != shard.numel()) {
    feedback.error = at::zeros({shard.numel()}, shard.options().dtype(at::kFloat));
  }
}

// The slow hop, compressed: every node's rounded shard is gathered and each rank sums the
// same N values in node order, so the result is identical everywhere. Rounding works on the
// fp32 values of the shard (bf16 gradients round from their fp32 sum); a residual that is
// not finite (a NaN or Inf gradient) is dropped so it does not poison the next steps.
void gather_bf16(Communicator& inter, at::Tensor shard, ErrorFeedback& feedback, HierarchicalScratch& buffers) {
  const int64_t n = shard.numel();
  feedback_buffer(shard, feedback);
  at::Tensor fp32 = fp32_values(shard, buffers);
  float* values = fp32.data_ptr<float>();
  const int64_t message = n * 2;
  const uint8_t* all = gather_messages(inter, buffers, message, [&](uint8_t* out) {
    kernels::bf16_round_with_feedback_cpu(values, feedback.error.data_ptr<float>(), reinterpret_cast<uint16_t*>(out), n);
  });
  for (int j = 0; j < inter.size(); ++j) {
    const kernels::UnpackDest dest{values, n, kernels::DType::Float32};
    kernels::bucket_unpack_cpu(all + j * message, kernels::DType::BFloat16, &dest, 1, 1.0f, /*accumulate=*/j > 0);
  }
  if (!fp32.is_same(shard)) shard.copy_(fp32);
}

void gather_int8(Communicator& inter, at::Tensor shard, ErrorFeedback& feedback, HierarchicalScratch& buffers) {
  const int64_t n = shard.numel();
  feedback_buffer(shard, feedback);
  at::Tensor fp32 = fp32_values(shard, buffers);
  float* values = fp32.data_ptr<float>();
  const int64_t blocks = kernels::int8_num_blocks(n, kInt8Block);
  // One message per node: n int8 values, then `blocks` fp32 scales.
  const int64_t message = n + blocks * static_cast<int64_t>(sizeof(float));
  std::vector<float> scales(static_cast<size_t>(blocks));
  const uint8_t* all = gather_messages(inter, buffers, message, [&](uint8_t* out) {
    kernels::int8_quantize_cpu(values, feedback.error.data_ptr<float>(), reinterpret_cast<int8_t*>(out),
                               scales.data(), n, kInt8Block);
    if (blocks > 0) std::memcpy(out + n, scales.data(), scales.size() * sizeof(float));
  });
  for (int j = 0; j < inter.size(); ++j) {
    const uint8_t* node = all + j * message;
    std::memcpy(scales.data(), node + n, scales.size() * sizeof(float));
    kernels::int8_dequantize_cpu(reinterpret_cast<const int8_t*>(node), scales.data(), values, n, kInt8Block,
                                 /*accumulate=*/j > 0);
  }
  if (!fp32.is_same(shard)) shard.copy_(fp32);
}

void between_nodes(Communicator& inter, at::Tensor shard, WireCompression compression, ErrorFeedback& feedback,
                   HierarchicalScratch& buffers) {
  if (inter.size() <= 1) return;
  Communicator::Phase phase(inter, "hierarchical all-reduce: between nodes");
  switch (compression) {
    case WireCompression::none: inter.all_reduce(shard).wait(); break;
    case WireCompression::bf16: gather_bf16(inter, shard, feedback, buffers); break;
    case WireCompression::int8: gather_int8(inter, shard, feedback, buffers); break;
  }
}

}  // namespace

void hierarchical_all_reduce(Communicator& intra, Communicator& inter, at::Tensor flat, WireCompression compression,
                             ErrorFeedback& feedback, HierarchicalScratch& buffers, const NodeSharedBuffer* shared) {
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
  if (local == 1) {  // one rank per node: the slow hop is the whole reduction
    between_nodes(inter, flat, compression, feedback, buffers);
    return;
  }
  if (shared != nullptr) {
    TORCH_CHECK(shared->mine().data_ptr() == flat.data_ptr() && shared->numel() == flat.numel(),
                "monarch: hierarchical all-reduce: the buffer is not this rank's shared slot");
    shared_reduce_scatter_all_gather(intra, *shared, buffers.sum,
                                     [&](at::Tensor shard) { between_nodes(inter, shard, compression, feedback, buffers); });
    return;
  }
  at::Tensor shard = reuse(buffers.shard, flat.numel() / local, flat.options());
  {
    Communicator::Phase phase(intra, "hierarchical all-reduce: reduce-scatter inside the node");
    intra.reduce_scatter(shard, flat).wait();
  }
  between_nodes(inter, shard, compression, feedback, buffers);
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
