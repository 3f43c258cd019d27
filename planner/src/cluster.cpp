// Cluster presets. Peak FLOP/s and memory bandwidth are the vendors' datasheet numbers
// (NVIDIA A100 datasheet 2021, H100 and H200 SXM datasheets, dense, no sparsity). Link
// bandwidths are *achieved* all-reduce bus bandwidths of the kind nccl-tests reports, not
// line rates: NVLink3 (600 GB/s bidirectional) ~230 GB/s per GPU, NVLink4 (900 GB/s) ~360;
// inter-node one HDR 200 Gb/s (A100) or NDR 400 Gb/s (H100/H200) NIC per GPU, i.e. 25 or
// 50 GB/s line rate, ~90% of it achieved.
#include "monarch/planner/cluster.h"

#include <cmath>
#include <functional>
#include <map>

#include "monarch/planner/errors.h"

namespace monarch::planner {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// Fitted to the ZeRO-3 rows of Narayanan et al. 2021 Table 2 (GPT-3 175B on 384, 768 and 1536
// A100s: published 144, 88 and 44 TFLOP/s per GPU; predicted within -1%, +5%, +14%), the
// only published runs here whose time is set by overlapped communication.
constexpr double kGpuOverlapContention = 0.5;

Cluster a100(double memory_bytes, double hbm_bytes_per_s) {
  Cluster c;
  c.devices_per_node = 8;
  c.device_memory_bytes = memory_bytes;
  c.memory_reserved_bytes = 2 * kGiB;  // CUDA context, NCCL buffers, allocator slack
  c.peak_flops_fp32 = 19.5e12;
  c.peak_flops_tf32 = 156e12;
  c.peak_flops_bf16 = 312e12;
  c.peak_flops_fp8 = 0;  // no fp8 tensor cores
  c.matmul_efficiency = 0.72;
  c.sm_count = 108;  // NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020)
  c.hbm_bytes_per_s = hbm_bytes_per_s;
  c.intra_node_bytes_per_s = 230e9;
  c.intra_node_latency_s = 5e-6;
  c.inter_node_bytes_per_s = 22.5e9;
  c.inter_node_latency_s = 1e-5;
  c.overlap_contention = kGpuOverlapContention;
  return c;
}

Cluster hopper(double memory_bytes, double hbm_bytes_per_s) {
  Cluster c;
  c.devices_per_node = 8;
  c.device_memory_bytes = memory_bytes;
  c.memory_reserved_bytes = 2 * kGiB;
  c.peak_flops_fp32 = 67e12;
  c.peak_flops_tf32 = 494e12;
  c.peak_flops_bf16 = 989e12;
  c.peak_flops_fp8 = 1979e12;
  c.matmul_efficiency = 0.65;
  c.sm_count = 132;  // H100 SXM5 (NVIDIA H100 Tensor Core GPU Architecture whitepaper); H200 the same die
  c.hbm_bytes_per_s = hbm_bytes_per_s;
  c.intra_node_bytes_per_s = 360e9;
  c.intra_node_latency_s = 5e-6;
  c.inter_node_bytes_per_s = 45e9;
  c.inter_node_latency_s = 1e-5;
  c.overlap_contention = kGpuOverlapContention;  // A100's value: not calibrated on Hopper
  return c;
}

// Ranks of a CPU job (Gloo over loopback): one "node", modest numbers so plans for small
// test models come out sensible.
Cluster cpu() {
  Cluster c;
  c.devices_per_node = 1;
  c.device_memory_bytes = 8 * kGiB;
  c.memory_reserved_bytes = 0.5 * kGiB;
  c.peak_flops_fp32 = 100e9;
  c.peak_flops_tf32 = 100e9;
  c.peak_flops_bf16 = 100e9;
  c.peak_flops_fp8 = 0;
  c.matmul_efficiency = 0.5;
  c.hbm_bytes_per_s = 20e9;
  c.intra_node_bytes_per_s = 2e9;
  c.intra_node_latency_s = 5e-5;
  c.inter_node_bytes_per_s = 2e9;
  c.inter_node_latency_s = 5e-5;
  return c;
}

const std::map<std::string, std::function<Cluster()>>& presets() {
  static const std::map<std::string, std::function<Cluster()>> table = {
      {"a100-40gb", [] { return a100(40 * kGiB, 1.555e12); }},
      {"a100-80gb", [] { return a100(80 * kGiB, 2.039e12); }},
      {"h100-80gb", [] { return hopper(80 * kGiB, 3.35e12); }},
      {"h200-141gb", [] { return hopper(141e9, 4.8e12); }},
      {"cpu", [] { return cpu(); }},
  };
  return table;
}

void require(bool ok, const char* field, const std::string& message) {
  if (!ok) throw ValidationError(std::string("cluster.") + field, message);
}

}  // namespace

