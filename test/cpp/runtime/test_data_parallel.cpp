// Data-parallel engine: multi-process parity with a single process, no_sync accumulation,
// compression, and refusal of bad setups. Tolerance: 1e-5 relative (fp32; the only
// difference from the reference is the order of the cross-rank gradient sums, which moves
// results by a few ulps per step over 10 AdamW steps).
#include "catch_with_torch.h"

#include "harness.h"
#include "training.h"

using namespace monarch::testing;

namespace {

constexpr double kRelTol = 1e-5;

void require_parity(const TrainRecord& got, const TrainRecord& want, const std::string& who) {
  INFO(who);
  REQUIRE(got.losses.size() == want.losses.size());
  for (size_t s = 0; s < want.losses.size(); ++s) {
    INFO("step " << s);
    CHECK(got.losses[s] == Approx(want.losses[s]).epsilon(kRelTol));
  }
  REQUIRE(got.params.size() == want.params.size());
  for (size_t i = 0; i < want.params.size(); ++i) {
    INFO("parameter " << i);
    const double diff = (got.params[i] - want.params[i]).abs().max().item<double>();
    const double scale = want.params[i].abs().max().item<double>();
    INFO("max abs diff " << diff << ", max abs value " << scale);
    CHECK(diff <= kRelTol * std::max(scale, 1e-3));
  }
}

LaunchResult run(int ranks, const std::string& scenario,
                 const std::map<std::string, std::string>& env = {}) {
  return launch_ranks(ranks, scenario, std::chrono::seconds(120), env);
}

}  // namespace

TEST_CASE("data parallel on 2 and 4 ranks matches one process", "[runtime][dp]") {
  const TrainRecord reference = train_reference({});
  // The reference must actually train, or parity would prove little.
  INFO("reference losses " << reference.losses.front() << " -> " << reference.losses.back());
  CHECK(reference.losses.back() < reference.losses.front() - 0.1);
  for (int ranks : {2, 4}) {
    const LaunchResult r = run(ranks, "dp");
    INFO(r.describe());
    REQUIRE(r.all_ok());
    for (int rank = 0; rank < ranks; ++rank) {
      require_parity(load_record(r.output_dir + "/rank" + std::to_string(rank) + ".pt"), reference,
                     "dp" + std::to_string(ranks) + " rank " + std::to_string(rank));
    }
  }
}

TEST_CASE("no_sync gradient accumulation equals the larger batch", "[runtime][dp]") {
  const TrainRecord reference = train_reference({});
  const LaunchResult r = run(2, "dp_accumulate");
  INFO(r.describe());
  REQUIRE(r.all_ok());
  require_parity(load_record(r.output_dir + "/rank0.pt"), reference, "dp2 x accumulate 2");
}

TEST_CASE("bf16 compression halves the bytes and still trains", "[runtime][dp]") {
  const LaunchResult plain = run(2, "dp_bytes");
  const LaunchResult compressed = run(2, "dp_bf16");
  INFO(plain.describe() << compressed.describe());
  REQUIRE(plain.all_ok());
  REQUIRE(compressed.all_ok());
  const TrainRecord p = load_record(plain.output_dir + "/rank0.pt");
  const TrainRecord c = load_record(compressed.output_dir + "/rank0.pt");
  const double plain_bytes = p.params.front().item<double>();
  const double compressed_bytes = c.params.front().item<double>();
  CHECK(plain_bytes > 0);
  CHECK(compressed_bytes == Approx(plain_bytes / 2).epsilon(0.01));
  // Error feedback keeps the compressed run close to the exact one.
  for (size_t s = 0; s < p.losses.size(); ++s) CHECK(c.losses[s] == Approx(p.losses[s]).epsilon(0.02));
}

