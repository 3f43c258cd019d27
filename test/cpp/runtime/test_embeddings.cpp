// Sharded embedding tables from C++ (monarch/runtime/sharded_embeddings.h): every sharding
// kind and a planner-chosen mix train on 2 and 4 ranks exactly like one process holding the
// whole tables, with SGD and row-wise Adagrad. The reference is written independently here:
// at::embedding_bag over whole tables, autograd, the optimizers on dense gradients.
#include "catch_with_torch.h"

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "harness.h"
#include "monarch/planner/embeddings.h"
#include "monarch/runtime/device_mesh.h"
#include "monarch/runtime/sharded_embeddings.h"
#include "monarch/runtime/world.h"

namespace mp = monarch::planner;
using monarch::testing::LaunchResult;

namespace {

constexpr int64_t kGlobalBatch = 8;
constexpr int kSteps = 4;
constexpr double kLr = 0.05;

struct TableSpec {
  const char* name;
  int64_t rows, dim;
  std::vector<std::string> features;
  mp::EmbeddingPooling pooling;
};

const std::vector<TableSpec>& specs() {
  static const std::vector<TableSpec> s = {
      {"small", 50, 8, {"a", "b"}, mp::EmbeddingPooling::sum},
      {"mean", 40, 8, {"c"}, mp::EmbeddingPooling::mean},
      {"odd", 97, 16, {"d"}, mp::EmbeddingPooling::sum},
  };
  return s;
}

std::vector<mp::EmbeddingTable> planner_tables() {
  std::vector<mp::EmbeddingTable> out;
  for (const auto& s : specs()) {
    mp::EmbeddingTable t;
    t.name = s.name;
    t.rows = s.rows;
    t.dim = s.dim;
    t.features = s.features;
    t.pooling = s.pooling;
    t.pooling_factor = 2;
    out.push_back(t);
  }
  return out;
}

std::vector<at::Tensor> initial_tables() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(123);
  std::vector<at::Tensor> out;
  for (const auto& s : specs()) out.push_back(at::empty({s.rows, s.dim}).uniform_(-0.5, 0.5, gen));
  return out;
}

// The global batch of a step: every feature 0-4 power-law ids per sample; and the fixed
// per-sample output weights of the loss.
monarch::JaggedBatch global_batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  monarch::JaggedBatch b;
  std::vector<at::Tensor> values, lengths;
  for (const auto& s : specs()) {
    for (const auto& f : s.features) {
      b.keys.push_back(f);
      auto lens = at::randint(0, 5, {kGlobalBatch}, gen, at::kLong);
      const int64_t n = lens.sum().item<int64_t>();
      values.push_back((at::rand({n}, gen).pow(3) * s.rows).to(at::kLong).clamp_max(s.rows - 1));
      lengths.push_back(lens);
    }
  }
  b.values = at::cat(values);
  b.lengths = at::cat(lengths);
  return b;
}

int64_t width() {
  int64_t w = 0;
  for (const auto& s : specs()) w += s.dim * static_cast<int64_t>(s.features.size());
  return w;
}

at::Tensor loss_weights() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
  return at::randn({kGlobalBatch, width()}, gen);
}

// Samples [begin, end) of a batch.
monarch::JaggedBatch slice(const monarch::JaggedBatch& b, int64_t begin, int64_t end) {
  const int64_t B = b.batch_size();
  monarch::JaggedBatch out;
  out.keys = b.keys;
  std::vector<at::Tensor> values, lengths;
  int64_t at = 0;
  for (size_t k = 0; k < b.keys.size(); ++k) {
    const auto lens = b.lengths.slice(0, k * B, (k + 1) * B);
    const auto offsets = at::cat({at::zeros({1}, at::kLong), lens.cumsum(0)});
    values.push_back(b.values.slice(0, at + offsets[begin].item<int64_t>(), at + offsets[end].item<int64_t>()));
    lengths.push_back(lens.slice(0, begin, end));
    at += offsets[B].item<int64_t>();
  }
  out.values = at::cat(values);
  out.lengths = at::cat(lengths);
  return out;
}

at::Tensor loss_of(const at::Tensor& pooled, const at::Tensor& weights) {
  return at::softplus((pooled * weights).sum(1)).mean();
}

struct Record {
  std::vector<double> losses;
  std::vector<at::Tensor> tables;
};

// One process, whole tables, the global batch.
Record reference(mp::EmbeddingOptimizer optimizer) {
  std::vector<at::Tensor> tables = initial_tables(), state;
  for (auto& t : tables) {
    t.requires_grad_(true);
    state.push_back(at::zeros({t.size(0)}));
  }
  const auto w = loss_weights();
  Record r;
  for (int step = 0; step < kSteps; ++step) {
    const auto b = global_batch(step);
    std::vector<at::Tensor> outs;
    size_t k = 0;
    int64_t at = 0;
    for (size_t t = 0; t < specs().size(); ++t) {
      for (size_t f = 0; f < specs()[t].features.size(); ++f, ++k) {
        const auto lens = b.lengths.slice(0, k * kGlobalBatch, (k + 1) * kGlobalBatch);
        const int64_t n = lens.sum().item<int64_t>();
        const auto ids = b.values.slice(0, at, at + n);
        at += n;
        const auto offsets = at::cat({at::zeros({1}, at::kLong), lens.cumsum(0).slice(0, 0, kGlobalBatch - 1)});
        const int mode = specs()[t].pooling == mp::EmbeddingPooling::mean ? 1 : 0;
        outs.push_back(std::get<0>(at::embedding_bag(tables[t], ids, offsets, false, mode)));
      }
    }
    const auto loss = loss_of(at::cat(outs, 1), w);
    loss.backward();
    r.losses.push_back(loss.item<double>());
    at::NoGradGuard no_grad;
    for (size_t t = 0; t < tables.size(); ++t) {
      auto g = tables[t].grad();
      if (optimizer == mp::EmbeddingOptimizer::sgd) {
        tables[t].sub_(g * kLr);
      } else {
        state[t].add_(g.pow(2).mean(1));
        tables[t].sub_(g * kLr / (state[t].sqrt() + 1e-8).unsqueeze(1));
      }
      g.zero_();
    }
  }
  for (auto& t : tables) r.tables.push_back(t.detach().clone());
  return r;
}

