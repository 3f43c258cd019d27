#include "monarch/runtime/hierarchical_shard.h"

#include <cstring>
#include <vector>

#include <c10/util/Exception.h>

#include "monarch/kernels/pack.h"
#include "monarch/kernels/quantize.h"

namespace monarch {
namespace {

int64_t int8_scales(int64_t n) { return kernels::int8_num_blocks(n, kInt8Block); }

// One shard of n fp32 values rounded for the wire into `out`; `error` (n values, or null)
// takes the residual of this rounding, added back first.
void encode(const float* values, float* error, uint8_t* out, int64_t n, WireCompression compression) {
  switch (compression) {
    case WireCompression::int8: {
      std::vector<float> scales(static_cast<size_t>(int8_scales(n)));
      kernels::int8_quantize_cpu(values, error, reinterpret_cast<int8_t*>(out), scales.data(), n, kInt8Block);
      if (!scales.empty()) std::memcpy(out + n, scales.data(), scales.size() * sizeof(float));
      return;
    }
    case WireCompression::bf16:
      if (error != nullptr) {
        kernels::bf16_round_with_feedback_cpu(values, error, reinterpret_cast<uint16_t*>(out), n);
      } else {
        kernels::float_to_bf16_cpu(values, reinterpret_cast<uint16_t*>(out), n);
      }
      return;
    case WireCompression::none: break;
  }
  TORCH_CHECK(false, "monarch: hierarchical_shard: nothing to encode without compression");
}

// The reverse into n fp32 values (added to them with `accumulate`).
void decode(const uint8_t* in, float* dst, int64_t n, WireCompression compression, bool accumulate) {
  if (compression == WireCompression::int8) {
    // The scales follow the values; a message may start at any byte, so they are copied out.
    std::vector<float> scales(static_cast<size_t>(int8_scales(n)));
    if (!scales.empty()) std::memcpy(scales.data(), in + n, scales.size() * sizeof(float));
    kernels::int8_dequantize_cpu(reinterpret_cast<const int8_t*>(in), scales.data(), dst, n, kInt8Block, accumulate);
    return;
  }
  const kernels::UnpackDest dest{dst, n, kernels::DType::Float32};
  kernels::bucket_unpack_cpu(in, kernels::DType::BFloat16, &dest, 1, 1.0f, accumulate);
}

// The node's secondary shards (each rank's first-hop result) gathered inside the node, then
// placed: rank (node m, local l) is slot m * L + l of `padded`.
void fill_from_node(NodeGroups& nodes, const at::Tensor& secondary, const at::Tensor& padded,
                    WireCompression compression) {
  Communicator& intra = *nodes.intra;
  const int64_t L = intra.size(), M = nodes.inter->size();
  const int64_t S = padded.numel() / (L * M);
  at::Tensor bundle = at::empty({L * secondary.numel()}, secondary.options());
  {
    Communicator::Phase phase(intra, "fully_shard parameter gather: inside the node");
    intra.all_gather(bundle, secondary).wait();
  }
  if (compression == WireCompression::none) {
    padded.view({M, L, S}).copy_(bundle.view({L, M, S}).transpose(0, 1));
    return;
  }
  const int64_t message = shard_message_bytes(S, compression, at::kFloat);
  const uint8_t* all = bundle.data_ptr<uint8_t>();
  const bool direct = padded.scalar_type() == at::kFloat;
  at::Tensor values = direct ? at::Tensor() : at::empty({S}, padded.options().dtype(at::kFloat));
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t m = 0; m < M; ++m) {
      const uint8_t* in = all + (l * M + m) * message;
      const int64_t slot = m * L + l;
      if (direct) {
        decode(in, padded.data_ptr<float>() + slot * S, S, compression, false);
      } else {
        decode(in, values.data_ptr<float>(), S, compression, false);
        padded.narrow(0, slot * S, S).copy_(values);
      }
    }
  }
}

}  // namespace

int64_t shard_message_bytes(int64_t shard_numel, WireCompression compression, at::ScalarType dtype) {
  switch (compression) {
    case WireCompression::none: return shard_numel * static_cast<int64_t>(c10::elementSize(dtype));
    case WireCompression::bf16: return shard_numel * 2;
    case WireCompression::int8: return shard_numel + int8_scales(shard_numel) * static_cast<int64_t>(sizeof(float));
  }
  return 0;
}

