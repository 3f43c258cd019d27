// The inference layout search (inference.h): tp x pp with dp = world / (tp pp) replicas, the
// batch per replica (throughput) and the decode micro-batches, scored by inference_cost.cpp;
// the plan says why this layout (Plan::choices), naming the deciding quantity.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "inference_internal.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/inference.h"
#include "monarch/planner/plan.h"
#include "monarch/planner/report.h"

namespace monarch::planner {
namespace {

using namespace inference_detail;

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string ms(double s) { return format_seconds(s); }

std::string replicas(int64_t n) { return std::to_string(n) + (n == 1 ? " replica" : " replicas"); }

struct Candidate {
  int64_t tp = 1, pp = 1, dp = 1, batch = 1;
  InferencePlan plan;
  std::vector<int64_t> first;  // stage starts
  bool fits = false, meets_target = true;
  bool ok() const { return fits && meets_target; }
  const InferencePrediction& p() const { return plan.prediction; }
  std::string mesh() const {
    return "tp=" + std::to_string(tp) + " pp=" + std::to_string(pp) + " dp=" + std::to_string(dp);
  }
};

// Objective order: true when a is better than b.
bool better(const Candidate& a, const Candidate& b, InferenceObjective objective) {
  if (objective == InferenceObjective::latency) {
    if (a.p().per_token_s != b.p().per_token_s) return a.p().per_token_s < b.p().per_token_s;
    if (a.p().ttft_s != b.p().ttft_s) return a.p().ttft_s < b.p().ttft_s;
  } else {
    if (a.p().tokens_per_s != b.p().tokens_per_s) return a.p().tokens_per_s > b.p().tokens_per_s;
    if (a.p().per_token_s != b.p().per_token_s) return a.p().per_token_s < b.p().per_token_s;
  }
  if (a.tp * a.pp != b.tp * b.pp) return a.tp * a.pp < b.tp * b.pp;  // fewer devices per replica
  return a.pp < b.pp;
}

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i * i <= n; ++i) {
    if (n % i == 0) {
      d.push_back(i);
      if (i != n / i) d.push_back(n / i);
    }
  }
  std::sort(d.begin(), d.end());
  return d;
}

std::string memory_parts(const Candidate& c) {
  return format_bytes(c.p().memory_bytes) + " per device (weights " + format_bytes(c.p().weights_bytes) +
         " + KV cache " + format_bytes(c.p().kv_cache_bytes) + " + activations " +
         format_bytes(c.p().activation_bytes) + ")";
}

double decode_reads_s(const InferencePrediction& p) { return p.decode_weights_s + p.decode_kv_s; }

