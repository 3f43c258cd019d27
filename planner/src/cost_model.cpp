// Cost model. The formulas and their sources are written out in docs/cost_model.md; each
// function here names the section it implements.
#include "monarch/planner/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "monarch/planner/collectives.h"
#include "monarch/planner/context_parallel_cost.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/estimator.h"
#include "monarch/planner/moe_cost.h"

namespace monarch::planner {

// ---- Published closed forms --------------------------------------------------------------

double narayanan_flops_per_iteration(double B, double s, double l, double h, double V) {
  return 96.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * l * h));
}

ModelStateBytes zero_model_state_bytes(double params, int64_t dp, int64_t stage,
                                       double param_bytes, double grad_bytes,
                                       double optimizer_bytes) {
  const double n = static_cast<double>(std::max<int64_t>(dp, 1));
  ModelStateBytes m;
  m.params = params * param_bytes / (stage >= 3 ? n : 1.0);
  m.grads = params * grad_bytes / (stage >= 2 ? n : 1.0);
  m.optimizer = params * optimizer_bytes / (stage >= 1 ? n : 1.0);
  return m;
}

double korthikanti_layer_activation_bytes(double s, double b, double h, double a, int64_t tp,
                                          bool sp, Recompute recompute) {
  const double t = static_cast<double>(tp);
  const double sbh = s * b * h;
  switch (recompute) {
    case Recompute::full: return 2.0 * sbh / (sp ? t : 1.0);
    case Recompute::selective: return sbh * (sp ? 34.0 / t : 10.0 + 24.0 / t);
    case Recompute::none:
      return sp ? sbh / t * (34.0 + 5.0 * a * s / h)
                : sbh * (10.0 + 24.0 / t + 5.0 * a * s / (h * t));
  }
  return 0;
}

double shared_core_speedup(const Cluster& cluster, const Layout& layout) {
  const double devices = static_cast<double>(cluster.devices_per_node);
  const bool one_node = layout.pp * layout.dp * layout.cp * layout.tp <= cluster.devices_per_node;
  if (!(cluster.cores_per_node > 0 && cluster.cores_per_node < devices) || !one_node) return 1.0;
  return std::min(devices / cluster.cores_per_node, static_cast<double>(layout.pp));
}

ModelStateBytes layout_model_state_bytes(double params, double expert_params, const Layout& layout,
                                         const TrainingConfig& training, double grad_bytes) {
  ModelStateBytes m = zero_model_state_bytes(params - expert_params, layout.replicas(), layout.zero_stage,
                                             training.param_bytes, grad_bytes, training.optimizer_bytes);
  if (expert_params > 0) {
    const ModelStateBytes e = zero_model_state_bytes(expert_params, layout.expert_replicas(), layout.zero_stage,
                                                     training.param_bytes, grad_bytes, training.optimizer_bytes);
    m.params += e.params;
    m.grads += e.grads;
    m.optimizer += e.optimizer;
  }
  return m;
}

double harmonic_number(int64_t n) {
  if (n < 1) return 0.0;
  if (n <= 256) {
    double h = 0;
    for (int64_t k = n; k >= 1; --k) h += 1.0 / static_cast<double>(k);  // small terms first
    return h;
  }
  const double x = static_cast<double>(n);
  constexpr double kEulerGamma = 0.57721566490153286;
  return std::log(x) + kEulerGamma + 1.0 / (2.0 * x) - 1.0 / (12.0 * x * x);
}

double straggler_factor(const Cluster& cluster, int64_t devices) {
  if (cluster.straggler_spread <= 0 || devices <= 1) return 1.0;
  const int64_t per_node = std::max<int64_t>(cluster.devices_per_node, 1);
  const int64_t nodes = (devices + per_node - 1) / per_node;
  return 1.0 + cluster.straggler_spread * (harmonic_number(nodes) - 1.0);
}

bool zero_overlap_pays(const Cluster& cluster) { return cluster.overlap_contention < 1.0; }

double overlapped_seconds(double compute_s, double comm_s, double contention) {
  // While both run each goes 1 + contention times slower; whichever is left then runs alone:
  // max(c, x) + contention * min(c, x) for c, x >= 0.
  const double c = std::max(compute_s, 0.0), x = std::max(comm_s, 0.0);
  return std::max(c, x) + contention * std::min(c, x);
}

// ---- Graph-level quantities ---------------------------------------------------------------

double model_flops_per_step(const ModelGraph& graph, int64_t global_batch) {
  double forward = 0;
  for (const auto& l : graph.layers) forward += l.forward_flops_per_sample;
  return 3.0 * forward * static_cast<double>(global_batch);
}

double narayanan_flops_per_step(const ModelGraph& graph, int64_t global_batch) {
  double total = 0;
  for (const auto& l : graph.layers) {
    total += (l.recomputable ? 4.0 : 3.0) * l.forward_flops_per_sample;
  }
  return total * static_cast<double>(global_batch);
}

namespace {

bool is_split(const Layer& layer) { return layer.tp != TpPattern::replicated; }

double split_divisor(const Layer& layer, int64_t tp) {
  return is_split(layer) ? static_cast<double>(tp) : 1.0;
}

// Korthikanti et al. 2022 Sec. 4.2.2: sequence parallelism splits the regions tensor
// parallelism leaves replicated (norms, dropout) along the sequence.
double replicated_divisor(int64_t tp, bool sp) { return sp ? static_cast<double>(tp) : 1.0; }

// Tensor-parallel all-reduces per forward and per backward pass (Shoeybi et al. 2019,
// Fig. 4: f/g operators; a block has two in each direction). With sequence parallelism
// each all-reduce becomes an all-gather + reduce-scatter of the same total volume.
std::pair<int, int> tp_all_reduces(const Layer& layer) {
  switch (layer.tp) {
    case TpPattern::block: return {2, 2};
    case TpPattern::heads:
    case TpPattern::column_row: return {1, 1};
    case TpPattern::vocab:
      // Embedding: all-reduce of the partial lookups in forward. Head: the input's gradient
      // in backward (the vocab-parallel cross entropy adds only per-token scalars).
      return layer.kind == LayerKind::embedding ? std::pair{1, 0} : std::pair{0, 1};
    case TpPattern::replicated: return {0, 0};
  }
  return {0, 0};
}

double tp_message_bytes(const Layer& layer, int64_t micro_batch) {
  return static_cast<double>(micro_batch) *
         std::max(layer.output_bytes_per_sample, layer.activations.layer_input);
}

}  // namespace

double layer_activation_bytes(const Layer& layer, int64_t micro_batch, int64_t tp, bool sp,
                              Recompute recompute) {
  const auto& a = layer.activations;
  const double t = split_divisor(layer, tp);
  const double r = replicated_divisor(tp, sp);
  double bytes = 0;
  if (!layer.recomputable || recompute == Recompute::none) {
    bytes = a.replicated / r + a.tp_sharded / t + a.attention_scores / t;
  } else if (recompute == Recompute::selective) {
    bytes = a.replicated / r + a.tp_sharded / t;
  } else {
    bytes = a.layer_input / r;
  }
  return bytes * static_cast<double>(micro_batch);
}