at::Tensor gather_unit_two_hops(NodeGroups& nodes, const at::Tensor& shard, const at::Tensor& padded,
                                WireCompression compression) {
  TORCH_CHECK(shard.scalar_type() == at::kFloat && shard.is_contiguous() && shard.is_cpu(),
              "monarch: hierarchical_shard: the shard must be a contiguous fp32 CPU tensor");
  Communicator& inter = *nodes.inter;
  const int64_t M = inter.size(), S = shard.numel();
  TORCH_CHECK(padded.numel() == S * M * nodes.intra->size(), "monarch: hierarchical_shard: gather output of ",
              padded.numel(), " elements for shards of ", S, " on ", M, " nodes x ", nodes.intra->size());
  at::Tensor send, across;
  if (compression == WireCompression::none) {
    send = shard.to(padded.scalar_type());
    across = at::empty({M * S}, padded.options());
  } else {
    const int64_t message = shard_message_bytes(S, compression, at::kFloat);
    send = at::empty({message}, shard.options().dtype(at::kByte));
    // Weights are rounded afresh from the fp32 master each gather: no residual to carry.
    encode(shard.data_ptr<float>(), nullptr, send.data_ptr<uint8_t>(), S, compression);
    across = at::empty({M * message}, send.options());
  }
  {
    Communicator::Phase phase(inter, "fully_shard parameter gather: between nodes");
    inter.all_gather(across, send).wait();
  }
  fill_from_node(nodes, across, padded, compression);
  return across;
}

void gather_unit_from_secondary(NodeGroups& nodes, const at::Tensor& secondary, const at::Tensor& padded,
                                WireCompression compression) {
  fill_from_node(nodes, secondary, padded, compression);
}

void reduce_scatter_unit_two_hops(NodeGroups& nodes, const at::Tensor& grads, const at::Tensor& out,
                                  WireCompression compression, ErrorFeedback& feedback) {
  Communicator& intra = *nodes.intra;
  Communicator& inter = *nodes.inter;
  const int64_t L = intra.size(), M = inter.size(), m = inter.group_rank();
  const int64_t S = out.numel();
  TORCH_CHECK(grads.numel() == S * L * M && out.scalar_type() == at::kFloat,
              "monarch: hierarchical_shard: reduce-scatter of ", grads.numel(), " elements into ", out.numel());
  // Inside the node first: local rank l gets its node's sum of the chunks of ranks (m', l).
  at::Tensor by_local = grads.view({M, L, S}).transpose(0, 1).contiguous();
  at::Tensor node_sum = at::empty({M * S}, grads.options());
  {
    Communicator::Phase phase(intra, "fully_shard gradient reduce-scatter: inside the node");
    intra.reduce_scatter(node_sum, by_local).wait();
  }
  Communicator::Phase phase(inter, "fully_shard gradient reduce-scatter: between nodes");
  if (compression == WireCompression::none) {
    at::Tensor mine = at::empty({S}, grads.options());
    inter.reduce_scatter(mine, node_sum).wait();
    out.copy_(mine);
    return;
  }
  at::Tensor values = node_sum.to(at::kFloat).contiguous();
  const int64_t others = (M - 1) * S;
  if (!feedback.error.defined() || feedback.error.numel() != others) {
    feedback.error = at::zeros({others}, values.options());
  }
  const int64_t message = shard_message_bytes(S, compression, at::kFloat);
  at::Tensor send = at::zeros({M * message}, values.options().dtype(at::kByte));
  at::Tensor received = at::empty({M * message}, send.options());
  const float* v = values.data_ptr<float>();
  float* error = feedback.error.data_ptr<float>();
  uint8_t* wire = send.data_ptr<uint8_t>();
  for (int64_t j = 0, k = 0; j < M; ++j) {
    if (j == m) continue;  // this node's own chunk stays exact
    encode(v + j * S, error + (k++) * S, wire + j * message, S, compression);
  }
  inter.all_to_all(received, send).wait();
  out.copy_(values.narrow(0, m * S, S));
  const uint8_t* in = received.data_ptr<uint8_t>();
  for (int64_t j = 0; j < M; ++j) {
    if (j != m) decode(in + j * message, out.data_ptr<float>(), S, compression, true);
  }
}

}  // namespace monarch
