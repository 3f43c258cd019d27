#pragma once
// Pipeline schedules as data: per-rank ordered action lists that the runtime executes and
// the cost model simulates. See docs/architecture.md ("Schedules are data").
#include <cstdint>
#include <string>
#include <vector>

#include "monarch/planner/training_config.h"

namespace monarch::planner {

enum class ActionType {
  forward,          // F: forward of micro-batch on a stage
  backward,         // B: full backward (input and weight gradients) of micro-batch
  backward_input,   // Bi: gradient w.r.t. the stage input only (zero-bubble split)
  backward_weight,  // W: gradient w.r.t. the weights (zero-bubble split)
  send_activation,  // to the next stage, after F
  recv_activation,  // from the previous stage, before F
  send_gradient,    // to the previous stage, after B / Bi
  recv_gradient,    // from the next stage, before B / Bi
};
std::string to_string(ActionType type);
const char* action_name(ActionType type);  // the same name, a string literal
ActionType action_type_from_string(const std::string& name, const std::string& field = "type");

struct Action {
  ActionType type;
  int32_t micro_batch;  // 32-bit: schedules hold ~10^5 actions, kept compact
  int32_t stage;  // virtual stage index in [0, ranks * virtual_stages)
  int32_t peer;   // peer rank for send/recv, -1 otherwise
  bool operator==(const Action& o) const {
    return type == o.type && micro_batch == o.micro_batch && stage == o.stage && peer == o.peer;
  }
};

struct Schedule {
  ScheduleKind kind = ScheduleKind::one_f_one_b;
  int64_t ranks = 1;           // pipeline ranks (pp)
  int64_t virtual_stages = 1;  // stages per rank (v); stage s lives on rank_of_stage(s)
  int64_t micro_batches = 1;
  std::vector<std::vector<Action>> per_rank;  // per_rank[r] is rank r's program
  int64_t num_stages() const { return ranks * virtual_stages; }
  int64_t rank_of_stage(int64_t stage) const { return pipeline_rank_of_stage(kind, ranks, stage); }
};

// Most (micro-batch, stage) pairs, pp * m * v, a schedule may have. Each pair costs up to
// seven 16-byte actions plus the simulator's two message slots (~130 bytes), so a schedule
// stays under ~550 MB; real plans stay far below (p = 128, m = 4096, v = 8 is the limit).
// It also keeps every index an Action stores well inside int32.
inline constexpr int64_t kMaxSchedulePairs = int64_t{1} << 22;

// "" when make_schedule would build a schedule of this size (arguments >= 1), otherwise
// why not: "pp=2 x 33554432 micro-batches x 1 virtual stages is too large a schedule ...".
std::string schedule_size_problem(int64_t ranks, int64_t micro_batches, int64_t virtual_stages);

// Builds the action lists. Throws ValidationError naming the field when the combination
// is impossible (e.g. interleaved with micro_batches % ranks != 0) or too large
// (num_micro_batches: schedule_size_problem).
Schedule make_schedule(ScheduleKind kind, int64_t ranks, int64_t micro_batches,
                       int64_t virtual_stages = 1);

// Checks a schedule without running it: every (micro-batch, stage) has exactly one
// forward and one backward (or Bi + W) on the stage's rank, every recv has a matching
// send, sends precede compute dependencies, and a simulation with blocking receives
// finishes (no deadlock). Throws ValidationError naming the first broken action.
void check_schedule(const Schedule& schedule);

// Per virtual stage: the most of its micro-batches whose activations are alive at once along
// its rank's action list (a forward keeps them; the backward, or under the zero-bubble split
// the weight gradient, frees them). Under interleaving a rank's chunks differ: its first chunks
// run ahead in the warm-up, the last stage (the LM head's) holds one at a time.
std::vector<int64_t> stage_peak_in_flight(const Schedule& schedule);
// The same for make_schedule(interleaved_1f1b, ranks, micro_batches, virtual_stages), counted
// from the schedule's order without building it (the search asks for it per layout).
std::vector<int64_t> interleaved_stage_peak_in_flight(int64_t ranks, int64_t micro_batches,
                                                      int64_t virtual_stages);

// Durations of one micro-batch's work on one virtual stage.
struct StageCosts {
  double forward_s = 1;
  double backward_input_s = 1;   // backward = backward_input + backward_weight
  double backward_weight_s = 1;
  double p2p_s = 0;              // activation / gradient transfer between adjacent stages
  bool operator==(const StageCosts& o) const {
    return forward_s == o.forward_s && backward_input_s == o.backward_input_s &&
           backward_weight_s == o.backward_weight_s && p2p_s == o.p2p_s;
  }
};

// One interval of a simulated rank's timeline: a compute action (F, B, Bi, W) from its start
// to its end, a receive from when the rank started waiting to the message's arrival (only
// when it waited), a send from its post to its arrival at the peer.
struct TimelineEvent {
  ActionType type;
  int32_t micro_batch;
  int32_t stage;
  double start_s;
  double end_s;
};

struct SimulationResult {
  double makespan_s = 0;             // time until the last rank finishes
  std::vector<double> busy_s;        // per rank compute time
  std::vector<double> idle_s;        // per rank waiting time within the makespan
  double bubble_fraction = 0;        // mean over ranks of idle / makespan
  std::vector<int64_t> peak_in_flight;  // per rank: max micro-batches whose activations are alive
  std::vector<std::vector<TimelineEvent>> timeline;  // per rank, when asked for (else empty)
};

// Runs the action lists on a timeline: each rank executes its list in order; a compute
// action starts when the rank is free and its inputs have arrived. `costs` has one entry
// per virtual stage (or one entry used for all). Throws if the schedule deadlocks.
// `record_timeline` keeps every interval (TimelineEvent) for drawing.
SimulationResult simulate(const Schedule& schedule, const std::vector<StageCosts>& costs,
                          bool record_timeline = false);

// The makespan of a simulated step on devices that share compute (CPU ranks on fewer cores):
// `sim`'s costs are at the rate a device gets with all `ranks` busy; while k of them compute,
// each runs min(over, ranks / k) times faster (the node's capacity shared equally, a device
// alone at most `over` times its all-busy rate). Every busy device speeds up alike, so the
// timeline keeps its order and each interval shrinks by that factor (exact for equal sharing;
// idle intervals, transfers only, keep their length). Needs `sim` with its timeline.
double shared_core_makespan(const SimulationResult& sim, int64_t ranks, double over);

// Closed forms, used by tests and docs: 1F1B / GPipe bubble (p-1)/(m+p-1) with
// F and B uniform, interleaved divides the bubble time by v (Narayanan et al. 2021).
double closed_form_bubble_fraction(ScheduleKind kind, int64_t ranks, int64_t micro_batches,
                                   int64_t virtual_stages = 1);

}  // namespace monarch::planner
