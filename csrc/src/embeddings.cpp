// monarch/embeddings.h: the C++ face of the sharded embedding engine.
#include "monarch/embeddings.h"

#include <torch/nn/modules/embedding.h>

#include <set>
#include <stdexcept>

#include "monarch/runtime/checksum.h"

namespace monarch {
namespace {

void check_unique(const std::vector<EmbeddingBagConfig>& configs, const char* what) {
  std::set<std::string> names, features;
  for (const auto& t : configs) {
    if (!names.insert(t.name).second) throw std::invalid_argument(std::string(what) + ": two tables are named '" + t.name + "'");
    for (const auto& f : t.features) {
      if (!features.insert(f).second) {
        throw std::invalid_argument(std::string(what) + ": feature '" + f + "' looks up two tables; each feature names one");
      }
    }
  }
}

std::vector<EmbeddingBagConfig> completed(std::vector<EmbeddingBagConfig> configs) {
  for (auto& t : configs) {
    if (t.features.empty()) t.features = {t.name};
    if (t.rows <= 0 || t.dim <= 0) {
      throw std::invalid_argument("EmbeddingBagCollection: table '" + t.name + "': rows and dim must be > 0 (got " +
                                  std::to_string(t.rows) + " x " + std::to_string(t.dim) + ")");
    }
    if (t.pooling == planner::EmbeddingPooling::none) {
      throw std::invalid_argument("EmbeddingBagCollection: table '" + t.name + "' has pooling none; its rows per id "
                                  "are a sequence table's (the sharded engine's forward_all)");
    }
  }
  check_unique(configs, "EmbeddingBagCollection");
  return configs;
}

// The refusal of a plan that is not for these tables or this job: every difference.
void check_plan(const planner::EmbeddingPlan& plan, const std::vector<EmbeddingBagConfig>& configs, int world) {
  std::vector<std::string> problems;
  if (plan.world_size != world) {
    problems.push_back("the plan is for " + std::to_string(plan.world_size) + " ranks, the job has " + std::to_string(world));
  }
  if (plan.tables.size() != configs.size()) {
    problems.push_back("the plan has " + std::to_string(plan.tables.size()) + " tables, the model " +
                       std::to_string(configs.size()));
  }
  for (size_t i = 0; i < std::min(plan.tables.size(), configs.size()); ++i) {
    const auto& p = plan.tables[i];
    const auto& c = configs[i];
    if (p.name != c.name || p.rows != c.rows || p.dim != c.dim || p.features != c.features || p.pooling != c.pooling) {
      problems.push_back("table " + std::to_string(i) + ": the plan has '" + p.name + "' " + std::to_string(p.rows) + "x" +
                         std::to_string(p.dim) + " (" + planner::to_string(p.pooling) + "), the model '" + c.name + "' " +
                         std::to_string(c.rows) + "x" + std::to_string(c.dim) + " (" + planner::to_string(c.pooling) + ")");
    }
  }
  if (!problems.empty()) {
    std::string message = "shard_embeddings: the plan does not match the tables or the job:";
    for (const auto& p : problems) message += "\n  " + p;
    throw std::invalid_argument(message);
  }
}

}  // namespace

JaggedBatch samples(const JaggedBatch& batch, int64_t begin, int64_t end) {
  const int64_t B = batch.batch_size(), keys = static_cast<int64_t>(batch.keys.size());
  if (begin < 0 || end > B || begin > end) {
    throw std::invalid_argument("samples: [" + std::to_string(begin) + ", " + std::to_string(end) +
                                ") is not inside a batch of " + std::to_string(B));
  }
  const at::Tensor lengths = batch.lengths.to(at::kLong).view({keys, B});
  const at::Tensor before = lengths.narrow(1, 0, begin).sum(1), inside = lengths.narrow(1, begin, end - begin).sum(1);
  const at::Tensor key_start = at::cat({at::zeros({1}, at::kLong), lengths.sum(1).cumsum(0)}).narrow(0, 0, keys);
  std::vector<at::Tensor> values, weights;
  for (int64_t k = 0; k < keys; ++k) {
    const int64_t start = key_start[k].item<int64_t>() + before[k].item<int64_t>(), count = inside[k].item<int64_t>();
    values.push_back(batch.values.narrow(0, start, count));
    if (batch.weights.defined()) weights.push_back(batch.weights.narrow(0, start, count));
  }
  JaggedBatch out;
  out.keys = batch.keys;
  out.values = at::cat(values);
  out.lengths = lengths.narrow(1, begin, end - begin).reshape({-1}).contiguous();
  if (batch.weights.defined()) out.weights = at::cat(weights);
  return out;
}

EmbeddingBagCollectionImpl::EmbeddingBagCollectionImpl(std::vector<EmbeddingBagConfig> tables)
    : configs_(completed(std::move(tables))) {
  tables_ = register_module("tables", torch::nn::ModuleDict());
  for (const auto& t : configs_) {
    torch::nn::EmbeddingBagOptions o(t.rows, t.dim);
    if (t.pooling == planner::EmbeddingPooling::mean) {
      o.mode(torch::kMean);
    } else {
      o.mode(torch::kSum);
    }
    tables_->update({{t.name, torch::nn::EmbeddingBag(o).ptr()}});
  }
}

std::vector<std::string> EmbeddingBagCollectionImpl::output_keys() const {
  std::vector<std::string> out;
  for (const auto& t : configs_) out.insert(out.end(), t.features.begin(), t.features.end());
  return out;
}

std::vector<planner::EmbeddingTable> EmbeddingBagCollectionImpl::planner_tables() const {
  std::vector<planner::EmbeddingTable> out;
  for (const auto& t : configs_) {
    planner::EmbeddingTable p;
    p.name = t.name;
    p.rows = t.rows;
    p.dim = t.dim;
    p.features = t.features;
    p.pooling_factor = t.pooling_factor;
    p.pooling = t.pooling;
    out.push_back(p);
  }
  return out;
}

at::Tensor& EmbeddingBagCollectionImpl::weight(const std::string& name) {
  if (!tables_->contains(name)) throw std::invalid_argument("EmbeddingBagCollection has no table '" + name + "'");
  return (*tables_)[name]->as<torch::nn::EmbeddingBag>()->weight;
}

at::Tensor EmbeddingBagCollectionImpl::forward(const JaggedBatch& batch) {
  const int64_t B = batch.batch_size();
  // Each key's ids start where the previous keys' end (the layout is feature-major).
  std::map<std::string, int64_t> key_index;
  for (size_t k = 0; k < batch.keys.size(); ++k) key_index[batch.keys[k]] = static_cast<int64_t>(k);
  const at::Tensor lengths = batch.lengths.to(at::kLong);
  const at::Tensor per_key = lengths.view({static_cast<int64_t>(batch.keys.size()), B}).sum(1);
  const at::Tensor key_start = at::cat({at::zeros({1}, at::kLong), per_key.cumsum(0)});
  std::vector<at::Tensor> outs;
  for (const auto& t : configs_) {
    auto bag = (*tables_)[t.name]->as<torch::nn::EmbeddingBag>();
    for (const auto& f : t.features) {
      auto it = key_index.find(f);
      if (it == key_index.end()) throw std::invalid_argument("JaggedBatch lacks feature '" + f + "'");
      const int64_t k = it->second, start = key_start[k].item<int64_t>(), count = per_key[k].item<int64_t>();
      const at::Tensor ids = batch.values.narrow(0, start, count);
      if (count > 0) {
        const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
        if (lo < 0 || hi >= t.rows) {
          throw std::invalid_argument("feature '" + f + "': id " + std::to_string(lo < 0 ? lo : hi) +
                                      " is out of range for table '" + t.name + "' (" + std::to_string(t.rows) + " rows)");
        }
      }
      const at::Tensor lens = lengths.narrow(0, k * B, B);
      const at::Tensor offsets = at::cat({at::zeros({1}, at::kLong), lens.cumsum(0)}).narrow(0, 0, B);
      at::Tensor weights = batch.weights.defined() ? batch.weights.narrow(0, start, count) : at::Tensor();
      outs.push_back(bag->forward(ids, offsets, weights));
    }
  }
  return at::cat(outs, 1);
}

ShardedEmbeddingBagCollectionImpl::ShardedEmbeddingBagCollectionImpl(std::vector<EmbeddingBagConfig> configs,
                                                                     planner::EmbeddingPlan plan,
                                                                     std::shared_ptr<World> world,
                                                                     const EmbeddingOptimizerConfig& optimizer)
    : configs_(completed(std::move(configs))), world_(std::move(world)) {
  check_plan(plan, configs_, world_->size());
  planner::Mesh flat;
  flat.dp = world_->size();
  mesh_ = std::make_unique<DeviceMesh>(world_, flat);
  engine_ = std::make_unique<ShardedEmbeddingTables>(std::move(plan), mesh_->group("dp"), optimizer);
}

at::Tensor ShardedEmbeddingBagCollectionImpl::forward(const JaggedBatch& batch) { return engine_->forward(batch); }

void ShardedEmbeddingBagCollectionImpl::broadcast_from_first(at::Tensor& t) { mesh_->group("dp").broadcast(t, 0).wait(); }

ShardedEmbeddingBagCollection shard_embeddings(EmbeddingBagCollection& tables, ShardOptions options) {
  if (options.batch_per_rank <= 0) {  // the same on every rank: refused before any collective
    throw std::invalid_argument("shard_embeddings: ShardOptions::batch_per_rank (the samples each rank brings to a "
                                "step) must be set");
  }
  auto world = options.world ? options.world : World::init();
  planner::EmbeddingPlan plan;
  if (options.plan) {
    plan = *options.plan;
  } else {
    planner::EmbeddingOptions eo;
    eo.world_size = world->size();
    eo.batch_per_rank = options.batch_per_rank;
    eo.optimizer = options.optimizer.kind;
    eo.memory_budget_bytes = options.memory_budget_bytes;
    eo.pins = options.pins;
    const planner::Cluster cluster = options.cluster ? *options.cluster : planner::cluster_preset("cpu", world->size());
    plan = planner::plan_embeddings(tables->planner_tables(), cluster, eo);
  }
  // The ranks must shard alike (the same plan text everywhere).
  char settings[96];
  std::snprintf(settings, sizeof(settings), " lr=%.17g eps=%.17g betas=%.17g,%.17g", options.optimizer.lr,
                options.optimizer.eps, options.optimizer.beta1, options.optimizer.beta2);
  const std::string text = planner::embeddings_to_json(plan, -1) + settings;
  char digest[16];
  std::snprintf(digest, sizeof(digest), "%08x", crc32c(text.data(), text.size()));
  world->agree("the embedding plan and optimizer settings (CRC-32C of their text)", digest);
  if (plan.optimizer != options.optimizer.kind) {
    throw std::invalid_argument("shard_embeddings: the plan was made for the " + planner::to_string(plan.optimizer) +
                                " optimizer, ShardOptions::optimizer is " + planner::to_string(options.optimizer.kind));
  }
  ShardedEmbeddingBagCollection sharded(tables->configs(), std::move(plan), world, options.optimizer);
  // Every table starts from rank 0's values (replicas would otherwise differ forever).
  for (const auto& t : tables->configs()) {
    at::Tensor full = tables->weight(t.name).detach().to(at::kFloat).contiguous().clone();
    sharded->broadcast_from_first(full);
    sharded->engine().load_table(t.name, full);
  }
  return sharded;
}

}  // namespace monarch
