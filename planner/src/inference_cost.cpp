// Inference cost model: prefill, decode, KV cache and memory of one tp x pp layout
// (inference.h; docs/cost_model.md, "Inference").
//
// Sources:
// * Prefill is a forward pass: FLOPs as the training model counts them (Narayanan et al. 2021,
//   Sec. 5.1: 2 x weights per token plus the 4 s^2 h attention core), compute-bound.
// * Decode reads every weight and the KV cache once per generated token and is
//   memory-bandwidth-bound at small batches (Pope et al. 2022, "Efficiently Scaling Transformer
//   Inference", Sec. 2-3; Kwon et al. 2023, vLLM, Sec. 2.2): time = bytes / achieved HBM
//   bandwidth, or FLOPs / peak when the batch makes the step compute-bound (the roofline).
// * KV cache: 2 (k and v) x layers x kv_heads x head_dim x tokens x bytes per sequence
//   (Pope et al. 2022, Sec. 3.1; grouped-query attention: Ainslie et al. 2023), split over tp
//   by kv heads as Megatron / vLLM split attention (Shoeybi et al. 2019).
// * Tensor parallelism: 2 all-reduces per block forward (Shoeybi et al. 2019, Sec. 3). A decode
//   step's messages are batch x hidden values: latency-dominated; NCCL runs such small
//   all-reduces on its tree / LL protocols, whose latency grows with log2 of the ranks
//   (Jeaugey, "Massively Scale Your Deep Learning Training with NCCL 2.4", NVIDIA 2019).
// * Pipeline: one point-to-point send per stage boundary; a token passes every stage, so
//   per-token latency is the sum of the stages; m micro-batches in flight keep the stages busy
//   (Huang et al. 2019, GPipe; the round-robin decode of FasterTransformer / TensorRT-LLM).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "inference_internal.h"
#include "monarch/planner/cluster.h"
#include "monarch/planner/collectives.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/inference.h"
#include "monarch/planner/model_graph.h"