double layer_params_per_tp_rank(const Layer& layer, int64_t tp) {
  return static_cast<double>(layer.params) / split_divisor(layer, tp);
}

double tp_layer_bytes_per_micro_batch(const Layer& layer, const TrainingConfig& training, const Layout& layout) {
  if (layout.tp <= 1 || !is_split(layer)) return 0.0;
  const double act_scale = training.activation_bytes / bytes_of(layer.param_dtype);
  auto [fwd, bwd] = tp_all_reduces(layer);
  const double cp = static_cast<double>(layout.cp);  // each cp rank holds s/cp of the tokens
  // Sequence parallelism turns each all-reduce into a reduce-scatter plus an all-gather (the
  // same volume), and the embedding's backward needs an all-gather of its output's gradient
  // (every vocabulary shard sees every token): half an all-reduce more (Korthikanti et al.
  // 2022, Sec. 4.2.2).
  const double sp_extra = layout.sequence_parallel && layer.tp == TpPattern::vocab &&
                                  layer.kind == LayerKind::embedding ? 0.5 : 0.0;
  const double again = (layout.recompute == Recompute::full && layer.recomputable) ? fwd : 0;
  const double message = act_scale * tp_message_bytes(layer, layout.micro_batch_size) / cp;
  return (fwd + bwd + again + sp_extra) * ring_bytes_per_rank(Collective::all_reduce, message, layout.tp);
}

double tp_bytes_per_step(const ModelGraph& graph, const TrainingConfig& training, const Layout& layout) {
  double bytes = 0;
  for (const auto& layer : graph.layers) bytes += tp_layer_bytes_per_micro_batch(layer, training, layout);
  return bytes * static_cast<double>(layout.num_micro_batches);
}

double gemm_utilization(double m, double n, double k, int64_t sm_count) {
  // NVIDIA, "Matrix Multiplication Background User's Guide" (Deep Learning Performance
  // docs): a GEMM runs as output tiles, each on one SM; tiles are padded to the tile size
  // (tile quantization) and run in waves of one tile per SM, the last wave partly idle
  // (wave quantization). cuBLAS splits K when there are too few tiles to fill the SMs
  // (split-K), which this counts as more tiles (at most one per 512 of K).
  if (sm_count <= 0 || m <= 0 || n <= 0 || k <= 0) return 1.0;
  constexpr double kTile = 128;
  const double sms = static_cast<double>(sm_count);
  const double tiles = std::ceil(m / kTile) * std::ceil(n / kTile);
  const double split_k = std::max(1.0, std::min(std::floor(sms / tiles), std::ceil(k / 512.0)));
  const double waves = std::ceil(tiles * split_k / sms);
  return (m * n * split_k / (kTile * kTile)) / (waves * sms);
}

std::vector<LayerCost> layer_costs(const ModelGraph& graph, const Cluster& cluster,
                                   const TrainingConfig& training, const Layout& layout) {
  const double flops_per_s = cluster.peak_flops(training.compute_dtype) * cluster.matmul_efficiency;
  const Link tp_link = axis_link(cluster, layout.pp, layout.dp, layout.tp, Axis::tp);
  const int64_t b = layout.micro_batch_size;
  // Context parallelism: every layer sees s/cp of each sample's tokens, load-balanced so each
  // rank does 1/cp of the causal attention too (context_parallel_cost.h): FLOPs, kept
  // activations and activation messages divide by cp.
  const double cp = static_cast<double>(layout.cp);
  // cp's ring runs between neighbours of the cp group (ranks tp apart, cp of them).
  Link cp_link = axis_link(cluster, layout.pp, layout.cp, layout.tp, Axis::dp);
  cp_link.ranks = 2;
  // Layers built for one activation width; a config that stores wider activations scales.
  std::vector<LayerCost> costs;
  costs.reserve(graph.layers.size());
  for (const auto& layer : graph.layers) {
    const double act_scale = training.activation_bytes / bytes_of(layer.param_dtype);
    const double t = split_divisor(layer, layout.tp);
    // Forward: matmuls at the achievable fraction of peak; everything else (norms,
    // softmax, dropout, activations functions) is memory-bound: the bytes it keeps, and
    // those it reads once without keeping them (ActivationBytes::read_once), are written
    // once and read once.
    const double stored = act_scale *
        layer_activation_bytes(layer, b, layout.tp, layout.sequence_parallel, Recompute::none) / cp;
    const double moved = stored + act_scale * layer.activations.read_once * b / t / cp;
    // The layer's GEMMs at their shape's utilization, the rest of its FLOPs at the
    // large-GEMM rate. `effective` = the FLOPs one tp rank runs, each divided by its
    // utilization.
    double effective = layer.forward_flops_per_sample * b / t / cp;
    // The routed experts are whole on every tp rank, which runs them on all its tokens (the
    // runtime has no expert tensor parallelism): their FLOPs are not divided by tp.
    if (layer.moe.experts > 0) effective += layer.moe.routed_flops_per_sample * b / cp * (1.0 - 1.0 / t);
    for (const Gemm& g : layer.gemms) {
      const double m = g.m_per_sample * b / cp;
      const bool split = t > 1 && g.experts == 0;
      const double n = g.split == GemmSplit::n && split ? g.n / t : g.n;
      const double k = g.split == GemmSplit::k && split ? g.k / t : g.k;
      if (g.experts > 0) {
        // Routed experts (moe_cost.h): the ep group's rows for this rank's experts / ep
        // experts, each getting (rows x ep / experts) x the load factor (imbalance, or the
        // padded capacity), as one grouped GEMM; the balanced FLOPs are in the layer's total.
        const double experts = static_cast<double>(g.experts);
        const double groups = experts / static_cast<double>(layout.ep);
        const double rows = m * static_cast<double>(layout.ep) / experts * layer.moe.load_factor();
        const double run = 2.0 * rows * n * k * groups;
        effective += run / grouped_gemm_utilization(rows, n, k, groups, cluster.sm_count) -
                     run / layer.moe.load_factor();
        continue;
      }
      const double flops = 2.0 * m * n * k;
      effective += flops / gemm_utilization(m, n, k, cluster.sm_count) - flops;
    }
    const double forward_compute = effective / flops_per_s + 2.0 * moved / cluster.hbm_bytes_per_s;
    // Backward: twice the forward (gradients w.r.t. inputs and weights), Narayanan et al.;
    // or the cluster's measured ratio.
    const double backward_compute = cluster.backward_forward_ratio * forward_compute;
    double recompute = 0;
    if (layer.recomputable && layout.recompute == Recompute::full) {
      recompute = forward_compute;
    } else if (layer.recomputable && layout.recompute == Recompute::selective &&
               layer.activations.attention_scores > 0) {  // nothing to rebuild without kept scores
      const double scores = act_scale * layer.activations.attention_scores * b / t / cp;
      recompute = layer.attention_flops_per_sample * b / t / cp / flops_per_s +
                  2.0 * scores / cluster.hbm_bytes_per_s;
    }
    const auto [fwd_ar, bwd_ar] = tp_all_reduces(layer);
    const double ar = collective_seconds(Collective::all_reduce,
                                         act_scale * tp_message_bytes(layer, b) / cp, tp_link);
    const double fwd_tp = is_split(layer) ? fwd_ar * ar : 0.0;
    const double bwd_tp = is_split(layer) ? bwd_ar * ar : 0.0;
    const double recompute_tp = (recompute > 0 && layout.recompute == Recompute::full) ? fwd_tp : 0.0;
    const bool full_recompute = recompute > 0 && layout.recompute == Recompute::full;
    // Expert parallelism: dispatch and combine all-to-alls over the ep group (moe_cost.h), on
    // the critical path (not overlapped: DeepSeek-V3's DualPipe overlap is not modelled).
    double fwd_ep = 0, bwd_ep = 0;
    if (layer.moe.experts > 0 && layout.ep > 1) {
      const double a2a = all_to_all_seconds(moe_all_to_all_bytes(layer, training, layout), layout.ep,
                                            layout.tp, cluster);
      const MoeAllToAlls n = moe_all_to_alls(layout.recompute);
      fwd_ep = n.forward * a2a;
      bwd_ep = n.backward * a2a + (full_recompute ? n.recompute * a2a : 0.0);
    }
    // Context parallelism: the ring's cp - 1 steps each send the local k and v (the backward
    // k, v, dk, dv) while the block that arrived before is computed (context_parallel_cost.h).
    double fwd_cp = 0, bwd_cp = 0;
    if (layout.cp > 1 && layer.kv_elements_per_token > 0) {
      const double step_bytes = cp_ring_step_bytes(layer, training, layout, graph.seq_len());
      const double step_compute = layer.attention_flops_per_sample * b / t / cp / cp / flops_per_s;
      const double fwd_step = collective_seconds(Collective::send_recv, step_bytes, cp_link);
      const double bwd_step = collective_seconds(Collective::send_recv, 2.0 * step_bytes, cp_link);
      fwd_cp = ring_exposed_seconds(layout.cp - 1, fwd_step, step_compute);
      bwd_cp = ring_exposed_seconds(layout.cp - 1, bwd_step, cluster.backward_forward_ratio * step_compute) +
               (full_recompute ? fwd_cp : 0.0);
    }

    LayerCost c;
    c.forward_s = forward_compute + fwd_tp + fwd_ep + fwd_cp;
    c.recompute_s = recompute;
    c.backward_s = backward_compute + recompute + bwd_tp + recompute_tp + bwd_ep + bwd_cp;
    c.backward_compute_s = backward_compute;
    c.tp_comm_s = fwd_tp + bwd_tp + recompute_tp;
    c.forward_tp_s = fwd_tp;
    c.ep_comm_s = fwd_ep + bwd_ep;
    c.cp_comm_s = fwd_cp + bwd_cp;
    c.params = layer_params_per_tp_rank(layer, layout.tp);
    if (layer.moe.experts > 0) {
      // Routed experts are split over ep (each rank holds experts / ep of them) and whole on
      // every tp rank (the runtime has no expert tensor parallelism; Megatron-Core's would
      // divide them by tp too).
      const double experts = static_cast<double>(layer.moe.expert_params);
      c.expert_params = experts / static_cast<double>(layout.ep);
      c.params += c.expert_params - experts / split_divisor(layer, layout.tp);
    }
    c.activation_bytes = act_scale * layer_activation_bytes(layer, b, layout.tp,
                                                            layout.sequence_parallel, layout.recompute) / cp;
    // What this layer's backward holds beyond what it keeps: what it rebuilds (full: all its
    // activations but the input it kept; selective: its attention core) and the gradients its
    // backward makes (ActivationBytes::backward_transient).
    const double rebuilt = !layer.recomputable                          ? 0.0
                           : layout.recompute == Recompute::full        ? std::max(0.0, stored - c.activation_bytes)
                           : layout.recompute == Recompute::selective   ? act_scale * layer.activations.attention_scores * b / t / cp
                                                                        : 0.0;
    // (The transient shrinks as the layer's split part does: a replicated layer's, a norm's,
    // only along the sequence with sequence parallelism.)
    const double transient_divisor = is_split(layer) ? t : replicated_divisor(layout.tp, layout.sequence_parallel);
    c.workspace_bytes = rebuilt + act_scale * layer.activations.backward_transient * b / transient_divisor / cp;
    costs.push_back(c);
  }
  return costs;
}

