#pragma once
// The machines a plan runs on: identical nodes of identical devices on a network of link
// levels (two by default: inside a node, between nodes).
#include <cstdint>
#include <string>
#include <vector>

#include "monarch/planner/dtype.h"

namespace monarch::planner {

// One tier of the network (docs/cost_model.md, "Link levels"): the NVLink domain, the node,
// a leaf (rail group, scalable unit), the spine. Levels are listed innermost first.
struct LinkLevel {
  std::string name;
  // Consecutive ranks one unit of this level holds, counted in devices (cumulative: a leaf of
  // 32 nodes of 8 holds 256); strictly increasing level to level, each a multiple of the one
  // inside it. 0 on the outermost level: it spans the whole cluster.
  int64_t devices = 0;
  double bytes_per_s = 0;  // achieved bandwidth per device on this level's links
  double latency_s = 0;    // per message (per ring step)
  // >= 1: the links up into this level carry 1/oversubscription of what the devices below
  // it can send (Al-Fares et al. 2008's ratio, 2 for a 2:1 taper), so a collective whose
  // group needs this level gets bytes_per_s / oversubscription per device.
  double oversubscription = 1;
  bool operator==(const LinkLevel& o) const;
};

struct Cluster {
  std::string name = "custom";
  int64_t nodes = 1;
  int64_t devices_per_node = 1;
  double device_memory_bytes = 0;
  double memory_reserved_bytes = 0;  // kept back for the framework/allocator (CUDA context, fragmentation)
  double peak_flops_fp32 = 0;        // per device, dense
  double peak_flops_tf32 = 0;
  double peak_flops_bf16 = 0;        // also used for fp16
  double peak_flops_fp8 = 0;
  double matmul_efficiency = 0.75;   // share of peak large GEMMs reach
  // Streaming multiprocessors per device: GEMMs run as 128 x 128 output tiles, one wave of
  // tiles per SM at a time, so a GEMM whose tiles leave SMs idle in its last wave (or whose
  // sides are not tile multiples) reaches less than matmul_efficiency (cost_model.cpp,
  // gemm_utilization). 0: no such effect (CPUs, or unknown).
  int64_t sm_count = 0;
  double hbm_bytes_per_s = 0;        // device memory bandwidth (memory-bound kernels)
  // Backward compute time / forward compute time: 2 for matmul-bound layers (gradients for
  // inputs and weights, Narayanan et al. 2021); a measured profile may say otherwise (CPU
  // kernels whose forward is dominated by memory-bound ops measure about 1.4).
  double backward_forward_ratio = 2.0;
  // Compute units a node's devices share (CPU cores for CPU ranks); 0: every device computes
  // on its own (GPUs). With fewer than devices_per_node, the rates above are per device with
  // all of the node's devices busy, and a device idle in a pipeline bubble lends its share to
  // the busy ones (cost_model.cpp).
  double cores_per_node = 0;
  // How much slower computation and communication each run while they overlap: they share
  // the device's SMs and memory bandwidth (Rashidi et al. 2021, "Enabling Compute-Communication
  // Overlap in Distributed Deep Learning Training Platforms", ISCA). 0: overlap is free. The
  // GPU presets' value is calibrated on Narayanan et al. 2021 Table 2 (docs/cost_model.md).
  double overlap_contention = 0;
  // Stragglers: every step waits for the slowest of the job's nodes. With each node's step
  // time spread independently around its mean with an exponential tail of relative scale
  // sigma = straggler_spread, the slowest of N is (H_N - 1) sigma slower than a node alone
  // (H_N the N-th harmonic number, ~ ln N + 0.58; cost_model.cpp, straggler_factor). 0: no
  // such effect (custom clusters, CPU ranks). The GPU presets' value is fitted to MegaScale's
  // weak-scaling rows (Jiang et al. 2024, Fig. 9; docs/cost_model.md, "Scale effects").
  double straggler_spread = 0;
  // Effective (achieved bus) bandwidth per device and per-message latency of the two default
  // link levels: inside a node and between nodes. With `levels` given they are its first two
  // levels' numbers (set_levels keeps them so; validate() checks it).
  double intra_node_bytes_per_s = 0;
  double intra_node_latency_s = 0;
  double inter_node_bytes_per_s = 0;  // per device: the node's NIC bandwidth / devices_per_node
  double inter_node_latency_s = 0;
  // The network as levels, innermost first (at least two; the last one's devices 0). Empty:
  // the two levels above, {"node", devices_per_node, intra_node_*} and {"network", 0,
  // inter_node_*}, which is what every cluster without levels is costed on. A level may be
  // larger than a node (GB200 NVL72: NVLink domains of 72 over nodes of 4), so tp may span
  // nodes inside it. Nodes stay what a host is (stragglers, the runtime's hierarchical
  // reduction, which groups the ranks of a host).
  std::vector<LinkLevel> levels;

