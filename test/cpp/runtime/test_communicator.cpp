// Collectives on flat buffers: values every rank can predict, and the byte counters (ring
// volumes: all-reduce 2(n-1)/n S, reduce-scatter / all-gather (n-1)/n S, broadcast and send S).
#include "catch_with_torch.h"

#include <fstream>
#include <iterator>
#include <string>

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
      REQUIRE(p.size() == 9);
      const float sum = n * (n + 1) / 2.0f;
      CHECK(torch::allclose(p[0], torch::full({6}, sum)));              // all_reduce
      CHECK(torch::allclose(p[1], torch::full({5}, sum / n), 1e-2));    // bf16 average
      // reduce_scatter: sum over ranks q of (3*rank + i + 100q).
      auto expect_rs = (torch::arange(3, torch::kFloat) + 3 * rank) * n + 100.0f * n * (n - 1) / 2;
      CHECK(torch::allclose(p[2], expect_rs));
      CHECK(torch::allclose(p[8], expect_rs));  // the same, its output inside its input
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

TEST_CASE("the node's shared-memory all-reduce gives the sum in group order on every rank", "[runtime][collectives]") {
  for (int n : {2, 3, 4}) {
    const LaunchResult r = launch_ranks(n, "node_all_reduce", std::chrono::seconds(120));  // the default path
    INFO("world " << n << r.describe());
    REQUIRE(r.all_ok());
    for (int rank = 0; rank < n; ++rank) {
      const auto facts = load_record(r.output_dir + "/rank" + std::to_string(rank) + ".pt").params.at(0);
      INFO("rank " << rank << ": " << facts);
      // 600 calls, 8 cases: 7 of every 8 fit in 256 KiB (the 100000-float one does not).
      CHECK(facts[0].item<double>() == 525);  // every fitting call took the shared path
      CHECK(facts[1].item<double>() == 525);
      CHECK(facts[2].item<double>() == 0);    // bit for bit the sum in group order
      CHECK(facts[3].item<double>() < 1e-3);  // Gloo's ring sums in another order
    }
  }
}

namespace {
std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
}  // namespace

TEST_CASE("ranks making different collectives fail on every rank naming both sides", "[runtime][faults]") {
  const LaunchResult r = launch_ranks(2, "collective_mismatch", std::chrono::seconds(60));
  INFO(r.describe());
  REQUIRE(r.all_ok());
  for (int rank = 0; rank < 2; ++rank) {
    const std::string text = read_text(r.output_dir + "/rank" + std::to_string(rank) + ".pt.txt");
    INFO(text);
    CHECK(text.find("the ranks of group 'dp' are not making the same collective call") != std::string::npos);
    CHECK(text.find("rank 0: all_reduce (sum) of 4 Float in a direct call, step 0 (collective #0") != std::string::npos);
    CHECK(text.find("rank 1: all_reduce (sum) of 8 Float in a direct call, step 0 (collective #0") != std::string::npos);
    // The second attempt repeats the first error instead of pairing anew.
    const auto second = text.find("---");
    REQUIRE(second != std::string::npos);
    CHECK(text.find("cannot be used after a failed collective", second) != std::string::npos);
    CHECK(text.find("of 4 Float in a direct call", second) != std::string::npos);
  }
}

TEST_CASE("a rank that exits during the shared-memory all-reduce is named at once, not after the timeout",
          "[runtime][faults]") {
  const LaunchResult r = launch_ranks(2, "node_all_reduce_dead", std::chrono::seconds(60));
  INFO(r.describe());
  REQUIRE(r.all_ok());
  const std::string text = read_text(r.output_dir + "/rank0.pt.txt");
  INFO(text);
  CHECK(text.find("shared-memory all-reduce #3 on group tp: rank 1 (pid ") != std::string::npos);
  CHECK(text.find("exited before arriving") != std::string::npos);
  const auto at = text.find("seconds ");
  REQUIRE(at != std::string::npos);
  CHECK(std::stod(text.substr(at + 8)) < 5.0);
  // Later calls repeat the first error.
  const auto second = text.find("---");
  REQUIRE(second != std::string::npos);
  CHECK(text.find("exited before arriving", second) != std::string::npos);
}

TEST_CASE("an operation only one rank calls fails within its deadline and leaves the group usable",
          "[runtime][faults]") {
  const LaunchResult r = launch_ranks(2, "expect_all_alone", std::chrono::seconds(60));
  INFO(r.describe());
  REQUIRE(r.all_ok());
  const std::string text = read_text(r.output_dir + "/rank0.pt.txt");
  INFO(text);
  CHECK(text.find("rank 0 called state_dict() (call #0 on group 'dp', ranks 0 1) but rank 1 did not call it "
                  "within 1 s") != std::string::npos);
  CHECK(text.find("every rank must call it") != std::string::npos);
  const auto at = text.find("seconds ");
  REQUIRE(at != std::string::npos);
  CHECK(std::stod(text.substr(at + 8)) < 2.5);
  CHECK(text.find("after 6") != std::string::npos);  // 3 ones summed over 2 ranks
}