TEST_CASE("hierarchical reduction over 2 nodes x 2 ranks matches one process; compressed slow hop trains",
          "[runtime][dp][hierarchical]") {
  const TrainRecord reference = train_reference({});
  const std::map<std::string, std::string> two_nodes{{"LOCAL_WORLD_SIZE", "2"}};
  std::map<std::string, std::vector<TrainRecord>> runs;
  // The node's ranks share their buckets through shared memory; "/collectives" runs the same
  // with MONARCH_SHARED_MEMORY=off (reduce-scatter and all-gather over the intra group).
  for (const std::string c : {"none", "bf16", "int8", "none/collectives", "int8/collectives"}) {
    const bool collectives = c.find("/collectives") != std::string::npos;
    auto env = two_nodes;
    if (collectives) env["MONARCH_SHARED_MEMORY"] = "off";
    const LaunchResult r = run(4, "dp_hier_" + c.substr(0, c.find('/')), env);
    INFO(c << ": " << r.describe());
    REQUIRE(r.all_ok());
    for (int rank = 0; rank < 4; ++rank) {
      runs[c].push_back(load_record(r.output_dir + "/rank" + std::to_string(rank) + ".pt"));
    }
  }
  const auto bytes = [](const TrainRecord& r, int64_t i) { return r.params.front()[i].item<double>(); };
  const auto without_bytes = [](TrainRecord r) {
    r.params.erase(r.params.begin());
    return r;
  };
  // Uncompressed: the same sums as the flat all-reduce, in another order.
  for (int rank = 0; rank < 4; ++rank) {
    require_parity(without_bytes(runs["none"][rank]), reference, "hierarchical rank " + std::to_string(rank));
  }
  // Per rank, the flat ring on 4 ranks sends 1.5 S; the slow hop sends the 2-rank all-reduce
  // of a half shard: S / 2, a third. bf16 halves that, int8 quarters it (+ 4 bytes per 256).
  const TrainRecord& none = runs["none"][0];
  const double flat = bytes(none, 2);
  CHECK(bytes(none, 1) == Approx(flat / 3).epsilon(0.02));
  CHECK(bytes(runs["bf16"][0], 1) == Approx(flat / 6).epsilon(0.02));
  CHECK(bytes(runs["int8"][0], 1) == Approx(flat / 12 * (1 + 4.0 / 256)).epsilon(0.02));
  // Shared memory: the same sums in the same order as the collectives, so bitwise the same
  // training; inside the node only the setup and the barriers' checks go over the group.
  for (const std::string c : {"none", "int8"}) {
    INFO(c);
    const auto& shared = runs[c];
    const auto& collectives = runs[c + "/collectives"];
    for (int rank = 0; rank < 4; ++rank) {
      REQUIRE(shared[rank].params.size() == collectives[rank].params.size());
      for (size_t i = 1; i < shared[rank].params.size(); ++i) CHECK(at::equal(shared[rank].params[i], collectives[rank].params[i]));
      CHECK(shared[rank].losses == collectives[rank].losses);
    }
    // Collectives: a reduce-scatter and an all-gather sending S / 2 each per step (2 ranks per
    // node), where the flat ring on 4 ranks sends 1.5 S.
    CHECK(bytes(collectives[0], 0) == Approx(flat / 1.5).epsilon(0.02));
    CHECK(bytes(collectives[0], 1) == Approx(bytes(shared[0], 1)));
    CHECK(bytes(shared[0], 0) < bytes(collectives[0], 0) / 100);
  }
  // 2 nodes x 3 ranks: three slots summed per chunk, still in the collectives' order.
  {
    const std::map<std::string, std::string> three{{"LOCAL_WORLD_SIZE", "3"}};
    auto off = three;
    off["MONARCH_SHARED_MEMORY"] = "off";
    const LaunchResult shared = run(6, "dp_hier_none", three);
    const LaunchResult collectives = run(6, "dp_hier_none", off);
    INFO(shared.describe() << collectives.describe());
    REQUIRE(shared.all_ok());
    REQUIRE(collectives.all_ok());
    for (int rank = 0; rank < 6; ++rank) {
      const auto a = load_record(shared.output_dir + "/rank" + std::to_string(rank) + ".pt");
      const auto b = load_record(collectives.output_dir + "/rank" + std::to_string(rank) + ".pt");
      CHECK(a.losses == b.losses);
      for (size_t i = 1; i < a.params.size(); ++i) CHECK(at::equal(a.params[i], b.params[i]));
      CHECK(bytes(a, 0) < bytes(b, 0) / 100);
    }
  }
  for (const std::string c : {"bf16", "int8"}) {
    INFO(c);
    // Every rank sums the same rounded values: replicas stay bitwise equal.
    for (int rank = 1; rank < 4; ++rank) {
      for (size_t i = 1; i < runs[c][0].params.size(); ++i) CHECK(at::equal(runs[c][rank].params[i], runs[c][0].params[i]));
    }
    // Error feedback keeps the losses close to the exact run.
    for (size_t s = 0; s < reference.losses.size(); ++s) {
      INFO("step " << s);
      CHECK(runs[c][0].losses[s] == Approx(reference.losses[s]).epsilon(0.02));
    }
  }
}

TEST_CASE("a dead rank makes the others fail fast, naming the collective", "[runtime][faults]") {
  const auto start = std::chrono::steady_clock::now();
  const LaunchResult r = run(2, "dp", {{"MONARCH_TEST_DIE_AT_STEP", "3"}, {"MONARCH_TIMEOUT_MS", "10000"}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(r.describe());
  CHECK_FALSE(r.timed_out);
  CHECK(seconds < 60);
  CHECK(r.ranks[1].exit_code == 3);
  CHECK(r.ranks[0].exit_code != 0);
  CHECK_THAT(r.ranks[0].stderr_text, Catch::Contains("rank 0") && Catch::Contains("group 'dp'") &&
                                         (Catch::Contains("all_reduce") || Catch::Contains("broadcast")));
}

TEST_CASE("bad setups are refused with a clear error", "[runtime][errors]") {
  const LaunchResult mismatch = run(2, "dp_mismatch");
  INFO(mismatch.describe());
  CHECK(mismatch.ranks[0].exit_code == 1);
  CHECK(mismatch.ranks[1].exit_code == 1);
  CHECK_THAT(mismatch.ranks[0].stderr_text, Catch::Contains("every rank must wrap the same model"));

  const LaunchResult mesh = run(2, "mesh_too_big");
  INFO(mesh.describe());
  CHECK(mesh.ranks[0].exit_code == 1);
  CHECK_THAT(mesh.ranks[0].stderr_text, Catch::Contains("does not match the world size 2"));
}