Plan build_plan(const ModelGraph& graph, const Cluster& cluster, const ModelCosts& m, const Candidate& c) {
  Plan plan;
  plan.model_name = graph.name;
  plan.model_params = graph.total_params();
  plan.transformer = graph.transformer;
  plan.cluster = cluster;
  const DType dtype = graph.layers.front().param_dtype;
  TrainingConfig& t = plan.training;
  t.global_batch = c.dp * c.batch;
  t.compute_dtype = dtype;
  t.param_bytes = m.weight_bytes;
  t.optimizer_bytes = 0;
  t.activation_bytes = bytes_of(dtype);
  t.allow_zero = false;
  t.allow_recompute = false;
  t.recompute_modes = {Recompute::none};
  t.allow_sequence_parallel = false;
  t.schedules = {ScheduleKind::gpipe};
  const int64_t mb = c.plan.decode_micro_batches;
  t.max_micro_batch_size = std::max<int64_t>(c.batch / mb, 1);
  plan.mesh.pp = c.pp;
  plan.mesh.dp = c.dp;
  plan.mesh.tp = c.tp;
  plan.zero_stage = 0;
  plan.micro_batch_size = c.batch / mb;
  plan.num_micro_batches = mb;
  // A pipeline decodes its micro-batches forward-only, round-robin: GPipe's forward half.
  plan.schedule = c.pp > 1 ? ScheduleKind::gpipe : ScheduleKind::none;
  plan.virtual_stages = 1;
  plan.recompute = Recompute::none;
  plan.sequence_parallel = false;
  const int64_t n = static_cast<int64_t>(graph.layers.size());
  for (int64_t i = 0, stage = 0; i < n; ++i) {
    while (stage + 1 < c.pp && c.first[stage + 1] <= i) ++stage;
    const Layer& layer = graph.layers[i];
    LayerPlacement lp;
    lp.name = layer.name;
    lp.kind = layer.kind;
    lp.params = layer.params;
    lp.stage = stage;
    lp.tp = c.tp > 1 ? layer.tp : TpPattern::replicated;
    lp.tp_dims = layer.tp_dims;
    plan.layers.push_back(lp);
  }
  plan.inference = c.plan;
  const InferencePrediction& p = c.p();
  Prediction& pr = plan.prediction;
  const double steps = static_cast<double>(c.plan.config.max_new_tokens - 1);
  pr.step_time_s = p.request_s;
  pr.time.total = p.request_s;
  pr.time.compute = p.prefill_compute_s + steps * (decode_reads_s(p) + p.decode_compute_s);
  pr.time.tp_comm = p.prefill_tp_comm_s + steps * p.decode_tp_comm_s;
  pr.time.pp_comm = p.prefill_pp_comm_s + steps * p.decode_pp_comm_s;
  pr.time.bubble = std::max(0.0, p.request_s - pr.time.compute - pr.time.tp_comm - pr.time.pp_comm);
  pr.memory.params = p.weights_bytes;
  pr.memory.activations = p.activation_bytes;
  pr.memory.buffers = p.kv_cache_bytes;
  pr.memory_bytes_per_device = pr.memory.total();
  pr.tokens_per_s = p.tokens_per_s;
  return plan;
}

std::string alternative_reason(const Candidate& a, const Candidate& best, InferenceObjective objective,
                               double usable, double target) {
  if (!a.fits) return "over memory: needs " + memory_parts(a) + ", " + format_bytes(usable) + " usable";
  if (!a.meets_target) {
    return "per-token " + ms(a.p().per_token_s) + " over the " + ms(target) + " target";
  }
  if (objective == InferenceObjective::latency && a.p().per_token_s < best.p().per_token_s) {
    return fmt("%.1f%%", 100 * (1 - a.p().per_token_s / best.p().per_token_s)) +
           " faster per token, within the tie tolerance, with " + std::to_string(a.tp * a.pp) +
           " devices per replica instead of " + std::to_string(best.tp * best.pp);
  }
  if (objective == InferenceObjective::throughput && a.p().tokens_per_s > best.p().tokens_per_s) {
    return fmt("%.0f", a.p().tokens_per_s) + " vs " + fmt("%.0f", best.p().tokens_per_s) +
           " tokens/s, within the tie tolerance, at per-token " + ms(a.p().per_token_s) + " vs " +
           ms(best.p().per_token_s);
  }
  if (objective == InferenceObjective::latency) {
    return fmt("%.3fx", a.p().per_token_s / best.p().per_token_s) + " slower per token: " +
           ms(a.p().per_token_s) + " vs " + ms(best.p().per_token_s) + " (weights + KV read " +
           ms(decode_reads_s(a.p())) + " vs " + ms(decode_reads_s(best.p())) + ", tp all-reduces " +
           ms(a.p().decode_tp_comm_s) + " vs " + ms(best.p().decode_tp_comm_s) + ")";
  }
  return fmt("%.0f", a.p().tokens_per_s) + " vs " + fmt("%.0f", best.p().tokens_per_s) +
         " tokens/s (batch " + std::to_string(a.batch) + " x " + replicas(a.dp) + ", per-token " + ms(a.p().per_token_s) + ")";
}

}  // namespace