  int64_t world_size() const { return nodes * devices_per_node; }
  double peak_flops(DType dtype) const;
  double usable_memory_bytes() const { return device_memory_bytes - memory_reserved_bytes; }
  bool operator==(const Cluster& o) const;
};

// The cluster's levels: `levels`, or the two default ones built from devices_per_node and the
// intra/inter-node fields.
std::vector<LinkLevel> link_levels(const Cluster& cluster);
// Sets `levels` and the two-level fields from levels[0] (intra_node_*) and levels[1]
// (inter_node_*). An empty list clears the levels (the two-level fields stay as they are).
void set_levels(Cluster& cluster, std::vector<LinkLevel> levels);
// Devices in one unit of the innermost level (the node, or the NVLink domain where levels
// say it is larger), at most the world size: tp stays inside it.
int64_t innermost_level_devices(const Cluster& cluster);

// Known presets: devices (a100-40gb, a100-80gb, h100-80gb, h200-141gb, b200-180gb,
// gb200-186gb, mi300x-192gb: nodes of 8 with their usual network), instance types (AWS
// p4d.24xlarge, p4de.24xlarge, p5.48xlarge, p5e.48xlarge, p5en.48xlarge, p6-b200.48xlarge;
// Azure nd96asr-a100-v4, nd96amsr-a100-v4, nd96isr-h100-v5, nd96isr-h200-v5; GCP
// a2-ultragpu-8g, a3-highgpu-8g, a3-megagpu-8g, a3-ultragpu-8g, a4-highgpu-8g; NVIDIA
// dgx-h100, dgx-b200, gb200-nvl72: nodes of 4 GPUs (compute trays) in NVLink domains of 72)
// and cpu. dgx-h100, dgx-b200 and gb200-nvl72 have levels (NVLink, leaf, spine).
// docs/clusters.md gives every number's source. `devices` is the total device count; nodes
// = devices / devices_per_node and devices must fill whole nodes unless it is smaller than
// one node. Throws ValidationError("cluster", ...) if unknown.
Cluster cluster_preset(const std::string& name, int64_t devices);
std::vector<std::string> cluster_preset_names();

// What `monarch-plan presets` lists: the hardware behind each preset (cpu aside).
struct PresetInfo {
  std::string name;
  std::string kind;     // AWS, Azure, GCP, NVIDIA, device
  std::string gpu;
  int64_t devices_per_node = 0;
  double memory_gb = 0;            // per GPU, as the provider states it
  double nvlink_gb_per_s = 0;      // per GPU, bidirectional
  double network_gbit_per_s = 0;   // per node, the GPU network's line rate
  std::string network;
  int64_t nvlink_domain = 0;       // GPUs in one NVLink domain (devices_per_node, or 72 on NVL72)
  std::string levels;              // the preset's link levels, "nvlink 72 > leaf 576 > spine"; empty: two-level
  std::string source;              // key into docs/clusters.md's sources
};
std::vector<PresetInfo> cluster_preset_infos();

// Largest world size the planner handles: schedules and plans store ranks as 32-bit
// integers, and the search enumerates divisors of the world size.
inline constexpr int64_t kMaxWorldSize = int64_t{1} << 31;

// Throws ValidationError naming the field if a value is out of range.
void validate(const Cluster& cluster);
// Throws ValidationError("cluster.peak_flops_<dtype>", ...) when the cluster has no peak
// FLOP/s for `dtype` (e.g. fp8 on an A100): every compute time would be infinite.
void require_peak_flops(const Cluster& cluster, DType dtype);

}  // namespace monarch::planner
