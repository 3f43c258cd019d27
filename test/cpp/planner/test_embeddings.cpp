#include "catch_compat.h"
#include <cstdint>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "monarch/planner/embeddings.h"
#include "monarch/planner/errors.h"

using namespace monarch::planner;

namespace {

EmbeddingTable table(const std::string& name, int64_t rows, int64_t dim, double pooling = 4,
                     int features = 1) {
  EmbeddingTable t;
  t.name = name;
  t.rows = rows;
  t.dim = dim;
  t.pooling_factor = pooling;
  for (int i = 0; i < features; ++i) t.features.push_back(name + "_f" + std::to_string(i));
  return t;
}

EmbeddingOptions opts(int64_t world, int64_t batch) {
  EmbeddingOptions o;
  o.world_size = world;
  o.batch_per_rank = batch;
  return o;
}

double kGiB = 1024.0 * 1024 * 1024;

}  // namespace

TEST_CASE("table-wise bytes: ids and lengths to the owner, pooled rows back, gradients again", "[embeddings]") {
  const Cluster c = cluster_preset("a100-80gb", 4);
  const EmbeddingTable t = table("t", 1000, 16, /*pooling=*/3, /*features=*/2);
  EmbeddingPlacement p;
  p.table = "t";
  p.sharding = EmbeddingSharding::table_wise;
  p.shards = {{2, 0, 1000, 0, 16}};
  const auto loads = embedding_placement_loads(t, p, c, opts(4, 8));
  // Each of the 3 other ranks: 8 samples x 2 features x 3 ids x 8 bytes + 8 x 2 lengths x 4,
  // then its 8 x 2 pooled rows of 16 fp32 come back and their gradients go out.
  const double ids = 8 * 2 * 3 * 8 + 8 * 2 * 4;
  const double rows = 8 * 2 * 16 * 4;
  for (int r : {0, 1, 3}) {
    CHECK(loads[r].sent_bytes == ids + rows);
    CHECK(loads[r].received_bytes == rows);
    CHECK(loads[r].storage_bytes == 0);
  }
  CHECK(loads[2].received_bytes == 3 * (ids + rows));
  CHECK(loads[2].sent_bytes == 3 * rows);
  CHECK(loads[2].storage_bytes == 1000 * 16 * 4);
}

TEST_CASE("row-wise bytes: ids to their row's owner, partial sums reduce-scattered", "[embeddings]") {
  const Cluster c = cluster_preset("a100-80gb", 2);
  const EmbeddingTable t = table("t", 100, 8, 2, 1);
  EmbeddingPlacement p;
  p.table = "t";
  p.sharding = EmbeddingSharding::row_wise;
  p.shards = {{0, 0, 50, 0, 8}, {1, 50, 50, 0, 8}};
  const auto loads = embedding_placement_loads(t, p, c, opts(2, 4));
  // Half of each rank's 4 x 2 ids go to the other rank, with all 4 lengths; the other rank's
  // partial sums for this rank's 4 samples come back (forward) and gradients go (backward).
  const double in = 4 * 2 * 0.5 * 8 + 4 * 4;
  const double rows = 4 * 8 * 4;
  for (int r : {0, 1}) {
    CHECK(loads[r].sent_bytes == Approx(in + 2 * rows));
    CHECK(loads[r].received_bytes == Approx(in + 2 * rows));
    CHECK(loads[r].storage_bytes == 50 * 8 * 4);
  }
}

TEST_CASE("optimizer state per row", "[embeddings]") {
  CHECK(embedding_optimizer_bytes_per_row(EmbeddingOptimizer::sgd, 64) == 0);
  CHECK(embedding_optimizer_bytes_per_row(EmbeddingOptimizer::rowwise_adagrad, 64) == 4);
  CHECK(embedding_optimizer_bytes_per_row(EmbeddingOptimizer::adam, 64) == 64 * 8);
}

TEST_CASE("plan: small tables spread table-wise, a table too large for a rank goes row-wise", "[embeddings]") {
  const Cluster c = cluster_preset("a100-80gb", 4);
  std::vector<EmbeddingTable> tables;
  for (int i = 0; i < 8; ++i) tables.push_back(table("small" + std::to_string(i), 10000, 64));
  tables.push_back(table("huge", 400'000'000, 64));  // 95 GiB in fp32: no single rank holds it
  EmbeddingOptions o = opts(4, 512);
  const EmbeddingPlan plan = plan_embeddings(tables, c, o);
  REQUIRE(plan.placements.size() == tables.size());
  EmbeddingPlan rescored = evaluate_embeddings(plan, c);  // consistent and within budget
  CHECK(rescored.max_rank_s == Approx(plan.max_rank_s));
  const auto& huge = plan.placements.back();
  CHECK((huge.sharding == EmbeddingSharding::row_wise || huge.sharding == EmbeddingSharding::table_row_wise ||
         huge.sharding == EmbeddingSharding::column_wise));
  for (const auto& r : plan.ranks) CHECK(r.storage_bytes <= c.usable_memory_bytes());
  CHECK(plan.lower_bound_s > 0);
  CHECK(plan.lower_bound_s <= plan.max_rank_s * (1 + 1e-9));
  // The small tables use more than one rank between them.
  std::set<int64_t> owners;
  for (size_t i = 0; i + 1 < plan.placements.size(); ++i) {
    for (const auto& s : plan.placements[i].shards) owners.insert(s.rank);
  }
  CHECK(owners.size() > 1);
}

