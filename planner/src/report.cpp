#include "monarch/planner/report.h"

#include "monarch/planner/embeddings.h"

#include <cmath>
#include <cstdio>
#include <sstream>

#include "monarch/planner/cost_model.h"

namespace monarch::planner {
namespace {

std::string fmt(const char* format, double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, value);
  return buf;
}

std::string percent(double part, double whole) {
  return whole > 0 ? fmt("%5.1f%%", 100.0 * part / whole) : "  -  ";
}

std::string count(double n) {
  if (n >= 1e12) return fmt("%.2fT", n / 1e12);
  if (n >= 1e9) return fmt("%.2fB", n / 1e9);
  if (n >= 1e6) return fmt("%.2fM", n / 1e6);
  if (n >= 1e3) return fmt("%.2fK", n / 1e3);
  return fmt("%.0f", n);
}

}  // namespace

std::string format_bytes(double bytes) {
  const double kib = 1024.0;
  if (bytes >= kib * kib * kib * kib) return fmt("%.2f TiB", bytes / (kib * kib * kib * kib));
  if (bytes >= kib * kib * kib) return fmt("%.2f GiB", bytes / (kib * kib * kib));
  if (bytes >= kib * kib) return fmt("%.2f MiB", bytes / (kib * kib));
  if (bytes >= kib) return fmt("%.2f KiB", bytes / kib);
  return fmt("%.0f B", bytes);
}

std::string format_seconds(double s) {
  if (s >= 1) return fmt("%.3f s", s);
  if (s >= 1e-3) return fmt("%.3f ms", s * 1e3);
  return fmt("%.3f us", s * 1e6);
}

std::string format_inference_report(const Plan& plan) {
  const InferencePlan& inf = *plan.inference;
  const InferenceConfig& k = inf.config;
  const InferencePrediction& q = inf.prediction;
  std::ostringstream out;
  out << "inference " << to_string(k.objective) << ": batch " << inf.batch_per_replica << " per replica x "
      << plan.mesh.dp << (plan.mesh.dp == 1 ? " replica" : " replicas") << " (asked " << k.batch << "), prompt " << k.prompt_len << " + "
      << k.max_new_tokens << " new tokens";
  if (k.latency_target_s > 0) out << ", per-token target " << format_seconds(k.latency_target_s);
  if (inf.decode_micro_batches > 1) out << ", " << inf.decode_micro_batches << " decode micro-batches";
  out << "\n";
  out << "  time to first token  " << format_seconds(q.ttft_s) << "  (prefill: compute "
      << format_seconds(q.prefill_compute_s) << ", tp comm " << format_seconds(q.prefill_tp_comm_s)
      << ", pp comm " << format_seconds(q.prefill_pp_comm_s) << ")\n";
  out << "  per-token latency    " << format_seconds(q.per_token_s) << "  (weights read "
      << format_seconds(q.decode_weights_s) << ", KV read " << format_seconds(q.decode_kv_s) << ", compute beyond "
      << format_seconds(q.decode_compute_s) << ", tp all-reduces " << format_seconds(q.decode_tp_comm_s)
      << ", pp hops " << format_seconds(q.decode_pp_comm_s) << ")\n";
  out << "  tokens/s             " << fmt("%.0f", q.tokens_per_s) << "  (all replicas; request "
      << format_seconds(q.request_s) << ")\n";
  out << "memory per device (most loaded stage)  " << format_bytes(q.memory_bytes) << " of "
      << format_bytes(plan.cluster.usable_memory_bytes()) << " usable\n";
  out << "  weights      " << format_bytes(q.weights_bytes) << "\n";
  out << "  KV cache     " << format_bytes(q.kv_cache_bytes) << "\n";
  out << "  activations  " << format_bytes(q.activation_bytes) << "\n";
  for (const auto& c : plan.choices) out << "why         " << c << "\n";
  if (!plan.tie_break.empty()) out << "tie break   " << plan.tie_break << "\n";
  if (!plan.alternatives.empty()) {
    out << "\nalternatives\n";
    for (const auto& a : plan.alternatives) {
      out << "  " << a.summary << "  " << format_bytes(a.memory_bytes_per_device) << "  -- " << a.reason << "\n";
    }
  }
  return out.str();
}

