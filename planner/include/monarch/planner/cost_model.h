#pragma once
// The cost model: time and memory of a layout. Every formula is in docs/cost_model.md with
// its source; the paper-form functions below exist so tests can check the published
// worked examples directly.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "monarch/planner/plan.h"
#include "monarch/planner/schedule.h"

namespace monarch::planner {

class Estimator;  // estimator.h

// ---- Published closed forms --------------------------------------------------------------

// Narayanan et al. 2021 (SC'21), Sec. 5.1: FLOPs per iteration of a GPT model with
// activation recomputation, F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
double narayanan_flops_per_iteration(double batch, double seq, double layers, double hidden,
                                     double vocab);

// ZeRO (Rajbhandari et al. 2020), Fig. 1: model-state bytes per device for `params`
// parameters on `dp` data-parallel ranks: (2 + 2 + K) Psi replicated, divided as
// stage 1: optimizer (K), stage 2: + gradients, stage 3: + parameters.
struct ModelStateBytes {
  double params = 0, grads = 0, optimizer = 0;
  double total() const { return params + grads + optimizer; }
};
// Wall time of `compute_s` of computation overlapped with `comm_s` of communication when each
// runs 1 + contention times slower while both do (Cluster::overlap_contention).
double overlapped_seconds(double compute_s, double comm_s, double contention);

// n-th harmonic number H_n = 1 + 1/2 + ... + 1/n (exact sum up to n = 256, then
// ln n + gamma + 1/(2n) - 1/(12 n^2), within 1e-12 there); 0 for n < 1.
double harmonic_number(int64_t n);

// Scale effects (docs/cost_model.md, "Scale effects"): every step waits for the slowest node
// of the job. Each node's step time varies independently around its mean with an exponential
// tail of relative scale sigma = cluster.straggler_spread; the expected slowest of N such
// nodes is H_N sigma above the mean where one node alone is sigma above it, so the step takes
// 1 + sigma (H_N - 1) times what the rest of the model predicts. N = the nodes `devices`
// occupy (ceil(devices / devices_per_node)); 1 for a job inside one node (no change).
double straggler_factor(const Cluster& cluster, int64_t devices);

ModelStateBytes zero_model_state_bytes(double params, int64_t dp, int64_t stage,
                                       double param_bytes = 2, double grad_bytes = 2,
                                       double optimizer_bytes = 12);

// Korthikanti et al. 2022, Table 2: activation bytes of one transformer layer for micro-batch
// b: none: sbh(34 + 5as/h); tp t: sbh(10 + 24/t + 5as/(ht)); tp + sequence parallel:
// sbh/t (34 + 5as/h); + selective recompute: 34 sbh/t; full recompute: 2sbh (/t with sp).
double korthikanti_layer_activation_bytes(double seq, double micro_batch, double hidden,
                                          double heads, int64_t tp, bool sequence_parallel,
                                          Recompute recompute);

// ---- Graph-level quantities ---------------------------------------------------------------

// Model FLOPs per step (Korthikanti et al.'s "model FLOPs"): 3 x forward (forward + 2x for
// backward), no recomputation. Used for MFU.
double model_flops_per_step(const ModelGraph& graph, int64_t global_batch);
// FLOPs as Narayanan et al. count them: recomputable layers 4 x forward, the rest 3 x, the
// same for every plan so plans compare fairly. Used for tflops_per_device.
double narayanan_flops_per_step(const ModelGraph& graph, int64_t global_batch);

// Share of the large-GEMM rate an (m x k) @ (k x n) GEMM reaches on a device with
// `sm_count` SMs: tile and wave quantization (NVIDIA's Matrix Multiplication Background
// User's Guide), with split-K for GEMMs of few tiles. 1 when sm_count is 0.
double gemm_utilization(double m, double n, double k, int64_t sm_count);

// Activation bytes one layer keeps for backward for one micro-batch on one tp rank.
double layer_activation_bytes(const Layer& layer, int64_t micro_batch, int64_t tp,
                              bool sequence_parallel, Recompute recompute);
// Parameters of the layer held by one tp rank.
double layer_params_per_tp_rank(const Layer& layer, int64_t tp);

// ---- One layout -----------------------------------------------------------------------------

// What the cost model needs about one layer on one rank, per micro-batch.
struct LayerCost {
  double forward_s = 0;    // compute + memory-bound time + exposed tp, ep and cp communication
  double backward_s = 0;   // same for backward, including recomputation
  double recompute_s = 0;  // part of backward_s
  double backward_compute_s = 0;  // backward_s without recompute and tp collectives
  double tp_comm_s = 0;    // exposed tp collectives, forward + backward + recompute
  double forward_tp_s = 0; // the forward's part of tp_comm_s
  double ep_comm_s = 0;    // exposed MoE dispatch/combine all-to-alls, forward + backward + recompute
  double cp_comm_s = 0;    // exposed ring k/v exchange (context parallelism), same
  double params = 0;       // on one tp rank (and, for routed experts, one ep rank)
  double expert_params = 0;  // the routed experts' part of `params` (ZeRO over dp x cp / ep)
  double activation_bytes = 0;  // kept per micro-batch
  // Live only while this layer's backward runs, beyond what it keeps: what recomputation
  // rebuilds and the backward's transient gradients (ActivationBytes::backward_transient).
  double workspace_bytes = 0;
};

// The layout being scored (what a Plan says, before stages are known).
struct Layout {
  int64_t pp = 1, dp = 1, tp = 1;
  // Context parallelism (sequence split over cp ranks, Mesh::cp) and expert parallelism
  // (experts split over ep of the dp x cp ranks, Mesh::ep).
  int64_t cp = 1, ep = 1;
  // Ranks holding one replica's parameters with different tokens: the non-expert parameters'
  // gradient reduction and ZeRO group (dp x cp).
  int64_t replicas() const { return dp * cp; }
  // The routed experts' gradient reduction and ZeRO group (dp x cp / ep).
  int64_t expert_replicas() const { return dp * cp / ep; }
  int64_t zero_stage = 0;
  int64_t micro_batch_size = 1;
  int64_t num_micro_batches = 1;
  ScheduleKind schedule = ScheduleKind::none;
  int64_t virtual_stages = 1;
  Recompute recompute = Recompute::none;
  bool sequence_parallel = false;
  // How the dp collectives run (collectives.h, DpGroup); no effect on memory.
  DpReduction dp_reduction = DpReduction::flat;
  Compression inter_node_compression = Compression::none;
  bool zero_overlap = true;  // Plan::zero_overlap
};

// Model state of `params` parameters (on one rank, before ZeRO) of which `expert_params` are
// routed experts' (already divided by ep): ZeRO over dp x cp for the rest, over dp x cp / ep
// for the experts (Rajbhandari et al. 2020 per group; docs/cost_model.md, "Experts").
ModelStateBytes layout_model_state_bytes(double params, double expert_params, const Layout& layout,
                                         const TrainingConfig& training, double grad_bytes);

// Whether overlapping ZeRO's gradient reductions with computation can save time on `cluster`: with
// overlap_contention >= 1 each side runs fully slowed while both do (overlapped_seconds(c, x,
// 1) = c + x, the serial time), so overlap only costs memory there (Plan::zero_overlap).
bool zero_overlap_pays(const Cluster& cluster);

// The elements of the weight tied between the layers of graph.tied_groups[g]
// (ModelGraph::tied_params), at the share one rank's layer holds under `costs`' layout.
double tied_params(const ModelGraph& graph, size_t g, const std::vector<LayerCost>& costs);

std::vector<LayerCost> layer_costs(const ModelGraph& graph, const Cluster& cluster,
                                   const TrainingConfig& training, const Layout& layout);

// Bytes one tp rank sends in tensor-parallel collectives per optimizer step, over every
// layer of the graph (a pipeline rank sends its stages' share): Megatron's all-reduces per
// layer (tp_all_reduces) on the layer's activation, as ring volumes 2(t-1)/t S, for each of
// the step's micro-batches, plus the forward's again under full recompute. Under sequence
// parallelism each all-reduce is an all-gather plus a reduce-scatter: the same volume.
double tp_bytes_per_step(const ModelGraph& graph, const TrainingConfig& training, const Layout& layout);
// One layer's share of it, for one micro-batch.
double tp_layer_bytes_per_micro_batch(const Layer& layer, const TrainingConfig& training, const Layout& layout);

// The layout a plan describes.
Layout layout_of(const Plan& plan);

// How many times faster than its all-busy rate a rank of `layout` can run while others idle
// in the pipeline's bubbles (shared_core_makespan): min(devices / cores, pp) when the ranks
// share fewer cores than there are devices and the whole job is on one node; 1 otherwise
// (on several nodes a pipeline's stages sit on different machines, and no node is known to
// have an idle rank to lend from: not modelled).
double shared_core_speedup(const Cluster& cluster, const Layout& layout);

// Memory and per-micro-batch time of one virtual stage made of layers [first, last].
struct StageEstimate {
  StageCosts costs;            // per micro-batch, for the schedule simulation
  double compute_s = 0;        // forward + backward compute of one micro-batch (no tp comm)
  double recompute_s = 0;
  double tp_comm_s = 0;
  double ep_comm_s = 0;        // exposed all-to-alls (part of costs' forward / backward)
  double cp_comm_s = 0;        // exposed ring k/v exchange (likewise)
  double zero_comm_exposed_s = 0;  // ZeRO-2/3 per-micro-batch exposed collectives
  ModelStateBytes state;       // params, grads, optimizer after ZeRO division
  double activation_bytes_per_micro_batch = 0;
  // The most one micro-batch's backward through the stage holds beyond the stage's kept
  // activations: max over its layers i of workspace_i - what the layers after i kept (freed
  // by then, backward running last to first).
  double workspace_bytes = 0;
  double params = 0;           // on one tp rank, before ZeRO division
  double expert_params = 0;    // the routed experts' part of params (already / ep)
};

// Caches generated schedules and simulations: the search evaluates many layouts that share
// the same (schedule, pp, m, v) and the same stage costs. Schedules can be large (p=64,
// m=512: ~200k actions), so only the few most recent are kept; the search visits the layouts
// of one schedule one after another.
class SimulationCache {
 public:
  using ScheduleKey = std::tuple<int, int64_t, int64_t, int64_t>;  // kind, pp, m, v
  const Schedule& schedule(ScheduleKind kind, int64_t pp, int64_t m, int64_t v);
  const SimulationResult& simulate(const Schedule& schedule, const std::vector<StageCosts>& costs);

