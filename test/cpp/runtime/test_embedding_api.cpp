// monarch/embeddings.h (csrc/src/embeddings.cpp): the one-process EmbeddingBagCollection against
// torch's embedding_bag by hand, samples(), and shard_embeddings on a one-rank job (the same
// outputs as unsharded; a plan for other tables or another job refused listing each
// difference). Multi-rank sharding and training: examples/cpp/train_dlrm through the launcher
// (test/python/test_cpp_frontend.py); the engine itself: test_embeddings.cpp.
#include "catch_with_torch.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "monarch/checkpoint.h"
#include "monarch/embeddings.h"

namespace mp = monarch::planner;

namespace {

std::vector<monarch::EmbeddingBagConfig> configs() {
  return {{"user", 10, 4, {}, mp::EmbeddingPooling::sum, 1.0},
          {"item", 7, 3, {"item", "clicked"}, mp::EmbeddingPooling::mean, 2.0}};
}

// Batch of 3: user [[1], [2, 3], []], item [[0, 6], [5], [1]], clicked [[], [2, 2], [4]].
monarch::JaggedBatch batch(bool weighted) {
  monarch::JaggedBatch b;
  b.keys = {"user", "item", "clicked"};
  b.values = torch::tensor({1, 2, 3, 0, 6, 5, 1, 2, 2, 4}, torch::kLong);
  b.lengths = torch::tensor({1, 2, 0, 2, 1, 1, 0, 2, 1}, torch::kLong);
  if (weighted) b.weights = torch::tensor({0.5, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0}, torch::kFloat);
  return b;
}

}  // namespace

TEST_CASE("EmbeddingBagCollection pools each feature of its table, in table order", "[runtime][embeddings]") {
  torch::manual_seed(0);
  monarch::EmbeddingBagCollection ebc(configs());
  CHECK(ebc->output_keys() == std::vector<std::string>{"user", "item", "clicked"});
  CHECK(ebc->configs()[0].features == std::vector<std::string>{"user"});  // default: the table's name
  auto out = ebc->forward(batch(false));
  REQUIRE(out.sizes() == torch::IntArrayRef({3, 4 + 3 + 3}));
  const auto& user = ebc->weight("user");
  const auto& item = ebc->weight("item");
  CHECK(torch::allclose(out[0].narrow(0, 0, 4), user[1]));
  CHECK(torch::allclose(out[1].narrow(0, 0, 4), user[2] + user[3]));
  CHECK(out[2].narrow(0, 0, 4).abs().sum().item<double>() == 0.0);  // no ids: zeros
  CHECK(torch::allclose(out[0].narrow(0, 4, 3), (item[0] + item[6]) / 2));
  CHECK(torch::allclose(out[1].narrow(0, 7, 3), item[2]));  // mean of [2, 2]
  CHECK(torch::allclose(out[2].narrow(0, 7, 3), item[4]));
  // Per-id weights on a sum table.
  monarch::EmbeddingBagCollection weighted(std::vector<monarch::EmbeddingBagConfig>{{"user", 10, 4}});
  monarch::JaggedBatch wb;
  wb.keys = {"user"};
  wb.values = torch::tensor({1, 2, 3}, torch::kLong);
  wb.lengths = torch::tensor({1, 2}, torch::kLong);
  wb.weights = torch::tensor({0.5, 1.0, 2.0}, torch::kFloat);
  auto w = weighted->forward(wb);
  const auto& u = weighted->weight("user");
  CHECK(torch::allclose(w[1], u[2] + 2 * u[3]));

  auto bad = batch(false);
  bad.values[0] = 10;
  CHECK_THROWS_WITH(ebc->forward(bad), Catch::Contains("id 10 is out of range for table 'user' (10 rows)"));
  auto missing = batch(false);
  missing.keys[2] = "other";
  CHECK_THROWS_WITH(ebc->forward(missing), Catch::Contains("JaggedBatch lacks feature 'clicked'"));
  CHECK_THROWS_WITH(monarch::EmbeddingBagCollection(std::vector<monarch::EmbeddingBagConfig>{{"a", 3, 2}, {"a", 4, 2}}),
                    Catch::Contains("two tables are named 'a'"));
  CHECK_THROWS_WITH(monarch::EmbeddingBagCollection(std::vector<monarch::EmbeddingBagConfig>{{"a", 0, 2}}),
                    Catch::Contains("rows and dim must be > 0"));
}

TEST_CASE("samples() takes a range of samples of every feature", "[runtime][embeddings]") {
  auto b = batch(true);
  auto s = monarch::samples(b, 1, 3);
  CHECK(s.keys == b.keys);
  CHECK(torch::equal(s.lengths, torch::tensor({2, 0, 1, 1, 2, 1}, torch::kLong)));
  CHECK(torch::equal(s.values, torch::tensor({2, 3, 5, 1, 2, 2, 4}, torch::kLong)));
  CHECK(torch::equal(s.weights, torch::tensor({1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0}, torch::kFloat)));
  CHECK(monarch::samples(b, 0, 0).values.numel() == 0);
  CHECK_THROWS_WITH(monarch::samples(b, 2, 4), Catch::Contains("is not inside a batch of 3"));
}

TEST_CASE("shard_embeddings on one rank: the unsharded outputs; a plan for other tables or another job is refused",
          "[runtime][embeddings]") {
  auto world = monarch::World::from_store(c10::make_intrusive<c10d::HashStore>(), 0, 1);
  torch::manual_seed(0);
  monarch::EmbeddingBagCollection ebc(configs());
  monarch::ShardOptions so;
  so.world = world;
  so.batch_per_rank = 3;
  so.optimizer.kind = mp::EmbeddingOptimizer::sgd;
  auto sharded = monarch::shard_embeddings(ebc, so);
  CHECK(sharded->plan().tables.size() == 2);
  CHECK(sharded->output_keys() == ebc->output_keys());
  CHECK(torch::allclose(sharded->forward(batch(false)), ebc->forward(batch(false))));
  CHECK(torch::equal(sharded->full_table("item"), ebc->weight("item")));

  // The one-process checkpoint overloads refuse a model holding sharded tables (they are
  // not parameters: they would be left out).
  struct Holder : torch::nn::Module {
    explicit Holder(monarch::ShardedEmbeddingBagCollection t) { tables = register_module("tables", t); }
    monarch::ShardedEmbeddingBagCollection tables{nullptr};
  } holder(sharded);
  CHECK_THROWS_WITH(monarch::checkpoint::save(holder, nullptr, "/tmp/monarch_never_written"),
                    Catch::Contains("'tables' is a ShardedEmbeddingBagCollection"));

  auto plan = sharded->plan();
  plan.world_size = 2;
  plan.tables[1].rows = 8;
  so.plan = plan;
  try {
    monarch::shard_embeddings(ebc, so);
    FAIL("a plan for another job loaded");
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("the plan is for 2 ranks, the job has 1") != std::string::npos);
    CHECK(what.find("table 1: the plan has 'item' 8x3 (mean), the model 'item' 7x3 (mean)") != std::string::npos);
  }
  so.plan.reset();
  so.batch_per_rank = 0;
  CHECK_THROWS_WITH(monarch::shard_embeddings(ebc, so), Catch::Contains("batch_per_rank"));
}
