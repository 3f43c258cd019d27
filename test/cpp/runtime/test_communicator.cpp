// Collectives on flat buffers: values every rank can predict, and the byte counters (ring
// volumes: all-reduce 2(n-1)/n S, reduce-scatter / all-gather (n-1)/n S, broadcast and send S).
#include "catch_with_torch.h"

#include "harness.h"
#include "training.h"

using namespace monarch::testing;

TEST_CASE("collectives give the expected values and count their bytes", "[runtime][collectives]") {
  for (int n : {2, 3}) {
    const LaunchResult r = launch_ranks(n, "collectives", std::chrono::seconds(60));
    INFO("world " << n << r.describe());
    REQUIRE(r.all_ok());
    for (int rank = 0; rank < n; ++rank) {
      const TrainRecord got = load_record(r.output_dir + "/rank" + std::to_string(rank) + ".pt");
      const auto& p = got.params;
      REQUIRE(p.size() == 8);
      const float sum = n * (n + 1) / 2.0f;
      CHECK(torch::allclose(p[0], torch::full({6}, sum)));              // all_reduce
      CHECK(torch::allclose(p[1], torch::full({5}, sum / n), 1e-2));    // bf16 average
      // reduce_scatter: sum over ranks q of (3*rank + i + 100q).
      auto expect_rs = (torch::arange(3, torch::kFloat) + 3 * rank) * n + 100.0f * n * (n - 1) / 2;
      CHECK(torch::allclose(p[2], expect_rs));
      CHECK(torch::allclose(p[3], torch::arange(n, torch::kFloat).repeat_interleave(2)));  // all_gather
      CHECK(torch::allclose(p[4], torch::full({4}, 7.0f)));             // broadcast from 0
      CHECK(torch::allclose(p[5], torch::arange(n, torch::kFloat) * 10 + rank));  // all_to_all
      CHECK(torch::allclose(p[6], torch::full({3}, static_cast<float>((rank + n - 1) % n))));
      const auto bytes = p[7];
      const double f = 4.0, k = (n - 1.0) / n;
      CHECK(bytes[0].item<double>() == Approx(2 * k * (6 * f + 5 * 2)));  // 6 fp32 + 5 bf16 elements
      CHECK(bytes[1].item<double>() == Approx(k * n * 3 * f));
      CHECK(bytes[2].item<double>() == Approx(k * n * 2 * f));
      CHECK(bytes[3].item<double>() == Approx(rank == 0 ? 4 * f : 0));
      CHECK(bytes[4].item<double>() == Approx(3 * f));
      CHECK(bytes[5].item<double>() == Approx(k * n * f));
    }
  }
}