double tied_params(const ModelGraph& graph, size_t g, const std::vector<LayerCost>& costs) {
  // The graph's count of the shared tensor, at the share of it one rank's layer holds (its
  // smallest layer's costs over the graph's: tp splits a vocabulary embedding too).
  const auto& group = graph.tied_groups.at(g);
  int smallest = group.front();
  for (int idx : group) smallest = costs[idx].params < costs[smallest].params ? idx : smallest;
  const double layer = static_cast<double>(graph.layers[smallest].params);
  const double share = layer > 0 ? costs[smallest].params / layer : 1.0;
  return static_cast<double>(graph.tied_params(g)) * share;
}

namespace {

// Parameters held by a stage, counting a tied weight once when its layers share the stage.
double stage_params(const ModelGraph& graph, const std::vector<LayerCost>& costs, int64_t first,
                    int64_t last) {
  double params = 0;
  for (int64_t i = first; i <= last; ++i) params += costs[i].params;
  for (size_t g = 0; g < graph.tied_groups.size(); ++g) {
    int inside = 0;
    for (int idx : graph.tied_groups[g]) inside += (idx >= first && idx <= last) ? 1 : 0;
    if (inside > 1) params -= (inside - 1) * tied_params(graph, g, costs);
  }
  return params;
}

}  // namespace

double stage_p2p_bytes(const ModelGraph& graph, const TrainingConfig& training,
                       const Layout& layout, int64_t last) {
  // With sequence parallelism the output is sharded along the sequence, and each tp rank
  // sends its shard (Narayanan et al. 2021 Sec. 4.1 scatter/gather does the same).
  const Layer& layer = graph.layers[last];
  const double act_scale = training.activation_bytes / bytes_of(layer.param_dtype);
  return act_scale * layer.output_bytes_per_sample * static_cast<double>(layout.micro_batch_size) /
         static_cast<double>(layout.sequence_parallel ? layout.tp : 1) / static_cast<double>(layout.cp);
}

