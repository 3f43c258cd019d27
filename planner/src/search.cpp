// Hybrid-parallel search. See docs/cost_model.md ("Search") for the space and the pruning.
#include "monarch/planner/search.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>
#include <tuple>

#include "monarch/planner/collectives.h"
#include "monarch/planner/cost_model.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/estimator.h"
#include "monarch/planner/report.h"
#include "monarch/planner/stage_partition.h"
#include "monarch/planner/traffic.h"

namespace monarch::planner {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A mesh as the search keys it: (pp, dp, cp, tp). ep is chosen within a mesh, like ZeRO.
using MeshKey = std::tuple<int64_t, int64_t, int64_t, int64_t>;

// Fewest tokens of a sequence one context-parallel rank may hold for the search to consider
// cp (a pin may ask for less). What the model does not cost grows as chunks shrink: every ring
// step is a kernel launch and a synchronization, and blockwise attention on short chunks runs
// below its large-tile rate. Without this floor the model picks cp for 2K-8K sequences, where
// published runs do not use it (Llama 3 405B: cp = 1 at 8K, cp = 16 only in the 128K stage,
// 8K tokens per rank; Dubey et al. 2024, Table 4).
constexpr int64_t kMinContextParallelTokens = 4096;

// Whether the sequence can be split over cp ranks: into 2 cp equal chunks (each rank takes
// chunk i and 2cp-1-i, which balances causal attention), of at least `min_tokens` tokens per
// rank, in a model with attention.
bool cp_possible(const ModelGraph& graph, int64_t cp, int64_t min_tokens) {
  if (cp == 1) return true;
  const int64_t seq = graph.seq_len();
  bool attention = false;
  for (const auto& l : graph.layers) attention = attention || l.kv_elements_per_token > 0;
  return attention && seq > 0 && seq % (2 * cp) == 0 && seq / cp >= min_tokens;
}

// Experts per MoE layer that ep must divide: the gcd over the graph's MoE layers (0: none).
int64_t moe_experts_gcd(const ModelGraph& graph) {
  int64_t g = 0;
  for (const auto& l : graph.layers) {
    if (l.moe.experts > 0) g = std::gcd(g, l.moe.experts);
  }
  return g;
}

// Divisors of n (>= 1) that are at most `limit`, ascending. Pairs d, n/d are found with
// d up to min(limit, sqrt(n)), so a huge n (a global batch near 2^63) costs no more than the
// limit; `d <= n / d` cannot overflow where `d * d <= n` would.
std::vector<int64_t> divisors(int64_t n, int64_t limit = std::numeric_limits<int64_t>::max()) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= limit && d <= n / d; ++d) {
    if (n % d != 0) continue;
    out.push_back(d);
    if (d != n / d && n / d <= limit) out.push_back(n / d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Why tp cannot split this model, or "" if it can. Heads are checked before the vocabulary:
// they are what a user is most likely to have mis-sized.
std::string tp_conflict(const ModelGraph& graph, int64_t tp) {
  if (tp == 1) return "";
  // The runtime refuses tp > 1 that splits nothing, or, in a model made of blocks, none of
  // the blocks (tensor_parallel_modules._check_coverage): every tp rank would run the whole
  // model. Same rule here.
  bool splits_any = false, has_blocks = false, splits_blocks = false;
  for (const auto& layer : graph.layers) {
    const bool split = layer.tp != TpPattern::replicated;
    splits_any = splits_any || split;
    has_blocks = has_blocks || layer.kind == LayerKind::block;
    splits_blocks = splits_blocks || (split && layer.kind == LayerKind::block);
  }
  if (!splits_any) return std::to_string(tp) + " splits nothing (every layer's tensor-parallel pattern is replicated)";
  if (has_blocks && !splits_blocks) {
    return std::to_string(tp) + " splits none of the blocks (every block's tensor-parallel pattern is replicated)";
  }
  const std::pair<const char*, int64_t TpDims::*> dims[] = {
      {"heads", &TpDims::heads}, {"kv_heads", &TpDims::kv_heads},
      {"ffn", &TpDims::ffn}, {"vocab", &TpDims::vocab}};
  for (const auto& [what, field] : dims) {
    for (const auto& layer : graph.layers) {
      const int64_t value = layer.tp_dims.*field;
      if (layer.tp != TpPattern::replicated && value > 0 && value % tp != 0) {
        return std::to_string(tp) + " does not divide " + what + "=" + std::to_string(value) +
               " (layer '" + layer.name + "')";
      }
    }
  }
  return "";
}

int64_t max_stages(const ModelGraph& graph) {
  int64_t cuts = 1;
  for (int i = 1; i < static_cast<int>(graph.layers.size()); ++i) cuts += graph.can_cut_before(i) ? 1 : 0;
  return cuts;
}

void check_pins(const ModelGraph& graph, const Cluster& cluster, const TrainingConfig& training,
                const Pins& pins) {
  const int64_t world = cluster.world_size();
  auto fail = [](const char* field, const std::string& msg) { throw ValidationError(field, msg); };
  if (pins.tp) {
    if (*pins.tp < 1 || world % *pins.tp != 0) {
      fail("pins.tp", std::to_string(*pins.tp) + " does not divide the world size " + std::to_string(world));
    }
    const std::string conflict = tp_conflict(graph, *pins.tp);
    if (!conflict.empty()) fail("pins.tp", conflict);
  }
  if (pins.pp) {
    if (*pins.pp < 1 || world % *pins.pp != 0) {
      fail("pins.pp", std::to_string(*pins.pp) + " does not divide the world size " + std::to_string(world));
    }
    if (*pins.pp > max_stages(graph)) {
      fail("pins.pp", std::to_string(*pins.pp) + " stages but the model can be cut into at most " +
                          std::to_string(max_stages(graph)));
    }
  }
  if (pins.dp) {
    if (*pins.dp < 1 || world % *pins.dp != 0) {
      fail("pins.dp", std::to_string(*pins.dp) + " does not divide the world size " + std::to_string(world));
    }
    if (training.global_batch % *pins.dp != 0) {
      fail("pins.dp", "global batch " + std::to_string(training.global_batch) +
                          " is not divisible by dp=" + std::to_string(*pins.dp));
    }
  }
  if (pins.cp) {
    if (*pins.cp < 1 || world % *pins.cp != 0) {
      fail("pins.cp", std::to_string(*pins.cp) + " does not divide the world size " + std::to_string(world));
    }
    if (!cp_possible(graph, *pins.cp, 1)) {
      fail("pins.cp", std::to_string(*pins.cp) + ": the sequence (" + std::to_string(graph.seq_len()) +
                          ") must split into 2 x cp equal chunks (load-balanced causal attention) of a "
                          "model with attention");
    }
  }
  if (pins.ep && *pins.ep != 1) {
    const int64_t experts = moe_experts_gcd(graph);
    if (*pins.ep < 1 || experts == 0 || experts % *pins.ep != 0) {
      fail("pins.ep", std::to_string(*pins.ep) + (experts == 0 ? " needs a model with MoE layers"
                                                              : " does not divide the experts (" +
                                                                    std::to_string(experts) + ")"));
    }
  }
  const int64_t product = pins.tp.value_or(1) * pins.pp.value_or(1) * pins.dp.value_or(1) * pins.cp.value_or(1);
  // With tp, pp and dp pinned, what is left of the world is cp: it must be one cp can be.
  const bool cp_fills = !pins.cp && world % product == 0 &&
                        cp_possible(graph, world / product, kMinContextParallelTokens);
  if (world % product != 0 || (pins.tp && pins.pp && pins.dp && product != world && !cp_fills)) {
    fail("pins", std::string(pins.cp ? "tp*pp*dp*cp" : "tp*pp*dp") + " = " + std::to_string(product) +
                     " does not match the world size " + std::to_string(world));
  }
  if (pins.zero_stage && (*pins.zero_stage < 0 || *pins.zero_stage > 3)) {
    fail("pins.zero_stage", "must be 0, 1, 2 or 3, got " + std::to_string(*pins.zero_stage));
  }
  if (pins.micro_batch_size && *pins.micro_batch_size < 1) {
    fail("pins.micro_batch_size", "must be >= 1, got " + std::to_string(*pins.micro_batch_size));
  }
  if (pins.virtual_stages && *pins.virtual_stages < 1) {
    fail("pins.virtual_stages", "must be >= 1");
  }
  if (pins.virtual_stages && *pins.virtual_stages > 1) {
    if (pins.pp && *pins.pp == 1) {
      fail("pins.virtual_stages",
           std::to_string(*pins.virtual_stages) + " needs pp > 1 (pp=1 has no pipeline)");
    }
    if (pins.schedule && *pins.schedule != ScheduleKind::interleaved_1f1b &&
        *pins.schedule != ScheduleKind::zero_bubble_v) {
      fail("pins.virtual_stages", std::to_string(*pins.virtual_stages) +
                                      " needs the interleaved_1f1b or zbv schedule, got " +
                                      to_string(*pins.schedule));
    }
  }
  if (pins.schedule && *pins.schedule == ScheduleKind::zero_bubble_v && pins.virtual_stages &&
      *pins.virtual_stages != 2) {
    fail("pins.virtual_stages", "zbv runs two stages per rank (a V), got " + std::to_string(*pins.virtual_stages));
  }
  if (pins.schedule && pins.pp) {
    if (*pins.pp == 1 && *pins.schedule != ScheduleKind::none) {
      fail("pins.schedule", to_string(*pins.schedule) + " needs pp > 1 (pp=1 runs without a pipeline schedule)");
    }
    if (*pins.pp > 1 && *pins.schedule == ScheduleKind::none) {
      fail("pins.schedule", "none needs pp=1, got pp=" + std::to_string(*pins.pp));
    }
  }
  if (pins.sequence_parallel && *pins.sequence_parallel && pins.tp && *pins.tp == 1) {
    fail("pins.sequence_parallel", "needs tp > 1");
  }
  if (pins.sequence_parallel && *pins.sequence_parallel && world == 1) {
    fail("pins.sequence_parallel", "needs tp > 1, and the cluster has one device");
  }
  if (pins.sequence_parallel && *pins.sequence_parallel && moe_experts_gcd(graph) > 0) {
    fail("pins.sequence_parallel", "is not run with MoE layers (their router and experts need every token of the "
                                   "sequence on each tp rank)");
  }
}

struct Candidate {
  Plan plan;
  bool over_memory = false;
  std::string key;  // deterministic tie-break
};

bool better(const Candidate& a, const Candidate& b) {
  if (a.over_memory != b.over_memory) return !a.over_memory;
  if (a.plan.prediction.step_time_s != b.plan.prediction.step_time_s) {
    return a.plan.prediction.step_time_s < b.plan.prediction.step_time_s;
  }
  return a.key < b.key;
}

// Two layouts of one mesh whose predictions differ by less than this are the same to the
// planner: what separates them (ZeRO-1's cheaper optimizer step against its all-gather, one
// micro-batch of 4 against four of 1) is far below the model's error. Measured
// (bench/layouts.py, 4 CPU ranks), the simpler of such pairs ran faster: four micro-batches of
// 1 +4.7%, ZeRO-1 +4.1%, both predicted 0.15% faster. Kept small: a wider window (1% was
// tried) also turns pipelines' zero-bubble schedules into 1F1B and, through the tie-break
// across meshes (finish(), SearchOptions::tie_tolerance), changes GPT-3's pick. An estimator
// that states a coarser resolution widens it (a measured profile: its own repeatability).
// Never wider than the tie tolerance (0: always the fastest).
constexpr double kSameTime = 0.005;

// Extra mechanisms a plan uses (virtual stages, zero-bubble split, recomputation), and its
// ZeRO stage where it matters (dp > 1).
int extras(const Plan& p) {
  return (p.virtual_stages > 1) + splits_backward(p.schedule) + (p.recompute != Recompute::none);
}
int64_t effective_zero(const Plan& p) { return p.mesh.token_parallel() > 1 ? p.zero_stage : 0; }

// Fewer moving parts, in order: fewer extra mechanisms (virtual stages, zero-bubble split,
// recomputation), a lower ZeRO stage, fewer micro-batches (each one more pass of every
// kernel at a smaller size, and more per-micro-batch work the model does not cost).
bool simpler(const Plan& a, const Plan& b) {
  auto parts = [](const Plan& p) { return std::make_tuple(extras(p), effective_zero(p), p.num_micro_batches); };
  return parts(a) < parts(b);
}

// Why `a` is simpler than `b` (simpler(a, b)), for the plan's tie_break.
std::string simpler_reason(const Plan& a, const Plan& b) {
  if (extras(a) != extras(b)) {
    return std::to_string(extras(a)) + " extra mechanisms (virtual stages, zero-bubble split, recomputation) vs " +
           std::to_string(extras(b));
  }
  if (effective_zero(a) != effective_zero(b)) {
    return "ZeRO stage " + std::to_string(effective_zero(a)) + " vs " + std::to_string(effective_zero(b));
  }
  return std::to_string(a.num_micro_batches) + " micro-batches vs " + std::to_string(b.num_micro_batches);
}

// "1.21x slower: bubble 9.1 s vs 2.3 s" -- the component that grew the most.
std::string why_slower(const Prediction& loser, const Prediction& winner) {
  const std::pair<const char*, double TimeBreakdown::*> parts[] = {
      {"compute", &TimeBreakdown::compute},   {"tp comm", &TimeBreakdown::tp_comm},
      {"dp comm", &TimeBreakdown::dp_comm},   {"pp comm", &TimeBreakdown::pp_comm},
      {"bubble", &TimeBreakdown::bubble},     {"optimizer", &TimeBreakdown::optimizer}};
  const char* worst = "step";
  double grew = -kInf, lose_v = 0, win_v = 0;
  for (const auto& [name, field] : parts) {
    const double d = loser.time.*field - winner.time.*field;
    if (d > grew) {
      grew = d;
      worst = name;
      lose_v = loser.time.*field;
      win_v = winner.time.*field;
    }
  }
  std::ostringstream out;
  out << std::fixed;
  out.precision(3);
  out << loser.step_time_s / winner.step_time_s << "x slower: " << worst << " "
      << format_seconds(lose_v) << " vs " << format_seconds(win_v);
  if (std::string(worst) == "compute" && loser.time.recompute > winner.time.recompute) {
    out << " (recompute " << format_seconds(loser.time.recompute) << ")";
  }
  return out.str();
}

class Searcher {
 public:
  Searcher(const ModelGraph& graph, const Cluster& cluster, const TrainingConfig& training,
           const SearchOptions& options, bool allow_over_memory)
      : graph_(graph),
        estimator_(options.estimator ? *options.estimator : analytic_estimator()),
        cluster_(estimator_.cluster_for(cluster)), training_(training), pins_(options.pins),
        options_(options), allow_over_memory_(allow_over_memory) {}

  Plan run() {
    validate(graph_);
    validate(cluster_);
    validate(training_);
    require_peak_flops(cluster_, training_.compute_dtype);
    if (!(options_.tie_tolerance >= 0 && options_.tie_tolerance < 1)) {
      throw ValidationError("tie_tolerance", "must be in [0, 1), got " + std::to_string(options_.tie_tolerance));
    }
    same_time_ = std::min(std::max(kSameTime, estimator_.resolution()), options_.tie_tolerance);
    if (options_.alternatives < 0) {
      throw ValidationError("alternatives",
                            "must be >= 0, got " + std::to_string(options_.alternatives));
    }
    check_pins(graph_, cluster_, training_, pins_);
    for (size_t i = 0; i < graph_.layers.size(); ++i) cut_before_.push_back(graph_.can_cut_before(static_cast<int>(i)));
    const int64_t world = cluster_.world_size();
    for (int64_t tp : divisors(world)) {
      if (pins_.tp ? tp != *pins_.tp : !tp_allowed(tp)) continue;
      for (int64_t pp : divisors(world / tp)) {
        if (pins_.pp ? pp != *pins_.pp : !pp_allowed(pp)) continue;
        for (int64_t cp : divisors(world / (tp * pp))) {
          if (pins_.cp ? cp != *pins_.cp : !cp_allowed(cp)) continue;
          const int64_t dp = world / (tp * pp * cp);
          if (pins_.dp && dp != *pins_.dp) continue;
          if (training_.global_batch % dp != 0) {
            note_rejection("global batch " + std::to_string(training_.global_batch) +
                           " is not divisible by dp=" + std::to_string(dp));
            continue;
          }
          meshes_.push_back({pp, dp, cp, tp});
        }
      }
    }
    for (const auto& [pp, dp, cp, tp] : meshes_) search_mesh(pp, dp, cp, tp);
    rescue_deferred();
    if (best_per_mesh_.empty()) {
      // Nothing fits: score the over-memory layouts too, to report the smallest need (and
      // to return the least bad one when the caller allows it).
      scoring_over_memory_ = true;
      for (const auto& [pp, dp, cp, tp] : meshes_) search_mesh(pp, dp, cp, tp);
    }
    return finish();
  }

 private:
  bool tp_allowed(int64_t tp) {
    if (tp > 1 && !training_.allow_tensor_parallel) return false;
    // Tensor parallelism stays inside a node (its collectives are on the critical path), or
    // inside the NVLink domain where the cluster's levels make it larger than a node.
    const int64_t domain = innermost_level_devices(cluster_);
    if (tp > domain || domain % tp != 0) return false;
    const std::string conflict = tp_conflict(graph_, tp);
    if (!conflict.empty()) {
      note_rejection("tp=" + conflict);
      return false;
    }
    return true;
  }

  // Context parallelism: the sequence must split into 2 cp equal chunks (each rank takes chunk
  // i and 2cp-1-i, balancing causal attention), of at least kMinContextParallelTokens tokens
  // per rank, in a model with attention.
  bool cp_allowed(int64_t cp) { return cp_possible(graph_, cp, kMinContextParallelTokens); }

  // Expert parallelism: ep divides dp x cp and every MoE layer's experts.
  std::vector<int64_t> ep_options(int64_t replicas) const {
    const int64_t experts = moe_experts_gcd(graph_);
    if (pins_.ep) return (replicas % *pins_.ep == 0) ? std::vector<int64_t>{*pins_.ep} : std::vector<int64_t>{};
    if (experts == 0) return {1};
    std::vector<int64_t> out;
    for (int64_t ep : divisors(replicas)) {
      if (experts % ep == 0) out.push_back(ep);
    }
    return out;
  }

  bool pp_allowed(int64_t pp) {
    if (pp > 1 && !training_.allow_pipeline_parallel) return false;
    return pp <= max_stages(graph_);
  }

  void search_mesh(int64_t pp, int64_t dp, int64_t cp, int64_t tp) {
    const int64_t per_replica = training_.global_batch / dp;
    const std::vector<int64_t> eps = ep_options(dp * cp);
    for (int64_t mbs : micro_batch_sizes(per_replica, dp)) {
      const int64_t m = per_replica / mbs;
      for (const auto& [schedule, v] : schedules_for(pp, m)) {
        for (Recompute rc : recompute_options()) {
          for (bool sp : sequence_parallel_options(tp)) {
            for (int64_t zero : zero_options(dp * cp)) {
             for (int64_t ep : eps) {
              Layout l;
              l.pp = pp; l.dp = dp; l.tp = tp;
              l.cp = cp; l.ep = ep;
              l.zero_stage = zero;
              l.micro_batch_size = mbs;
              l.num_micro_batches = m;
              l.schedule = schedule;
              l.virtual_stages = v;
              l.recompute = rc;
              l.sequence_parallel = sp;
              consider(l);
             }
            }
          }
        }
      }
    }
  }

  // Micro-batch sizes dividing the replica's share of the batch: the pinned one, or those up
  // to max_micro_batch_size.
  std::vector<int64_t> micro_batch_sizes(int64_t per_replica, int64_t dp) {
    if (!pins_.micro_batch_size) return divisors(per_replica, training_.max_micro_batch_size);
    const int64_t mbs = *pins_.micro_batch_size;
    if (per_replica % mbs == 0) return {mbs};
    note_rejection("micro-batch size " + std::to_string(mbs) + " does not divide the " +
                   std::to_string(per_replica) +
                   " samples per data-parallel replica (global batch " +
                   std::to_string(training_.global_batch) + " / dp=" + std::to_string(dp) + ")");
    return {};
  }

  std::vector<std::pair<ScheduleKind, int64_t>> schedules_for(int64_t pp, int64_t m) {
    std::vector<std::pair<ScheduleKind, int64_t>> out;
    if (pp == 1) {
      // Pins that need a pipeline rule pp=1 out; say so in case no pp > 1 works either.
      if (pins_.virtual_stages && *pins_.virtual_stages > 1) {
        note_rejection("virtual_stages=" + std::to_string(*pins_.virtual_stages) +
                       " needs pp > 1 (pp=1 has no pipeline)");
      } else if (pins_.schedule && *pins_.schedule != ScheduleKind::none) {
        note_rejection(to_string(*pins_.schedule) +
                       " needs pp > 1 (pp=1 runs without a pipeline schedule)");
      } else {
        out.push_back({ScheduleKind::none, 1});
      }
      return out;
    }
    const int64_t stages = max_stages(graph_);
    // A pinned schedule is scored even when the search would not list it.
    const std::vector<ScheduleKind> kinds =
        pins_.schedule ? std::vector<ScheduleKind>{*pins_.schedule} : training_.schedules;
    bool said_why = false;  // a note naming the cause: no generic "impossible" one beside it
    for (ScheduleKind kind : kinds) {
      if (kind == ScheduleKind::none) continue;
      if (kind == ScheduleKind::interleaved_1f1b) {
        if (m % pp != 0) continue;
        // A pinned number of virtual stages is scored even when the search would not list it
        // (Megatron recipes run e.g. 24 on 48 layers over pp 2).
        const std::vector<int64_t> vs = pins_.virtual_stages && *pins_.virtual_stages > 1
                                            ? std::vector<int64_t>{*pins_.virtual_stages}
                                            : std::vector<int64_t>{2, 3, 4, 6, 8};
        for (int64_t v : vs) {
          if (pp * v <= stages) out.push_back({kind, v});
        }
      } else if (kind == ScheduleKind::zero_bubble_v) {
        // Two stages per rank, placed as a V (pipeline_rank_of_stage).
        if ((!pins_.virtual_stages || *pins_.virtual_stages == 2) && 2 * pp <= stages) {
          out.push_back({kind, 2});
        } else if (pins_.schedule && 2 * pp > stages) {
          note_rejection("zbv with pp=" + std::to_string(pp) + " needs " + std::to_string(2 * pp) +
                         " stages (two per rank), the model can be cut into at most " + std::to_string(stages));
          said_why = true;
        }
      } else if (!pins_.virtual_stages || *pins_.virtual_stages == 1) {
        out.push_back({kind, 1});
      }
    }
    if (pins_.schedule && *pins_.schedule != ScheduleKind::none && out.empty() && pp > 1 && !said_why) {
      note_rejection(to_string(*pins_.schedule) + " impossible with pp=" + std::to_string(pp) +
                     " and " + std::to_string(m) + " micro-batches");
    }
    return out;
  }

  std::vector<Recompute> recompute_options() {
    if (pins_.recompute) return {*pins_.recompute};
    if (!training_.allow_recompute) return {Recompute::none};
    std::vector<Recompute> out = {Recompute::none};
    for (Recompute r : training_.recompute_modes) {
      if (r != Recompute::none) out.push_back(r);
    }
    return out;
  }

  std::vector<bool> sequence_parallel_options(int64_t tp) {
    // Sequence parallelism splits along the tp group: with tp=1 there is nothing to split.
    // Pinned on, it pins tp > 1 too: meshes with tp=1 are not candidates (never a plan that
    // silently dropped the pin; pinning tp=1 with it is refused up front).
    if (tp == 1) {
      if (pins_.sequence_parallel && *pins_.sequence_parallel) return {};
      return {false};
    }
    // MoE layers need every token of the sequence on each tp rank (the router, the capacity,
    // the load-balancing loss; the runtime refuses sequence parallelism with experts).
    if (moe_experts_gcd(graph_) > 0) {
      if (pins_.sequence_parallel && *pins_.sequence_parallel) return {};
      return {false};
    }
    if (pins_.sequence_parallel) return {*pins_.sequence_parallel};
    // Same communication volume as plain tp (all-gather + reduce-scatter = all-reduce) and
    // less memory (Korthikanti et al. 2022 Sec. 4.2.2), so it is on whenever tp > 1.
    return {training_.allow_sequence_parallel};
  }

  std::vector<int64_t> zero_options(int64_t dp) {
    if (pins_.zero_stage) return {*pins_.zero_stage};
    if (dp == 1 || !training_.allow_zero) return {0};
    return {0, 1, 2, 3};
  }

  const std::vector<LayerCost>& costs_for(const Layout& l) {
    // Layer costs depend on the tp group only (its link is the innermost axis).
    const auto key = std::make_tuple(l.tp, l.sequence_parallel, static_cast<int>(l.recompute),
                                     l.micro_batch_size, l.cp, l.ep);
    auto it = cost_cache_.find(key);
    if (it == cost_cache_.end()) {
      auto costs = estimator_.layer_costs(graph_, cluster_, training_, l);
      if (costs.size() != graph_.layers.size()) {  // a custom Estimator's mistake, said where
        throw ValidationError("estimator", "layer_costs gave " + std::to_string(costs.size()) + " entries for " +
                                               std::to_string(graph_.layers.size()) + " layers");
      }
      it = cost_cache_.emplace(key, std::move(costs)).first;
    }
    return it->second;
  }

  // A step cannot be faster than this, whatever the stage split (see predict_if_faster's
  // per-stage bound T >= sum_{s<k} W_s + m W_k): the split minimizing its max over k has
  // W_k = W_0 r^k with r = (m-1)/m, giving T = work / (1 - r^p). Interleaved and ZB-H1
  // schedules get the plain m * work / p.
  double lower_bound_s(const Layout& l, const std::vector<LayerCost>& costs) const {
    double work = 0;
    for (const auto& c : costs) work += c.forward_s + c.backward_s;
    const double m = static_cast<double>(l.num_micro_batches);
    // Ranks sharing cores run faster while others idle (shared_core_speedup): at most that.
    const double speedup = shared_core_speedup(cluster_, l);
    if (l.schedule == ScheduleKind::gpipe || l.schedule == ScheduleKind::one_f_one_b ||
        l.schedule == ScheduleKind::none) {
      return work / (1.0 - std::pow((m - 1.0) / m, static_cast<double>(l.pp))) / speedup;
    }
    return m * work / static_cast<double>(l.pp) / speedup;
  }

  // Skip a layout that can neither beat its mesh's best nor enter the top alternatives.
  double prune_threshold(const MeshKey& mesh) const {
    const auto it = best_per_mesh_.find(mesh);
    if (it == best_per_mesh_.end() || it->second.over_memory) return kInf;
    // A layout up to same_time_ slower than its mesh's best may still be its layout (simpler).
    return std::min(it->second.plan.prediction.step_time_s * (1 + same_time_), alternatives_threshold());
  }

  // Above this a mesh's best can be neither among the alternatives nor the choice: once as
  // many meshes as the plan keeps (alternatives + 1) have one that fits, a mesh whose best is
  // slower than the last of them (by more than same_time_) and than the tie tolerance of the
  // fastest is not used. (A mesh within the tie tolerance of the fastest may still be chosen,
  // having fewer moving parts: it is not cut for missing the alternatives list.)
  double alternatives_threshold() const {
    std::vector<double> times;
    for (const auto& [_, c] : best_per_mesh_) {
      if (!c.over_memory) times.push_back(c.plan.prediction.step_time_s);
    }
    const size_t keep = static_cast<size_t>(options_.alternatives) + 1;
    if (times.size() < keep) return kInf;
    std::nth_element(times.begin(), times.begin() + (keep - 1), times.end());
    const double fastest = *std::min_element(times.begin(), times.end());
    return std::max(times[keep - 1] * (1 + same_time_),
                    fastest * (1 + std::max(options_.tie_tolerance, same_time_)));
  }

  // Model state of the most loaded rank is at least the average over pipeline ranks, and
  // the ranks together hold every weight at least once: a tied weight counts once (ranks
  // holding a copy each only add to the average). As in predict() (stage_params), each
  // member of a tied group after the first reuses the first's parameters.
  double state_lower_bound_bytes(const Layout& l, const std::vector<LayerCost>& costs) const {
    double params = 0, experts = 0;
    for (const auto& c : costs) {
      params += c.params;
      experts += c.expert_params;
    }
    for (size_t g = 0; g < graph_.tied_groups.size(); ++g) {
      params -= static_cast<double>(graph_.tied_groups[g].size() - 1) * tied_params(graph_, g, costs);
    }
    return layout_model_state_bytes(params / l.pp, experts / l.pp, l, training_, training_.grad_bytes).total();
  }

  // Why the layout's schedule or stage partition would be too large to build, or "".
  std::string size_problem(const Layout& l) const {
    const std::string schedule = schedule_size_problem(l.pp, l.num_micro_batches, l.virtual_stages);
    if (!schedule.empty()) return schedule;
    const int64_t stages = l.pp * l.virtual_stages;
    const int64_t layers = static_cast<int64_t>(graph_.layers.size());
    if (stages > kMaxPartitionCells / layers) {
      return std::to_string(stages) + " stages x " + std::to_string(layers) +
             " layers is too large a stage partition (at most " +
             std::to_string(kMaxPartitionCells) + ")";
    }
    return "";
  }

  void consider(const Layout& l) {
    ++stats_.considered;
    // Skipped, not fatal: other layouts (larger micro-batches, smaller pp) may be fine. One
    // note is enough; the others differ only in their numbers.
    const std::string too_large = size_problem(l);
    if (!too_large.empty()) {
      if (!noted_too_large_) note_rejection(too_large);
      noted_too_large_ = true;
      return;
    }
    const auto& costs = costs_for(l);
    const MeshKey mesh{l.pp, l.dp, l.cp, l.tp};
    if (lower_bound_s(l, costs) * (1 - 1e-9) >= prune_threshold(mesh)) {
      ++stats_.pruned;
      return;
    }
    const double limit = cluster_.usable_memory_bytes();
    // Cheap memory test first: the model state alone may not fit on the average rank.
    const bool hopeless = state_lower_bound_bytes(l, costs) > limit;
    auto partition = hopeless ? std::nullopt : partition_for(l, costs, limit);
    if (hopeless || l.virtual_stages == 1 || scoring_over_memory_) {
      score(l, costs, std::move(partition));
      return;
    }
    // Interleaved chunks whose shares of the rank's memory admit no split, or whose split
    // predict() finds over memory, may still share the rank's memory in another split: tried
    // once every layout has been seen (rescue_deferred), when most such layouts are pruned by
    // the fastest that fit, since the attempt is costly and rarely succeeds. (The second pass,
    // over memory, follows a first whose rescues were not pruned: none fitted.)
    Deferred d{l, std::nullopt};
    if (partition) {
      d.tried = partition->stage_of_layer;
      if (score(l, costs, std::move(partition)) != Scored::over_memory) return;
    }
    deferred_.push_back(std::move(d));
  }

  // Layouts whose interleaved chunks did not fit their shares of a rank's memory (consider):
  // each still under its mesh's prune threshold is scored with the other splits in turn (the
  // rank's peak spread evenly over its chunks, then the loosened shares), until one fits.
  void rescue_deferred() {
    std::vector<Deferred> deferred;
    deferred.swap(deferred_);
    const double limit = cluster_.usable_memory_bytes();
    for (const Deferred& d : deferred) {
      const Layout& l = d.layout;
      const auto& costs = costs_for(l);
      // A mesh with nothing that fits: what the rescue finds becomes its best.
      const MeshKey mesh{l.pp, l.dp, l.cp, l.tp};
      const bool mesh_fits = best_per_mesh_.count(mesh) && !best_per_mesh_.at(mesh).over_memory;
      const double threshold = mesh_fits ? prune_threshold(mesh) : alternatives_threshold();
      if (lower_bound_s(l, costs) * (1 - 1e-9) >= threshold) {
        ++stats_.pruned;
        continue;
      }
      std::vector<std::vector<int64_t>> tried;
      if (d.tried) tried.push_back(*d.tried);
      bool settled = false;
      auto attempt = [&](std::optional<Partition> split) {
        if (settled || !split) return;
        if (std::find(tried.begin(), tried.end(), split->stage_of_layer) != tried.end()) return;
        tried.push_back(split->stage_of_layer);
        settled = score(l, costs, std::move(split)) != Scored::over_memory;
      };
      attempt(even_split(l, costs, limit));
      if (!settled) attempt(loosened_split(l, costs, limit));
      if (tried.empty()) score(l, costs, std::nullopt);  // no split at all: counted over memory
    }
  }

  enum class Scored { fits, over_memory, pruned };

  // Scores a layout with its stage partition (none: no split fits memory); says whether it
  // fits, does not, or could not beat the threshold.
  Scored score(const Layout& l, const std::vector<LayerCost>& costs, std::optional<Partition> partition) {
    const MeshKey mesh{l.pp, l.dp, l.cp, l.tp};
    const double limit = cluster_.usable_memory_bytes();
    bool over = false;
    if (!partition) {
      ++stats_.over_memory;
      if (!scoring_over_memory_) return Scored::over_memory;
      if (state_lower_bound_bytes(l, costs) >= smallest_need_) return Scored::over_memory;  // cannot need less
      // Score the time-balanced split to report how much memory it would need.
      partition = partition_for(l, costs, kInf);
      over = true;
      if (!partition) return Scored::over_memory;
    }
    Candidate c;
    c.plan = make_plan(l, *partition);
    // The layout's dp reduction: the fastest that fits (the first on a tie, flat before
    // hierarchical before compressed, overlapped before not). Under ZeRO 0 they need the same
    // memory; ZeRO++ keeps secondary shards (and residuals when compressed), so it may not
    // fit where flat does; overlap holds a unit more (Plan::zero_overlap).
    std::optional<Prediction> prediction;
    std::tuple<DpReduction, Compression, bool> chosen{DpReduction::flat, Compression::none, true};
    double threshold = over ? kInf : prune_threshold(mesh);
    bool chosen_fits = false;
    std::vector<std::tuple<DpReduction, Compression, bool>> options;
    for (const auto& [reduction, compression] : dp_reductions(l)) {
      for (bool overlap : zero_overlaps(l)) options.emplace_back(reduction, compression, overlap);
    }
    for (const auto& option : options) {
      c.plan.dp_reduction = std::get<0>(option);
      c.plan.inter_node_compression = std::get<1>(option);
      c.plan.zero_overlap = std::get<2>(option);
      // The threshold only falls for an option that fits: a faster one that does not must
      // not prune a slower one that does.
      auto scored = predict_if_faster(graph_, c.plan, &sims_, threshold, &estimator_);
      if (!scored) continue;
      const bool fits = scored->memory_bytes_per_device <= limit;
      const bool better = !prediction || (fits && !chosen_fits) ||
                          (fits == chosen_fits && scored->step_time_s < prediction->step_time_s);
      if (better) {
        prediction = std::move(scored);
        chosen = option;
        chosen_fits = fits;
        if (fits) threshold = std::min(threshold, prediction->step_time_s);
      }
    }
    if (!prediction) {
      ++stats_.pruned;
      return Scored::pruned;
    }
    c.plan.dp_reduction = std::get<0>(chosen);
    c.plan.inter_node_compression = std::get<1>(chosen);
    c.plan.zero_overlap = std::get<2>(chosen);
    c.plan.prediction = *prediction;
    c.over_memory = over || c.plan.prediction.memory_bytes_per_device > limit;
    c.key = c.plan.summary();
    ++stats_.scored;
    if (c.over_memory) {
      if (c.plan.prediction.memory_bytes_per_device < smallest_need_) {
        smallest_need_ = c.plan.prediction.memory_bytes_per_device;
        smallest_need_plan_ = c.plan;
      }
      if (!scoring_over_memory_ || !allow_over_memory_) return Scored::over_memory;
    }
    const Scored result = c.over_memory ? Scored::over_memory : Scored::fits;
    auto [it, inserted] = best_per_mesh_.emplace(mesh, c);
    if (!inserted && better(c, it->second)) it->second = c;
    // The mesh's near ties: every layout that fits within same_time_ of its fastest.
    if (!c.over_memory && std::isfinite(c.plan.prediction.step_time_s) && !it->second.over_memory) {
      const double limit_s = it->second.plan.prediction.step_time_s * (1 + same_time_);
      auto& near = near_per_mesh_[mesh];
      near.push_back(std::move(c));
      near.erase(std::remove_if(near.begin(), near.end(),
                                [&](const Candidate& n) { return n.plan.prediction.step_time_s > limit_s; }),
                 near.end());
    }
    return result;
  }

  // The dp reductions to score for a layout: flat; and where the training config allows it and
  // the dp group spans nodes with more than one of its ranks on each, hierarchical, plain and
  // with the one lossy compression the config allows.
  // Overlap of the ZeRO engine's collectives (Plan::zero_overlap): where it pays, overlapped
  // first and waited-for as the fallback that holds a unit less; where it cannot save time
  // (zero_overlap_pays), only waited-for. DDP (ZeRO 0) overlaps its buckets in every plan.
  std::vector<bool> zero_overlaps(const Layout& l) const {
    if (l.replicas() <= 1 || l.zero_stage == 0) return {true};
    if (pins_.zero_overlap) return {*pins_.zero_overlap};
    if (!zero_overlap_pays(cluster_)) return {false};
    return {true, false};
  }

  std::vector<std::pair<DpReduction, Compression>> dp_reductions(const Layout& l) const {
    std::vector<std::pair<DpReduction, Compression>> out = {{DpReduction::flat, Compression::none}};
    // The runtime runs it under ZeRO 0 (DataParallel) and ZeRO-3 (ZeRO++); its ZeRO-1/2
    // engines reduce flat (plan_validate.cpp).
    if (!training_.allow_hierarchical_dp || l.dp <= 1 || (l.zero_stage != 0 && l.zero_stage != 3)) return out;
    // Not with cp or ep: the runtime's hierarchical engines reduce over dp alone.
    if (l.cp > 1 || l.ep > 1) return out;
    if (!dp_node_split(cluster_, l.pp, l.dp, l.tp).hierarchical_possible()) return out;
    out.push_back({DpReduction::hierarchical, Compression::none});
    if (training_.inter_node_compression != Compression::none) {
      out.push_back({DpReduction::hierarchical, training_.inter_node_compression});
    }
    return out;
  }

  std::optional<Partition> partition_for(const Layout& l, const std::vector<LayerCost>& costs,
                                         double limit) {
    return partition_stages(partition_problem(l, costs, limit));
  }

  // The stage partition's problem for a rank memory of `limit` bytes.
  PartitionProblem partition_problem(const Layout& l, const std::vector<LayerCost>& costs, double limit) {
    PartitionProblem p;
    const int64_t stages = l.pp * l.virtual_stages;
    p.stages = stages;
    double largest_params = 0, workspace = 0, p2p = 0;
    for (size_t i = 0; i < costs.size(); ++i) {
      const auto& c = costs[i];
      p.layer_time_s.push_back(c.forward_s + c.backward_s);
      p.layer_state_bytes.push_back(
          layout_model_state_bytes(c.params, c.expert_params, l, training_, training_.grad_bytes).total());
      p.layer_activation_bytes.push_back(c.activation_bytes);
      p.cut_allowed.push_back(i == 0 || cut_before_[i]);
      largest_params = std::max(largest_params, c.params);
      workspace = std::max(workspace, c.workspace_bytes);
      // A stage can end where the next may start: the largest output any stage may send.
      if (i + 1 == costs.size() || cut_before_[i + 1]) {
        p2p = std::max(p2p, stage_p2p_bytes(graph_, training_, l, static_cast<int64_t>(i)));
      }
    }
    // One stage holds every layer: a tied weight is one tensor there, and predict() charges
    // each member after the first only what it has beyond the first's parameters (clamped
    // at zero, so the partition stays conservative and its prefix sums keep rising). With
    // more stages every layer is charged in full: its stage may hold its own copy.
    if (stages == 1) {
      for (size_t g = 0; g < graph_.tied_groups.size(); ++g) {
        const auto& group = graph_.tied_groups[g];
        // The tied tensor's state: its share of the smallest member's.
        int smallest = group.front();
        for (int idx : group) smallest = costs[idx].params < costs[smallest].params ? idx : smallest;
        const double shared = costs[smallest].params > 0
            ? p.layer_state_bytes[smallest] * tied_params(graph_, g, costs) / costs[smallest].params
            : 0.0;
        for (size_t k = 1; k < group.size(); ++k) {
          p.layer_state_bytes[group[k]] = std::max(0.0, p.layer_state_bytes[group[k]] - shared);
        }
      }
    }
    p.stage_in_flight = stage_in_flight(l);
    // Per rank, as predict() charges them: the recompute workspace, two p2p buffers, two
    // gradient buckets or two gathered ZeRO-3 units.
    double buffers = workspace + (l.pp > 1 ? 2 * p2p : 0.0);
    if (l.replicas() > 1) {
      buffers += l.zero_stage >= 3 ? 2 * largest_params * training_.param_bytes
                                   : 2 * training_.dp_bucket_bytes;
    }
    p.stage_fixed_bytes = buffers / static_cast<double>(l.virtual_stages);
    set_rank_memory(p, l, limit);
    return p;
  }

  // The stages' memory limits for `limit` bytes per rank. A rank holds v interleaved chunks:
  // each gets 1/v of the rank's buffers (p.stage_fixed_bytes) and a share of the rest of its
  // memory in proportion to what the chunk keeps when the layers are spread evenly (its
  // state, and its activations times its own micro-batches in flight). An even split then
  // fits exactly when the rank's sum does; a split that puts more layers in the chunks
  // holding more micro-batches (the early ones) is charged for it.
  static void set_rank_memory(PartitionProblem& p, const Layout& l, double limit) {
    const double v = static_cast<double>(l.virtual_stages);
    p.stage_memory_limit_bytes = limit / v;
    p.stage_memory_limits_bytes.clear();
    if (l.virtual_stages == 1 || !std::isfinite(limit)) return;  // (no limit: the same for each)
    const double buffers = p.stage_fixed_bytes * v;
    for (double share : chunk_shares(p, l)) p.stage_memory_limits_bytes.push_back(buffers / v + (limit - buffers) * share);
  }

  // Per stage: its share of its rank's memory beyond the buffers (set_rank_memory).
  static std::vector<double> chunk_shares(const PartitionProblem& p, const Layout& l) {
    const double v = static_cast<double>(l.virtual_stages);
    double state = 0, activations = 0;
    for (size_t i = 0; i < p.layer_state_bytes.size(); ++i) {
      state += p.layer_state_bytes[i];
      activations += p.layer_activation_bytes[i];
    }
    const int64_t stages = p.stages;
    std::vector<double> expected(stages), rank_total(l.pp, 0.0), shares(stages);
    for (int64_t s = 0; s < stages; ++s) {
      expected[s] = state + activations * p.stage_in_flight[s];
      rank_total[pipeline_rank_of_stage(l.schedule, l.pp, s)] += expected[s];
    }
    for (int64_t s = 0; s < stages; ++s) {
      const double total = rank_total[pipeline_rank_of_stage(l.schedule, l.pp, s)];
      shares[s] = total > 0 ? expected[s] / total : 1 / v;
    }
    return shares;
  }

  // Per stage: the micro-batches whose activations it keeps at once. With one stage per rank,
  // the rank's count (estimated_in_flight: equal to the simulated one). With interleaved
  // chunks, each chunk's own peak along its rank's action list: the early chunks run ahead in
  // the warm-up and the LM head's holds one at a time, so the rank's peak spread evenly
  // under-charges the first and over-charges the last.
  std::vector<double> stage_in_flight(const Layout& l) {
    std::vector<double> out;
    if (l.virtual_stages == 1) {
      for (int64_t s = 0; s < l.pp; ++s) out.push_back(estimated_in_flight(l, s));
      return out;
    }
    const SimulationCache::ScheduleKey key{static_cast<int>(l.schedule), l.pp, l.num_micro_batches, l.virtual_stages};
    auto it = in_flight_cache_.find(key);
    if (it == in_flight_cache_.end()) {
      const auto peaks = l.schedule == ScheduleKind::interleaved_1f1b
                             ? interleaved_stage_peak_in_flight(l.pp, l.num_micro_batches, l.virtual_stages)
                             : stage_peak_in_flight(make_schedule(l.schedule, l.pp, l.num_micro_batches,
                                                                  l.virtual_stages));
      it = in_flight_cache_.emplace(key, std::vector<double>(peaks.begin(), peaks.end())).first;
    }
    return it->second;
  }

  // The least, over splits into contiguous non-empty stages, of the stages' state plus
  // activations times their in-flight counts: min over the last stage's start i of
  // best[k-1][i] + in_flight[k-1] (A_j - A_i), with a running minimum of best[k-1][i] -
  // in_flight[k-1] A_i, O(stages x layers).
  static double least_total_bytes(const PartitionProblem& p) {
    const size_t n = p.layer_state_bytes.size();
    const size_t S = static_cast<size_t>(p.stages);
    if (n < S || S == 0) return kInf;
    double state = 0;
    std::vector<double> A(n + 1, 0.0);
    for (size_t i = 0; i < n; ++i) {
      state += p.layer_state_bytes[i];
      A[i + 1] = A[i] + p.layer_activation_bytes[i];
    }
    std::vector<double> best(n + 1, kInf), next(n + 1, kInf);
    for (size_t j = 1; j <= n; ++j) best[j] = p.stage_in_flight[0] * A[j];
    for (size_t k = 2; k <= S; ++k) {
      const double f = p.stage_in_flight[k - 1];
      double running = kInf;
      std::fill(next.begin(), next.end(), kInf);
      for (size_t j = k; j <= n; ++j) {
        running = std::min(running, best[j - 1] - f * A[j - 1]);
        next[j] = running + f * A[j];
      }
      best.swap(next);
    }
    return state + best[n];
  }

  // The rank's peak count spread evenly over its chunks, each within 1/v of the rank's memory
  // (the partition before the shares): exact for the rank's sum where the chunks are alike;
  // it under-charges the early chunks, so predict()'s walk decides.
  std::optional<Partition> even_split(const Layout& l, const std::vector<LayerCost>& costs, double limit) {
    PartitionProblem even = partition_problem(l, costs, limit);
    even.stage_memory_limits_bytes.clear();
    for (int64_t s = 0; s < even.stages; ++s) even.stage_in_flight[s] = estimated_in_flight(l, pipeline_rank_of_stage(l.schedule, l.pp, s));
    return partition_stages(even);
  }

  // The shares of a rank's memory are fixed where its chunks really share it: a rank whose
  // head chunk needs more than its share may fit when its other chunks need less. The rank's
  // memory the shares divide is loosened (alpha times it) from 1 up to where every chunk's
  // limit reaches the rank's whole memory, to about the least alpha that admits a split (six
  // halvings), and that split is kept if every rank fits with each of its chunks at its own
  // peak count at once (the chunks' peaks need not coincide: a bound on predict()'s walk, which
  // then decides).
  std::optional<Partition> loosened_split(const Layout& l, const std::vector<LayerCost>& costs, double limit) {
    const double v = static_cast<double>(l.virtual_stages);
    PartitionProblem p = partition_problem(l, costs, limit);
    const double buffers = p.stage_fixed_bytes * v;
    // Necessary: the ranks' memory together holds every layer's state, its activations times
    // the fewest micro-batches in flight any split into non-empty stages gives them, and each
    // rank's buffers.
    if (least_total_bytes(p) + static_cast<double>(l.pp) * buffers > static_cast<double>(l.pp) * limit) {
      return std::nullopt;
    }
    // A stage's limit at alpha is buffers / v + (alpha limit - buffers) share: it reaches the
    // rank's memory at alpha = ((limit - buffers / v) / share + buffers) / limit.
    double widest = 1;
    for (double share : chunk_shares(p, l)) {
      if (share > 0) widest = std::max(widest, ((limit - buffers / v) / share + buffers) / limit);
    }
    // The least alpha is searched with the partition's O(layers) necessary condition, then a
    // partition is made there (the dynamic program, at O(stages x layers x log), only where it
    // can succeed).
    auto admits = [&](double alpha) {
      set_rank_memory(p, l, limit * alpha);
      return memory_may_admit_partition(p);
    };
    auto split = [&](double alpha) {
      set_rank_memory(p, l, limit * alpha);
      return partition_stages(p);
    };
    if (!admits(widest)) return std::nullopt;  // not even with the rank's whole memory for each chunk
    double lo = 1, hi = widest;               // hi admits; lo need not
    for (int i = 0; i < 6; ++i) {
      const double mid = 0.5 * (lo + hi);
      (admits(mid) ? hi : lo) = mid;
    }
    auto found = split(hi);
    // The condition is not sufficient (cuts, non-empty stages): then the dynamic program
    // itself between hi and the widest.
    if (!found) {
      lo = hi;
      hi = widest;
      found = split(hi);
      if (!found) return std::nullopt;
      for (int i = 0; i < 6; ++i) {
        const double mid = 0.5 * (lo + hi);
        if (auto q = split(mid)) {
          hi = mid;
          found = std::move(q);
        } else {
          lo = mid;
        }
      }
    }
    std::vector<double> rank_bytes(l.pp, buffers);
    for (size_t i = 0; i < found->stage_of_layer.size(); ++i) {
      const int64_t s = found->stage_of_layer[i];
      rank_bytes[pipeline_rank_of_stage(l.schedule, l.pp, s)] += p.layer_state_bytes[i] + p.layer_activation_bytes[i] * p.stage_in_flight[s];
    }
    for (double bytes : rank_bytes) {
      if (bytes > limit) return std::nullopt;
    }
    return found;
  }

  Plan make_plan(const Layout& l, const Partition& partition) {
    Plan plan;
    plan.model_name = graph_.name;
    plan.model_params = graph_.total_params();
    plan.transformer = graph_.transformer;
    plan.cluster = cluster_;
    plan.training = training_;
    plan.mesh.pp = l.pp;
    plan.mesh.dp = l.dp;
    plan.mesh.tp = l.tp;
    plan.mesh.cp = l.cp;
    plan.mesh.ep = l.ep;
    if (l.cp > 1) plan.mesh.order = {"pp", "dp", "cp", "tp"};
    plan.zero_stage = l.zero_stage;
    plan.micro_batch_size = l.micro_batch_size;
    plan.num_micro_batches = l.num_micro_batches;
    plan.schedule = l.schedule;
    plan.virtual_stages = l.virtual_stages;
    plan.recompute = l.recompute;
    plan.sequence_parallel = l.sequence_parallel;
    plan.dp_bucket_bytes = training_.dp_bucket_bytes;
    plan.dp_reduction = l.dp_reduction;
    plan.inter_node_compression = l.inter_node_compression;
    plan.zero_overlap = l.zero_overlap;
    for (size_t i = 0; i < graph_.layers.size(); ++i) {
      const Layer& layer = graph_.layers[i];
      LayerPlacement lp;
      lp.name = layer.name;
      lp.kind = layer.kind;
      lp.params = layer.params;
      lp.stage = partition.stage_of_layer[i];
      lp.tp = l.tp > 1 ? layer.tp : TpPattern::replicated;
      lp.tp_dims = layer.tp_dims;
      // ZeRO-3 gathers and frees each block as one unit; the other layers (embeddings, final
      // norm, head) form the root unit, gathered for the whole forward and backward.
      lp.sharding_unit = l.zero_stage == 3 && l.replicas() > 1 && layer.params > 0 && layer.kind == LayerKind::block;
      plan.layers.push_back(lp);
    }
    return plan;
  }

  void note_rejection(const std::string& why) {
    if (std::find(rejections_.begin(), rejections_.end(), why) == rejections_.end()) {
      rejections_.push_back(why);
    }
  }

  // What makes a layout harder to run, for breaking ties (SearchOptions::tie_tolerance).
  struct MovingParts {
    double slow_link_bytes = 0;  // per step, on the busiest rank, over the slowest link it uses
    bool slow_link_inter_node = false;
    int dimensions = 0;          // parallel axes larger than 1
    int extras = 0;              // virtual stages, zero-bubble split, ZeRO-3, recomputation
    int64_t micro_batches = 1;   // per step on each pipeline
    int64_t cp = 1, ep = 1;      // ranks in the k/v ring, in the all-to-all
  };

  MovingParts moving_parts(const Plan& plan) const {
    MovingParts m;
    const int64_t pp = plan.mesh.pp, dp = plan.mesh.dp, tp = plan.mesh.tp;
    m.dimensions = (pp > 1) + (dp > 1) + (tp > 1) + (plan.mesh.cp > 1) + (plan.mesh.ep > 1);
    m.micro_batches = plan.num_micro_batches;
    m.cp = plan.mesh.cp;
    m.ep = plan.mesh.ep;
    m.extras = extras(plan) + (effective_zero(plan) == 3);
    const int64_t replicas = plan.mesh.token_parallel();  // the dp x cp ranks reduce gradients
    const bool inter[] = {axis_link(cluster_, pp, replicas, tp, Axis::pp).inter_node,
                          axis_link(cluster_, pp, replicas, tp, Axis::dp).inter_node,
                          axis_link(cluster_, pp, dp, tp, Axis::tp).inter_node};
    m.slow_link_inter_node = inter[0] || inter[1] || inter[2];
    const std::vector<AxisBytes> sent = bytes_per_step(graph_, plan);
    for (const AxisBytes& r : sent) {
      m.slow_link_inter_node = m.slow_link_inter_node || r.ep_inter_node > 0 || r.cp_inter_node > 0;
    }
    for (const AxisBytes& r : sent) {
      // The ends' all-reduce runs between the first and last pipeline rank: the pp link.
      const double slow = m.slow_link_inter_node
                              ? (inter[0] ? r.pp + r.ends : 0) + r.dp_inter_node + (inter[2] ? r.tp : 0) +
                                    r.ep_inter_node + r.cp_inter_node
                              : r.total();
      m.slow_link_bytes = std::max(m.slow_link_bytes, slow);
    }
    return m;
  }

  // "" when `a` has no fewer moving parts than `b`; else why it has fewer. In order: less
  // traffic over the network (when either crosses nodes), at most half the micro-batches,
  // fewer parallel dimensions, fewer extra mechanisms, less traffic inside the node. Traffic
  // within 10% counts as the same (the byte counts are exact, what they cost is not).
  // Micro-batches before dimensions: each is a round of kernel launches, framework dispatch
  // and pipeline messages that neither estimator fully counts. On this project's CPU bench
  // (bench/layouts.py) 4 micro-batches of 1 measured 3-5% slower than 1 of 4 in every run,
  // and a 4-stage pipeline of 16 micro-batches, picked over a 2 x 2 mesh of one micro-batch
  // predicted 4% faster, measured 8.5% behind the fastest layout (docs/cost_model.md).
  static std::string fewer_moving_parts(const MovingParts& a, const MovingParts& b) {
    auto traffic = [](const MovingParts& x, const MovingParts& y) -> int {
      if (x.slow_link_bytes < 0.9 * y.slow_link_bytes) return -1;
      if (y.slow_link_bytes < 0.9 * x.slow_link_bytes) return 1;
      return 0;
    };
    auto bytes_text = [](const MovingParts& x, const MovingParts& y, const char* link) {
      return format_bytes(x.slow_link_bytes) + " vs " + format_bytes(y.slow_link_bytes) + " per step on the " +
             link + " link";
    };
    if (a.slow_link_inter_node || b.slow_link_inter_node) {
      // A layout that stays inside one node has no network traffic at all.
      MovingParts x = a, y = b;
      if (!x.slow_link_inter_node) x.slow_link_bytes = 0;
      if (!y.slow_link_inter_node) y.slow_link_bytes = 0;
      const int t = traffic(x, y);
      if (t != 0) return t < 0 ? bytes_text(x, y, "inter-node") : "";
    }
    if (2 * a.micro_batches <= b.micro_batches) {
      return std::to_string(a.micro_batches) + " micro-batches vs " + std::to_string(b.micro_batches);
    }
    if (2 * b.micro_batches <= a.micro_batches) return "";
    if (a.dimensions != b.dimensions) {
      return a.dimensions < b.dimensions ? std::to_string(a.dimensions) + " parallel dimensions vs " +
                                               std::to_string(b.dimensions)
                                         : "";
    }
    if (a.extras != b.extras) {
      return a.extras < b.extras ? std::to_string(a.extras) +
                                       " extra mechanisms (virtual stages, zero-bubble, ZeRO-3, recompute) vs " +
                                       std::to_string(b.extras)
                                 : "";
    }
    if (!a.slow_link_inter_node && !b.slow_link_inter_node && traffic(a, b) < 0) {
      return bytes_text(a, b, "intra-node");
    }
    // A shorter k/v ring, a smaller all-to-all: fewer steps and messages the model does not
    // fully cost (a chunk of 2K tokens per rank and of 4K predict alike).
    if (a.cp != b.cp) return a.cp < b.cp ? "cp=" + std::to_string(a.cp) + " vs " + std::to_string(b.cp) : "";
    if (a.ep != b.ep) return a.ep < b.ep ? "ep=" + std::to_string(a.ep) + " vs " + std::to_string(b.ep) : "";
    return "";
  }

  static std::string percent(double fraction) {
    std::ostringstream out;
    out.precision(2);
    out << std::fixed << 100.0 * fraction << "%";
    return out.str();
  }

  Plan finish() {
    if (options_.stats) *options_.stats = stats_;
    // The fastest layout of all, before any tie rule: every tie window is measured from it,
    // so the rules do not compound (the pick is never more than tie_tolerance behind it).
    const Candidate* fastest_of_all = nullptr;
    for (const auto& [_, c] : best_per_mesh_) {
      if (!fastest_of_all || better(c, *fastest_of_all)) fastest_of_all = &c;
    }
    const Candidate true_fastest = fastest_of_all ? *fastest_of_all : Candidate{};
    // Each mesh's layout: the simplest of its near ties (same_time_), the fastest among equals.
    std::map<MeshKey, Candidate> passed_over;  // per mesh: its fastest, when replaced
    for (auto& [mesh, near] : near_per_mesh_) {
      Candidate& best = best_per_mesh_.at(mesh);
      if (best.over_memory || near.empty()) continue;
      const Candidate* chosen = &near.front();
      for (const Candidate& n : near) {
        if (simpler(n.plan, chosen->plan) || (!simpler(chosen->plan, n.plan) && better(n, *chosen))) chosen = &n;
      }
      if (chosen->plan.summary() != best.plan.summary()) passed_over.emplace(mesh, best);
      best = *chosen;
    }
    std::vector<const Candidate*> ranked;
    for (const auto& [_, c] : best_per_mesh_) ranked.push_back(&c);
    std::sort(ranked.begin(), ranked.end(), [](const Candidate* a, const Candidate* b) { return better(*a, *b); });
    if (ranked.empty()) throw InfeasibleError(explain_failure());
    // Ties: among the layouts the model cannot tell from the fastest, the simplest.
    size_t chosen = 0;
    std::string tie_reason;
    const double tolerance = options_.tie_tolerance;
    if (tolerance > 0 && !ranked.front()->over_memory) {
      const double fastest = true_fastest.plan.prediction.step_time_s;
      MovingParts chosen_parts = moving_parts(ranked.front()->plan);
      for (size_t i = 1; i < ranked.size(); ++i) {
        const Candidate& c = *ranked[i];
        if (c.over_memory || c.plan.prediction.step_time_s > fastest * (1 + tolerance)) break;
        const MovingParts parts = moving_parts(c.plan);
        if (!fewer_moving_parts(parts, chosen_parts).empty()) {
          chosen = i;
          chosen_parts = parts;
        }
      }
      // The reason is against the fastest (the 10% traffic rule is not transitive: keep the
      // fastest unless the pick beats it directly).
      if (chosen != 0) {
        tie_reason = fewer_moving_parts(chosen_parts, moving_parts(ranked.front()->plan));
        if (tie_reason.empty()) chosen = 0;
      }
    }
    Plan best = ranked[chosen]->plan;
    const auto mesh_of = [](const Plan& p) { return std::make_tuple(p.mesh.pp, p.mesh.dp, p.mesh.cp, p.mesh.tp); };
    const auto replaced = passed_over.find(mesh_of(best));
    if (!true_fastest.over_memory && best.summary() != true_fastest.plan.summary() &&
        best.prediction.step_time_s > true_fastest.plan.prediction.step_time_s) {
      // Said against the fastest layout of all, whichever rule moved the pick: across meshes
      // (fewer moving parts) and within its mesh (simpler, within same_time_).
      const Plan& fastest = true_fastest.plan;
      std::vector<std::string> why;
      if (chosen != 0) why.push_back("fewer moving parts, " + tie_reason);
      if (replaced != passed_over.end()) {
        why.push_back("simpler than its mesh's fastest, " + simpler_reason(best, replaced->second.plan) + " (within " +
                      percent(same_time_) + (same_time_ > kSameTime ? ", from the estimator's resolution " +
                                                                          percent(estimator_.resolution())
                                                                    : std::string()) +
                      ")");
      }
      std::string reasons;
      for (const auto& w : why) reasons += (reasons.empty() ? "" : "; ") + w;
      best.tie_break = "preferred over " + fastest.summary() + " (predicted " +
                       percent(best.prediction.step_time_s / fastest.prediction.step_time_s - 1) +
                       " faster, within the " + percent(tolerance) + " tie tolerance): " + reasons;
    }
    int64_t kept = 0;
    // The pick's own mesh's fastest layout, when the within-mesh rule passed it over: first.
    if (replaced != passed_over.end() && kept < options_.alternatives) {
      const Plan& alt = replaced->second.plan;
      Alternative a;
      a.summary = alt.summary();
      a.step_time_s = alt.prediction.step_time_s;
      a.memory_bytes_per_device = alt.prediction.memory_bytes_per_device;
      a.reason = "predicted " + percent(best.prediction.step_time_s / alt.prediction.step_time_s - 1) +
                 " faster, within the same mesh's " + percent(same_time_) + " window, with more moving parts";
      best.alternatives.push_back(a);
      ++kept;
    }
    for (size_t i = 0; i < ranked.size() && kept < options_.alternatives; ++i) {
      if (i == chosen) continue;
      const Plan& alt = ranked[i]->plan;
      Alternative a;
      a.summary = alt.summary();
      a.step_time_s = alt.prediction.step_time_s;
      a.memory_bytes_per_device = alt.prediction.memory_bytes_per_device;
      if (ranked[i]->over_memory) {
        a.reason = "needs " + format_bytes(a.memory_bytes_per_device) + " per device";
      } else if (alt.prediction.step_time_s < best.prediction.step_time_s) {
        a.reason = "predicted " + percent(best.prediction.step_time_s / alt.prediction.step_time_s - 1) +
                   " faster, within the tie tolerance, with more moving parts";
      } else {
        a.reason = why_slower(alt.prediction, best.prediction);
      }
      best.alternatives.push_back(a);
      ++kept;
    }
    add_traffic(graph_, best);
    // Why this ep and cp (evaluations of the same layout with the neighbouring values): not for
    // the nested searches that make them (alternatives 0) nor over-memory scoring.
    if (options_.alternatives > 0 && !allow_over_memory_ && !ranked[chosen]->over_memory) {
      best.choices = explain_choices(best);
    }
    return best;
  }

  // The plan's layout as pins, everything fixed.
  static Pins pins_of(const Plan& p) {
    Pins q;
    q.tp = p.mesh.tp;
    q.pp = p.mesh.pp;
    q.dp = p.mesh.dp;
    q.cp = p.mesh.cp;
    q.ep = p.mesh.ep;
    q.zero_stage = p.zero_stage;
    q.micro_batch_size = p.micro_batch_size;
    q.schedule = p.schedule;
    q.virtual_stages = p.virtual_stages;
    q.recompute = p.recompute;
    q.sequence_parallel = p.sequence_parallel;
    return q;
  }

  // The best layout under `pins`; when none fits, the one needing the least memory; nullopt
  // when there is none.
  std::optional<Plan> best_with(const Pins& pins) const {
    SearchOptions o;
    o.pins = pins;
    o.alternatives = 0;
    o.estimator = &estimator_;
    o.tie_tolerance = options_.tie_tolerance;
    try {
      Searcher inner(graph_, cluster_, training_, o, true);
      Plan p = inner.run();
      // Nothing fits: the layout needing the least memory says how far off it is.
      if (p.prediction.memory_bytes_per_device > cluster_.usable_memory_bytes() && inner.smallest_need_ < kInf) {
        return inner.smallest_need_plan_;
      }
      return p;
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }

  // One line on how `other` (ep or cp = value) compares with the pick.
  std::string compare_line(const char* axis, int64_t value, const std::optional<Plan>& other, const Plan& best,
                           const char* what_grows) const {
    const double usable = cluster_.usable_memory_bytes();
    std::string line = std::string(axis) + "=" + std::to_string(value) + " ";
    if (!other) return line + "has no layout that works here";
    const Prediction& q = other->prediction;
    if (q.memory_bytes_per_device > usable) {
      return line + "needs " + format_bytes(q.memory_bytes_per_device) + " per device (" + format_bytes(usable) +
             " usable; params+grads+optimizer " + format_bytes(q.memory.params + q.memory.grads + q.memory.optimizer) +
             ", activations " + format_bytes(q.memory.activations) + ")";
    }
    const double ratio = q.step_time_s / best.prediction.step_time_s;
    std::ostringstream out;
    out.precision(3);
    out << std::fixed << line << "is predicted " << ratio << "x the step time (" << other->summary() << "; "
        << what_grows << ")";
    return out.str();
  }

  std::vector<std::string> explain_choices(const Plan& best) const {
    std::vector<std::string> lines;
    const int64_t replicas = best.mesh.token_parallel();
    if (moe_experts_gcd(graph_) > 0 && !pins_.ep) {
      std::vector<int64_t> eps;
      for (int64_t ep : divisors(replicas)) {
        if (moe_experts_gcd(graph_) % ep == 0) eps.push_back(ep);
      }
      const auto at = std::find(eps.begin(), eps.end(), best.mesh.ep);
      std::string options = " (of";
      for (int64_t ep : eps) options += " " + std::to_string(ep);
      options += " dividing dp*cp=" + std::to_string(replicas) + " and the experts)";
      auto ep_comm = [](const Plan& p) { return "ep comm " + format_seconds(p.prediction.time.ep_comm); };
      std::vector<std::string> details;
      bool smaller_over_memory = false;
      if (at != eps.end() && at != eps.begin()) {
        Pins q = pins_of(best);
        q.ep = *(at - 1);
        const auto other = best_with(q);
        smaller_over_memory = other && other->prediction.memory_bytes_per_device > cluster_.usable_memory_bytes();
        details.push_back("  smaller: " + compare_line("ep", *q.ep, other, best,
                                                     other ? (ep_comm(*other) + " vs " + ep_comm(best)).c_str() : ""));
      }
      if (at != eps.end() && at + 1 != eps.end()) {
        Pins q = pins_of(best);
        q.ep = *(at + 1);
        const auto other = best_with(q);
        details.push_back("  larger: " + compare_line("ep", *q.ep, other, best,
                                                    other ? (ep_comm(*other) + " vs " + ep_comm(best)).c_str() : ""));
      }
      const std::string why = smaller_over_memory
          ? ": expert memory needs ep>=" + std::to_string(best.mesh.ep) +
                " (expert weights, gradients and optimizer state are 1/ep per rank, ZeRO over dp*cp/ep)"
          : ": the fastest ep that fits (expert state is 1/ep per rank; the all-to-all crosses nodes "
            "once ep*tp exceeds a node)";
      lines.push_back("ep=" + std::to_string(best.mesh.ep) + options + why);
      lines.insert(lines.end(), details.begin(), details.end());
    }
    if (best.mesh.cp > 1 && !pins_.cp) {
      const size_t headline = lines.size();
      bool smaller_over_memory = false;
      // The next smaller cp on the same pp and tp (dp takes what cp gives up), best layout.
      int64_t smaller = 0;
      for (int64_t cp : divisors(best.mesh.cp)) {
        if (cp < best.mesh.cp && cp_possible(graph_, cp, kMinContextParallelTokens)) smaller = cp;
      }
      if (smaller > 0) {
        Pins q = pins_;  // what the user fixed still holds
        q.tp = best.mesh.tp;
        q.pp = best.mesh.pp;
        q.cp = smaller;
        q.ep = best.mesh.ep;
        const int64_t dp = replicas / smaller;
        if (training_.global_batch % dp != 0) {
          lines.push_back("  smaller: cp=" + std::to_string(smaller) + " would need dp=" + std::to_string(dp) +
                          ", which does not divide the global batch " + std::to_string(training_.global_batch));
        } else {
          q.dp = dp;
          const auto other = best_with(q);
          smaller_over_memory = other && other->prediction.memory_bytes_per_device > cluster_.usable_memory_bytes();
          lines.push_back("  smaller: " + compare_line("cp", smaller, other, best, "activations per rank grow with s/cp"));
        }
      }
      const std::string tokens = std::to_string(graph_.seq_len() / best.mesh.cp) + " of the " +
                                 std::to_string(graph_.seq_len()) + " tokens of each sequence per rank";
      lines.insert(lines.begin() + static_cast<std::ptrdiff_t>(headline),
                   "cp=" + std::to_string(best.mesh.cp) +
                       (smaller_over_memory ? ": activations at seq " + std::to_string(graph_.seq_len()) +
                                                  " need cp>=" + std::to_string(best.mesh.cp) + " (" + tokens +
                                                  "; activations and attention FLOPs are 1/cp)"
                                            : ": the fastest cp that fits (" + tokens + ")") +
                       "; the ring k/v exchange shows " + format_seconds(best.prediction.time.cp_comm) +
                       " beyond the attention it overlaps");
    }
    return lines;
  }

  std::string explain_failure() const {
    std::ostringstream out;
    if (smallest_need_ < kInf) {
      const Plan& p = smallest_need_plan_;
      const MemoryBreakdown& m = p.prediction.memory;
      out << "no layout fits in " << format_bytes(cluster_.usable_memory_bytes())
          << " usable memory per device (" << cluster_.name << ": "
          << format_bytes(cluster_.device_memory_bytes) << " minus "
          << format_bytes(cluster_.memory_reserved_bytes) << " reserved); the smallest need found is "
          << format_bytes(m.total()) << " with " << p.summary() << " (params "
          << format_bytes(m.params) << ", grads " << format_bytes(m.grads) << ", optimizer "
          << format_bytes(m.optimizer) << ", activations " << format_bytes(m.activations)
          << ", buffers " << format_bytes(m.buffers) << ")";
    } else {
      out << "no layout satisfies the constraints";
      if (!pins_.tp && !pins_.pp && !pins_.dp) out << " for " << cluster_.world_size() << " devices";
    }
    for (const auto& r : rejections_) out << "; " << r;
    return out.str();
  }

  const ModelGraph& graph_;
  const Estimator& estimator_;
  const Cluster cluster_;  // the estimator's (a profile's measured links replace the given ones)
  const TrainingConfig& training_;
  const Pins pins_;
  const SearchOptions options_;
  const bool allow_over_memory_;
  SimulationCache sims_;
  // consider() -> rescue_deferred(): a layout, and the split already scored for it (if any)
  struct Deferred {
    Layout layout;
    std::optional<std::vector<int64_t>> tried;
  };
  std::vector<Deferred> deferred_;
  std::vector<bool> cut_before_;  // graph_.can_cut_before(i), O(layers + edges) each: asked per layout
  std::map<SimulationCache::ScheduleKey, std::vector<double>> in_flight_cache_;  // stage_in_flight()
  std::map<std::tuple<int64_t, bool, int, int64_t, int64_t, int64_t>, std::vector<LayerCost>> cost_cache_;
  std::map<MeshKey, Candidate> best_per_mesh_;
  // Per mesh, the layouts that fit within same_time_ of its fastest (finish() takes the simplest).
  std::map<MeshKey, std::vector<Candidate>> near_per_mesh_;
  double same_time_ = kSameTime;  // min(max(kSameTime, the estimator's resolution), tie_tolerance)
  std::vector<std::string> rejections_;
  double smallest_need_ = kInf;
  Plan smallest_need_plan_;
  std::vector<MeshKey> meshes_;
  bool scoring_over_memory_ = false;
  bool noted_too_large_ = false;
  SearchStats stats_;
};

}  // namespace

Plan search(const ModelGraph& graph, const Cluster& cluster, const TrainingConfig& training,
            const SearchOptions& options) {
  return Searcher(graph, cluster, training, options, false).run();
}

Plan evaluate_layout(const ModelGraph& graph, const Cluster& cluster,
                     const TrainingConfig& training, const Pins& pins, bool allow_over_memory,
                     const Estimator* estimator) {
  if (!pins.all_layout_pinned()) {
    throw ValidationError("pins", "evaluate_layout needs tp, pp, dp, zero stage, micro-batch size "
                                  "and schedule all pinned");
  }
  SearchOptions options;
  options.pins = pins;
  options.alternatives = 0;
  options.estimator = estimator;
  return Searcher(graph, cluster, training, options, allow_over_memory).run();
}

}  // namespace monarch::planner
