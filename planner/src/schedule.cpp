// Pipeline schedule generation and static checking.
//
// Convention for communication actions: `stage` is always the stage on the rank that
// executes the action. send_activation(mb, s) carries stage s's output to stage s + 1,
// matched by recv_activation(mb, s + 1); send_gradient(mb, s) carries the gradient of
// stage s's input to stage s - 1, matched by recv_gradient(mb, s - 1).
#include "monarch/planner/schedule.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "monarch/planner/errors.h"
#include "schedule_text.h"

namespace monarch::planner {
namespace {

using detail::action_field;
using detail::describe;

constexpr const char* kActionNames[] = {"forward",         "backward",        "backward_input",
                                        "backward_weight", "send_activation", "recv_activation",
                                        "send_gradient",   "recv_gradient"};
constexpr int kNumActionTypes = sizeof(kActionNames) / sizeof(kActionNames[0]);

// ---------------------------------------------------------------------------------------
// Argument validation

void validate_args(ScheduleKind kind, int64_t ranks, int64_t micro_batches,
                   int64_t virtual_stages) {
  if (ranks < 1) throw ValidationError("pp", "must be >= 1, got " + std::to_string(ranks));
  if (micro_batches < 1)
    throw ValidationError("num_micro_batches",
                          "must be >= 1, got " + std::to_string(micro_batches));
  if (virtual_stages < 1)
    throw ValidationError("virtual_stages", "must be >= 1, got " + std::to_string(virtual_stages));
  const bool interleaved = kind == ScheduleKind::interleaved_1f1b;
  if (interleaved && virtual_stages < 2)
    throw ValidationError("virtual_stages", "interleaved_1f1b needs virtual_stages >= 2, got " +
                                                std::to_string(virtual_stages));
  if (kind == ScheduleKind::zero_bubble_v && virtual_stages != 2)
    throw ValidationError("virtual_stages", "zbv runs two stages per rank (a V), so virtual_stages must be 2, got " +
                                                std::to_string(virtual_stages));
  if (!interleaved && kind != ScheduleKind::zero_bubble_v && virtual_stages > 1)
    throw ValidationError("virtual_stages", "virtual_stages=" + std::to_string(virtual_stages) +
                                                " requires the interleaved_1f1b or zbv schedule");
  // With one rank, consecutive virtual stages would share a rank: nothing to interleave.
  if (ranks == 1 && virtual_stages > 1)
    throw ValidationError("virtual_stages", "virtual_stages=" + std::to_string(virtual_stages) +
                                                " needs pp >= 2 (pp=1 has no pipeline)");
  if (interleaved && micro_batches % ranks != 0)
    throw ValidationError("num_micro_batches",
                          "interleaved_1f1b: num_micro_batches=" + std::to_string(micro_batches) +
                              " must be a multiple of pp=" + std::to_string(ranks));
  if (kind == ScheduleKind::none && ranks > 1)
    throw ValidationError("schedule",
                          "'none' is only valid with pp=1, got pp=" + std::to_string(ranks));
  const std::string too_large = schedule_size_problem(ranks, micro_batches, virtual_stages);
  if (!too_large.empty()) throw ValidationError("num_micro_batches", too_large);
}

// ---------------------------------------------------------------------------------------
// Generation

// Appends a compute action to its stage's rank, wrapped in the communication it needs:
// the input arrives right before the compute, the output leaves right after it.
// Actions store 32-bit indices (make_schedule bounds the sizes).
Action action(ActionType type, int64_t mb, int64_t stage, int64_t peer) {
  return {type, static_cast<int32_t>(mb), static_cast<int32_t>(stage), static_cast<int32_t>(peer)};
}

void emit(Schedule& s, ActionType type, int64_t mb, int64_t stage) {
  const int64_t last = s.num_stages() - 1;
  std::vector<Action>& prog = s.per_rank[s.rank_of_stage(stage)];
  switch (type) {
    case ActionType::forward:
      if (stage > 0)
        prog.push_back(action(ActionType::recv_activation, mb, stage, s.rank_of_stage(stage - 1)));
      prog.push_back(action(type, mb, stage, -1));
      if (stage < last)
        prog.push_back(action(ActionType::send_activation, mb, stage, s.rank_of_stage(stage + 1)));
      return;
    case ActionType::backward:
    case ActionType::backward_input:
      if (stage < last)
        prog.push_back(action(ActionType::recv_gradient, mb, stage, s.rank_of_stage(stage + 1)));
      prog.push_back(action(type, mb, stage, -1));
      if (stage > 0)
        prog.push_back(action(ActionType::send_gradient, mb, stage, s.rank_of_stage(stage - 1)));
      return;
    case ActionType::backward_weight:
      prog.push_back(action(type, mb, stage, -1));
      return;
    default:
      throw std::logic_error("emit: not a compute action");
  }
}

// Sizes each rank's program exactly, so building never reallocates.
void reserve_programs(Schedule& s, bool split_backward) {
  const int64_t last = s.num_stages() - 1;
  for (int64_t r = 0; r < s.ranks; ++r) {
    int64_t per_micro_batch = 0;
    for (int64_t stage = 0; stage <= last; ++stage) {
      if (s.rank_of_stage(stage) != r) continue;
      const int64_t comms = (stage > 0 ? 1 : 0) + (stage < last ? 1 : 0);
      per_micro_batch += 2 * (1 + comms) + (split_backward ? 1 : 0);  // F, B (Bi + W)
    }
    s.per_rank[r].reserve(per_micro_batch * s.micro_batches);
  }
}

// GPipe (Huang et al. 2019): all forwards, then all backwards.
void build_gpipe(Schedule& s) {
  for (int64_t r = 0; r < s.ranks; ++r) {
    for (int64_t mb = 0; mb < s.micro_batches; ++mb) emit(s, ActionType::forward, mb, r);
    for (int64_t mb = 0; mb < s.micro_batches; ++mb) emit(s, ActionType::backward, mb, r);
  }
}

// 1F1B / PipeDream-Flush (Narayanan et al. 2021): warmup forwards fill the pipeline, then
// alternate, so rank r never holds more than p - r micro-batches of activations.
// With one rank this is plain gradient accumulation (F, B per micro-batch).
void build_one_f_one_b(Schedule& s) {
  const int64_t p = s.ranks, m = s.micro_batches;
  for (int64_t r = 0; r < p; ++r) {
    const int64_t warmup = std::min(p - r - 1, m);
    for (int64_t i = 0; i < warmup; ++i) emit(s, ActionType::forward, i, r);
    for (int64_t i = 0; i < m - warmup; ++i) {
      emit(s, ActionType::forward, warmup + i, r);
      emit(s, ActionType::backward, i, r);
    }
    for (int64_t i = m - warmup; i < m; ++i) emit(s, ActionType::backward, i, r);
  }
}

// Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM
// forward_backward_pipelining_with_interleaving): rank r holds chunks c = 0..v-1, i.e.
// stages c * p + r. Forwards sweep chunks in groups of p micro-batches; backwards sweep
// them in reverse chunk order.
// The order of rank r's forwards and backwards (k = 0..m v - 1, k-th of each kind).
struct InterleavedOrder {
  int64_t p, m, v, r;
  int64_t micro_batch(int64_t k) const { return (k / (p * v)) * p + k % p; }
  int64_t forward_chunk(int64_t k) const { return (k / p) % v; }
  int64_t backward_chunk(int64_t k) const { return v - 1 - (k / p) % v; }
  int64_t total() const { return m * v; }  // virtual micro-batch steps per rank
  int64_t warmup() const { return std::min((p - r - 1) * 2 + (v - 1) * p, total()); }
};

void build_interleaved(Schedule& s) {
  const int64_t p = s.ranks;
  for (int64_t r = 0; r < p; ++r) {
    const InterleavedOrder o{p, s.micro_batches, s.virtual_stages, r};
    auto fwd = [&](int64_t k) { emit(s, ActionType::forward, o.micro_batch(k), o.forward_chunk(k) * p + r); };
    auto bwd = [&](int64_t k) { emit(s, ActionType::backward, o.micro_batch(k), o.backward_chunk(k) * p + r); };
    const int64_t warmup = o.warmup(), total = o.total();
    for (int64_t k = 0; k < warmup; ++k) fwd(k);
    for (int64_t i = 0; i < total - warmup; ++i) {
      fwd(warmup + i);
      bwd(i);
    }
    for (int64_t k = total - warmup; k < total; ++k) bwd(k);
  }
}

// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 2.1): 1F1B with the
// backward split into Bi (input gradient, on the critical path) and W (weight gradient,
// deferrable). Rank r runs W(k) right after Bi(k + r): the deferred W's fill what would
// be 1F1B's cooldown bubbles, leaving (p-1)(F + Bi - W) idle per rank. Every rank then
// holds at most p micro-batches between F and W, the first rank's 1F1B peak; those
// waiting only for W keep less than a full activation set (paper, Table 1), so peak
// memory stays at 1F1B's. (Capping rank r at its own 1F1B count p - r instead forces the
// last rank into strict F, Bi, W order, which costs 2(p-1) idle units per rank.)
void build_zero_bubble_h1(Schedule& s) {
  const int64_t p = s.ranks, m = s.micro_batches;
  for (int64_t r = 0; r < p; ++r) {
    const int64_t warmup = std::min(p - r - 1, m);
    int64_t next_w = 0;
    auto bi = [&](int64_t k) {
      emit(s, ActionType::backward_input, k, r);
      if (k - next_w >= r) emit(s, ActionType::backward_weight, next_w++, r);
    };
    for (int64_t i = 0; i < warmup; ++i) emit(s, ActionType::forward, i, r);
    for (int64_t i = 0; i < m - warmup; ++i) {
      emit(s, ActionType::forward, warmup + i, r);
      bi(i);
    }
    for (int64_t i = m - warmup; i < m; ++i) bi(i);
    while (next_w < m) emit(s, ActionType::backward_weight, next_w++, r);
  }
}

// ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", Sec. 4): every rank
// runs two stages placed as a V (pipeline_rank_of_stage: a micro-batch goes down the ranks
// through their first stages and back up through their second, so the loss is on rank 0),
// with the backward split into B and W as in ZB-H1. The order comes from list scheduling on
// a unit-time timeline (F = B = W = 1, transfers free: the paper's setting). Each time unit,
// each rank runs the first of:
//   1. a B whose output gradient has arrived (the critical path), oldest micro-batch first;
//   2. an F whose input has arrived, oldest micro-batch first (a micro-batch's second stage,
//      on its way to the loss, before a newer one's first), while the rank keeps fewer than
//      2p (micro-batch, stage) pairs between F and W: p micro-batches of a p-stage split's
//      activations, 1F1B's first rank's peak and ZB-V's bound in the paper;
//   3. a deferred W, oldest first;
// and waits otherwise. The runtime executes the resulting order whatever the real costs
// (check_schedule proves it deadlock-free).
void build_zero_bubble_v(Schedule& s) {
  const int64_t p = s.ranks, m = s.micro_batches, n = s.num_stages();
  const int64_t cap = 2 * p;
  constexpr int64_t kNever = INT64_MAX;
  // Time unit from which a (stage, micro-batch) has its input activation / its output gradient.
  std::vector<int64_t> input_at(static_cast<size_t>(n * m), kNever), gradient_at(input_at.size(), kNever);
  for (int64_t mb = 0; mb < m; ++mb) input_at[mb] = 0;
  struct RankState {
    int64_t next_forward[2] = {0, 0}, next_backward[2] = {0, 0};
    std::vector<std::pair<int64_t, int64_t>> weight_queue;  // (micro-batch, stage) awaiting W
    size_t weight_head = 0;
    int64_t in_flight = 0;
  };
  std::vector<RankState> ranks(static_cast<size_t>(p));
  auto stage_of = [&](int64_t r, int c) { return c == 0 ? r : n - 1 - r; };
  int64_t remaining = 3 * n * m;
  for (int64_t t = 0; remaining > 0; ++t) {
    bool acted = false;
    for (int64_t r = 0; r < p; ++r) {
      RankState& st = ranks[r];
      // 1. B
      int best = -1;
      for (int c = 0; c < 2; ++c) {
        const int64_t mb = st.next_backward[c], stage = stage_of(r, c);
        if (mb >= m || st.next_forward[c] <= mb || gradient_at[stage * m + mb] > t) continue;
        if (best < 0 || mb < st.next_backward[best]) best = c;
      }
      if (best >= 0) {
        const int64_t mb = st.next_backward[best]++, stage = stage_of(r, best);
        emit(s, ActionType::backward_input, mb, stage);
        if (stage > 0) gradient_at[(stage - 1) * m + mb] = t + 1;
        st.weight_queue.emplace_back(mb, stage);
        --remaining;
        acted = true;
        continue;
      }
      // 2. F
      for (int c = 0; c < 2 && st.in_flight < cap; ++c) {
        const int64_t mb = st.next_forward[c], stage = stage_of(r, c);
        if (mb >= m || input_at[stage * m + mb] > t) continue;
        if (best < 0 || mb < st.next_forward[best]) best = c;
      }
      if (best >= 0) {
        const int64_t mb = st.next_forward[best]++, stage = stage_of(r, best);
        emit(s, ActionType::forward, mb, stage);
        (stage + 1 < n ? input_at[(stage + 1) * m + mb] : gradient_at[stage * m + mb]) = t + 1;
        ++st.in_flight;
        --remaining;
        acted = true;
        continue;
      }
      // 3. W
      if (st.weight_head < st.weight_queue.size()) {
        const auto [mb, stage] = st.weight_queue[st.weight_head++];
        emit(s, ActionType::backward_weight, mb, stage);
        --st.in_flight;
        --remaining;
        acted = true;
      }
    }
    // Nothing ran and nothing is in transit: nothing ever will (a bug in the rules above).
    if (!acted) throw std::logic_error("zbv: the list scheduler stalled with " + std::to_string(remaining) + " actions left");
  }
}

// ---------------------------------------------------------------------------------------
// Static checking

// What has happened so far to one (micro-batch, stage), as bits.
enum Seen : uint8_t {
  kF = 1 << 0,
  kB = 1 << 1,
  kBi = 1 << 2,
  kW = 1 << 3,
  kSendAct = 1 << 4,
  kRecvAct = 1 << 5,
  kSendGrad = 1 << 6,
  kRecvGrad = 1 << 7,
};

uint8_t seen_bit(ActionType type) {
  switch (type) {
    case ActionType::forward:
      return kF;
    case ActionType::backward:
      return kB;
    case ActionType::backward_input:
      return kBi;
    case ActionType::backward_weight:
      return kW;
    case ActionType::send_activation:
      return kSendAct;
    case ActionType::recv_activation:
      return kRecvAct;
    case ActionType::send_gradient:
      return kSendGrad;
    case ActionType::recv_gradient:
      return kRecvGrad;
  }
  return 0;
}

// Peer a communication action must name, or -1 for compute and for sends/recvs that
// have no neighbour (first / last stage); `exists` tells which.
int64_t expected_peer(const Schedule& s, const Action& a, bool* exists) {
  const int64_t last = s.num_stages() - 1;
  *exists = true;
  switch (a.type) {
    case ActionType::send_activation:
    case ActionType::recv_gradient:
      *exists = a.stage < last;
      return *exists ? s.rank_of_stage(a.stage + 1) : -1;
    case ActionType::recv_activation:
    case ActionType::send_gradient:
      *exists = a.stage > 0;
      return *exists ? s.rank_of_stage(a.stage - 1) : -1;
    default:
      return -1;
  }
}

// Index range, ownership and peer of one action; returns "" when fine.
std::string field_problem(const Schedule& s, int64_t rank, const Action& a) {
  const int t = static_cast<int>(a.type);
  if (t < 0 || t >= kNumActionTypes) return "unknown action type " + std::to_string(t);
  if (a.micro_batch < 0 || a.micro_batch >= s.micro_batches)
    return describe(a) + ": micro_batch out of range [0, " + std::to_string(s.micro_batches) + ")";
  if (a.stage < 0 || a.stage >= s.num_stages())
    return describe(a) + ": stage out of range [0, " + std::to_string(s.num_stages()) + ")";
  if (s.rank_of_stage(a.stage) != rank)
    return describe(a) + ": stage " + std::to_string(a.stage) + " lives on rank " +
           std::to_string(s.rank_of_stage(a.stage)) + ", not rank " + std::to_string(rank);
  bool exists = true;
  const int64_t peer = expected_peer(s, a, &exists);
  if (!exists)
    return describe(a) + ": stage " + std::to_string(a.stage) + " has no " +
           (a.type == ActionType::send_activation || a.type == ActionType::recv_gradient
                ? "next"
                : "previous") +
           " stage to communicate with";
  if (a.peer != peer) return describe(a) + ": peer must be " + std::to_string(peer);
  return "";
}

// Why `a` may not run given what its rank already did for (mb, stage); nullptr if it may.
const char* order_problem(const Schedule& s, const Action& a, uint8_t seen) {
  if (seen & seen_bit(a.type)) return "appears more than once";
  const bool has_next = a.stage < s.num_stages() - 1;
  switch (a.type) {
    case ActionType::forward:
      return a.stage > 0 && !(seen & kRecvAct) ? "comes before its recv_activation" : nullptr;
    case ActionType::backward:
    case ActionType::backward_input:
      if (seen & (a.type == ActionType::backward ? (kBi | kW) : kB))
        return "mixes backward with backward_input/backward_weight";
      if (!(seen & kF)) return "comes before its forward";
      return has_next && !(seen & kRecvGrad) ? "comes before its recv_gradient" : nullptr;
    case ActionType::backward_weight:
      if (seen & kB) return "mixes backward with backward_input/backward_weight";
      return (seen & kBi) ? nullptr : "comes before its backward_input";
    case ActionType::send_activation:
      return (seen & kF) ? nullptr : "comes before its forward";
    case ActionType::send_gradient:
      return (seen & (kB | kBi)) ? nullptr : "comes before its backward";
    default:
      return nullptr;
  }
}

// Pass over each rank's program in order: fields and local dependency order.
void check_programs(const Schedule& s, std::vector<uint8_t>& seen) {
  const int64_t n = s.num_stages();
  for (int64_t r = 0; r < s.ranks; ++r) {
    const std::vector<Action>& prog = s.per_rank[r];
    for (size_t i = 0; i < prog.size(); ++i) {
      const Action& a = prog[i];
      const std::string problem = field_problem(s, r, a);
      if (!problem.empty()) throw ValidationError(action_field(r, i), problem);
      uint8_t& state = seen[a.micro_batch * n + a.stage];
      if (const char* why = order_problem(s, a, state))
        throw ValidationError(action_field(r, i), describe(a) + " " + why);
      state |= seen_bit(a.type);
    }
  }
}

// Every (micro-batch, stage) ran a forward and a complete backward.
void check_complete(const Schedule& s, const std::vector<uint8_t>& seen) {
  const int64_t n = s.num_stages();
  for (int64_t stage = 0; stage < n; ++stage) {
    for (int64_t mb = 0; mb < s.micro_batches; ++mb) {
      const uint8_t st = seen[mb * n + stage];
      const char* missing = !(st & kF)                 ? "has no forward"
                            : (st & kBi) && !(st & kW) ? "has backward_input but no backward_weight"
                            : !(st & (kB | kBi))       ? "has no backward"
                                                       : nullptr;
      if (missing)
        throw ValidationError("schedule.per_rank[" + std::to_string(s.rank_of_stage(stage)) + "]",
                              "micro-batch " + std::to_string(mb) + " on stage " +
                                  std::to_string(stage) + " " + missing);
    }
  }
}

// The other end of a message: a send's receive, a receive's send.
bool counterpart(const Action& a, ActionType* type, int64_t* stage) {
  switch (a.type) {
    case ActionType::send_activation:
      *type = ActionType::recv_activation;
      *stage = a.stage + 1;
      return true;
    case ActionType::recv_activation:
      *type = ActionType::send_activation;
      *stage = a.stage - 1;
      return true;
    case ActionType::send_gradient:
      *type = ActionType::recv_gradient;
      *stage = a.stage - 1;
      return true;
    case ActionType::recv_gradient:
      *type = ActionType::send_gradient;
      *stage = a.stage + 1;
      return true;
    default:
      return false;
  }
}

// Every send has its receive on the peer and vice versa.
void check_matching(const Schedule& s, const std::vector<uint8_t>& seen) {
  const int64_t n = s.num_stages();
  for (int64_t r = 0; r < s.ranks; ++r) {
    for (size_t i = 0; i < s.per_rank[r].size(); ++i) {
      const Action& a = s.per_rank[r][i];
      ActionType other = a.type;
      int64_t other_stage = 0;
      if (!counterpart(a, &other, &other_stage)) continue;
      if (!(seen[a.micro_batch * n + other_stage] & seen_bit(other)))
        throw ValidationError(action_field(r, i), describe(a) + " has no matching " +
                                                      to_string(other) + " on rank " +
                                                      std::to_string(a.peer));
    }
  }
}

}  // namespace

namespace detail {

std::string describe(const Action& a) {
  const int t = static_cast<int>(a.type);
  std::string out =
      (t >= 0 && t < kNumActionTypes) ? kActionNames[t] : "action type " + std::to_string(t);
  out += "(micro_batch=" + std::to_string(a.micro_batch) + ", stage=" + std::to_string(a.stage);
  if (a.peer != -1) out += ", peer=" + std::to_string(a.peer);
  return out + ")";
}

std::string action_field(int64_t rank, size_t index) {
  return "schedule.per_rank[" + std::to_string(rank) + "][" + std::to_string(index) + "]";
}

}  // namespace detail

std::vector<int64_t> interleaved_stage_peak_in_flight(int64_t ranks, int64_t micro_batches,
                                                      int64_t virtual_stages) {
  const int64_t p = ranks, v = virtual_stages;
  std::vector<int64_t> peak(p * v, 0), alive(v);
  for (int64_t r = 0; r < p; ++r) {
    const InterleavedOrder o{p, micro_batches, v, r};
    std::fill(alive.begin(), alive.end(), 0);
    auto forward = [&](int64_t k) {
      const int64_t c = o.forward_chunk(k);
      peak[c * p + r] = std::max(peak[c * p + r], ++alive[c]);
    };
    const int64_t warmup = o.warmup(), total = o.total();
    for (int64_t k = 0; k < warmup; ++k) forward(k);
    for (int64_t i = 0; i < total - warmup; ++i) {  // the cool-down's backwards only free
      forward(warmup + i);
      --alive[o.backward_chunk(i)];
    }
  }
  return peak;
}

std::vector<int64_t> stage_peak_in_flight(const Schedule& schedule) {
  std::vector<int64_t> alive(schedule.num_stages(), 0), peak(schedule.num_stages(), 0);
  for (const auto& program : schedule.per_rank) {
    for (const Action& a : program) {
      switch (a.type) {
        case ActionType::forward:
          peak[a.stage] = std::max(peak[a.stage], ++alive[a.stage]);
          break;
        case ActionType::backward:
        case ActionType::backward_weight:
          --alive[a.stage];
          break;
        default:
          break;
      }
    }
  }
  return peak;
}

std::string schedule_size_problem(int64_t ranks, int64_t micro_batches, int64_t virtual_stages) {
  // Divisions, not the product, which could overflow int64 (all three are >= 1 here).
  if (ranks <= kMaxSchedulePairs / virtual_stages &&
      micro_batches <= kMaxSchedulePairs / (ranks * virtual_stages)) {
    return "";
  }
  return "pp=" + std::to_string(ranks) + " x " + std::to_string(micro_batches) +
         " micro-batches x " + std::to_string(virtual_stages) +
         " virtual stages is too large a schedule (at most " + std::to_string(kMaxSchedulePairs) +
         " micro-batch x stage pairs)";
}

std::string to_string(ActionType type) { return action_name(type); }

const char* action_name(ActionType type) {
  const int t = static_cast<int>(type);
  if (t < 0 || t >= kNumActionTypes) throw std::invalid_argument("invalid ActionType");
  return kActionNames[t];
}

ActionType action_type_from_string(const std::string& name, const std::string& field) {
  std::string expected;
  for (int t = 0; t < kNumActionTypes; ++t) {
    if (name == kActionNames[t]) return static_cast<ActionType>(t);
    expected += (t ? ", " : "") + std::string(kActionNames[t]);
  }
  throw ValidationError(field,
                        "unknown action type '" + name + "' (expected one of " + expected + ")");
}

Schedule make_schedule(ScheduleKind kind, int64_t ranks, int64_t micro_batches,
                       int64_t virtual_stages) {
  validate_args(kind, ranks, micro_batches, virtual_stages);
  Schedule s;
  s.kind = kind;
  s.ranks = ranks;
  s.virtual_stages = virtual_stages;
  s.micro_batches = micro_batches;
  s.per_rank.resize(ranks);
  reserve_programs(s, splits_backward(kind));
  switch (kind) {
    case ScheduleKind::none:  // pp=1 only: F, B per micro-batch
    case ScheduleKind::one_f_one_b:
      build_one_f_one_b(s);
      break;
    case ScheduleKind::gpipe:
      build_gpipe(s);
      break;
    case ScheduleKind::interleaved_1f1b:
      build_interleaved(s);
      break;
    case ScheduleKind::zero_bubble_h1:
      build_zero_bubble_h1(s);
      break;
    case ScheduleKind::zero_bubble_v:
      build_zero_bubble_v(s);
      break;
  }
  return s;
}

void check_schedule(const Schedule& schedule) {
  validate_args(schedule.kind, schedule.ranks, schedule.micro_batches, schedule.virtual_stages);
  if (static_cast<int64_t>(schedule.per_rank.size()) != schedule.ranks)
    throw ValidationError("schedule.per_rank",
                          "has " + std::to_string(schedule.per_rank.size()) +
                              " programs for pp=" + std::to_string(schedule.ranks));
  std::vector<uint8_t> seen(schedule.micro_batches * schedule.num_stages(), 0);
  check_programs(schedule, seen);
  check_complete(schedule, seen);
  check_matching(schedule, seen);
  // Every message exists; what is left is the order: replay with blocking receives and
  // let the simulator name the first rank stuck in a wait cycle.
  simulate(schedule, {StageCosts{}});
}

double closed_form_bubble_fraction(ScheduleKind kind, int64_t ranks, int64_t micro_batches,
                                   int64_t virtual_stages) {
  if (ranks < 1) throw ValidationError("pp", "must be >= 1, got " + std::to_string(ranks));
  if (micro_batches < 1)
    throw ValidationError("num_micro_batches",
                          "must be >= 1, got " + std::to_string(micro_batches));
  if (virtual_stages < 1)
    throw ValidationError("virtual_stages", "must be >= 1, got " + std::to_string(virtual_stages));
  const double p = static_cast<double>(ranks), m = static_cast<double>(micro_batches);
  const double v = static_cast<double>(virtual_stages);
  if (ranks == 1) return 0;
  switch (kind) {
    case ScheduleKind::none:
      return 0;
    case ScheduleKind::gpipe:
    case ScheduleKind::one_f_one_b:
      // Huang et al. 2019 (GPipe); Narayanan et al. 2021, eq. (1): (p-1)/(m+p-1).
      return (p - 1) / (m + p - 1);
    case ScheduleKind::interleaved_1f1b: {
      // Narayanan et al. 2021, Sec. 2.2.2: bubble time shrinks by v.
      const double b = (p - 1) / v;
      return b / (m + b);
    }
    case ScheduleKind::zero_bubble_h1:
      // Qi et al. 2023, ZB-H1: bubble (p-1)(T_F + T_B - T_W) against m(T_F + T_B + T_W);
      // with T_F = T_B = T_W this is (p-1)/(3m+p-1) (reached when m >= p).
      return (p - 1) / (3 * m + p - 1);
    case ScheduleKind::zero_bubble_v:
      // Qi et al. 2024, Sec. 4, with T_F = T_B = T_W and each of the 2p stages half a
      // 1F1B stage: every rank does 6m units (two stages' F, B, W) and the last rank cannot
      // start before the first micro-batch reached it, p - 1 units in: (p-1)/(6m+p-1), half
      // ZB-H1's bubble time. The list-scheduled order (build_zero_bubble_v) reaches it once
      // m >= p for p <= 8; at p = 64 it is 18 units (0.6% of the step) above.
      return (p - 1) / (6 * m + p - 1);
  }
  return 0;
}

}  // namespace monarch::planner
