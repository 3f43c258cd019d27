// Timeline simulation of a pipeline schedule.
//
// Each rank runs its program in order. Sends are non-blocking; a receive blocks its rank
// until the message has arrived. Ranks advance from a work list: a rank runs until it
// blocks on a receive, and is re-queued only when a message is posted to it, so the cost
// is O(number of actions + ranks). Messages live in flat arrays indexed by
// (micro-batch, receiving stage); see schedule.cpp for the stage convention.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "monarch/planner/errors.h"
#include "monarch/planner/schedule.h"
#include "schedule_text.h"

namespace monarch::planner {
namespace {

constexpr double kNotSent = -1;   // arrival time of a message nobody posted yet
constexpr double kConsumed = -2;  // a receive already took it

using detail::action_field;
using detail::describe;

bool is_send(ActionType t) {
  return t == ActionType::send_activation || t == ActionType::send_gradient;
}

// Per-stage durations resolved once, so the hot loop only indexes arrays.
struct StageTimes {
  std::vector<double> forward, backward, backward_input, backward_weight;
  std::vector<double> p2p_out;  // transfer across the boundary stage s -> s + 1 (both ways)
};

StageTimes resolve_costs(const std::vector<StageCosts>& costs, int64_t stages) {
  if (costs.size() != 1 && static_cast<int64_t>(costs.size()) != stages)
    throw ValidationError("costs", "has " + std::to_string(costs.size()) +
                                       " entries; expected 1 or one per virtual stage (" +
                                       std::to_string(stages) + ")");
  StageTimes t;
  for (int64_t s = 0; s < stages; ++s) {
    const StageCosts& c = costs.size() == 1 ? costs[0] : costs[s];
    t.forward.push_back(c.forward_s);
    t.backward.push_back(c.backward_input_s + c.backward_weight_s);
    t.backward_input.push_back(c.backward_input_s);
    t.backward_weight.push_back(c.backward_weight_s);
    t.p2p_out.push_back(c.p2p_s);
  }
  return t;
}

// Indices must be in range before the hot loop trusts them.
void check_indices(const Schedule& s) {
  if (s.ranks < 1 || s.micro_batches < 1 || s.virtual_stages < 1)
    throw ValidationError("schedule", "ranks, micro_batches and virtual_stages must be >= 1");
  // The simulator allocates message slots per (micro-batch, stage): refuse a hand-built
  // schedule whose sizes make_schedule would refuse.
  const std::string too_large = schedule_size_problem(s.ranks, s.micro_batches, s.virtual_stages);
  if (!too_large.empty()) throw ValidationError("schedule", too_large);
  if (static_cast<int64_t>(s.per_rank.size()) != s.ranks)
    throw ValidationError("schedule.per_rank", "has " + std::to_string(s.per_rank.size()) +
                                                   " programs for pp=" + std::to_string(s.ranks));
  const int64_t last = s.num_stages() - 1;
  for (int64_t r = 0; r < s.ranks; ++r) {
    for (size_t i = 0; i < s.per_rank[r].size(); ++i) {
      const Action& a = s.per_rank[r][i];
      const int t = static_cast<int>(a.type);
      const bool needs_next =
          a.type == ActionType::send_activation || a.type == ActionType::recv_gradient;
      const bool needs_prev =
          a.type == ActionType::recv_activation || a.type == ActionType::send_gradient;
      if (t < 0 || t > static_cast<int>(ActionType::recv_gradient))
        throw ValidationError(action_field(r, i), "unknown action type " + std::to_string(t));
      if (a.micro_batch < 0 || a.micro_batch >= s.micro_batches || a.stage < 0 || a.stage > last ||
          (needs_next && a.stage == last) || (needs_prev && a.stage == 0))
        throw ValidationError(action_field(r, i),
                              describe(a) + ": micro-batch or stage out of range");
    }
  }
}

// Arrival times of all messages, reset per call but kept per thread: the search simulates
// many schedules, and a fresh megabyte-sized buffer each time costs a page fault per page.
double* message_slots(int64_t count) {
  thread_local std::vector<double> slots;
  slots.assign(count, kNotSent);
  return slots.data();
}

struct RankState {
  size_t pc = 0;  // next action
  double clock = 0;
  double busy = 0;
  int64_t in_flight = 0;
  int64_t peak = 0;
  bool waiting = false;  // blocked on a receive and not in the work list
};

class Simulator {
 public:
  Simulator(const Schedule& s, const std::vector<StageCosts>& costs, bool record)
      : s_(s),
        record_(record),
        stages_(s.num_stages()),
        times_(resolve_costs(costs, stages_)),
        activation_(message_slots(2 * s.micro_batches * stages_)),
        gradient_(activation_ + s.micro_batches * stages_),
        ranks_(s.ranks),
        timeline_(record ? s.ranks : 0) {}

