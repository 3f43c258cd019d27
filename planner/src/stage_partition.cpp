#include "monarch/planner/stage_partition.h"

#include <algorithm>
#include <limits>

namespace monarch::planner {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Prefix {
  std::vector<double> time, state, activations;
  explicit Prefix(const PartitionProblem& p) {
    const size_t n = p.layer_time_s.size();
    time.assign(n + 1, 0);
    state.assign(n + 1, 0);
    activations.assign(n + 1, 0);
    for (size_t i = 0; i < n; ++i) {
      time[i + 1] = time[i] + p.layer_time_s[i];
      state[i + 1] = state[i] + p.layer_state_bytes[i];
      activations[i + 1] = activations[i] + p.layer_activation_bytes[i];
    }
  }
};

}  // namespace

std::optional<Partition> partition_stages(const PartitionProblem& p) {
  const int64_t n = static_cast<int64_t>(p.layer_time_s.size());
  const int64_t S = p.stages;
  if (S < 1 || n < S) return std::nullopt;
  const Prefix pre(p);
  const bool all_cuts = std::all_of(p.cut_allowed.begin() + 1, p.cut_allowed.end(), [](bool b) { return b; });

  auto seg_time = [&](int64_t i, int64_t j) { return pre.time[j] - pre.time[i]; };  // layers [i, j)
  auto fits = [&](int64_t i, int64_t j, int64_t stage) {
    const double bytes = pre.state[j] - pre.state[i] +
                         (pre.activations[j] - pre.activations[i]) * p.stage_in_flight[stage] +
                         p.stage_fixed_bytes;
    return bytes <= p.stage_memory_limit_bytes;
  };

  // Quick refusal: fill each stage with as many layers as its memory allows. Any partition
  // can be turned into this one without breaking a stage's limit (a shorter suffix is
  // easier for the stages after it), so if even this leaves layers over, nothing fits.
  {
    int64_t next = 0;
    for (int64_t stage = 0; stage < S && next < n; ++stage) {
      int64_t end = next;
      while (end < n && fits(next, end + 1, stage)) ++end;
      next = end;
    }
    if (next < n) return std::nullopt;
  }

  // best[k][j]: slowest stage when layers [0, j) form stages 0..k-1; from[k][j]: first layer
  // of stage k-1 in that optimum.
  std::vector<std::vector<double>> best(S + 1, std::vector<double>(n + 1, kInf));
  std::vector<std::vector<int64_t>> from(S + 1, std::vector<int64_t>(n + 1, -1));
  for (int64_t j = 1; j <= n - (S - 1); ++j) {
    if (fits(0, j, 0)) {
      best[1][j] = seg_time(0, j);
      from[1][j] = 0;
    }
  }
  for (int64_t k = 2; k <= S; ++k) {
    const int64_t stage = k - 1;
    // Layers [i, j) form stage k-1; the first k-1 stages need >= k-1 layers, the remaining
    // S-k stages need >= S-k layers.
    for (int64_t j = k; j <= n - (S - k); ++j) {
      // Memory shrinks as i grows: smallest feasible start by binary search.
      int64_t lo = k - 1, hi = j - 1;
      if (!fits(hi, j, stage)) continue;
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (fits(mid, j, stage)) hi = mid; else lo = mid + 1;
      }
      const int64_t first_i = lo;
      auto value = [&](int64_t i) {
        if (!p.cut_allowed[i] || best[k - 1][i] == kInf) return kInf;
        return std::max(best[k - 1][i], seg_time(i, j));
      };
      int64_t arg = -1;
      double val = kInf;
      if (all_cuts) {
        // best[k-1][i] rises and seg_time(i, j) falls with i: the optimum is at the
        // crossing, i.e. the first i with best >= seg_time, or the one before it.
        int64_t a = first_i, b = j - 1;
        while (a < b) {
          const int64_t mid = (a + b) / 2;
          if (best[k - 1][mid] >= seg_time(mid, j)) b = mid; else a = mid + 1;
        }
        for (int64_t i : {a - 1, a}) {
          if (i < first_i || i > j - 1) continue;
          const double v = value(i);
          if (v < val) { val = v; arg = i; }
        }
      } else {
        for (int64_t i = first_i; i <= j - 1; ++i) {
          const double v = value(i);
          if (v < val) { val = v; arg = i; }
        }
      }
      best[k][j] = val;
      from[k][j] = arg;
    }
  }
  if (best[S][n] == kInf) return std::nullopt;

  Partition result;
  result.bottleneck_s = best[S][n];
  result.stage_of_layer.assign(n, 0);
  int64_t j = n;
  for (int64_t k = S; k >= 1; --k) {
    const int64_t i = from[k][j];
    for (int64_t l = i; l < j; ++l) result.stage_of_layer[l] = k - 1;
    j = i;
  }
  return result;
}

}  // namespace monarch::planner
