#include "monarch/planner/stage_partition.h"

#include <algorithm>
#include <limits>
#include <string>

#include "monarch/planner/errors.h"

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

void check_sizes(const PartitionProblem& p) {
  const size_t n = p.layer_time_s.size();
  auto require = [&](size_t size, size_t expected, const char* field) {
    if (size != expected) {
      throw ValidationError(
          field, "has " + std::to_string(size) + " entries, expected " + std::to_string(expected));
    }
  };
  require(p.layer_state_bytes.size(), n, "layer_state_bytes");
  require(p.layer_activation_bytes.size(), n, "layer_activation_bytes");
  require(p.cut_allowed.size(), n, "cut_allowed");
  if (p.stages < 1) return;
  require(p.stage_in_flight.size(), static_cast<size_t>(p.stages), "stage_in_flight");
  if (!p.stage_memory_limits_bytes.empty()) {
    require(p.stage_memory_limits_bytes.size(), static_cast<size_t>(p.stages), "stage_memory_limits_bytes");
  }
  if (p.stages > kMaxPartitionCells / static_cast<int64_t>(std::max<size_t>(n, 1))) {
    throw ValidationError("stages", std::to_string(p.stages) + " stages x " + std::to_string(n) +
                                        " layers is too large a partition (at most " +
                                        std::to_string(kMaxPartitionCells) + ")");
  }
}

}  // namespace

namespace {

// Whether layers [i, j) fit as stage `stage`.
struct StageFits {
  const PartitionProblem& p;
  const Prefix& pre;
  bool operator()(int64_t i, int64_t j, int64_t stage) const {
    const double bytes = pre.state[j] - pre.state[i] +
                         (pre.activations[j] - pre.activations[i]) * p.stage_in_flight[stage] +
                         p.stage_fixed_bytes;
    return bytes <= (p.stage_memory_limits_bytes.empty() ? p.stage_memory_limit_bytes
                                                         : p.stage_memory_limits_bytes[stage]);
  }
};

// Fills each stage with as many layers as its memory allows. Any partition can be turned
// into this one without breaking a stage's limit (a shorter suffix is easier for the stages
// after it), so if even this leaves layers over, nothing fits.
bool greedy_fill_places_every_layer(const PartitionProblem& p, const Prefix& pre) {
  const int64_t n = static_cast<int64_t>(p.layer_time_s.size());
  const StageFits fits{p, pre};
  int64_t next = 0;
  for (int64_t stage = 0; stage < p.stages && next < n; ++stage) {
    int64_t end = next;
    while (end < n && fits(next, end + 1, stage)) ++end;
    next = end;
  }
  return next == n;
}

}  // namespace

bool memory_may_admit_partition(const PartitionProblem& p) {
  check_sizes(p);
  const int64_t n = static_cast<int64_t>(p.layer_time_s.size());
  if (p.stages < 1 || n < p.stages) return false;
  return greedy_fill_places_every_layer(p, Prefix(p));
}

std::optional<Partition> partition_stages(const PartitionProblem& p) {
  check_sizes(p);
  const int64_t n = static_cast<int64_t>(p.layer_time_s.size());
  const int64_t S = p.stages;
  if (S < 1 || n < S) return std::nullopt;
  const Prefix pre(p);
  auto seg_time = [&](int64_t i, int64_t j) { return pre.time[j] - pre.time[i]; };  // layers [i, j)
  const StageFits fits{p, pre};
  if (!greedy_fill_places_every_layer(p, pre)) return std::nullopt;  // quick refusal

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
  // best[k][j] = min over i of max(f(i), seg_time(i, j)) with f = best[k-1] (infinite where
  // no cut is allowed) and i from the first start that fits memory to j - 1. f need not
  // rise with i (an interleaved schedule's in-flight counts rise again at each chunk, so a
  // longer prefix may fit where a shorter one does not), but its suffix minimum M(a) =
  // min f over [a, j) does, while seg_time falls: min over i of max(f(i), seg(i)) equals
  // min over a of max(M(a), seg(a)) (take i = argmin f on [a, j), whose segment is no
  // longer), found by binary search at the crossing. The suffix minima are kept as a stack
  // of indices whose f rises strictly; each i enters once as j passes it.
  for (int64_t k = 2; k <= S; ++k) {
    const int64_t stage = k - 1;
    const std::vector<double>& f = best[k - 1];
    std::vector<int64_t> minima;
    // Layers [i, j) form stage k-1; the first k-1 stages need >= k-1 layers, the remaining
    // S-k stages need >= S-k layers.
    for (int64_t j = k; j <= n - (S - k); ++j) {
      const int64_t newest = j - 1;
      if (p.cut_allowed[newest] && f[newest] < kInf) {
        while (!minima.empty() && f[minima.back()] >= f[newest]) minima.pop_back();
        minima.push_back(newest);
      }
      // Memory shrinks as i grows: smallest feasible start by binary search.
      int64_t lo = k - 1, hi = j - 1;
      if (!fits(hi, j, stage)) continue;
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (fits(mid, j, stage)) hi = mid; else lo = mid + 1;
      }
      // Candidates: the suffix minima at or after the first start that fits. Along them f
      // rises and seg_time falls: the optimum is at the first one with f >= seg_time, or the
      // one before it.
      const size_t first =
          static_cast<size_t>(std::lower_bound(minima.begin(), minima.end(), lo) - minima.begin());
      size_t a = first, b = minima.size();
      while (a < b) {
        const size_t mid = a + (b - a) / 2;
        if (f[minima[mid]] >= seg_time(minima[mid], j))
          b = mid;
        else
          a = mid + 1;
      }
      int64_t arg = -1;
      double val = kInf;
      for (size_t c = a > first ? a - 1 : a; c <= a && c < minima.size(); ++c) {
        const double v = std::max(f[minima[c]], seg_time(minima[c], j));
        if (v < val) {
          val = v;
          arg = minima[c];
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