TEST_CASE("plan: equal tables balance exactly, at the lower bound", "[embeddings]") {
  const Cluster c = cluster_preset("a100-80gb", 8);
  std::vector<EmbeddingTable> tables;
  for (int i = 0; i < 16; ++i) tables.push_back(table("t" + std::to_string(i), 1'000'000, 128, 20));
  EmbeddingOptions o = opts(8, 1024);
  for (auto& t : tables) o.pins[t.name] = EmbeddingSharding::table_wise;
  const EmbeddingPlan plan = plan_embeddings(tables, c, o);
  std::vector<int> per_rank(8, 0);
  for (const auto& p : plan.placements) per_rank[p.shards.at(0).rank] += 1;
  for (int n : per_rank) CHECK(n == 2);
  CHECK(plan.max_rank_s <= plan.lower_bound_s * 1.10);
}

TEST_CASE("pins: honoured, and refused with the reason when impossible", "[embeddings]") {
  const Cluster c = cluster_preset("a100-80gb", 4);
  std::vector<EmbeddingTable> tables = {table("a", 1000, 32), table("b", 1000, 32)};
  EmbeddingOptions o = opts(4, 64);
  o.pins["a"] = EmbeddingSharding::row_wise;
  o.pins["b"] = EmbeddingSharding::column_wise;
  const EmbeddingPlan plan = plan_embeddings(tables, c, o);
  CHECK(plan.placements[0].sharding == EmbeddingSharding::row_wise);
  CHECK(plan.placements[1].sharding == EmbeddingSharding::column_wise);
  CHECK(plan.placements[1].shards.size() == 4);  // 32 columns in chunks of 8

  EmbeddingOptions bad = opts(4, 64);
  bad.pins["a"] = EmbeddingSharding::table_wise;
  std::vector<EmbeddingTable> big = {table("a", 400'000'000, 64)};
  try {
    plan_embeddings(big, c, bad);
    FAIL("expected a ValidationError");
  } catch (const ValidationError& e) {
    CHECK(e.field() == "embeddings.tables.a.sharding");
    CHECK_THAT(e.what(), Catch::Contains("table_wise needs the whole table"));
  }
  EmbeddingOptions unknown = opts(4, 64);
  unknown.pins["nope"] = EmbeddingSharding::row_wise;
  CHECK_THROWS_WITH(plan_embeddings(tables, c, unknown), Catch::Contains("embeddings.pins.nope"));
  EmbeddingOptions narrow = opts(4, 64);
  narrow.pins["a"] = EmbeddingSharding::column_wise;
  std::vector<EmbeddingTable> thin = {table("a", 1000, 4)};
  CHECK_THROWS_WITH(plan_embeddings(thin, c, narrow), Catch::Contains("dim >= 2 chunks"));
}