  SimulationResult run() {
    for (int64_t r = s_.ranks - 1; r >= 0; --r) work_.push_back(r);
    while (!work_.empty()) {
      const int64_t r = work_.back();
      work_.pop_back();
      ranks_[r].waiting = !advance(r);
    }
    report_deadlock();
    report_unreceived();
    return result();
  }

 private:
  // Runs rank r until it finishes (true) or blocks on a receive (false).
  bool advance(int64_t r) {
    RankState& st = ranks_[r];
    const std::vector<Action>& prog = s_.per_rank[r];
    for (; st.pc < prog.size(); ++st.pc) {
      const Action& a = prog[st.pc];
      const int64_t key = a.micro_batch * stages_ + a.stage;
      switch (a.type) {
        case ActionType::forward:
          compute(r, a, times_.forward[a.stage]);
          st.peak = std::max(st.peak, ++st.in_flight);
          break;
        case ActionType::backward:
          compute(r, a, times_.backward[a.stage]);
          --st.in_flight;
          break;
        case ActionType::backward_input:
          compute(r, a, times_.backward_input[a.stage]);
          break;
        case ActionType::backward_weight:  // activations are freed once W is done
          compute(r, a, times_.backward_weight[a.stage]);
          --st.in_flight;
          break;
        case ActionType::send_activation: {
          const double transfer = a.peer == r ? 0 : times_.p2p_out[a.stage];  // ZB-V's turn stays on the rank
          note(r, a, st.clock, st.clock + transfer);
          post(r, activation_[key + 1], st.clock + transfer, a.stage + 1);
          break;
        }
        case ActionType::send_gradient: {
          const double transfer = a.peer == r ? 0 : times_.p2p_out[a.stage - 1];
          note(r, a, st.clock, st.clock + transfer);
          post(r, gradient_[key - 1], st.clock + transfer, a.stage - 1);
          break;
        }
        case ActionType::recv_activation:
          if (!receive(r, a, activation_[key])) return false;
          break;
        case ActionType::recv_gradient:
          if (!receive(r, a, gradient_[key])) return false;
          break;
      }
    }
    return true;
  }

  void compute(int64_t r, const Action& a, double duration) {
    RankState& st = ranks_[r];
    note(r, a, st.clock, st.clock + duration);
    st.clock += duration;
    st.busy += duration;
  }

  void note(int64_t r, const Action& a, double start, double end) {
    if (record_) timeline_[r].push_back({a.type, a.micro_batch, a.stage, start, end});
  }

  // Non-blocking send: the message arrives at `arrival`; wakes the receiver if it waits.
  void post(int64_t r, double& slot, double arrival, int64_t to_stage) {
    if (slot != kNotSent)
      throw ValidationError(action_field(r, ranks_[r].pc),
                            describe(s_.per_rank[r][ranks_[r].pc]) + " sends a message twice");
    slot = arrival;
    ++posted_;
    const int64_t to = s_.rank_of_stage(to_stage);
    if (ranks_[to].waiting) {
      ranks_[to].waiting = false;
      work_.push_back(to);
    }
  }

  bool receive(int64_t r, const Action& a, double& slot) {
    RankState& st = ranks_[r];
    if (slot < 0) return false;  // not sent yet (or already consumed: waits forever)
    if (slot > st.clock) note(r, a, st.clock, slot);  // the wait, when there is one
    st.clock = std::max(st.clock, slot);
    slot = kConsumed;
    ++received_;
    return true;
  }

