#include <catch2/catch.hpp>

#include <numeric>

#include "monarch/planner/stage_partition.h"

using namespace monarch::planner;

namespace {

PartitionProblem problem(std::vector<double> time, int64_t stages) {
  PartitionProblem p;
  p.layer_time_s = time;
  p.layer_state_bytes.assign(time.size(), 1);
  p.layer_activation_bytes.assign(time.size(), 0);
  p.cut_allowed.assign(time.size(), true);
  p.stage_in_flight.assign(stages, 1);
  p.stage_memory_limit_bytes = 1e18;
  p.stages = stages;
  return p;
}

// Exhaustive optimum for small inputs.
double brute_force(const PartitionProblem& p, size_t start, int64_t stages) {
  const size_t n = p.layer_time_s.size();
  if (stages == 1) {
    double t = 0, mem = 0;
    for (size_t i = start; i < n; ++i) { t += p.layer_time_s[i]; mem += p.layer_state_bytes[i]; }
    if (mem > p.stage_memory_limit_bytes || start >= n) return 1e300;
    return t;
  }
  double best = 1e300, t = 0, mem = 0;
  for (size_t end = start; end + stages <= n; ++end) {
    t += p.layer_time_s[end];
    mem += p.layer_state_bytes[end];
    if (mem > p.stage_memory_limit_bytes) break;
    if (!p.cut_allowed[end + 1]) continue;
    best = std::min(best, std::max(t, brute_force(p, end + 1, stages - 1)));
  }
  return best;
}

}  // namespace

TEST_CASE("uniform layers split evenly", "[partition]") {
  auto p = problem(std::vector<double>(12, 1.0), 4);
  const auto r = partition_stages(p);
  REQUIRE(r);
  CHECK(r->bottleneck_s == 3.0);
  CHECK(r->stage_of_layer == std::vector<int64_t>{0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3});
}

TEST_CASE("partition is optimal against brute force", "[partition]") {
  uint64_t seed = 12345;
  auto next = [&] { seed = seed * 6364136223846793005ULL + 1442695040888963407ULL; return (seed >> 33) % 100 + 1; };
  for (int trial = 0; trial < 200; ++trial) {
    const size_t n = 3 + next() % 10;
    std::vector<double> t(n);
    for (auto& x : t) x = static_cast<double>(next());
    const int64_t stages = 1 + static_cast<int64_t>(next() % std::min<size_t>(n, 5));
    auto p = problem(t, stages);
    if (trial % 3 == 0) p.cut_allowed[1 + next() % (n - 1)] = false;  // a skip connection
    if (trial % 2 == 0) p.stage_memory_limit_bytes = static_cast<double>(n / stages + 1 + next() % 3);
    const double expect = brute_force(p, 0, stages);
    const auto r = partition_stages(p);
    INFO("trial " << trial << " n=" << n << " stages=" << stages);
    if (expect >= 1e300) {
      CHECK_FALSE(r);
      continue;
    }
    REQUIRE(r);
    CHECK(r->bottleneck_s == expect);
    // Contiguous, non-empty, in order; every stage within memory.
    std::vector<double> mem(stages, 0);
    for (size_t i = 0; i < n; ++i) {
      mem[r->stage_of_layer[i]] += p.layer_state_bytes[i];
      if (i > 0) {
        const int64_t d = r->stage_of_layer[i] - r->stage_of_layer[i - 1];
        CHECK((d == 0 || d == 1));
        if (d == 1) CHECK(p.cut_allowed[i]);
      }
    }
    CHECK(r->stage_of_layer.front() == 0);
    CHECK(r->stage_of_layer.back() == stages - 1);
    for (double m : mem) CHECK(m <= p.stage_memory_limit_bytes);
  }
}

TEST_CASE("stages with more micro-batches in flight get fewer layers", "[partition]") {
  auto p = problem(std::vector<double>(8, 1.0), 2);
  p.layer_state_bytes.assign(8, 0);
  p.layer_activation_bytes.assign(8, 1);
  p.stage_in_flight = {4, 1};  // 1F1B on 2 ranks... with m large: rank 0 holds more
  p.stage_memory_limit_bytes = 12;  // rank 0: at most 3 layers
  const auto r = partition_stages(p);
  REQUIRE(r);
  CHECK(r->stage_of_layer == std::vector<int64_t>{0, 0, 0, 1, 1, 1, 1, 1});
  p.stage_memory_limit_bytes = 3;  // nothing fits
  CHECK_FALSE(partition_stages(p));
}

TEST_CASE("more stages than layers is refused", "[partition]") {
  CHECK_FALSE(partition_stages(problem({1, 2}, 3)));
}
