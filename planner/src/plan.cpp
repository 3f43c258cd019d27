// Field-wise equality of the plan's value types, and the one-line plan summary.
#include "monarch/planner/plan.h"

#include <string>

namespace monarch::planner {

ExpertGroups expert_groups(const Mesh& mesh) {
  ExpertGroups out;
  const int64_t tokens = mesh.token_parallel();
  if (mesh.ep < 1 || tokens % mesh.ep != 0) return out;  // validate() says why
  const int64_t edp = tokens / mesh.ep;
  for (int64_t pp = 0; pp < mesh.pp; ++pp) {
    for (int64_t tp = 0; tp < mesh.tp; ++tp) {
      // rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i = (pp_i * dp * cp + f) * tp + tp_i
      const auto rank = [&](int64_t f) { return (pp * tokens + f) * mesh.tp + tp; };
      for (int64_t g = 0; g < edp; ++g) {
        std::vector<int64_t> ranks;
        for (int64_t e = 0; e < mesh.ep; ++e) ranks.push_back(rank(g * mesh.ep + e));
        out.ep.push_back(std::move(ranks));
      }
      for (int64_t e = 0; e < mesh.ep; ++e) {
        std::vector<int64_t> ranks;
        for (int64_t g = 0; g < edp; ++g) ranks.push_back(rank(g * mesh.ep + e));
        out.edp.push_back(std::move(ranks));
      }
    }
  }
  return out;
}

bool MoeConfig::operator==(const MoeConfig& o) const {
  return experts == o.experts && top_k == o.top_k && expert_ffn == o.expert_ffn &&
         shared_experts == o.shared_experts && first_dense_layers == o.first_dense_layers &&
         every == o.every && capacity_factor == o.capacity_factor && imbalance == o.imbalance;
}

bool TransformerConfig::operator==(const TransformerConfig& o) const {
  return name == o.name && layers == o.layers && hidden == o.hidden && heads == o.heads &&
         kv_heads == o.kv_heads && ffn == o.ffn && gated_mlp == o.gated_mlp && seq == o.seq &&
         attention == o.attention &&
         vocab == o.vocab && tied_embeddings == o.tied_embeddings && dtype == o.dtype &&
         head_dim == o.head_dim && attention_params == o.attention_params && moe == o.moe &&
         fused_kernels == o.fused_kernels && dropout == o.dropout;
}

bool Cluster::operator==(const Cluster& o) const {
  return name == o.name && nodes == o.nodes && devices_per_node == o.devices_per_node &&
         device_memory_bytes == o.device_memory_bytes &&
         memory_reserved_bytes == o.memory_reserved_bytes &&
         peak_flops_fp32 == o.peak_flops_fp32 && peak_flops_tf32 == o.peak_flops_tf32 &&
         peak_flops_bf16 == o.peak_flops_bf16 && peak_flops_fp8 == o.peak_flops_fp8 &&
         matmul_efficiency == o.matmul_efficiency && hbm_bytes_per_s == o.hbm_bytes_per_s &&
         backward_forward_ratio == o.backward_forward_ratio && cores_per_node == o.cores_per_node &&
         sm_count == o.sm_count &&
         overlap_contention == o.overlap_contention && straggler_spread == o.straggler_spread &&
         intra_node_bytes_per_s == o.intra_node_bytes_per_s &&
         intra_node_latency_s == o.intra_node_latency_s &&
         inter_node_bytes_per_s == o.inter_node_bytes_per_s &&
         inter_node_latency_s == o.inter_node_latency_s && levels == o.levels;
}

bool TrainingConfig::operator==(const TrainingConfig& o) const {
  return global_batch == o.global_batch && compute_dtype == o.compute_dtype &&
         param_bytes == o.param_bytes && grad_bytes == o.grad_bytes && zero_grad_bytes == o.zero_grad_bytes &&
         master_grad_bytes == o.master_grad_bytes &&
         optimizer_bytes == o.optimizer_bytes && activation_bytes == o.activation_bytes &&
         allow_tensor_parallel == o.allow_tensor_parallel &&
         allow_pipeline_parallel == o.allow_pipeline_parallel && allow_zero == o.allow_zero &&
         allow_recompute == o.allow_recompute && recompute_modes == o.recompute_modes &&
         allow_sequence_parallel == o.allow_sequence_parallel && schedules == o.schedules &&
         max_micro_batch_size == o.max_micro_batch_size && dp_bucket_bytes == o.dp_bucket_bytes &&
         allow_hierarchical_dp == o.allow_hierarchical_dp &&
         inter_node_compression == o.inter_node_compression && pipeline_sends_kept == o.pipeline_sends_kept &&
         weights_cast_per_forward == o.weights_cast_per_forward;
}

namespace {
bool same_tp_dims(const TpDims& a, const TpDims& b) {
  return a.heads == b.heads && a.kv_heads == b.kv_heads && a.ffn == b.ffn && a.vocab == b.vocab;
}
}  // namespace

bool LayerPlacement::operator==(const LayerPlacement& o) const {
  return name == o.name && kind == o.kind && params == o.params && stage == o.stage &&
         tp == o.tp && same_tp_dims(tp_dims, o.tp_dims) && sharding_unit == o.sharding_unit;
}

bool MemoryBreakdown::operator==(const MemoryBreakdown& o) const {
  return params == o.params && grads == o.grads && optimizer == o.optimizer &&
         activations == o.activations && buffers == o.buffers;
}

bool TimeBreakdown::operator==(const TimeBreakdown& o) const {
  return compute == o.compute && recompute == o.recompute && tp_comm == o.tp_comm &&
         dp_comm == o.dp_comm && pp_comm == o.pp_comm && ep_comm == o.ep_comm &&
         cp_comm == o.cp_comm && stragglers == o.stragglers && bubble == o.bubble &&
         optimizer == o.optimizer && total == o.total;
}

bool Prediction::operator==(const Prediction& o) const {
  return step_time_s == o.step_time_s && time == o.time && memory == o.memory &&
         memory_bytes_per_device == o.memory_bytes_per_device &&
         tokens_per_s == o.tokens_per_s && tflops_per_device == o.tflops_per_device &&
         mfu == o.mfu && bubble_fraction == o.bubble_fraction && estimator == o.estimator &&
         stages == o.stages && ranks == o.ranks;
}

bool RankPrediction::operator==(const RankPrediction& o) const {
  return memory == o.memory && busy_s == o.busy_s && idle_s == o.idle_s && dp_bytes == o.dp_bytes &&
         tp_bytes == o.tp_bytes && pp_bytes == o.pp_bytes && ends_bytes == o.ends_bytes &&
         dp_inter_node_bytes == o.dp_inter_node_bytes;
}

bool Alternative::operator==(const Alternative& o) const {
  return summary == o.summary && step_time_s == o.step_time_s &&
         memory_bytes_per_device == o.memory_bytes_per_device && reason == o.reason;
}

bool Plan::operator==(const Plan& o) const {
  return version == o.version && model_name == o.model_name && model_params == o.model_params &&
         transformer == o.transformer && cluster == o.cluster && training == o.training &&
         mesh == o.mesh && zero_stage == o.zero_stage && micro_batch_size == o.micro_batch_size &&
         num_micro_batches == o.num_micro_batches && schedule == o.schedule &&
         virtual_stages == o.virtual_stages && recompute == o.recompute &&
         sequence_parallel == o.sequence_parallel && dp_bucket_bytes == o.dp_bucket_bytes &&
         dp_reduction == o.dp_reduction && inter_node_compression == o.inter_node_compression &&
         zero_overlap == o.zero_overlap && layers == o.layers && embeddings == o.embeddings && prediction == o.prediction &&
         alternatives == o.alternatives && tie_break == o.tie_break &&
         choices == o.choices && inference == o.inference;
}

// "pp=12 dp=4 tp=8 zero=1 mbs=1 m=384 1f1b recompute=full sp=on"
std::string mesh_summary(const Mesh& m) {
  std::string s = "pp=" + std::to_string(m.pp) + " dp=" + std::to_string(m.dp);
  if (m.cp != 1) s += " cp=" + std::to_string(m.cp);
  s += " tp=" + std::to_string(m.tp);
  if (m.ep != 1) s += " ep=" + std::to_string(m.ep);
  return s;
}

std::string Plan::summary() const {
  std::string s = mesh_summary(mesh) + " zero=" + std::to_string(zero_stage) +
                  " mbs=" + std::to_string(micro_batch_size) +
                  " m=" + std::to_string(num_micro_batches) + " " + to_string(schedule);
  if (schedule == ScheduleKind::interleaved_1f1b || virtual_stages != 1) {
    s += " v=" + std::to_string(virtual_stages);
  }
  s += " recompute=" + to_string(recompute);
  s += sequence_parallel ? " sp=on" : " sp=off";
  if (dp_reduction != DpReduction::flat) s += " dp_reduction=" + to_string(dp_reduction);
  if (inter_node_compression != Compression::none) s += " compression=" + to_string(inter_node_compression);
  if (!zero_overlap && zero_stage >= 2 && mesh.dp > 1) s += " overlap=off";
  return s;
}

}  // namespace monarch::planner