TEST_CASE("bad tables and placements name what is wrong", "[embeddings]") {
  const Cluster c = cluster_preset("a100-80gb", 2);
  EmbeddingTable t = table("t", 0, 8);
  CHECK_THROWS_WITH(plan_embeddings({t}, c, opts(2, 4)), Catch::Contains("embeddings.tables.t.rows"));
  t = table("t", 10, 8);
  t.features.clear();
  CHECK_THROWS_WITH(plan_embeddings({t}, c, opts(2, 4)), Catch::Contains("embeddings.tables.t.features"));
  CHECK_THROWS_WITH(plan_embeddings({table("t", 10, 8), table("t", 5, 8)}, c, opts(2, 4)),
                    Catch::Contains("two tables have this name"));

  EmbeddingPlan p = plan_embeddings({table("t", 10, 8)}, c, opts(2, 4));
  EmbeddingPlan gap = p;
  gap.placements[0].sharding = EmbeddingSharding::row_wise;
  gap.placements[0].shards = {{0, 0, 4, 0, 8}, {1, 5, 5, 0, 8}};
  CHECK_THROWS_WITH(evaluate_embeddings(gap, c), Catch::Contains("do not cover"));
  EmbeddingPlan overlap = p;
  overlap.placements[0].sharding = EmbeddingSharding::row_wise;
  overlap.placements[0].shards = {{0, 0, 6, 0, 8}, {1, 4, 6, 0, 8}};
  CHECK_THROWS_WITH(evaluate_embeddings(overlap, c), Catch::Contains("overlap"));
  // Shapes the runtime would route wrongly are refused by kind.
  EmbeddingPlan chunks_as_rows = p;
  chunks_as_rows.placements[0].sharding = EmbeddingSharding::row_wise;
  chunks_as_rows.placements[0].shards = {{0, 0, 10, 0, 4}, {1, 0, 10, 4, 4}};
  CHECK_THROWS_WITH(evaluate_embeddings(chunks_as_rows, c), Catch::Contains("row_wise shards hold every column"));
  EmbeddingPlan split_table = p;
  split_table.placements[0].sharding = EmbeddingSharding::table_wise;
  split_table.placements[0].shards = {{0, 0, 5, 0, 8}, {1, 5, 5, 0, 8}};
  CHECK_THROWS_WITH(evaluate_embeddings(split_table, c), Catch::Contains("table_wise shards hold the whole table"));
  EmbeddingPlan twice = plan_embeddings({table("t", 10, 8), table("u", 10, 8)}, c, opts(2, 4));
  twice.tables[1].name = "t";
  twice.placements[1].table = "t";
  CHECK_THROWS_WITH(evaluate_embeddings(twice, c), Catch::Contains("two tables have this name"));
  EmbeddingPlan far = p;
  far.placements[0].shards = {{7, 0, 10, 0, 8}};
  CHECK_THROWS_WITH(evaluate_embeddings(far, c), Catch::Contains("rank 7 outside the world of 2"));
}

TEST_CASE("plan: tables that fit nowhere are infeasible, naming the table", "[embeddings]") {
  const Cluster c = cluster_preset("a100-80gb", 2);
  EmbeddingOptions o = opts(2, 4);
  o.memory_budget_bytes = 1 * kGiB;
  CHECK_THROWS_AS(plan_embeddings({table("giant", 1'000'000'000, 64)}, c, o), InfeasibleError);
  CHECK_THROWS_WITH(plan_embeddings({table("giant", 1'000'000'000, 64)}, c, o), Catch::Contains("giant"));
}

TEST_CASE("plan: 1000 tables on 128 ranks stay within memory and near the bound", "[embeddings]") {
  const Cluster c = cluster_preset("a100-80gb", 128);
  std::vector<EmbeddingTable> tables;
  for (int i = 0; i < 1000; ++i) {
    // Power-law sizes: a few huge tables, many small ones; several pooling factors.
    const int64_t rows = 1000 + static_cast<int64_t>(2e8 / ((i + 1) * (i + 1) / 4.0 + 1));
    tables.push_back(table("t" + std::to_string(i), rows, 32 * (1 + i % 4), 1 + i % 30));
  }
  const EmbeddingPlan plan = plan_embeddings(tables, c, opts(128, 512));
  CHECK(plan.placements.size() == 1000);
  for (const auto& r : plan.ranks) CHECK(r.storage_bytes <= c.usable_memory_bytes());
  CHECK(plan.lower_bound_s <= plan.max_rank_s * (1 + 1e-9));
  CHECK(plan.max_rank_s <= plan.lower_bound_s * 2.0);
}

TEST_CASE("embedding plan JSON round-trips and names bad fields", "[embeddings][json]") {
  const Cluster c = cluster_preset("a100-80gb", 4);
  EmbeddingTable seq = table("seq", 5000, 16, 7, 2);
  seq.pooling = EmbeddingPooling::none;
  EmbeddingOptions o = opts(4, 32);
  o.optimizer = EmbeddingOptimizer::rowwise_adagrad;
  const EmbeddingPlan plan = plan_embeddings({table("a", 1000, 32), seq}, c, o);
  const std::string text = embeddings_to_json(plan);
  const EmbeddingPlan back = embeddings_from_json(text);
  CHECK(back == plan);
  CHECK(embeddings_to_json(back) == text);

  nlohmann::ordered_json bad = nlohmann::ordered_json::parse(text);
  bad["placements"][1]["sharding"] = "diagonal";
  CHECK_THROWS_WITH(embeddings_from_json(bad.dump()),
                    Catch::Contains("embeddings.placements[1].sharding") && Catch::Contains("diagonal"));
  CHECK_THROWS_AS(embeddings_from_json("{"), FormatError);
  std::string extra = text;
  extra.insert(1, "\"colour\": 1,");
  CHECK_THROWS_WITH(embeddings_from_json(extra), Catch::Contains("embeddings.colour") && Catch::Contains("unknown field"));
}