StageEstimate estimate_stage(const ModelGraph& graph, const std::vector<LayerCost>& costs,
                             const Cluster& cluster, const TrainingConfig& training,
                             const Layout& layout, int64_t first, int64_t last) {
  StageEstimate e;
  double forward = 0, backward = 0, tp_comm = 0, recompute = 0, largest_layer = 0;
  double backward_compute = 0, ep_comm = 0, cp_comm = 0;
  // Backward runs the stage's layers last to first, freeing each one's activations as it
  // goes: while layer i's backward runs, the layers after it hold nothing, so the stage's peak
  // beyond what it keeps is max_i (workspace_i - sum_{j > i} kept_j).
  double kept_after = 0;
  for (int64_t i = last; i >= first; --i) {
    const auto& c = costs[i];
    e.workspace_bytes = std::max(e.workspace_bytes, c.workspace_bytes - kept_after);
    kept_after += c.activation_bytes;
  }
  for (int64_t i = first; i <= last; ++i) {
    const auto& c = costs[i];
    ep_comm += c.ep_comm_s;
    cp_comm += c.cp_comm_s;
    e.expert_params += c.expert_params;
    forward += c.forward_s;
    backward += c.backward_s;
    tp_comm += c.tp_comm_s;
    recompute += c.recompute_s;
    backward_compute += c.backward_compute_s;
    e.activation_bytes_per_micro_batch += c.activation_bytes;
    largest_layer = std::max(largest_layer, c.params);
  }
  e.params = stage_params(graph, costs, first, last);
  // A ZeRO engine's gradients in its own accumulation dtype (TrainingConfig::zero_grad_bytes).
  // Without ZeRO: the master weights' gradients (TrainingConfig::master_grad_bytes).
  const double grad_bytes =
      layout.zero_stage >= 1 ? training.zero_gradient_bytes() : training.replica_gradient_bytes();
  e.state = layout_model_state_bytes(e.params, e.expert_params, layout, training, grad_bytes);
  // ZeRO-2 under gradient accumulation reduces once per step (as the runtime does), so the
  // micro-batches before the last accumulate into whole gradients.
  if (layout.zero_stage == 2 && layout.num_micro_batches > 1) e.state.grads = e.params * grad_bytes;
  e.compute_s = forward + backward - tp_comm - ep_comm - cp_comm;
  e.recompute_s = recompute;
  e.tp_comm_s = tp_comm;
  e.ep_comm_s = ep_comm;
  e.cp_comm_s = cp_comm;

  // ZeRO-3 all-gathers each unit's parameters before its forward and again before its
  // backward, and reduce-scatters its gradients after the backward (FSDP with
  // reshard_after_forward; Zhao et al. 2023, PyTorch FSDP, Sec. 3.3-3.4). Every layer is its
  // own message, paying the ring's latency. The first gather of each pass and the last
  // reduction cannot overlap; the rest overlap the pass's computation, each side slowed by
  // the cluster's contention while they do (overlapped_seconds). The dp collectives hide
  // behind tp collectives only when those use another link: two collectives on one link take
  // turns. ZeRO-1/2 reduce once per step (predict).
  // A hierarchical dp reduction (DpGroup) runs partly on the intra-node link: it then takes
  // turns with tp's collectives there too.
  // The dp x cp ranks (Layout::replicas) reduce the non-expert parameters; the routed experts'
  // gradients go over their own group, dp x cp / ep ranks ep x tp apart (expert_groups).
  const DpGroup dp_comm = dp_group(cluster, layout.pp, layout.replicas(), layout.tp, layout.dp_reduction,
                                   layout.inter_node_compression);
  const DpGroup edp_comm = dp_group(cluster, layout.pp, layout.expert_replicas(), layout.ep * layout.tp);
  const Link tp_link = axis_link(cluster, layout.pp, layout.dp, layout.tp, Axis::tp);
  const bool tp_shares_link =
      layout.tp > 1 && (tp_link.inter_node == dp_comm.flat.inter_node || dp_comm.hierarchical());
  double exposed_forward = 0, exposed_backward_input = 0, exposed_backward_weight = 0;
  if (layout.replicas() > 1 && layout.zero_stage >= 3) {
    auto gather = [&](const LayerCost& c) {
      return dp_comm.seconds(Collective::all_gather, (c.params - c.expert_params) * training.param_bytes,
                             training.param_bytes) +
             edp_comm.seconds(Collective::all_gather, c.expert_params * training.param_bytes, training.param_bytes);
    };
    // ZeRO++'s hierarchical partitioning (Wang et al. 2023, hpZ): the forward gather's
    // first hop leaves each rank 1/L of the unit, so the backward's gather stays in the node.
    auto regather = [&](const LayerCost& c) {
      return dp_comm.node_gather_seconds((c.params - c.expert_params) * training.param_bytes, training.param_bytes) +
             edp_comm.node_gather_seconds(c.expert_params * training.param_bytes, training.param_bytes);
    };
    auto reduce = [&](const LayerCost& c) {
      return dp_comm.seconds(Collective::reduce_scatter, (c.params - c.expert_params) * training.grad_bytes,
                             training.grad_bytes) +
             edp_comm.seconds(Collective::reduce_scatter, c.expert_params * training.grad_bytes, training.grad_bytes);
    };
    double ag = 0, ag_back = 0, rs = 0, forward_tp = 0;
    for (int64_t i = first; i <= last; ++i) {
      ag += gather(costs[i]);
      ag_back += regather(costs[i]);
      rs += reduce(costs[i]);
      forward_tp += costs[i].forward_tp_s;
    }
    // Forward runs first to last; backward gathers the last layer first and reduces the
    // first layer last.
    const double first_ag = gather(costs[first]);
    const double backward_first_ag = regather(costs[last]);
    const double last_rs = reduce(costs[first]);
    const double kappa = cluster.overlap_contention;
    const double forward_hiding = forward - (tp_shares_link ? forward_tp : 0.0);
    const double backward_hiding = backward - (tp_shares_link ? tp_comm - forward_tp : 0.0);
    exposed_forward = first_ag + overlapped_seconds(forward_hiding, ag - first_ag, kappa) - forward_hiding;
    if (!layout.zero_overlap) {
      // Each gradient reduce-scatter waited for as it is launched; the gathers still prefetch.
      const double input_hiding = splits_backward(layout.schedule)
                                      ? backward_hiding - backward_compute / 2.0 : backward_hiding;
      exposed_backward_input = backward_first_ag +
          overlapped_seconds(input_hiding, ag_back - backward_first_ag, kappa) - input_hiding;
      exposed_backward_weight = rs;
    } else if (splits_backward(layout.schedule)) {
      // The input-gradient pass needs the gathered weights; the weight pass, which the
      // schedule defers into bubbles, produces the gradients to reduce.
      const double weight_grad = backward_compute / 2.0;
      const double input_hiding = backward_hiding - weight_grad;
      exposed_backward_input = backward_first_ag +
          overlapped_seconds(input_hiding, ag_back - backward_first_ag, kappa) - input_hiding;
      exposed_backward_weight = last_rs + overlapped_seconds(weight_grad, rs - last_rs, kappa) - weight_grad;
    } else {
      exposed_backward_input = backward_first_ag + last_rs +
          overlapped_seconds(backward_hiding, ag_back + rs - backward_first_ag - last_rs, kappa) - backward_hiding;
    }
  }
  const double exposed_backward = exposed_backward_input + exposed_backward_weight;
  e.zero_comm_exposed_s = exposed_forward + exposed_backward;

  Link p2p = axis_link(cluster, layout.pp, layout.replicas(), layout.tp, Axis::pp);
  p2p.ranks = 2;
  e.costs.p2p_s = layout.pp > 1
                      ? collective_seconds(Collective::send_recv,
                                           stage_p2p_bytes(graph, training, layout, last), p2p)
                      : 0.0;

  // Zero-bubble split: W is the weight-gradient half of the backward matmuls; everything
  // else (input gradients, recompute, tp collectives) is on the critical path in B.
  const double weight_grad = backward_compute / 2.0;
  e.costs.forward_s = forward + exposed_forward;
  e.costs.backward_weight_s = weight_grad + exposed_backward_weight;
  e.costs.backward_input_s = backward - weight_grad + exposed_backward_input;
  return e;
}