std::string format_report(const Plan& plan) {
  const Prediction& p = plan.prediction;
  const Cluster& c = plan.cluster;
  std::ostringstream out;
  out << "model     " << plan.model_name << ": " << count(static_cast<double>(plan.model_params))
      << " parameters";
  if (plan.transformer) {
    const auto& t = *plan.transformer;
    out << " (layers=" << t.layers << " hidden=" << t.hidden << " heads=" << t.heads;
    if (t.kv_heads != t.heads) out << " kv_heads=" << t.kv_heads;
    out << " seq=" << t.seq << " vocab=" << t.vocab << ")";
  }
  out << "\ncluster   " << c.name << ": " << c.world_size() << " devices (" << c.nodes << " x "
      << c.devices_per_node << "), " << format_bytes(c.device_memory_bytes) << " each\n";
  if (!c.levels.empty()) {  // the link levels, innermost first, with each one's bandwidth per device
    out << "network  ";
    for (size_t k = 0; k < c.levels.size(); ++k) {
      const LinkLevel& l = c.levels[k];
      out << (k ? " > " : " ") << l.name;
      if (l.devices > 0) out << " " << l.devices;
      out << fmt(" (%.1f GB/s", l.bytes_per_s / 1e9);
      if (l.oversubscription != 1) out << fmt(", %g:1", l.oversubscription);
      out << ")";
    }
    out << "\n";
  }
  out << "batch     " << plan.training.global_batch << " samples = " << plan.micro_batch_size
      << " per micro-batch x " << plan.num_micro_batches << " micro-batches x dp " << plan.mesh.dp
      << "\n\n";
  out << "plan      " << plan.summary() << "\n";
  out << "mesh      " << mesh_summary(plan.mesh) << "  (rank order";
  for (const auto& a : plan.mesh.order) out << " " << a;
  out << ", tp innermost)\n";

  // Stage boundaries.
  out << "stages    ";
  int64_t stage = -1, first = 0;
  auto flush = [&](int64_t last) {
    if (stage < 0) return;
    out << "[" << stage << ": " << plan.layers[first].name;
    if (last != first) out << " .. " << plan.layers[last].name;
    out << "] ";
  };
  const int64_t shown = 6;
  int64_t printed = 0;
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    if (plan.layers[i].stage != stage) {
      if (printed < shown) flush(static_cast<int64_t>(i) - 1);
      if (stage >= 0) ++printed;
      stage = plan.layers[i].stage;
      first = static_cast<int64_t>(i);
    }
  }
  if (printed < shown) flush(static_cast<int64_t>(plan.layers.size()) - 1);
  if (printed >= shown) out << "... (" << plan.num_stages() << " stages)";
  out << "\n\n";
  if (plan.inference) {
    out << format_inference_report(plan);
    return out.str();
  }

  const MemoryBreakdown& m = p.memory;
  out << "memory per device (most loaded rank)     " << format_bytes(m.total()) << " of "
      << format_bytes(c.usable_memory_bytes()) << " usable\n";
  out << "  parameters   " << format_bytes(m.params) << "\n";
  out << "  gradients    " << format_bytes(m.grads) << "\n";
  out << "  optimizer    " << format_bytes(m.optimizer) << "\n";
  out << "  activations  " << format_bytes(m.activations) << "\n";
  out << "  buffers      " << format_bytes(m.buffers) << "\n\n";

  const TimeBreakdown& t = p.time;
  out << "step time   " << format_seconds(t.total);
  if (p.estimator != "analytic") out << "  (layer times from the " << p.estimator << ")";
  out << "\n";
  out << "  compute    " << format_seconds(t.compute) << "  " << percent(t.compute, t.total)
      << "  (recompute " << format_seconds(t.recompute) << ")\n";
  out << "  tp comm    " << format_seconds(t.tp_comm) << "  " << percent(t.tp_comm, t.total) << "\n";
  out << "  dp comm    " << format_seconds(t.dp_comm) << "  " << percent(t.dp_comm, t.total)
      << "  (exposed)\n";
  out << "  pp comm    " << format_seconds(t.pp_comm) << "  " << percent(t.pp_comm, t.total) << "\n";
  if (t.ep_comm > 0) {
    out << "  ep comm    " << format_seconds(t.ep_comm) << "  " << percent(t.ep_comm, t.total)
        << "  (all-to-all, exposed)\n";
  }
  if (t.cp_comm > 0) {
    out << "  cp comm    " << format_seconds(t.cp_comm) << "  " << percent(t.cp_comm, t.total)
        << "  (ring k/v beyond the blockwise attention it overlaps)\n";
  }
  if (t.stragglers > 0) {
    out << "  stragglers " << format_seconds(t.stragglers) << "  " << percent(t.stragglers, t.total)
        << "  (each step waits for the slowest node)\n";
  }
  out << "  bubble     " << format_seconds(t.bubble) << "  " << percent(t.bubble, t.total)
      << "  (schedule bubble fraction " << fmt("%.3f", p.bubble_fraction) << ")\n";
  out << "  optimizer  " << format_seconds(t.optimizer) << "  " << percent(t.optimizer, t.total)
      << "\n\n";
  out << "throughput  " << fmt("%.0f", p.tokens_per_s) << " tokens/s, "
      << fmt("%.1f", p.tflops_per_device) << " TFLOP/s per device, MFU "
      << fmt("%.1f%%", 100 * p.mfu) << "\n";
  if (!plan.tie_break.empty()) out << "tie break   " << plan.tie_break << "\n";
  for (const auto& c : plan.choices) out << "why         " << c << "\n";

  if (!plan.alternatives.empty()) {
    out << "\nalternatives\n";
    for (const auto& a : plan.alternatives) {
      out << "  " << a.summary << "  " << format_seconds(a.step_time_s) << "  "
          << format_bytes(a.memory_bytes_per_device) << "  -- " << a.reason << "\n";
    }
  }
  if (plan.embeddings) out << "\n" << format_embedding_report(*plan.embeddings);
  return out.str();
}

}  // namespace monarch::planner