// MONARCH_TEST_SCENARIO=embeddings:<optimizer>:<layout>
Record train_sharded(monarch::Communicator& group, mp::EmbeddingOptimizer optimizer, const std::string& layout) {
  std::map<std::string, mp::EmbeddingSharding> pins;
  if (layout == "mix") {
    pins = {{"small", mp::EmbeddingSharding::table_wise}, {"mean", mp::EmbeddingSharding::row_wise}};
  } else {
    for (const auto& s : specs()) pins[s.name] = mp::embedding_sharding_from_string(layout);
  }
  const int64_t world = group.size(), rank = group.group_rank();
  const int64_t local = kGlobalBatch / world;
  mp::EmbeddingOptions options;
  options.world_size = world;
  options.batch_per_rank = local;
  options.optimizer = optimizer;
  options.pins = pins;
  const auto plan = mp::plan_embeddings(planner_tables(), mp::cluster_preset("a100-80gb", world), options);
  monarch::EmbeddingOptimizerConfig config;
  config.kind = optimizer;
  config.lr = kLr;
  monarch::ShardedEmbeddingTables tables(plan, group, config);
  const auto init = initial_tables();
  for (size_t t = 0; t < specs().size(); ++t) tables.load_table(specs()[t].name, init[t]);
  const auto w = loss_weights().slice(0, rank * local, (rank + 1) * local);
  Record r;
  for (int step = 0; step < kSteps; ++step) {
    const auto b = slice(global_batch(step), rank * local, (rank + 1) * local);
    const auto loss = loss_of(tables.forward(b), w);
    loss.backward();
    auto mean = torch::tensor({loss.item<double>()}, torch::kDouble);
    group.all_reduce(mean, /*average=*/true).wait();
    r.losses.push_back(mean.item<double>());
  }
  for (const auto& s : specs()) r.tables.push_back(tables.full_table(s.name));
  return r;
}

const char* kLayouts[] = {"data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "mix"};

}  // namespace

namespace monarch::testing {

// Returns -1 when `scenario` is not an embeddings scenario.
int run_embedding_worker(const std::string& scenario, const std::string& out) {
  if (scenario.rfind("embeddings:", 0) != 0) return -1;
  torch::set_num_threads(1);
  const auto optimizer = mp::embedding_optimizer_from_string(scenario.substr(std::string("embeddings:").size()));
  auto world = World::init(InitOptions{});
  planner::Mesh shape;
  shape.dp = world->size();
  DeviceMesh mesh(world, shape);
  std::vector<at::Tensor> saved;
  for (const char* layout : kLayouts) {
    const Record r = train_sharded(mesh.group("dp"), optimizer, layout);
    saved.push_back(torch::tensor(r.losses, torch::kDouble));
    saved.insert(saved.end(), r.tables.begin(), r.tables.end());
  }
  torch::save(saved, out);
  return 0;
}

}  // namespace monarch::testing

TEST_CASE("C++ sharded embeddings: every sharding trains like one process", "[runtime][embeddings]") {
  for (const auto optimizer : {mp::EmbeddingOptimizer::sgd, mp::EmbeddingOptimizer::rowwise_adagrad}) {
    const Record ref = reference(optimizer);
    const auto start = initial_tables();
    for (int ranks : {2, 4}) {
      const LaunchResult r = monarch::testing::launch_ranks(ranks, "embeddings:" + mp::to_string(optimizer),
                                                            std::chrono::seconds(180));
      INFO(r.describe());
      REQUIRE(r.all_ok());
      std::vector<at::Tensor> saved;
      torch::load(saved, r.output_dir + "/rank0.pt");
      size_t at = 0;
      for (const char* layout : kLayouts) {
        INFO(mp::to_string(optimizer) << " on " << ranks << " ranks, " << layout);
        const auto losses = saved.at(at++);
        for (int s = 0; s < kSteps; ++s) CHECK(losses[s].item<double>() == Approx(ref.losses[s]).epsilon(1e-5));
        for (size_t t = 0; t < specs().size(); ++t) {
          const auto got = saved.at(at++);
          CHECK(at::allclose(got, ref.tables[t], 1e-5, 1e-6));
          // The updates themselves, so a wrong gradient scale cannot hide in the tolerance.
          CHECK(at::allclose(got - start[t], ref.tables[t] - start[t], 1e-3, 1e-7));
        }
      }
    }
  }
}
