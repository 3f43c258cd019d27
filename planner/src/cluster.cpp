// Cluster presets: devices (a100-40gb ... mi300x-192gb) and the instance types people rent
// (AWS p4d ... p6-b200, Azure ND v4/v5, GCP A2/A3/A4, NVIDIA DGX and GB200 NVL72), every
// number from the provider's or vendor's page (docs/clusters.md lists each with its source and
// the phrase that states it). Peak FLOP/s are dense (vendors' sparse figures halved) and
// memory bandwidths the datasheets'. Link bandwidths are *achieved* all-reduce bus bandwidths
// of the kind nccl-tests reports, not line rates: NVLink3 (600 GB/s bidirectional) ~230 GB/s
// per GPU, NVLink4 (900 GB/s) ~360, i.e. 0.4 of the bidirectional figure, which NVLink5
// (1.8 TB/s) and AMD's Infinity Fabric are assumed to share; a node's GPU network is its
// NICs' line rate shared by its GPUs, ~90% of it achieved.
#include "monarch/planner/cluster.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>

#include "monarch/planner/errors.h"

namespace monarch::planner {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// Fitted to the ZeRO-3 rows of Narayanan et al. 2021 Table 2 (GPT-3 175B on 384, 768 and 1536
// A100s: published 144, 88 and 44 TFLOP/s per GPU; predicted -1%, +2%, +8.5% with the scale
// term, +0%, +6%, +14% when fitted without it), the only published runs here whose time is
// set by overlapped communication.
constexpr double kGpuOverlapContention = 0.5;
// Relative spread of one node's step time (Cluster::straggler_spread), fitted to the one
// published experiment that scales a job at fixed work per GPU with nothing else changed:
// MegaScale's Megatron-LM 530B rows (Jiang et al. 2024, Fig. 9: 2240, 4480, 11200 A100s at
// batch = GPUs, MFU 49.2, 48.8, 48.2%). docs/cost_model.md, "Scale effects".
constexpr double kGpuStragglerSpread = 0.012;

Cluster a100(double memory_bytes, double hbm_bytes_per_s) {
  Cluster c;
  c.devices_per_node = 8;
  c.device_memory_bytes = memory_bytes;
  c.memory_reserved_bytes = 2 * kGiB;  // CUDA context, NCCL buffers, allocator slack
  c.peak_flops_fp32 = 19.5e12;
  c.peak_flops_tf32 = 156e12;
  c.peak_flops_bf16 = 312e12;
  c.peak_flops_fp8 = 0;  // no fp8 tensor cores
  c.matmul_efficiency = 0.76;  // fitted with the scale term (docs/cost_model.md, "Calibration"): 0.72 before
  c.sm_count = 108;  // NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020)
  c.hbm_bytes_per_s = hbm_bytes_per_s;
  c.intra_node_bytes_per_s = 230e9;
  c.intra_node_latency_s = 5e-6;
  c.inter_node_bytes_per_s = 22.5e9;
  c.inter_node_latency_s = 1e-5;
  c.overlap_contention = kGpuOverlapContention;
  c.straggler_spread = kGpuStragglerSpread;
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
  c.straggler_spread = kGpuStragglerSpread;      // fitted on A100 rows, checked on Hopper's
  return c;
}

// Blackwell: B200 (HGX/DGX B200, 180 GB, 7.7 TB/s) and the GB200 superchip's GPU (186 GB,
// 8 TB/s, a little faster clocks). NVIDIA's Blackwell spec table: FP16/BF16 4.5 / 5 PFLOPS
// and FP8 9 / 10 PFLOPS with sparsity (halved here), FP32 75 / 80 TFLOPS. SM count: not on
// a vendor page; 148 is the widely reported B200 figure (unconfirmed, docs/clusters.md).
Cluster blackwell(double memory_bytes, double hbm_bytes_per_s, double bf16_dense, double fp32) {
  Cluster c;
  c.devices_per_node = 8;
  c.device_memory_bytes = memory_bytes;
  c.memory_reserved_bytes = 2 * kGiB;
  c.peak_flops_fp32 = fp32;
  c.peak_flops_tf32 = bf16_dense / 2;
  c.peak_flops_bf16 = bf16_dense;
  c.peak_flops_fp8 = 2 * bf16_dense;
  c.matmul_efficiency = 0.65;  // Hopper's: no published Blackwell GEMM efficiency calibrated here
  c.sm_count = 148;
  c.hbm_bytes_per_s = hbm_bytes_per_s;
  c.intra_node_bytes_per_s = 0.4 * 1800e9;  // NVLink5, 1.8 TB/s bidirectional per GPU
  c.intra_node_latency_s = 5e-6;
  c.inter_node_bytes_per_s = 45e9;  // one 400 Gb/s NIC per GPU (DGX B200: 8 x ConnectX-7)
  c.inter_node_latency_s = 1e-5;
  c.overlap_contention = kGpuOverlapContention;
  c.straggler_spread = kGpuStragglerSpread;
  return c;
}

// AMD Instinct MI300X (ROCm's MI300 page: matrix BF16 1307.4 TFLOPS, FP8 2614.9, FP32 163.4
// dense; 192 GB HBM3 at 5.3 TB/s; 304 CUs), 8 per node fully connected by 7 Infinity Fabric
// links each (128 GB/s bidirectional per link, 896 GB/s per GPU: AMD's datasheet,
// unconfirmed here). The node's network is assumed to be one 400 Gb/s NIC per GPU, as the
// NVIDIA nodes above.
Cluster mi300x() {
  Cluster c;
  c.devices_per_node = 8;
  c.device_memory_bytes = 192e9;
  c.memory_reserved_bytes = 2 * kGiB;
  c.peak_flops_fp32 = 163.4e12;
  c.peak_flops_tf32 = 653.7e12;
  c.peak_flops_bf16 = 1307.4e12;
  c.peak_flops_fp8 = 2614.9e12;
  c.matmul_efficiency = 0.55;  // below Hopper's: published MI300X GEMM studies reach less of peak (uncalibrated)
  c.sm_count = 304;            // compute units, the SMs' counterpart for the wave model
  c.hbm_bytes_per_s = 5.3e12;
  c.intra_node_bytes_per_s = 0.4 * 896e9;
  c.intra_node_latency_s = 5e-6;
  c.inter_node_bytes_per_s = 45e9;
  c.inter_node_latency_s = 1e-5;
  c.overlap_contention = kGpuOverlapContention;
  c.straggler_spread = kGpuStragglerSpread;
  return c;
}

// The network above the node as its vendor's reference architecture draws it: an NVLink
// domain of `nvlink` GPUs, leaves (rail-aligned scalable units) of `leaf` GPUs, a spine
// between them (docs/clusters.md, "Link levels"). The leaf and the spine run at the node's
// per-GPU network bandwidth and latency, oversubscription 1: NVIDIA's SuperPOD designs cable
// as many leaf-spine links as node-leaf links.
struct Fabric {
  int64_t nvlink = 0;  // 0: no levels, the two-level default
  int64_t leaf = 0;
};

// An instance type: its device, how many share a node (a host: GB200 NVL72's compute tray
// holds 4), their NVLink's bidirectional bandwidth per GPU, the node's GPU network (line
// rate) and, where the vendor publishes it, the fabric's levels.
struct Instance {
  std::function<Cluster()> device;
  int64_t devices_per_node;
  double nvlink_bidirectional_bytes_per_s;
  double network_bits_per_s;  // per node, the NICs serving GPU traffic (not front-end Ethernet)
  PresetInfo info;
  Fabric fabric = {};
};

// Achieved all-reduce bus bandwidth of a GPU's links: nccl-tests' ~230 GB/s on NVLink3 and
// ~360 on NVLink4; 0.4 of the bidirectional figure for the others.
double achieved_link(double bidirectional) {
  if (bidirectional == 600e9) return 230e9;
  return 0.4 * bidirectional;
}

Cluster instance_cluster(const Instance& i) {
  Cluster c = i.device();
  c.devices_per_node = i.devices_per_node;
  c.intra_node_bytes_per_s = achieved_link(i.nvlink_bidirectional_bytes_per_s);
  c.inter_node_bytes_per_s = 0.9 * i.network_bits_per_s / 8 / static_cast<double>(i.devices_per_node);
  if (i.fabric.nvlink > 0) {
    set_levels(c, {{"nvlink", i.fabric.nvlink, c.intra_node_bytes_per_s, c.intra_node_latency_s, 1},
                   {"leaf", i.fabric.leaf, c.inter_node_bytes_per_s, c.inter_node_latency_s, 1},
                   {"spine", 0, c.inter_node_bytes_per_s, c.inter_node_latency_s, 1}});
  }
  return c;
}

std::string levels_text(const std::vector<LinkLevel>& levels) {
  std::string out;
  for (const auto& l : levels) {
    if (!out.empty()) out += " > ";
    out += l.name;
    if (l.devices > 0) out += " " + std::to_string(l.devices);
    if (l.oversubscription != 1) {
      char ratio[32];
      std::snprintf(ratio, sizeof(ratio), " (%g:1)", l.oversubscription);
      out += ratio;
    }
  }
  return out;
}

PresetInfo info(const char* kind, const char* gpu, int64_t per_node, double memory_gb, double nvlink_gb_s,
                double network_gbps, const char* network, const char* source) {
  return {"", kind, gpu, per_node, memory_gb, nvlink_gb_s, network_gbps, network, 0, "", source};
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

const std::map<std::string, Instance>& instances() {
  const auto a100_40 = [] { return a100(40 * kGiB, 1.555e12); };
  const auto a100_80 = [] { return a100(80 * kGiB, 2.039e12); };
  const auto h100 = [] { return hopper(80 * kGiB, 3.35e12); };
  const auto h200 = [] { return hopper(141e9, 4.8e12); };
  const auto b200 = [] { return blackwell(180e9, 7.7e12, 2.25e15, 75e12); };
  const auto gb200 = [] { return blackwell(186e9, 8e12, 2.5e15, 80e12); };
  static const std::map<std::string, Instance> table = {
      // AWS (docs.aws.amazon.com/ec2/latest/instancetypes/ac.html; EFA generations: .../efa.html)
      {"p4d.24xlarge", {a100_40, 8, 600e9, 400e9, info("AWS", "A100 40GB", 8, 40, 600, 400, "EFA v1 (4 x 100 Gb/s)", "aws-ac")}},
      {"p4de.24xlarge", {a100_80, 8, 600e9, 400e9, info("AWS", "A100 80GB", 8, 80, 600, 400, "EFA v1 (4 x 100 Gb/s)", "aws-ac")}},
      {"p5.48xlarge", {h100, 8, 900e9, 3200e9, info("AWS", "H100 80GB", 8, 80, 900, 3200, "EFA v2 (32 cards)", "aws-ac")}},
      {"p5e.48xlarge", {h200, 8, 900e9, 3200e9, info("AWS", "H200 141GB", 8, 141, 900, 3200, "EFA v2 (32 cards)", "aws-ac")}},
      {"p5en.48xlarge", {h200, 8, 900e9, 3200e9, info("AWS", "H200 141GB", 8, 141, 900, 3200, "EFA v3 (16 cards)", "aws-ac")}},
      {"p6-b200.48xlarge", {b200, 8, 1800e9, 3200e9, info("AWS", "B200 180GB", 8, 180, 1800, 3200, "EFA v4 (8 x 400 Gb/s)", "aws-p6")}},
      // Azure (learn.microsoft.com/azure/virtual-machines/sizes/gpu-accelerated/...)
      {"nd96asr-a100-v4", {a100_40, 8, 600e9, 1600e9, info("Azure", "A100 40GB", 8, 40, 600, 1600, "8 x 200 Gb/s HDR InfiniBand", "az-a100")}},
      {"nd96amsr-a100-v4", {a100_80, 8, 600e9, 1600e9, info("Azure", "A100 80GB", 8, 80, 600, 1600, "8 x 200 Gb/s HDR InfiniBand", "az-a100m")}},
      {"nd96isr-h100-v5", {h100, 8, 900e9, 3200e9, info("Azure", "H100 80GB", 8, 80, 900, 3200, "8 x 400 Gb/s NDR InfiniBand", "az-h100")}},
      {"nd96isr-h200-v5", {h200, 8, 900e9, 3200e9, info("Azure", "H200 141GB", 8, 141, 900, 3200, "8 x 400 Gb/s NDR InfiniBand", "az-h200")}},
      // GCP (cloud.google.com/compute/docs/gpus/gpu-network-bandwidth): the GPU NICs, not the
      // front-end gVNIC. A3 High's 1,000 Gb/s total is taken as 4 x 200 for the GPUs, A3 Mega's
      // as 8 x 200 (the split is not on the page: docs/clusters.md).
      {"a2-ultragpu-8g", {a100_80, 8, 600e9, 100e9, info("GCP", "A100 80GB", 8, 80, 600, 100, "100 Gb/s (no GPUDirect)", "gcp-net")}},
      {"a3-highgpu-8g", {h100, 8, 900e9, 800e9, info("GCP", "H100 80GB", 8, 80, 900, 800, "GPUDirect-TCPX (4 x 200 Gb/s)", "gcp-net")}},
      {"a3-megagpu-8g", {h100, 8, 900e9, 1600e9, info("GCP", "H100 80GB", 8, 80, 900, 1600, "GPUDirect-TCPXO (8 x 200 Gb/s)", "gcp-net")}},
      {"a3-ultragpu-8g", {h200, 8, 900e9, 3200e9, info("GCP", "H200 141GB", 8, 141, 900, 3200, "8 x 400 Gb/s CX-7 RDMA (RoCE)", "gcp-net")}},
      {"a4-highgpu-8g", {b200, 8, 1800e9, 3200e9, info("GCP", "B200 180GB", 8, 180, 1800, 3200, "8 x 400 Gb/s CX-7 RDMA (RoCE)", "gcp-net")}},
      // NVIDIA systems (docs.nvidia.com: DGX BasePOD, DGX B200 and DGX GB200 user guides; the
      // DGX SuperPOD reference architectures for the levels). DGX H100 / B200: nodes of 8 on
      // NVLink, 32 nodes (256 GPUs) per rail-aligned scalable unit, a spine between units. An
      // NVL72 rack is one NVLink domain of 72 GPUs over 18 compute trays (nodes) of 4, so tp
      // may span nodes inside it; 8 racks (576 GPUs) per scalable unit.
      {"dgx-h100", {h100, 8, 900e9, 3200e9, info("NVIDIA", "H100 80GB", 8, 80, 900, 3200, "8 x 400 Gb/s ConnectX-7", "nv-basepod"), {8, 256}}},
      {"dgx-b200", {b200, 8, 1800e9, 3200e9, info("NVIDIA", "B200 180GB", 8, 180, 1800, 3200, "8 x 400 Gb/s ConnectX-7", "nv-dgxb200"), {8, 256}}},
      {"gb200-nvl72", {gb200, 4, 1800e9, 4 * 400e9, info("NVIDIA", "GB200 186GB", 4, 186, 1800, 4 * 400, "4 x 400 Gb/s ConnectX-7 per tray", "nv-dgxgb200"), {72, 576}}},
      // Devices on their own: a node of 8 with the network of their usual systems.
      {"a100-40gb", {a100_40, 8, 600e9, 1600e9, info("device", "A100 40GB", 8, 40, 600, 1600, "one 200 Gb/s HDR NIC per GPU", "nv-a100")}},
      {"a100-80gb", {a100_80, 8, 600e9, 1600e9, info("device", "A100 80GB", 8, 80, 600, 1600, "one 200 Gb/s HDR NIC per GPU", "nv-a100")}},
      {"h100-80gb", {h100, 8, 900e9, 3200e9, info("device", "H100 80GB", 8, 80, 900, 3200, "one 400 Gb/s NDR NIC per GPU", "nv-h100")}},
      {"h200-141gb", {h200, 8, 900e9, 3200e9, info("device", "H200 141GB", 8, 141, 900, 3200, "one 400 Gb/s NDR NIC per GPU", "az-h200")}},
      {"b200-180gb", {b200, 8, 1800e9, 3200e9, info("device", "B200 180GB", 8, 180, 1800, 3200, "one 400 Gb/s NIC per GPU", "nv-dgxb200")}},
      {"gb200-186gb", {gb200, 8, 1800e9, 3200e9, info("device", "GB200 186GB", 8, 186, 1800, 3200, "one 400 Gb/s NIC per GPU", "nv-blackwell")}},
      {"mi300x-192gb", {mi300x, 8, 896e9, 3200e9, info("device", "MI300X 192GB", 8, 192, 896, 3200, "one 400 Gb/s NIC per GPU (assumed)", "amd-mi300")}},
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

bool LinkLevel::operator==(const LinkLevel& o) const {
  return name == o.name && devices == o.devices && bytes_per_s == o.bytes_per_s && latency_s == o.latency_s &&
         oversubscription == o.oversubscription;
}

std::vector<LinkLevel> link_levels(const Cluster& c) {
  if (!c.levels.empty()) return c.levels;
  return {{"node", c.devices_per_node, c.intra_node_bytes_per_s, c.intra_node_latency_s, 1},
          {"network", 0, c.inter_node_bytes_per_s, c.inter_node_latency_s, 1}};
}

void set_levels(Cluster& c, std::vector<LinkLevel> levels) {
  c.levels = std::move(levels);
  if (c.levels.size() >= 1) {
    c.intra_node_bytes_per_s = c.levels[0].bytes_per_s;
    c.intra_node_latency_s = c.levels[0].latency_s;
  }
  if (c.levels.size() >= 2) {
    c.inter_node_bytes_per_s = c.levels[1].bytes_per_s;
    c.inter_node_latency_s = c.levels[1].latency_s;
  }
}

int64_t innermost_level_devices(const Cluster& c) {
  const int64_t world = c.world_size();
  const int64_t d = c.levels.empty() ? c.devices_per_node : c.levels.front().devices;
  return d <= 0 ? world : std::min(d, world);
}

std::vector<std::string> cluster_preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, _] : instances()) names.push_back(name);
  names.push_back("cpu");
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<PresetInfo> cluster_preset_infos() {
  std::vector<PresetInfo> out;
  for (const auto& [name, instance] : instances()) {
    PresetInfo i = instance.info;
    i.name = name;
    i.nvlink_domain = instance.fabric.nvlink > 0 ? instance.fabric.nvlink : instance.devices_per_node;
    if (instance.fabric.nvlink > 0) i.levels = levels_text(instance_cluster(instance).levels);
    out.push_back(i);
  }
  return out;
}

Cluster cluster_preset(const std::string& name, int64_t devices) {
  const auto it = instances().find(name);
  if (it == instances().end() && name != "cpu") {
    std::string known;
    for (const auto& n : cluster_preset_names()) known += (known.empty() ? "" : ", ") + n;
    throw ValidationError("cluster", "unknown preset '" + name + "' (known: " + known + ")");
  }
  if (devices < 1 || devices > kMaxWorldSize) {
    throw ValidationError("cluster.devices", "must be in [1, " + std::to_string(kMaxWorldSize) +
                                                 "], got " + std::to_string(devices));
  }
  Cluster c = name == "cpu" ? cpu() : instance_cluster(it->second);
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
  require(c.straggler_spread >= 0 && c.straggler_spread <= 1, "straggler_spread", "must be in [0, 1]");
  require(c.sm_count >= 0 && c.sm_count <= 1000000, "sm_count", "must be in [0, 1e6] (0: no wave quantization)");
  require(c.cores_per_node >= 0, "cores_per_node", "must be >= 0 (0: devices do not share compute)");
  require(c.intra_node_bytes_per_s > 0, "intra_node_bytes_per_s", "must be > 0");
  require(c.inter_node_bytes_per_s > 0, "inter_node_bytes_per_s", "must be > 0");
  require(c.intra_node_latency_s >= 0, "intra_node_latency_s", "must be >= 0");
  require(c.inter_node_latency_s >= 0, "inter_node_latency_s", "must be >= 0");
  if (c.levels.empty()) return;
  const size_t n = c.levels.size();
  require(n >= 2, "levels", "needs at least two levels (the innermost and the network above it), got " +
                                std::to_string(n));
  for (size_t k = 0; k < n; ++k) {
    const LinkLevel& l = c.levels[k];
    const std::string field = "levels[" + std::to_string(k) + "]";
    const auto req = [&](bool ok, const char* sub, const std::string& message) {
      if (!ok) throw ValidationError("cluster." + field + "." + sub, message);
    };
    req(!l.name.empty(), "name", "must not be empty");
    req(l.bytes_per_s > 0, "bytes_per_s", "must be > 0");
    req(l.latency_s >= 0, "latency_s", "must be >= 0");
    req(l.oversubscription >= 1 && l.oversubscription <= 1000, "oversubscription",
        "must be in [1, 1000] (1: a non-blocking tier; 2: a 2:1 taper)");
    if (k + 1 == n) {
      req(l.devices == 0, "devices", "must be 0 on the outermost level (it spans the whole cluster), got " +
                                         std::to_string(l.devices));
    } else {
      req(l.devices >= 1 && l.devices <= kMaxWorldSize, "devices",
          "must be in [1, " + std::to_string(kMaxWorldSize) + "] below the outermost level, got " +
              std::to_string(l.devices));
      if (k > 0) {
        const int64_t inner = c.levels[k - 1].devices;
        req(l.devices > inner && l.devices % inner == 0, "devices",
            std::to_string(l.devices) + " must be a larger multiple of the level inside it (" +
                std::to_string(inner) + ")");
      }
    }
  }
  // The two-level fields are the first two levels' numbers (set_levels).
  require(c.intra_node_bytes_per_s == c.levels[0].bytes_per_s && c.intra_node_latency_s == c.levels[0].latency_s,
          "intra_node_bytes_per_s", "must equal levels[0]'s bytes_per_s and latency_s when levels are given");
  require(c.inter_node_bytes_per_s == c.levels[1].bytes_per_s && c.inter_node_latency_s == c.levels[1].latency_s,
          "inter_node_bytes_per_s", "must equal levels[1]'s bytes_per_s and latency_s when levels are given");
}

void require_peak_flops(const Cluster& c, DType dtype) {
  if (c.peak_flops(dtype) > 0) return;
  // bf16 and fp16 share one peak (see Cluster::peak_flops).
  const std::string name = dtype == DType::fp16 ? "bf16" : to_string(dtype);
  throw ValidationError("cluster.peak_flops_" + name,
                        "must be > 0 for compute_dtype " + to_string(dtype));
}

}  // namespace monarch::planner