double peak_activation_bytes(const std::vector<Action>& program, const std::vector<double>& kept_bytes,
                             const std::vector<double>& workspace_bytes,
                             const std::vector<double>& sent_forward_bytes,
                             const std::vector<double>& sent_backward_bytes) {
  double now = 0, peak = 0;
  for (const Action& a : program) {
    const size_t s = static_cast<size_t>(a.stage);
    switch (a.type) {
      case ActionType::forward:
        now += kept_bytes[s];
        break;
      case ActionType::send_activation:
        now += sent_forward_bytes[s];
        break;
      case ActionType::send_gradient:
        now += sent_backward_bytes[s];
        break;
      case ActionType::backward:
        peak = std::max(peak, now + workspace_bytes[s]);
        now -= kept_bytes[s];
        break;
      case ActionType::backward_input:  // the micro-batch's activations stay until its W
        peak = std::max(peak, now + workspace_bytes[s]);
        break;
      case ActionType::backward_weight:
        now -= kept_bytes[s];
        break;
      case ActionType::recv_activation:
      case ActionType::recv_gradient:
        break;
    }
    peak = std::max(peak, now);
  }
  return peak;
}

double estimated_in_flight(const Layout& layout, int64_t rank) {
  const double m = static_cast<double>(layout.num_micro_batches);
  const double p = static_cast<double>(layout.pp);
  const double r = static_cast<double>(rank);
  switch (layout.schedule) {
    case ScheduleKind::none: return 1;
    case ScheduleKind::gpipe: return m;
    case ScheduleKind::one_f_one_b:
      return std::min(p - r, m);
    // Every rank keeps up to p micro-batches between F and W (build_zero_bubble_h1), and
    // the simulator counts them until W frees them.
    case ScheduleKind::zero_bubble_h1:
      return std::min(p, m);
    // ZB-V keeps fewer than 2p (micro-batch, stage) pairs on a rank (build_zero_bubble_v),
    // its two stages alike: p per stage, each stage half a 1F1B stage.
    case ScheduleKind::zero_bubble_v:
      return std::min(p, m);
    case ScheduleKind::interleaved_1f1b: {
      // Megatron-LM's warm-up: (p - r - 1) * 2 + (v - 1) * p forwards, then one more;
      // they are spread over the rank's v chunks.
      const double v = static_cast<double>(layout.virtual_stages);
      const double warmup = std::min((p - r - 1) * 2 + (v - 1) * p, m * v);
      return std::min(warmup + 1, m * v) / v;
    }
  }
  return m;
}

// ---- Simulation cache ---------------------------------------------------------------------

const Schedule& SimulationCache::schedule(ScheduleKind kind, int64_t pp, int64_t m, int64_t v) {
  const ScheduleKey key{static_cast<int>(kind), pp, m, v};
  for (size_t i = 0; i < recent_.size(); ++i) {
    if (recent_[i].first == key) {
      std::rotate(recent_.begin() + i, recent_.begin() + i + 1, recent_.end());
      return *recent_.back().second;
    }
  }
  if (recent_.size() == kSchedulesKept) recent_.erase(recent_.begin());
  recent_.emplace_back(key, std::make_unique<Schedule>(make_schedule(kind, pp, m, v)));
  return *recent_.back().second;
}

const SimulationResult& SimulationCache::simulate(const Schedule& schedule,
                                                  const std::vector<StageCosts>& costs) {
  std::vector<double> values;
  values.reserve(costs.size() * 4);
  for (const auto& c : costs) {
    values.insert(values.end(), {c.forward_s, c.backward_input_s, c.backward_weight_s, c.p2p_s});
  }
  const ScheduleKey key{static_cast<int>(schedule.kind), schedule.ranks, schedule.micro_batches,
                        schedule.virtual_stages};
  auto full_key = std::make_pair(key, std::move(values));
  auto it = results_.find(full_key);
  if (it == results_.end()) {
    it = results_.emplace(std::move(full_key), monarch::planner::simulate(schedule, costs)).first;
  }
  return it->second;
}

// ---- Prediction ---------------------------------------------------------------------------

Layout layout_of(const Plan& plan) {
  Layout l;
  l.pp = plan.mesh.pp;
  l.dp = plan.mesh.dp;
  l.tp = plan.mesh.tp;
  l.zero_stage = plan.zero_stage;
  l.micro_batch_size = plan.micro_batch_size;
  l.num_micro_batches = plan.num_micro_batches;
  l.schedule = plan.schedule;
  l.virtual_stages = plan.virtual_stages;
  l.recompute = plan.recompute;
  l.sequence_parallel = plan.sequence_parallel;
  l.dp_reduction = plan.dp_reduction;
  l.inter_node_compression = plan.inter_node_compression;
  l.zero_overlap = plan.zero_overlap;
  l.cp = plan.mesh.cp;
  l.ep = plan.mesh.ep;
  return l;
}

