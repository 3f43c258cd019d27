// C++ frontend of tensor and pipeline parallelism: the same engines torch_monarch drives
// from Python, checked against one process (SGD, fp32: every element within 1e-5 of the
// tensor's largest magnitude, losses within 1e-5 relative).
#include "catch_with_torch.h"

#include "harness.h"
#include "parallel_models.h"

using namespace monarch::testing;

namespace {

void require_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  INFO(what << ": shape " << got.sizes() << " vs " << want.sizes());
  REQUIRE(got.sizes() == want.sizes());
  const double scale = std::max(want.abs().max().item<double>(), 1e-6);
  CHECK((got - want).abs().max().item<double>() <= 1e-5 * scale);
}

}  // namespace

TEST_CASE("tensor-parallel embedding, MLP and vocabulary-parallel loss match one process",
          "[runtime][tensor_parallel]") {
  const TrainRecord ref = train_tp_reference(TpModelConfig{});
  REQUIRE(ref.losses.back() < ref.losses.front());
  for (const std::string scenario : {"tp_mlp", "tp_mlp_sp"}) {
    for (int n : {2, 4}) {
      const LaunchResult r = launch_ranks(n, scenario, std::chrono::seconds(90));
      INFO(scenario << " on " << n << " ranks" << r.describe());
      REQUIRE(r.all_ok());
      for (int rank = 0; rank < n; ++rank) {
        const TrainRecord got = load_record(r.output_dir + "/rank" + std::to_string(rank) + ".pt");
        REQUIRE(got.losses.size() == ref.losses.size());
        for (size_t s = 0; s < ref.losses.size(); ++s) CHECK(got.losses[s] == Approx(ref.losses[s]).epsilon(1e-5));
        const auto want = tp_expected_shards(ref, rank, n);
        REQUIRE(got.params.size() == want.size());
        for (size_t i = 0; i < want.size(); ++i) {
          require_close(got.params[i], want[i], scenario + " parameter " + std::to_string(i));
        }
      }
    }
  }
}

TEST_CASE("pipeline executor trains a 2-stage chain like one process under each schedule",
          "[runtime][pipeline]") {
  const TrainRecord ref = train_chain_reference();
  for (const std::string kind : {"gpipe", "1f1b", "zb_h1"}) {
    const LaunchResult r = launch_ranks(2, "pp_chain_" + kind, std::chrono::seconds(90));
    INFO(kind << r.describe());
    REQUIRE(r.all_ok());
    for (int rank = 0; rank < 2; ++rank) {
      const TrainRecord got = load_record(r.output_dir + "/rank" + std::to_string(rank) + ".pt");
      for (size_t s = 0; s < ref.losses.size(); ++s) CHECK(got.losses[s] == Approx(ref.losses[s]).epsilon(1e-5));
      REQUIRE(got.params.size() == 4 + 2);  // 2 layers x (weight, bias), trace, program
      for (int i = 0; i < 4; ++i) require_close(got.params[i], ref.params[rank * 4 + i], kind + " parameter");
      const auto& trace = got.params[4];
      const auto& program = got.params[5];
      CHECK(program.numel() > 0);
      CHECK(torch::equal(trace, program));  // the calls made are the action list's, in order
    }
  }
}

TEST_CASE("an inconsistent action list is refused on every rank before anything runs",
          "[runtime][pipeline]") {
  const auto start = std::chrono::steady_clock::now();
  const LaunchResult r = launch_ranks(2, "pp_bad_schedule", std::chrono::seconds(60));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(r.describe());
  REQUIRE_FALSE(r.timed_out);
  CHECK(seconds < 30);
  for (const auto& rank : r.ranks) {
    CHECK(rank.exit_code == 1);
    CHECK_THAT(rank.stderr_text, Catch::Contains("refuses the schedule before running it"));
    CHECK_THAT(rank.stderr_text, Catch::Contains("no matching send_activation on rank 0"));
  }
}