Plan plan_inference(const ModelGraph& graph, const Cluster& cluster, const InferenceConfig& config,
                    const InferenceOptions& options) {
  const DType dtype = checked_inputs(graph, cluster, config);
  const int64_t world = cluster.world_size();
  const InferenceObjective objective = config.objective;
  const double usable = cluster.usable_memory_bytes();
  const double target = objective == InferenceObjective::throughput ? config.latency_target_s : 0.0;
  if (options.tp < 0 || options.pp < 0) throw ValidationError("pins", "tp and pp pins must be >= 0 (0: searched)");
  if (options.tp > 0 && world % options.tp != 0) {
    throw ValidationError("pins.tp", std::to_string(options.tp) + " does not divide the world size " + std::to_string(world));
  }
  if (options.tp > 0) {
    const std::string why = tp_infeasible(graph, options.tp);
    if (!why.empty()) throw ValidationError("pins.tp", why);
  }

  int64_t max_stages = 1;
  for (size_t i = 1; i < graph.layers.size(); ++i) max_stages += graph.can_cut_before(static_cast<int>(i)) ? 1 : 0;

  // Batches per replica: the latency objective serves exactly `batch`; throughput also tries
  // 2x, 4x, ... up to max_batch.
  std::vector<int64_t> batches = {config.batch};
  if (objective == InferenceObjective::throughput) {
    const int64_t cap = std::max(config.effective_max_batch(), config.batch);
    for (int64_t b = config.batch * 2; b <= cap; b *= 2) batches.push_back(b);
    if (batches.back() != cap) batches.push_back(cap);
  }
  const double tokens = static_cast<double>(config.prompt_len + config.max_new_tokens);

  std::vector<Candidate> all;
  std::map<int64_t, ModelCosts> costs;
  std::vector<std::string> skipped;
  for (int64_t tp : divisors(world)) {
    if (options.tp > 0 && tp != options.tp) continue;
    const std::string why = tp_infeasible(graph, tp);
    if (!why.empty()) {
      skipped.push_back("tp=" + why);
      continue;
    }
    ModelCosts& m = costs[tp] = model_costs(graph, config, tp);
    m.peak_flops = cluster.peak_flops(dtype);
    for (int64_t pp : divisors(world / tp)) {
      if (options.pp > 0 && pp != options.pp) continue;
      if (pp > max_stages) continue;
      for (int64_t b : batches) {
        Candidate c;
        c.tp = tp;
        c.pp = pp;
        c.dp = world / (tp * pp);
        c.batch = b;
        c.first = partition_stages(m, pp, static_cast<double>(b) * tokens);
        const auto stages = stage_costs(m, c.first);
        bool have = false;
        for (int64_t mb : divisors(b)) {
          if (mb > pp) break;
          InferencePlan ip = evaluate_stages(m, stages, cluster, config, tp, pp, b, mb);
          Candidate trial = c;
          trial.plan = ip;
          if (!have || better(trial, c, objective)) {
            c.plan = ip;
            have = true;
          }
        }
        c.fits = c.p().memory_bytes <= usable;
        c.meets_target = target <= 0 || c.p().per_token_s <= target;
        all.push_back(c);
      }
    }
  }
  if (options.pp > 0 && all.empty()) {
    throw ValidationError("pins.pp", std::to_string(options.pp) + " stages: not a divisor of the world / tp, "
                                     "or more stages than the model can be cut into (" +
                                     std::to_string(max_stages) + ")");
  }
  if (all.empty()) {
    std::string why = skipped.empty() ? "" : " (" + skipped.front() + ")";
    throw InfeasibleError("inference: no tensor-parallel degree splits the model" + why);
  }

  const Candidate* best = nullptr;
  const Candidate* smallest = nullptr;  // least memory
  const Candidate* fastest_fitting = nullptr;
  for (const Candidate& c : all) {
    if (!smallest || c.p().memory_bytes < smallest->p().memory_bytes) smallest = &c;
    if (c.fits && (!fastest_fitting || c.p().per_token_s < fastest_fitting->p().per_token_s)) fastest_fitting = &c;
    if (c.ok() && (!best || better(c, *best, objective))) best = &c;
  }
  if (!fastest_fitting) {
    throw InfeasibleError("inference: no layout fits in memory: the smallest need is " + memory_parts(*smallest) +
                          " at " + smallest->mesh() + " with batch " + std::to_string(smallest->batch) +
                          ", " + format_bytes(usable) + " usable per device on " + cluster.name + " x" +
                          std::to_string(world));
  }
  if (!best) {
    throw InfeasibleError("inference: no layout meets the per-token latency target " + ms(target) +
                          ": the fastest that fits is " + fastest_fitting->mesh() + " at " +
                          ms(fastest_fitting->p().per_token_s) + " per token (batch " +
                          std::to_string(fastest_fitting->batch) + ")");
  }

  // Ties: layouts within the tie tolerance of the best are not told apart by the model (what it
  // leaves out: kernel launches, pipeline scheduling). Latency: the fewest devices per replica
  // among them (more replicas serve more requests at that latency); throughput: the lowest
  // per-token latency among them.
  const Candidate* fastest = best;
  if (options.tie_tolerance > 0) {
    for (const Candidate& c : all) {
      if (!c.ok() || &c == best) continue;
      if (objective == InferenceObjective::latency) {
        if (c.p().per_token_s > fastest->p().per_token_s * (1 + options.tie_tolerance)) continue;
        const int64_t dc = c.tp * c.pp, db = best->tp * best->pp;
        if (dc < db || (dc == db && c.p().per_token_s < best->p().per_token_s)) best = &c;
      } else {
        if (c.p().tokens_per_s < fastest->p().tokens_per_s / (1 + options.tie_tolerance)) continue;
        if (c.p().per_token_s < best->p().per_token_s) best = &c;
      }
    }
  }

  Plan plan = build_plan(graph, cluster, costs.at(best->tp), *best);
  const InferencePrediction& bp = best->p();
  if (best != fastest) {
    if (objective == InferenceObjective::latency) {
      plan.tie_break = "preferred over " + fastest->mesh() + " (per-token " + ms(fastest->p().per_token_s) + ", " +
                       fmt("%.1f%%", 100 * (bp.per_token_s / fastest->p().per_token_s - 1)) +
                       " faster, within the " + fmt("%.0f%%", 100 * options.tie_tolerance) +
                       " tie tolerance): " + std::to_string(best->tp * best->pp) + " devices per replica instead of " +
                       std::to_string(fastest->tp * fastest->pp) + ", " + replicas(best->dp) + " instead of " +
                       std::to_string(fastest->dp);
    } else {
      plan.tie_break = "preferred over " + fastest->mesh() + " batch " + std::to_string(fastest->batch) + " (" +
                       fmt("%.0f", fastest->p().tokens_per_s) + " tokens/s, within the " +
                       fmt("%.0f%%", 100 * options.tie_tolerance) + " tie tolerance): per-token " + ms(bp.per_token_s) +
                       " instead of " + ms(fastest->p().per_token_s);
    }
  }

  // Why: the headline names the deciding quantity, then the best layout of each other tp (and
  // pp) with the same quantity.
  // Bytes a decode step reads = its read time x the achieved bandwidth (embedding tables and
  // experts no token picked are held, not read).
  const double bw = cluster.hbm_bytes_per_s * config.hbm_efficiency;
  std::map<std::pair<int64_t, int64_t>, const Candidate*> per_mesh;  // best of each (tp, pp)
  for (const Candidate& c : all) {
    auto& slot = per_mesh[{c.tp, c.pp}];
    if (!slot || (c.ok() && !slot->ok()) || (c.ok() == slot->ok() && better(c, *slot, objective))) slot = &c;
  }
  const double tp_comm = best->tp > 1 && bp.decode_tp_comm_s > 0 ? bp.decode_tp_comm_s : 0.0;
  int64_t reduces = 0;
  for (const auto& l : graph.layers) {
    if (best->tp > 1 && l.tp != TpPattern::replicated) reduces += l.kind == LayerKind::block ? 2 : 1;
  }
  if (objective == InferenceObjective::latency) {
    std::string head = "latency: " + best->mesh() + " at batch " + std::to_string(best->batch) + ": per-token " +
                       ms(bp.per_token_s) + "; weights read per token per tp rank " +
                       format_bytes(bp.decode_weights_s * bw) + " (" + ms(bp.decode_weights_s) + " at " +
                       fmt("%.2f", cluster.hbm_bytes_per_s * config.hbm_efficiency / 1e12) + " TB/s)";
    if (best->tp > 1) {
      head += ", tp=" + std::to_string(best->tp) + " cuts them " + std::to_string(best->tp) +
              "x; its " + std::to_string(reduces) + " tp collectives per token (all-reduces of " +
              std::to_string(best->batch) + " x hidden values, latency-bound) cost " + ms(tp_comm);
    } else {
      head += "; tp=1: splitting the weights would cost more in all-reduce latency than it saves in reads";
    }
    if (best->pp > 1) {
      head += "; pp=" + std::to_string(best->pp) +
              (options.pp > 0 ? " (pinned)" : " because fewer stages do not fit") +
              " (a token passes the stages one after another: pp adds hops, never shortens it)";
    }
    plan.choices.push_back(head);
  } else {
    std::string head = "throughput: " + best->mesh() + " = " + replicas(best->dp) + " x batch " +
                       std::to_string(best->batch) + ": " + fmt("%.0f", bp.tokens_per_s) + " tokens/s; per-token " +
                       ms(bp.per_token_s) +
                       (target > 0 ? " under the " + ms(target) + " target" : " (no latency target)") +
                       "; time to first token " + ms(bp.ttft_s);
    plan.choices.push_back(head);
    // Why this batch: the next larger one tried, and what stopped it.
    const Candidate* next = nullptr;
    for (const Candidate& c : all) {
      if (c.tp == best->tp && c.pp == best->pp && c.batch > best->batch && (!next || c.batch < next->batch)) next = &c;
    }
    if (next && !next->fits) {
      plan.choices.push_back("  batch " + std::to_string(best->batch) + ": batch " + std::to_string(next->batch) +
                             " needs " + memory_parts(*next) + ", " + format_bytes(usable) + " usable");
    } else if (next && !next->meets_target) {
      plan.choices.push_back("  batch " + std::to_string(best->batch) + ": batch " + std::to_string(next->batch) +
                             " takes " + ms(next->p().per_token_s) + " per token, over the " + ms(target) + " target");
    } else if (!next && best->batch == batches.back() && batches.size() > 1) {
      plan.choices.push_back("  batch " + std::to_string(best->batch) + ": the largest tried (max_batch)");
    }
  }
  // The neighbours: best layout of each other tp (its best pp), in tp order.
  std::map<int64_t, const Candidate*> per_tp;
  for (const auto& [key, c] : per_mesh) {
    auto& slot = per_tp[key.first];
    if (!slot || (c->ok() && !slot->ok()) || (c->ok() == slot->ok() && better(*c, *slot, objective))) slot = c;
  }
  for (const auto& [tp, c] : per_tp) {
    if (tp == best->tp && c == best) continue;
    const InferencePrediction& p = c->p();
    std::string line = "  " + c->mesh() + ": ";
    if (!c->fits) {
      line += "over memory, needs " + memory_parts(*c);
    } else if (objective == InferenceObjective::latency) {
      line += "per-token " + ms(p.per_token_s) + " (weights read per token per tp rank " + format_bytes(p.decode_weights_s * bw) +
              " in " + ms(p.decode_weights_s) + ", tp all-reduces " + ms(p.decode_tp_comm_s) + ")";
    } else {
      line += fmt("%.0f", p.tokens_per_s) + " tokens/s with " + replicas(c->dp) + " x batch " +
              std::to_string(c->batch) + " (per-token " + ms(p.per_token_s) + ")";
      if (!c->meets_target) line += ", over the target";
    }
    plan.choices.push_back(line);
  }

  // Alternatives: the best of each other (tp, pp), by the objective (qualifying ones first).
  std::vector<const Candidate*> others;
  for (const auto& [key, c] : per_mesh) {
    if (c != best && !(key.first == best->tp && key.second == best->pp)) others.push_back(c);
  }
  std::sort(others.begin(), others.end(), [&](const Candidate* a, const Candidate* b) {
    if (a->ok() != b->ok()) return a->ok();
    return better(*a, *b, objective);
  });
  for (size_t i = 0; i < others.size() && static_cast<int64_t>(i) < options.alternatives; ++i) {
    const Candidate& a = *others[i];
    Alternative alt;
    alt.summary = a.mesh() + " batch=" + std::to_string(a.batch) + " m=" + std::to_string(a.plan.decode_micro_batches);
    alt.step_time_s = a.p().request_s;
    alt.memory_bytes_per_device = a.p().memory_bytes;
    alt.reason = alternative_reason(a, *best, objective, usable, target);
    plan.alternatives.push_back(alt);
  }
  validate(plan);
  return plan;
}

}  // namespace monarch::planner