 private:
  static constexpr size_t kSchedulesKept = 4;
  std::vector<std::pair<ScheduleKey, std::unique_ptr<Schedule>>> recent_;  // most recent last
  std::map<std::pair<ScheduleKey, std::vector<double>>, SimulationResult> results_;
};

// Fills plan.prediction from the plan's layout and layer stages, with the layer times of
// `estimator` (default: the analytic model). The plan must be valid for the graph
// (validate(plan, graph)).
Prediction predict(const ModelGraph& graph, const Plan& plan, SimulationCache* cache = nullptr,
                   const Estimator* estimator = nullptr);
// Same, but returns nullopt without simulating the schedule when a lower bound on the step
// time already reaches `prune_above` (the search's branch-and-bound).
std::optional<Prediction> predict_if_faster(const ModelGraph& graph, const Plan& plan,
                                            SimulationCache* cache, double prune_above,
                                            const Estimator* estimator = nullptr);

// Bytes a stage whose last layer is `last` sends downstream per micro-batch: that layer's
// output activation, at the training config's activation width; with sequence parallelism
// each tp rank sends its 1/tp shard. Both the p2p transfer's size and that of each of the
// rank's two p2p buffers (activation in, gradient out).
double stage_p2p_bytes(const ModelGraph& graph, const TrainingConfig& training,
                       const Layout& layout, int64_t last);

// The activation memory of pipeline rank `rank` at its peak, walking its action list in
// order (docs/cost_model.md, "Memory"): a forward of (micro-batch, stage) adds the stage's
// kept bytes, its backward (ZB-H1: its W) frees them, and while a backward runs the stage's
// workspace is live on top. Each virtual stage counts its own micro-batches (the true
// in-flight count per chunk, not the rank's peak spread evenly over its chunks). With
// `sent_bytes` (pipeline_sends_kept) every forward also adds what the stage sends forward and
// every backward what it sends back, held until the step ends. Vectors are per stage.
double peak_activation_bytes(const std::vector<Action>& program, const std::vector<double>& kept_bytes,
                             const std::vector<double>& workspace_bytes,
                             const std::vector<double>& sent_forward_bytes,
                             const std::vector<double>& sent_backward_bytes);

// Per-stage estimate (also used by the stage partitioner).
StageEstimate estimate_stage(const ModelGraph& graph, const std::vector<LayerCost>& costs,
                             const Cluster& cluster, const TrainingConfig& training,
                             const Layout& layout, int64_t first, int64_t last);

// Activations in flight on pipeline rank `rank` for the schedule before simulating it, as
// the simulation of the generated lists counts them (1F1B: min(p - r, m); ZB-H1: min(p, m)
// on every rank; GPipe: m; no pipeline: 1; interleaved: Megatron's warm-up count + 1 spread
// over the v chunks, at least the simulated peak / v). Used to bound memory while choosing
// boundaries.
double estimated_in_flight(const Layout& layout, int64_t rank);

}  // namespace monarch::planner