namespace monarch::planner {

std::string to_string(InferenceObjective objective) {
  return objective == InferenceObjective::latency ? "latency" : "throughput";
}

InferenceObjective inference_objective_from_string(const std::string& name, const std::string& field) {
  if (name == "latency") return InferenceObjective::latency;
  if (name == "throughput") return InferenceObjective::throughput;
  throw ValidationError(field, "unknown objective '" + name + "' (expected one of latency, throughput)");
}

bool InferenceConfig::operator==(const InferenceConfig& o) const {
  return objective == o.objective && batch == o.batch && prompt_len == o.prompt_len &&
         max_new_tokens == o.max_new_tokens && latency_target_s == o.latency_target_s &&
         max_batch == o.max_batch && weight_bytes == o.weight_bytes && kv_bytes == o.kv_bytes &&
         hbm_efficiency == o.hbm_efficiency && host_seconds_per_op == o.host_seconds_per_op &&
         ops_per_block == o.ops_per_block && host_seconds_per_step == o.host_seconds_per_step &&
         host_overlaps_device == o.host_overlaps_device;
}

bool InferencePrediction::operator==(const InferencePrediction& o) const {
  return ttft_s == o.ttft_s && per_token_s == o.per_token_s && tokens_per_s == o.tokens_per_s &&
         request_s == o.request_s && weights_bytes == o.weights_bytes &&
         kv_cache_bytes == o.kv_cache_bytes && activation_bytes == o.activation_bytes &&
         memory_bytes == o.memory_bytes && decode_weights_s == o.decode_weights_s &&
         decode_kv_s == o.decode_kv_s && decode_compute_s == o.decode_compute_s &&
         decode_tp_comm_s == o.decode_tp_comm_s && decode_pp_comm_s == o.decode_pp_comm_s &&
         prefill_compute_s == o.prefill_compute_s && prefill_tp_comm_s == o.prefill_tp_comm_s &&
         prefill_pp_comm_s == o.prefill_pp_comm_s && decode_host_s == o.decode_host_s;
}

bool InferencePlan::operator==(const InferencePlan& o) const {
  return config == o.config && batch_per_replica == o.batch_per_replica &&
         decode_micro_batches == o.decode_micro_batches && prediction == o.prediction;
}

void validate(const InferenceConfig& c) {
  auto require = [](bool ok, const char* field, const std::string& message) {
    if (!ok) throw ValidationError(std::string("inference.") + field, message);
  };
  require(c.batch >= 1, "batch", "must be >= 1, got " + std::to_string(c.batch));
  require(c.prompt_len >= 1, "prompt_len", "must be >= 1, got " + std::to_string(c.prompt_len));
  require(c.max_new_tokens >= 1, "max_new_tokens", "must be >= 1, got " + std::to_string(c.max_new_tokens));
  require(std::isfinite(c.latency_target_s) && c.latency_target_s >= 0, "latency_target_s",
          "must be >= 0 (0: no target)");
  require(c.max_batch >= 0, "max_batch", "must be >= 0 (0: 256)");
  require(c.max_batch == 0 || c.max_batch >= c.batch, "max_batch",
          "must be >= batch (" + std::to_string(c.batch) + "), got " + std::to_string(c.max_batch));
  require(std::isfinite(c.weight_bytes) && c.weight_bytes >= 0, "weight_bytes", "must be >= 0 (0: the model's dtype)");
  require(std::isfinite(c.kv_bytes) && c.kv_bytes >= 0, "kv_bytes", "must be >= 0 (0: the model's dtype)");
  require(c.hbm_efficiency > 0 && c.hbm_efficiency <= 1, "hbm_efficiency", "must be in (0, 1]");
  require(c.host_seconds_per_op >= 0, "host_seconds_per_op", "must be >= 0");
  require(c.ops_per_block >= 0, "ops_per_block", "must be >= 0");
  require(std::isfinite(c.host_seconds_per_step) && c.host_seconds_per_step >= 0, "host_seconds_per_step",
          "must be >= 0 (0: no host work outside the blocks)");
  require(c.prompt_len <= (int64_t{1} << 40) && c.max_new_tokens <= (int64_t{1} << 40) &&
              c.batch <= (int64_t{1} << 40),
          "prompt_len", "batch, prompt_len and max_new_tokens must stay below 2^40");
}

namespace inference_detail {

// Time of one all-reduce of `bytes` over `link` (decode and prefill): NCCL's tree latency,
// 2 ceil(log2 n) alpha, plus the ring's bandwidth term 2 (n-1)/n S / B (Jeaugey 2019).
double all_reduce_seconds(double bytes, const Link& link) {
  if (link.ranks <= 1) return 0;
  const double steps = 2 * std::ceil(std::log2(static_cast<double>(link.ranks)));
  return steps * link.latency_s + ring_bytes_per_rank(Collective::all_reduce, bytes, link.ranks) / link.bytes_per_s;
}

double all_gather_seconds(double bytes, const Link& link) {
  if (link.ranks <= 1) return 0;
  const double steps = std::ceil(std::log2(static_cast<double>(link.ranks)));
  return steps * link.latency_s + ring_bytes_per_rank(Collective::all_gather, bytes, link.ranks) / link.bytes_per_s;
}

ModelCosts model_costs(const ModelGraph& graph, const InferenceConfig& config, int64_t tp) {
  ModelCosts m;
  const double s = static_cast<double>(graph.seq_len());
  if (!(s > 0)) {
    throw ValidationError("model", "inference needs the sequence length the graph was built for "
                                   "(a graph from build_transformer: transformer.seq)");
  }
  const DType dtype = graph.layers.empty() ? DType::bf16 : graph.layers.front().param_dtype;
  const double act = bytes_of(dtype);
  m.weight_bytes = config.weight_bytes > 0 ? config.weight_bytes : act;
  m.kv_bytes = config.kv_bytes > 0 ? config.kv_bytes : act;
  m.layers.reserve(graph.layers.size());
  for (size_t i = 0; i < graph.layers.size(); ++i) {
    const Layer& l = graph.layers[i];
    LayerCost c;
    const bool split = tp > 1 && l.tp != TpPattern::replicated;
    const double t = split ? static_cast<double>(tp) : 1.0;
    // Routed experts stay whole on every tp rank (the runtime does not split them, as the
    // training cost model says: cost_model.cpp); the rest of a split layer is 1/tp.
    const double expert_params = static_cast<double>(l.moe.experts > 0 ? l.moe.expert_params : 0);
    c.weight_bytes = ((static_cast<double>(l.params) - expert_params) / t + expert_params) * m.weight_bytes;
    // An embedding lookup reads the batch's rows, not the table (a tied head reads it as the head).
    c.read_bytes = l.kind == LayerKind::embedding ? 0.0 : c.weight_bytes;
    if (l.moe.experts > 0) {
      c.expert_weight_bytes = expert_params * m.weight_bytes;
      c.experts = l.moe.experts;
      c.top_k = l.moe.top_k;
    }
    c.head = l.kind == LayerKind::head;
    const double dense = std::max(0.0, l.forward_flops_per_sample - l.attention_flops_per_sample) / s;
    const double routed = l.moe.experts > 0 ? l.moe.routed_flops_per_sample / s : 0.0;
    c.dense_flops_per_token = (dense - routed) / t + routed;
    c.attention_flops_per_token_ctx = l.attention_flops_per_sample / (s * s) / t;
    c.kv_bytes_per_token = l.kv_elements_per_token * m.kv_bytes / t;
    c.hidden_bytes_per_token = l.output_bytes_per_sample / s;
    // A forward keeps nothing for backward: its live set is about the layer's input plus its
    // tp-sharded intermediates (q, k, v, attention output, MLP inner activations), an upper
    // bound of what one layer holds at once (Korthikanti et al. 2022's parts, Sec. 4.1).
    c.activation_bytes_per_token = (l.activations.layer_input + l.activations.tp_sharded / t) / s;
    c.scores_bytes_per_token2 = l.activations.attention_scores / t / (s * s);
    c.vocab = l.tp_dims.vocab;
    c.logit_bytes_per_sequence = c.head ? 4.0 * static_cast<double>(l.tp_dims.vocab) / t : 0.0;
    if (split) {
      switch (l.kind) {
        case LayerKind::block: c.all_reduces = 2; break;
        case LayerKind::attention:
        case LayerKind::mlp:
        case LayerKind::embedding: c.all_reduces = 1; break;
        case LayerKind::head: c.gathers_logits = true; break;
        default: c.all_reduces = 1; break;
      }
    }
    c.can_cut_before = graph.can_cut_before(static_cast<int>(i));
    m.layers.push_back(c);
  }
  return m;
}

// Contiguous stages minimising the largest stage's weight + KV bytes (each stage at least one
// layer, cuts only where the graph allows). Dynamic programming over prefix sums.
std::vector<int64_t> partition_stages(const ModelCosts& m, int64_t pp, double kv_per_token_weight) {
  const int64_t n = static_cast<int64_t>(m.layers.size());
  std::vector<int64_t> first(pp, 0);
  if (pp == 1) return first;
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    prefix[i + 1] = prefix[i] + m.layers[i].weight_bytes + m.layers[i].kv_bytes_per_token * kv_per_token_weight;
  }
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the first i layers in k+1 stages; from[k][i]: where the last stage starts.
  std::vector<std::vector<double>> best(pp, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int64_t>> from(pp, std::vector<int64_t>(n + 1, -1));
  for (int64_t i = 1; i <= n; ++i) best[0][i] = prefix[i];
  for (int64_t k = 1; k < pp; ++k) {
    for (int64_t i = k + 1; i <= n; ++i) {
      for (int64_t j = k; j < i; ++j) {  // last stage = layers [j, i)
        if (!m.layers[j].can_cut_before || best[k - 1][j] == inf) continue;
        const double v = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (v < best[k][i]) {
          best[k][i] = v;
          from[k][i] = j;
        }
      }
    }
  }
  if (best[pp - 1][n] == inf) {
    throw ValidationError("pp", std::to_string(pp) + " stages cannot be cut from the model's " +
                                    std::to_string(n) + " layers (cuts only between blocks)");
  }
  int64_t end = n;
  for (int64_t k = pp - 1; k >= 1; --k) {
    first[k] = from[k][end];
    end = first[k];
  }
  return first;
}

std::vector<StageCost> stage_costs(const ModelCosts& m, const std::vector<int64_t>& first) {
  const int64_t pp = static_cast<int64_t>(first.size());
  const int64_t n = static_cast<int64_t>(m.layers.size());
  std::vector<StageCost> stages(pp);
  for (int64_t k = 0; k < pp; ++k) {
    StageCost& st = stages[k];
    const int64_t end = k + 1 < pp ? first[k + 1] : n;
    st.first_layer = first[k];
    st.end_layer = end;
    for (int64_t i = first[k]; i < end; ++i) {
      const LayerCost& c = m.layers[i];
      st.weight_bytes += c.weight_bytes;
      st.dense_weight_bytes += c.read_bytes - c.expert_weight_bytes;
      if (c.experts > 0) st.moe.push_back({c.expert_weight_bytes, c.experts, c.top_k});
      (c.head ? st.head_flops_per_token : st.dense_flops_per_token) += c.dense_flops_per_token;
      st.attention_flops_per_token_ctx += c.attention_flops_per_token_ctx;
      st.kv_bytes_per_token += c.kv_bytes_per_token;
      if (c.kv_bytes_per_token > 0) ++st.blocks;
      st.all_reduces += c.all_reduces;
      st.hidden_bytes_per_token = std::max(st.hidden_bytes_per_token, c.hidden_bytes_per_token);
      if (!c.head) {
        st.activation_bytes_per_token = std::max(st.activation_bytes_per_token, c.activation_bytes_per_token);
        st.scores_bytes_per_token2 = std::max(st.scores_bytes_per_token2, c.scores_bytes_per_token2);
      }
      if (c.gathers_logits) st.logit_gather_bytes_per_sequence += 4.0 * static_cast<double>(c.vocab);
      st.logit_bytes_per_sequence += c.logit_bytes_per_sequence;
      st.out_bytes_per_token = c.hidden_bytes_per_token > 0 ? c.hidden_bytes_per_token : st.out_bytes_per_token;
    }
  }
  return stages;
}

DType checked_inputs(const ModelGraph& graph, const Cluster& cluster, const InferenceConfig& config) {
  validate(graph);
  validate(cluster);
  validate(config);
  const DType dtype = graph.layers.front().param_dtype;
  require_peak_flops(cluster, dtype);
  return dtype;
}

}  // namespace inference_detail

using namespace inference_detail;

double kv_cache_bytes_per_sequence(const ModelGraph& graph, int64_t tokens, double kv_bytes, int64_t tp) {
  double per_token = 0;
  const double t = static_cast<double>(std::max<int64_t>(tp, 1));
  for (const Layer& l : graph.layers) {
    per_token += l.kv_elements_per_token * kv_bytes / (tp > 1 && l.tp != TpPattern::replicated ? t : 1.0);
  }
  return per_token * static_cast<double>(tokens);
}

InferencePlan evaluate_stages(const ModelCosts& m, const std::vector<StageCost>& stages,
                              const Cluster& cluster, const InferenceConfig& config, int64_t tp,
                              int64_t pp, int64_t batch, int64_t micro_batches) {
  const int64_t world = cluster.world_size();
  const int64_t dp = world / (tp * pp);
  const Link tp_link = axis_link(cluster, pp, dp, tp, Axis::tp);
  const Link pp_link = axis_link(cluster, pp, dp, tp, Axis::pp);
  const double peak = m.peak_flops * cluster.matmul_efficiency;
  const double bw = cluster.hbm_bytes_per_s * config.hbm_efficiency;
  const double bm = static_cast<double>(batch) / static_cast<double>(micro_batches);
  const double P = static_cast<double>(config.prompt_len);
  const double N = static_cast<double>(config.max_new_tokens);
  const double ctx = P + N / 2;  // mean context over the generated tokens

  InferencePlan plan;
  plan.config = config;
  plan.batch_per_replica = batch;
  plan.decode_micro_batches = micro_batches;
  InferencePrediction& r = plan.prediction;

  double decode_sum = 0, decode_max = 0, prefill_sum = 0, prefill_max = 0;
  for (size_t k = 0; k < stages.size(); ++k) {
    const StageCost& st = stages[k];
    const bool last = k + 1 == stages.size();
    // Decode: one token for each of the micro-batch's bm sequences.
    double weights = st.dense_weight_bytes;
    for (const auto& e : st.moe) {
      // Experts a step touches: each of bm tokens picks top_k of E uniformly, so an expert is
      // read with probability 1 - (1 - k/E)^bm.
      const double frac = 1 - std::pow(1 - static_cast<double>(e.top_k) / static_cast<double>(e.experts), bm);
      weights += e.bytes * frac;
    }
    const double kv = bm * st.kv_bytes_per_token * ctx;
    const double flops = bm * (st.dense_flops_per_token + st.head_flops_per_token + st.attention_flops_per_token_ctx * ctx);
    const double t_w = weights / bw, t_kv = kv / bw, t_f = flops / peak;
    const double t_dec = std::max(t_w + t_kv, t_f);
    const double tp_dec = st.all_reduces * all_reduce_seconds(bm * st.hidden_bytes_per_token, tp_link) +
                          (st.logit_gather_bytes_per_sequence > 0
                               ? all_gather_seconds(bm * st.logit_gather_bytes_per_sequence, tp_link) : 0.0);
    const double hop_dec = last ? 0.0 : collective_seconds(Collective::send_recv, bm * st.out_bytes_per_token, pp_link);
    // The host's dispatch of the stage's operators, once per micro-batch forward; the loop's
    // own work per step (the token's choice follows the head) on the last stage.
    const double host = static_cast<double>(st.blocks) * config.effective_ops_per_block() * config.host_seconds_per_op +
                        (last ? config.host_seconds_per_step : 0.0);
    const double stage_dec = config.host_overlaps_device ? std::max(host, t_dec + tp_dec) : host + t_dec + tp_dec;
    r.decode_weights_s += t_w;
    r.decode_kv_s += t_kv;
    r.decode_compute_s += std::max(0.0, t_f - (t_w + t_kv));
    r.decode_tp_comm_s += tp_dec;
    r.decode_pp_comm_s += hop_dec;
    r.decode_host_s += host;
    decode_sum += stage_dec + hop_dec;
    decode_max = std::max(decode_max, stage_dec);

    // Prefill: bm sequences of P tokens; the head computes only each sequence's last position.
    const double pre_flops = bm * (P * st.dense_flops_per_token + st.head_flops_per_token +
                                   st.attention_flops_per_token_ctx * P * P);
    double pre_weights = st.dense_weight_bytes;
    for (const auto& e : st.moe) pre_weights += e.bytes;
    const double pre_bytes = pre_weights + bm * st.kv_bytes_per_token * P;
    const double t_pre = std::max(pre_flops / peak, pre_bytes / bw);
    const double tp_pre = st.all_reduces * all_reduce_seconds(bm * P * st.hidden_bytes_per_token, tp_link) +
                          (st.logit_gather_bytes_per_sequence > 0
                               ? all_gather_seconds(bm * st.logit_gather_bytes_per_sequence, tp_link) : 0.0);
    const double hop_pre = last ? 0.0 : collective_seconds(Collective::send_recv, bm * P * st.out_bytes_per_token, pp_link);
    r.prefill_compute_s += t_pre;
    r.prefill_tp_comm_s += tp_pre;
    r.prefill_pp_comm_s += hop_pre;
    const double stage_pre = config.host_overlaps_device ? std::max(host, t_pre + tp_pre) : host + t_pre + tp_pre;
    prefill_sum += stage_pre + hop_pre;
    prefill_max = std::max(prefill_max, stage_pre);

    // Memory: the stage's weights, the whole batch's KV cache (every micro-batch's sequences
    // stay resident), one micro-batch's prefill activations of one layer, its logits (fp32).
    const double kv_mem = static_cast<double>(batch) * st.kv_bytes_per_token * (P + N);
    const double act_mem = bm * (P * st.activation_bytes_per_token + P * P * st.scores_bytes_per_token2 +
                                 st.logit_bytes_per_sequence);
    const double total = st.weight_bytes + kv_mem + act_mem;
    if (total >= r.memory_bytes) {
      r.memory_bytes = total;
      r.weights_bytes = st.weight_bytes;
      r.kv_cache_bytes = kv_mem;
      r.activation_bytes = act_mem;
    }
  }
  const double mb = static_cast<double>(micro_batches);
  r.per_token_s = std::max(decode_sum, mb * decode_max);
  r.ttft_s = prefill_sum + (mb - 1) * prefill_max;
  r.request_s = r.ttft_s + (N - 1) * r.per_token_s;
  r.tokens_per_s = static_cast<double>(dp) * static_cast<double>(batch) * N / r.request_s;
  return plan;
}

InferencePlan evaluate_inference(const ModelGraph& graph, const Cluster& cluster,
                                 const InferenceConfig& config, int64_t tp, int64_t pp,
                                 int64_t batch_per_replica, int64_t decode_micro_batches) {
  const DType dtype = checked_inputs(graph, cluster, config);
  const int64_t world = cluster.world_size();
  if (tp < 1 || world % tp != 0) {
    throw ValidationError("tp", std::to_string(tp) + " does not divide the world size " + std::to_string(world));
  }
  if (pp < 1 || (world / tp) % pp != 0) {
    throw ValidationError("pp", std::to_string(pp) + " does not divide the world size / tp = " +
                                    std::to_string(world / tp));
  }
  const std::string why = tp_infeasible(graph, tp);
  if (!why.empty()) throw ValidationError("tp", why);
  if (batch_per_replica < 1) throw ValidationError("batch", "must be >= 1");
  if (decode_micro_batches < 1 || batch_per_replica % decode_micro_batches != 0 ||
      (pp == 1 && decode_micro_batches != 1)) {
    throw ValidationError("decode_micro_batches",
                          std::to_string(decode_micro_batches) + " must divide the batch " +
                              std::to_string(batch_per_replica) + " (and be 1 with pp=1)");
  }
  ModelCosts m = model_costs(graph, config, tp);
  m.peak_flops = cluster.peak_flops(dtype);
  const double tokens = static_cast<double>(config.prompt_len + config.max_new_tokens);
  const auto first = partition_stages(m, pp, static_cast<double>(batch_per_replica) * tokens);
  return evaluate_stages(m, stage_costs(m, first), cluster, config, tp, pp, batch_per_replica,
                         decode_micro_batches);
}

namespace inference_detail {

std::string tp_infeasible(const ModelGraph& graph, int64_t tp) {
  if (tp == 1) return "";
  const std::pair<const char*, int64_t TpDims::*> dims[] = {
      {"heads", &TpDims::heads}, {"kv_heads", &TpDims::kv_heads}, {"ffn", &TpDims::ffn}, {"vocab", &TpDims::vocab}};
  bool splits = false;
  for (const auto& layer : graph.layers) splits = splits || layer.tp != TpPattern::replicated;
  if (!splits) return std::to_string(tp) + " splits nothing (every layer's tensor-parallel pattern is replicated)";
  for (const auto& [what, field] : dims) {
    for (const auto& layer : graph.layers) {
      const int64_t value = layer.tp_dims.*field;
      if (layer.tp != TpPattern::replicated && value > 0 && value % tp != 0) {
        return std::to_string(tp) + " does not divide " + what + "=" + std::to_string(value) + " (layer '" +
               layer.name + "'; the KV cache is split by kv heads, never replicated)";
      }
    }
  }
  return "";
}

}  // namespace inference_detail

}  // namespace monarch::planner