  void report_deadlock() const {
    for (int64_t r = 0; r < s_.ranks; ++r) {
      const RankState& st = ranks_[r];
      if (st.pc == s_.per_rank[r].size()) continue;
      const Action& a = s_.per_rank[r][st.pc];
      const int64_t from_stage = a.type == ActionType::recv_activation ? a.stage - 1 : a.stage + 1;
      throw ValidationError(action_field(r, st.pc),
                            "deadlock: rank " + std::to_string(r) + " waits for " + describe(a) +
                                " from rank " + std::to_string(s_.rank_of_stage(from_stage)));
    }
  }

  // A send nobody receives would leave the peer's buffer dangling at runtime.
  void report_unreceived() const {
    if (posted_ == received_) return;
    for (int64_t r = 0; r < s_.ranks; ++r) {
      for (size_t i = 0; i < s_.per_rank[r].size(); ++i) {
        const Action& a = s_.per_rank[r][i];
        if (!is_send(a.type)) continue;
        const bool act = a.type == ActionType::send_activation;
        const int64_t key = a.micro_batch * stages_ + a.stage + (act ? 1 : -1);
        if ((act ? activation_ : gradient_)[key] >= 0)
          throw ValidationError(action_field(r, i),
                                describe(a) + " is never received by rank " +
                                    std::to_string(s_.rank_of_stage(a.stage + (act ? 1 : -1))));
      }
    }
  }

  SimulationResult result() const {
    SimulationResult out;
    for (const RankState& st : ranks_) out.makespan_s = std::max(out.makespan_s, st.clock);
    double idle_share = 0;
    for (const RankState& st : ranks_) {
      out.busy_s.push_back(st.busy);
      out.idle_s.push_back(out.makespan_s - st.busy);
      out.peak_in_flight.push_back(st.peak);
      if (out.makespan_s > 0) idle_share += out.idle_s.back() / out.makespan_s;
    }
    out.bubble_fraction = idle_share / static_cast<double>(s_.ranks);
    out.timeline = timeline_;
    return out;
  }

  const Schedule& s_;
  bool record_;
  int64_t stages_;
  StageTimes times_;
  double* activation_;  // [mb * stages + receiving stage] arrival time
  double* gradient_;    // same, for gradients flowing backwards
  std::vector<RankState> ranks_;
  std::vector<int64_t> work_;  // ranks ready to advance
  int64_t posted_ = 0;
  int64_t received_ = 0;
  std::vector<std::vector<TimelineEvent>> timeline_;
};

}  // namespace

SimulationResult simulate(const Schedule& schedule, const std::vector<StageCosts>& costs,
                          bool record_timeline) {
  check_indices(schedule);
  return Simulator(schedule, costs, record_timeline).run();
}

double shared_core_makespan(const SimulationResult& sim, int64_t ranks, double over) {
  if (sim.timeline.empty() && sim.makespan_s > 0) {
    throw ValidationError("shared_core_makespan", "needs a simulation with its timeline (simulate(..., true))");
  }
  if (ranks < 1 || !(over >= 1)) throw ValidationError("shared_core_makespan", "needs ranks >= 1 and over >= 1");
  // Edges of the compute intervals (the timeline also holds sends and the waits of receives);
  // at one instant, ends before starts.
  std::vector<std::pair<double, int>> edges;
  for (const auto& rank : sim.timeline) {
    for (const TimelineEvent& e : rank) {
      const bool computes = e.type == ActionType::forward || e.type == ActionType::backward ||
                            e.type == ActionType::backward_input || e.type == ActionType::backward_weight;
      if (!computes) continue;  // waits for a message, and sends
      edges.emplace_back(e.start_s, +1);
      edges.emplace_back(e.end_s, -1);
    }
  }
  std::sort(edges.begin(), edges.end());
  double t = 0, warped = 0;
  int64_t busy = 0;
  for (const auto& [at, delta] : edges) {
    const double dt = at - t;
    if (dt > 0) {
      warped += busy == 0 ? dt : dt / std::min(over, static_cast<double>(ranks) / static_cast<double>(busy));
    }
    t = at;
    busy += delta;
  }
  return warped + std::max(0.0, sim.makespan_s - t);
}

}  // namespace monarch::planner