namespace {

// Per pipeline rank: what it holds and what it does.
struct RankLoad {
  ModelStateBytes state;
  double params = 0;
  double expert_params = 0;                // routed experts' part of params (ZeRO over dp x cp / ep)
  double ep_comm_s = 0, cp_comm_s = 0;     // one micro-batch
  double largest_gathered = 0;             // ZeRO-3: largest sharding unit
  double root_params = 0;                  // parameters outside the plan's sharding units
  double largest_block = 0;                // the runtime's default sharding unit
  double non_block_params = 0;             // ZeRO-1/2: the runtime's root unit (layers outside blocks)
  double compute_s = 0, recompute_s = 0, tp_comm_s = 0, zero_exposed_s = 0;
  double backward_s = 0;                   // one micro-batch, all chunks
  double p2p_bytes = 0;                    // largest stage output it sends
  double tied_all_reduce_s = 0;            // gradients of weights it shares with other ranks
};

// ZeRO-1/2 as the runtime holds them (fully_shard.cpp), `mem` holding the rank's params,
// optimizer state and activations. The optimizer steps on this rank's fp32 rows: with mixed
// precision they are the master weights (counted in optimizer_bytes, Rajbhandari et al. 2020
// Sec. 3.1); in fp32 training they are views of the whole parameters' rows (no second copy).
// The shards' reduced gradients are there at the end of every backward. Its working set,
// per sharding unit (the blocks; the other layers are one root unit): Gloo's reduce-scatter
// (Communicator::reduce_scatter, point-to-point) receives the other n-1 ranks' chunks of this
// rank's part, (n-1)/n of a unit's gradient, for each of the two reductions in flight; stage 2 also
// holds the unsharded gradients of the unit being filled and of the one being reduced;
// stage 1 keeps every unit's whole gradient until its backward ends. Without overlap
// (Plan::zero_overlap) one reduction is in flight and it is the unit just filled: half.
// Under gradient accumulation (several micro-batches) the whole gradients add up from the
// first backward to the step's end, beside the activations: all of it is counted at once.
// With one micro-batch the unsharded gradients live only within the backward, which frees
// the activations as it fills them; both grow and shrink layer by layer, so the sum peaks at
// one of the backward's ends: its start (every activation, the root unit's gradient and the
// first unit's) or its end (activations gone, every gradient that is still whole). The
// breakdown is that of the larger moment.
MemoryBreakdown zero12_peak_memory(MemoryBreakdown mem, const RankLoad& load,
                                   const TrainingConfig& training, const Layout& layout) {
  const double g = training.zero_gradient_bytes();
  // Within one backward the unsharded gradients are autograd's, in the compute dtype, packed
  // in the reduce dtype when the unit is complete (fully_shard.cpp: held gradients):
  // grad_bytes. Accumulating micro-batches add up in the engine's own dtype (g).
  const double ug = training.grad_bytes;
  // The plan's sharding units when it marks some, else the blocks, else the whole model.
  const double unit = load.largest_gathered > 0 ? load.largest_gathered
                      : load.largest_block > 0  ? load.largest_block
                                                : load.params;
  const double root = load.largest_gathered > 0 ? load.root_params
                      : load.largest_block > 0  ? load.non_block_params
                                                : 0.0;
  // Each group's shard: dp x cp for the non-expert parameters, dp x cp / ep for the experts'.
  const double shard = (load.params - load.expert_params) / static_cast<double>(layout.replicas()) +
                       load.expert_params / static_cast<double>(layout.expert_replicas());
  const double whole = load.params * g;
  const double n = static_cast<double>(layout.replicas());
  const double received = unit * (n - 1) / n;  // elements one reduction receives
  if (layout.num_micro_batches > 1) {
    mem.grads = whole;
    mem.buffers = (layout.zero_overlap ? 2 : 1) * received * g + shard * g;
    return mem;
  }
  MemoryBreakdown start = mem, end = mem;
  start.grads = end.grads = shard * g;
  start.buffers = (root + unit) * ug;
  end.activations = 0;
  if (layout.zero_stage == 1) end.grads += load.params * ug;
  // Per reduction in flight: what it receives, and under stage 2 the unit's unsharded gradients.
  end.buffers = 2 * ((layout.zero_stage == 1 ? 0.0 : unit) + received) * ug / (layout.zero_overlap ? 1.0 : 2.0);
  return end.total() > start.total() ? end : start;
}

}  // namespace

Prediction predict(const ModelGraph& graph, const Plan& plan, SimulationCache* cache,
                   const Estimator* estimator) {
  return *predict_if_faster(graph, plan, cache, std::numeric_limits<double>::infinity(), estimator);
}