double Cluster::peak_flops(DType dtype) const {
  switch (dtype) {
    case DType::fp32: return peak_flops_fp32;
    case DType::tf32: return peak_flops_tf32;
    case DType::bf16:
    case DType::fp16: return peak_flops_bf16;
    case DType::fp8: return peak_flops_fp8;
  }
  return 0;
}

std::vector<std::string> cluster_preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, _] : presets()) names.push_back(name);
  return names;
}

Cluster cluster_preset(const std::string& name, int64_t devices) {
  const auto it = presets().find(name);
  if (it == presets().end()) {
    std::string known;
    for (const auto& n : cluster_preset_names()) known += (known.empty() ? "" : ", ") + n;
    throw ValidationError("cluster", "unknown preset '" + name + "' (known: " + known + ")");
  }
  if (devices < 1 || devices > kMaxWorldSize) {
    throw ValidationError("cluster.devices", "must be in [1, " + std::to_string(kMaxWorldSize) +
                                                 "], got " + std::to_string(devices));
  }
  Cluster c = it->second();
  c.name = name;
  if (name == "cpu") {
    c.devices_per_node = devices;  // all ranks of a CPU job share one machine
  } else if (devices < c.devices_per_node) {
    c.devices_per_node = devices;
  } else if (devices % c.devices_per_node != 0) {
    throw ValidationError("cluster.devices",
                          std::to_string(devices) + " devices do not fill whole nodes of " +
                              std::to_string(c.devices_per_node) + " (" + name + ")");
  }
  c.nodes = devices / c.devices_per_node;
  return c;
}

void validate(const Cluster& c) {
  require(c.nodes >= 1, "nodes", "must be >= 1, got " + std::to_string(c.nodes));
  require(c.devices_per_node >= 1 && c.devices_per_node <= kMaxWorldSize, "devices_per_node",
          "must be in [1, " + std::to_string(kMaxWorldSize) + "], got " +
              std::to_string(c.devices_per_node));
  // Bounded before world_size() multiplies them (which would overflow int64 otherwise).
  require(c.nodes <= kMaxWorldSize / c.devices_per_node, "nodes",
          std::to_string(c.nodes) + " nodes x " + std::to_string(c.devices_per_node) +
              " devices exceed the largest supported world size " + std::to_string(kMaxWorldSize));
  require(c.device_memory_bytes > 0, "device_memory_bytes", "must be > 0");
  require(c.memory_reserved_bytes >= 0 && c.memory_reserved_bytes < c.device_memory_bytes,
          "memory_reserved_bytes", "must be in [0, device_memory_bytes)");
  require(c.peak_flops_fp32 > 0, "peak_flops_fp32", "must be > 0");
  require(c.peak_flops_tf32 >= 0, "peak_flops_tf32", "must be >= 0");
  require(c.peak_flops_bf16 >= 0, "peak_flops_bf16", "must be >= 0");
  require(c.peak_flops_fp8 >= 0, "peak_flops_fp8", "must be >= 0");
  require(c.matmul_efficiency > 0 && c.matmul_efficiency <= 1, "matmul_efficiency",
          "must be in (0, 1]");
  require(c.hbm_bytes_per_s > 0, "hbm_bytes_per_s", "must be > 0");
  require(c.backward_forward_ratio > 0 && c.backward_forward_ratio <= 10, "backward_forward_ratio",
          "must be in (0, 10]");
  require(c.overlap_contention >= 0 && c.overlap_contention <= 4, "overlap_contention", "must be in [0, 4]");
  require(c.sm_count >= 0 && c.sm_count <= 1000000, "sm_count", "must be in [0, 1e6] (0: no wave quantization)");
  require(c.cores_per_node >= 0, "cores_per_node", "must be >= 0 (0: devices do not share compute)");
  require(c.intra_node_bytes_per_s > 0, "intra_node_bytes_per_s", "must be > 0");
  require(c.inter_node_bytes_per_s > 0, "inter_node_bytes_per_s", "must be > 0");
  require(c.intra_node_latency_s >= 0, "intra_node_latency_s", "must be >= 0");
  require(c.inter_node_latency_s >= 0, "inter_node_latency_s", "must be >= 0");
}

void require_peak_flops(const Cluster& c, DType dtype) {
  if (c.peak_flops(dtype) > 0) return;
  // bf16 and fp16 share one peak (see Cluster::peak_flops).
  const std::string name = dtype == DType::fp16 ? "bf16" : to_string(dtype);
  throw ValidationError("cluster.peak_flops_" + name,
                        "must be > 0 for compute_dtype " + to_string(dtype));
}

}  // namespace monarch::planner