std::optional<Prediction> predict_if_faster(const ModelGraph& graph, const Plan& plan,
                                            SimulationCache* cache, double prune_above,
                                            const Estimator* estimator) {
  if (!estimator) estimator = &analytic_estimator();
  SimulationCache local;
  SimulationCache& sims = cache ? *cache : local;
  const Cluster& cluster = plan.cluster;
  const TrainingConfig& training = plan.training;
  const Layout layout = layout_of(plan);
  const auto costs = estimator->layer_costs(graph, cluster, training, layout);
  const int64_t stages = plan.num_stages();

  // Stage boundaries from the plan.
  std::vector<int64_t> first(stages, -1), last(stages, -1);
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const int64_t s = plan.layers[i].stage;
    if (first[s] < 0) first[s] = static_cast<int64_t>(i);
    last[s] = static_cast<int64_t>(i);
  }
  std::vector<int64_t> stage_of_layer(plan.layers.size());
  for (size_t i = 0; i < plan.layers.size(); ++i) stage_of_layer[i] = plan.layers[i].stage;

  std::vector<StageCosts> stage_costs(stages);
  double critical_path_p2p = 0;  // one activation down and one gradient up through every cut
  std::vector<RankLoad> ranks(layout.pp);
  // Per stage: activations kept per micro-batch, the backward's workspace beyond them, and
  // what it sends forward (its output) and back (its input's gradient) per micro-batch.
  std::vector<double> stage_kept(stages), stage_workspace(stages), sent_forward(stages, 0.0),
      sent_backward(stages, 0.0);
  // With weights cast per forward (below ZeRO-3, which casts what it gathers), each micro-batch
  // in flight also keeps a copy of the stage's weights its backward reads (its graph holds them;
  // an embedding's backward reads only the indices); the model state counts one per stage.
  const bool copies = training.weights_cast_per_forward && layout.zero_stage < 3;
  std::vector<double> stage_copy(stages, 0.0);
  for (int64_t s = 0; s < stages; ++s) {
    const StageEstimate e = estimate_stage(graph, costs, cluster, training, layout, first[s], last[s]);
    stage_costs[s] = e.costs;
    stage_kept[s] = e.activation_bytes_per_micro_batch;
    stage_workspace[s] = e.workspace_bytes;
    if (copies) {  // the weights the stage's backward reads (an embedding table's is not)
      for (int64_t i = first[s]; i <= last[s]; ++i) {
        if (graph.layers[i].kind != LayerKind::embedding) stage_copy[s] += costs[i].params * training.param_bytes;
      }
    }
    // A boundary inside one rank (ZB-V's turn) hands the tensors over without a message.
    const bool crosses = s + 1 < stages && pipeline_rank_of_stage(layout.schedule, layout.pp, s) !=
                                               pipeline_rank_of_stage(layout.schedule, layout.pp, s + 1);
    if (training.pipeline_sends_kept && crosses) {
      sent_forward[s] = sent_backward[s + 1] = stage_p2p_bytes(graph, training, layout, last[s]);
    }
    if (crosses) critical_path_p2p += 2 * e.costs.p2p_s;
    RankLoad& r = ranks[pipeline_rank_of_stage(layout.schedule, layout.pp, s)];
    r.params += e.params;
    r.expert_params += e.expert_params;
    r.ep_comm_s += e.ep_comm_s;
    r.cp_comm_s += e.cp_comm_s;
    r.state.params += e.state.params;
    r.state.grads += e.state.grads;
    r.state.optimizer += e.state.optimizer;
    for (int64_t i = first[s]; i <= last[s]; ++i) {
      if (plan.layers[i].kind == LayerKind::block) {
        r.largest_block = std::max(r.largest_block, costs[i].params);
      } else {
        r.non_block_params += costs[i].params;
      }
      if (plan.layers[i].sharding_unit) {
        r.largest_gathered = std::max(r.largest_gathered, costs[i].params);
      } else {
        r.root_params += costs[i].params;  // ZeRO-3's root unit: gathered through the step
      }
    }
    r.compute_s += e.compute_s;
    r.recompute_s += e.recompute_s;
    r.tp_comm_s += e.tp_comm_s;
    r.zero_exposed_s += e.zero_comm_exposed_s;
    r.backward_s += e.costs.backward_input_s + e.costs.backward_weight_s;
    r.p2p_bytes = std::max(r.p2p_bytes, stage_p2p_bytes(graph, training, layout, last[s]));
  }
  // Megatron-LM all-reduces a tied weight's gradient (embedding and LM head) among the
  // pipeline ranks holding a copy, at the end of the step, exposed. One all-reduce per
  // tied group, of the group's weight (its share on one tp rank).
  const Link pp_link = axis_link(cluster, layout.pp, layout.replicas(), layout.tp, Axis::pp);
  for (size_t g = 0; g < graph.tied_groups.size(); ++g) {
    const auto& group = graph.tied_groups[g];
    std::set<int64_t> holders, stages_holding;
    for (int idx : group) {
      holders.insert(pipeline_rank_of_stage(layout.schedule, layout.pp, stage_of_layer[idx]));
      stages_holding.insert(stage_of_layer[idx]);
    }
    if (holders.size() == 1 && stages_holding.size() > 1) {
      // Stages of one rank share the weight (ZB-V's first and last stage): the runtime holds
      // one parameter, which each stage's state above counted.
      const double grad_bytes =
          layout.zero_stage >= 1 ? training.zero_gradient_bytes() : training.replica_gradient_bytes();
      const double extra = static_cast<double>(stages_holding.size() - 1) * tied_params(graph, g, costs);
      ModelStateBytes twice = layout_model_state_bytes(extra, 0.0, layout, training, grad_bytes);
      if (layout.zero_stage == 2 && layout.num_micro_batches > 1) twice.grads = extra * grad_bytes;  // as above
      RankLoad& r = ranks[*holders.begin()];
      r.params -= extra;
      r.state.params -= twice.params;
      r.state.grads -= twice.grads;
      r.state.optimizer -= twice.optimizer;
    }
    if (holders.size() < 2) continue;
    Link tied = pp_link;
    tied.ranks = static_cast<int64_t>(holders.size());
    const double seconds = collective_seconds(
        Collective::all_reduce, tied_params(graph, g, costs) * training.grad_bytes, tied);
    for (int64_t r : holders) ranks[r].tied_all_reduce_s += seconds;
  }

  // Data-parallel gradient reduction at the end of the step (ZeRO 0/1/2), overlapped with the
  // last micro-batch's backward bucket by bucket (Li et al. 2020, PyTorch DDP, Sec. 3.2.3);
  // parameter all-gather after the optimizer step (ZeRO 1/2, Rajbhandari et al. Sec. 7).
  // Flat rings, or the hierarchical decomposition the plan asks for (DpGroup).
  // Over dp x cp ranks (context parallel ranks hold the same weights); the routed experts'
  // gradients over their dp x cp / ep ranks (expert_groups), one after the other.
  const DpGroup dp_comm = dp_group(cluster, layout.pp, layout.replicas(), layout.tp, layout.dp_reduction,
                                   layout.inter_node_compression);
  const DpGroup edp_comm = dp_group(cluster, layout.pp, layout.expert_replicas(), layout.ep * layout.tp);
  const double g = training.grad_bytes;
  double worst_end = 0, worst_optimizer = 0;
  for (int64_t r = 0; r < layout.pp; ++r) {
    const RankLoad& load = ranks[r];
    const double grads = (load.params - load.expert_params) * training.grad_bytes;
    const double expert_grads = load.expert_params * training.grad_bytes;
    double end = 0;
    if (layout.replicas() > 1) {
      const double bucket = std::min(grads, training.dp_bucket_bytes);
      if (layout.zero_stage <= 2) {
        const Collective c = layout.zero_stage == 0 ? Collective::all_reduce : Collective::reduce_scatter;
        const double reduce = dp_comm.seconds(c, grads, g) + edp_comm.seconds(c, expert_grads, g);
        const double last_micro_batch_backward = load.backward_s;
        const double last_bucket = dp_comm.seconds(c, bucket, g);
        if (layout.zero_stage == 2 && !layout.zero_overlap) {
          end += reduce;  // each unit's reduce-scatter waited for as its backward ends
        } else {
          end += last_bucket + overlapped_seconds(last_micro_batch_backward, reduce - last_bucket,
                                                  cluster.overlap_contention) - last_micro_batch_backward;
        }
      }
      if (layout.zero_stage == 1 || layout.zero_stage == 2) {
        end += dp_comm.seconds(Collective::all_gather, (load.params - load.expert_params) * training.param_bytes,
                               training.param_bytes) +
               edp_comm.seconds(Collective::all_gather, load.expert_params * training.param_bytes,
                                training.param_bytes);
      }
    }
    end += load.tied_all_reduce_s;
    worst_end = std::max(worst_end, end);
    // Optimizer step: memory-bound; reads gradients and optimizer state, writes state and
    // parameters.
    const double local =
        (load.params - load.expert_params) / (layout.zero_stage >= 1 ? layout.replicas() : 1) +
        load.expert_params / (layout.zero_stage >= 1 ? layout.expert_replicas() : 1);
    const double bytes = local * (2 * training.optimizer_bytes + training.grad_bytes + training.param_bytes);
    worst_optimizer = std::max(worst_optimizer, bytes / cluster.hbm_bytes_per_s);
  }

  // Before simulating: a bound the simulation can only exceed. Every rank does m times its
  // work; and stage k cannot start before micro-batch 0 went through the stages before it,
  // nor can the step end before the last micro-batch's backward went back through them:
  // makespan >= sum_{s<k} (F_s + B_s) + m (F_k + B_k) (ZB-H1 may defer W: only F before).
  if (prune_above < std::numeric_limits<double>::infinity()) {
    const double m = static_cast<double>(layout.num_micro_batches);
    std::vector<double> per_rank(layout.pp, 0.0);
    double bound = 0, before = 0;
    const bool chain = plan.schedule == ScheduleKind::gpipe ||
                       plan.schedule == ScheduleKind::one_f_one_b ||
                       plan.schedule == ScheduleKind::zero_bubble_h1 ||
                       plan.schedule == ScheduleKind::none;
    for (int64_t s = 0; s < stages; ++s) {
      const StageCosts& c = stage_costs[s];
      const double work = c.forward_s + c.backward_input_s + c.backward_weight_s;
      per_rank[pipeline_rank_of_stage(layout.schedule, layout.pp, s)] += work;
      if (chain) bound = std::max(bound, before + m * work);
      before += plan.schedule == ScheduleKind::zero_bubble_h1 ? c.forward_s : work;
    }
    for (double w : per_rank) bound = std::max(bound, m * w);
    // Devices sharing cores run a schedule up to that many times faster while others idle.
    bound /= shared_core_speedup(cluster, layout);
    // Cut only when the bound is above the threshold by more than rounding can explain:
    // the simulation sums the same costs in another order, and a layout tying the
    // threshold may still win the tie-break. The step waits for the slowest node on top
    // (straggler_factor >= 1), so the bound scales with it.
    const double stragglers = straggler_factor(cluster, layout.pp * layout.dp * layout.cp * layout.tp);
    if ((bound + worst_end + worst_optimizer) * stragglers * (1 - 1e-9) >= prune_above) return std::nullopt;
  }

  const Schedule& schedule = sims.schedule(plan.schedule, layout.pp, layout.num_micro_batches,
                                           layout.virtual_stages);
  const SimulationResult& sim = sims.simulate(schedule, stage_costs);

  Prediction p;
  for (int64_t r = 0; r < layout.pp; ++r) {
    const RankLoad& load = ranks[r];
    MemoryBreakdown mem;
    mem.params = load.state.params;
    mem.grads = load.state.grads;
    mem.optimizer = load.state.optimizer;
    if (layout.virtual_stages == 1 && !training.pipeline_sends_kept) {
      // One stage per rank, nothing sent kept: the walk's peak is the simulated peak count's
      // activations with the workspace on top (a backward runs at that count in every
      // schedule generated; test_activation_memory checks it), without walking again.
      mem.activations = static_cast<double>(sim.peak_in_flight[r]) * stage_kept[r] + stage_workspace[r];
    } else {
      mem.activations = peak_activation_bytes(schedule.per_rank[r], stage_kept, stage_workspace, sent_forward,
                                              sent_backward);
    }
    if (copies) {
      std::vector<double> with_copy(stages);
      double counted = 0;  // the copies the model state counts: one per stage of this rank
      for (int64_t s = 0; s < stages; ++s) {
        with_copy[s] = stage_kept[s] + stage_copy[s];
        if (pipeline_rank_of_stage(layout.schedule, layout.pp, s) == r) counted += stage_copy[s];
      }
      mem.activations = std::max(mem.activations, peak_activation_bytes(schedule.per_rank[r], with_copy,
                                                                        stage_workspace, sent_forward, sent_backward) -
                                                      counted);
    }
    double buffers = 0;
    if (layout.replicas() > 1 && layout.zero_stage >= 3) {
      // The runtime's working set (fully_shard.cpp): the unit computing, the next one
      // prefetched and its all-gather output while it is unpacked (3 units of parameters);
      // the unsharded gradients of the unit being filled and of the one being reduced (2);
      // the root unit (layers outside the units) whole with its gradient for the whole step.
      // Without overlap (Plan::zero_overlap) each reduction is waited for as it is launched:
      // one unit's unsharded gradients. Those are autograd's (compute dtype) until packed in
      // the reduce dtype: grad_bytes (stage 3 reduces every micro-batch, nothing accumulates
      // in them).
      const double g = training.grad_bytes;
      const double grad_units = layout.zero_overlap ? 2 : 1;
      buffers += 3 * load.largest_gathered * training.param_bytes +
                 grad_units * load.largest_gathered * g + load.root_params * (training.param_bytes + g);
      if (dp_comm.hierarchical()) {
        // ZeRO++ (hierarchical_shard.h): at the end of the forward every unit's secondary
        // shard (1/L of it, as it crossed nodes) waits for its backward; a compressed
        // gradient hop keeps the fp32 residuals of the chunks sent to the other nodes.
        const double L = static_cast<double>(dp_comm.split.ranks_per_node);
        const double M = static_cast<double>(dp_comm.split.nodes);
        const double units = load.params - load.root_params;
        buffers += units / L * compressed_value_bytes(layout.inter_node_compression, training.param_bytes);
        if (layout.inter_node_compression != Compression::none) buffers += load.params * (M - 1) / (L * M) * 4.0;
      }
    } else if (layout.replicas() > 1 && layout.zero_stage == 0) {
      // DDP's buckets hold every gradient a second time (gradients are copied into them and
      // averaged there), allocated once: the rank's whole gradient, not two buckets (Li et al.
      // 2020, Sec. 3.2.3; the runtime's DataParallelEngine does the same).
      buffers += load.params * training.grad_bytes;
    } else if (layout.replicas() > 1) {
      mem = zero12_peak_memory(mem, load, training, layout);
      buffers = mem.buffers;
    }
    if (layout.pp > 1) buffers += 2 * load.p2p_bytes;  // activation and gradient buffers
    mem.buffers = buffers;
    if (mem.total() > p.memory.total()) p.memory = mem;
    RankPrediction rank;
    rank.memory = mem;
    rank.busy_s = sim.busy_s[r];
    rank.idle_s = sim.idle_s[r];
    p.ranks.push_back(rank);  // traffic: add_traffic (traffic.h), for the plans kept
  }
  p.stages = stage_costs;

  // Breakdown on the busiest rank.
  int64_t busiest = 0;
  for (int64_t r = 1; r < layout.pp; ++r) {
    if (sim.busy_s[r] > sim.busy_s[busiest]) busiest = r;
  }
  const double m = static_cast<double>(layout.num_micro_batches);
  const RankLoad& b = ranks[busiest];
  TimeBreakdown& t = p.time;
  t.compute = m * b.compute_s;
  t.recompute = m * b.recompute_s;
  t.tp_comm = m * b.tp_comm_s;
  t.ep_comm = m * b.ep_comm_s;
  t.cp_comm = m * b.cp_comm_s;
  // The simulation's idle time splits into the transfers on the fill/drain critical path and
  // the schedule's bubble proper (which also absorbs stage imbalance).
  double makespan = sim.makespan_s;
  if (shared_core_speedup(cluster, layout) > 1) {
    // Devices sharing fewer cores (CPU ranks on one machine): the rates are with every device
    // busy, so the schedule's makespan holds when all are; a device idle in a bubble lends its
    // share to the busy ones, up to `over` times their all-busy rate (one core per device at
    // most, or what the cluster's effective cores_per_node says).
    const double over = static_cast<double>(cluster.devices_per_node) / cluster.cores_per_node;
    // While k of the pipeline's ranks compute (and their dp x tp copies, in step), each gets
    // min(over, pp / k) times its all-busy rate: warp the simulated timeline by that. In a
    // pipeline's fill and drain a rank alone cannot use the cores the idle ones leave.
    makespan = shared_core_makespan(monarch::planner::simulate(schedule, stage_costs, true), layout.pp, over);
  }
  const double idle = std::max(0.0, makespan - sim.busy_s[busiest]);
  t.pp_comm = std::min(idle, critical_path_p2p);
  t.bubble = idle - t.pp_comm;
  t.dp_comm = m * b.zero_exposed_s + worst_end;
  t.optimizer = worst_optimizer;
  // Scale effects: every step waits for the slowest of the job's nodes (straggler_factor).
  const double rest = makespan + worst_end + worst_optimizer;
  t.stragglers = (straggler_factor(cluster, layout.pp * layout.dp * layout.cp * layout.tp) - 1.0) * rest;
  t.total = rest + t.stragglers;

  p.step_time_s = t.total;
  p.memory_bytes_per_device = p.memory.total();
  p.bubble_fraction = sim.bubble_fraction;
  p.estimator = estimator->name();
  const double devices = static_cast<double>(layout.pp * layout.dp * layout.cp * layout.tp);
  const double seq = static_cast<double>(std::max<int64_t>(graph.seq_len(), 1));
  p.tokens_per_s = training.global_batch * seq / t.total;
  p.tflops_per_device =
      narayanan_flops_per_step(graph, training.global_batch) / (t.total * devices) / 1e12;
  p.mfu = model_flops_per_step(graph, training.global_batch) /
          (t.total * devices * cluster.peak_flops(training.compute_dtype));
  return p;
}

}  // namespace monarch::planner
