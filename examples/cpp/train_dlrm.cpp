// A DLRM (Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and
// Recommendation Systems", arXiv:1906.00091) written with torch::nn: a bottom MLP over dense
// features, embedding bags over sparse features, their pairwise dot-product interaction and a
// top MLP giving a click logit. Its tables are planned by the planner for this job and sharded
// over the ranks (monarch::shard_embeddings: table-, row-, column-wise ... per table, by cost),
// the dense part runs data-parallel (monarch::DataParallel); then rank 0 trains the same model
// in one process and prints whether they agree. Launch it as users launch jobs:
//
//   torchrun --no-python --nproc-per-node 4 build/bin/train_dlrm
//   torchrun --no-python --nproc-per-node 4 build/bin/train_dlrm --pins user=row_wise,item=column_wise
//
// Flags: --steps N, --batch N (global), --optimizer sgd|rowwise_adagrad (the tables' fused
// optimizer), --pins TABLE=SHARDING,... (data_parallel, table_wise, row_wise, column_wise,
// table_row_wise).
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "monarch/embeddings.h"
#include "monarch/parallel.h"
#include "monarch/runtime/world.h"

namespace {

struct Config {
  int64_t dense = 8, dim = 16, global_batch = 32, steps = 5;
  double dense_lr = 1e-2, table_lr = 0.1;
  monarch::planner::EmbeddingOptimizer optimizer = monarch::planner::EmbeddingOptimizer::rowwise_adagrad;
};

// Three tables; "item" is looked up by two features (the item shown and the last one
// clicked), "category" is mean-pooled.
std::vector<monarch::EmbeddingBagConfig> tables(const Config& c) {
  using monarch::planner::EmbeddingPooling;
  return {{"user", 400, c.dim, {"user"}, EmbeddingPooling::sum, 1.0},
          {"item", 300, c.dim, {"item", "last_item"}, EmbeddingPooling::sum, 2.0},
          {"category", 24, c.dim, {"category"}, EmbeddingPooling::mean, 3.0}};
}

torch::nn::Sequential mlp(std::vector<int64_t> sizes, bool last_relu) {
  torch::nn::Sequential seq;
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    seq->push_back(torch::nn::Linear(sizes[i], sizes[i + 1]));
    if (i + 2 < sizes.size() || last_relu) seq->push_back(torch::nn::ReLU());
  }
  return seq;
}

struct DlrmImpl : torch::nn::Module {
  explicit DlrmImpl(const Config& c) {
    torch::manual_seed(7);  // every rank and the reference build the same weights
    bottom = register_module("bottom", mlp({c.dense, 32, c.dim}, true));
    embeddings = register_module("embeddings", monarch::EmbeddingBagCollection(tables(c)));
    const int64_t vectors = 1 + static_cast<int64_t>(embeddings->output_keys().size());
    top = register_module("top", mlp({c.dim + vectors * (vectors - 1) / 2, 32, 1}, false));
  }

  // The tables sharded over the job: the registered child swapped for the sharded collection,
  // so the model's parameters are the dense part's alone.
  void shard(monarch::ShardOptions options) {
    sharded = monarch::shard_embeddings(embeddings, std::move(options));
    replace_module("embeddings", sharded);
    embeddings = nullptr;
  }

  torch::Tensor forward(const torch::Tensor& dense, const monarch::JaggedBatch& sparse) {
    auto x = bottom->forward(dense);                                           // [B, dim]
    auto pooled = sharded ? sharded->forward(sparse) : embeddings->forward(sparse);  // [B, features * dim]
    const int64_t B = x.size(0), dim = x.size(1);
    auto vectors = torch::cat({x.unsqueeze(1), pooled.view({B, -1, dim})}, 1);  // [B, 1 + features, dim]
    // Dot interaction: every pair of vectors once (the strict lower triangle of T T^T).
    auto dots = torch::bmm(vectors, vectors.transpose(1, 2));
    const int64_t n = vectors.size(1);
    auto pairs = torch::tril_indices(n, n, -1);
    auto interactions = dots.index({torch::indexing::Slice(), pairs[0], pairs[1]});
    return top->forward(torch::cat({x, interactions}, 1)).squeeze(1);
  }

  torch::nn::Sequential bottom{nullptr}, top{nullptr};
  monarch::EmbeddingBagCollection embeddings{nullptr};
  monarch::ShardedEmbeddingBagCollection sharded{nullptr};
};
TORCH_MODULE(Dlrm);

struct Batch {
  torch::Tensor dense, labels;
  monarch::JaggedBatch sparse;
};

// The global batch of step `step`: dense features, 1-3 ids per sparse feature, click labels.
Batch make_batch(const Config& c, int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  Batch b;
  b.dense = torch::randn({c.global_batch, c.dense}, gen);
  const std::vector<std::pair<std::string, int64_t>> features = {
      {"user", 400}, {"item", 300}, {"last_item", 300}, {"category", 24}};
  std::vector<torch::Tensor> values, lengths;
  for (const auto& [key, rows] : features) {
    auto lens = torch::randint(1, 4, {c.global_batch}, gen, torch::kLong);
    b.sparse.keys.push_back(key);
    lengths.push_back(lens);
    values.push_back(torch::randint(rows, {lens.sum().item<int64_t>()}, gen, torch::kLong));
  }
  b.sparse.values = torch::cat(values);
  b.sparse.lengths = torch::cat(lengths);
  b.labels = (b.dense.sum(1) > 0).to(torch::kFloat);  // learnable from the dense features
  return b;
}

// Samples [begin, end) of a batch (dense rows and each feature's ids).
Batch slice(const Batch& b, int64_t begin, int64_t end) {
  Batch out;
  out.dense = b.dense.narrow(0, begin, end - begin);
  out.labels = b.labels.narrow(0, begin, end - begin);
  out.sparse = monarch::samples(b.sparse, begin, end);
  return out;
}

// FBGEMM's row-wise Adagrad on a whole table (the reference for the engine's fused update):
// one accumulator per row, the mean of its squared gradient; untouched rows do not move.
void rowwise_adagrad(torch::Tensor& weight, const torch::Tensor& grad, torch::Tensor& state, double lr) {
  torch::NoGradGuard no_grad;
  state.add_(grad.pow(2).mean(1));
  weight.add_(-lr * grad / (state.sqrt() + 1e-8).unsqueeze(1));
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

int64_t int_flag(const std::map<std::string, std::string>& args, const std::string& key, int64_t fallback) {
  auto it = args.find(key);
  if (it == args.end()) return fallback;
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(it->second, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != it->second.size()) {
    throw std::invalid_argument("train_dlrm: --" + key + " takes an integer, got '" + it->second + "'");
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> args;
  const std::set<std::string> known = {"steps", "batch", "optimizer", "pins"};
  for (int i = 1; i < argc; i += 2) {
    const std::string key = argv[i];
    if (key.rfind("--", 0) != 0 || !known.count(key.substr(2)) || i + 1 >= argc) {
      std::cerr << "train_dlrm: bad flag " << key << " (known: --steps N --batch N --optimizer sgd|rowwise_adagrad "
                << "--pins TABLE=SHARDING,...)\n";
      return 2;
    }
    args[key.substr(2)] = argv[i + 1];
  }
  try {
    Config c;
    c.steps = int_flag(args, "steps", c.steps);
    c.global_batch = int_flag(args, "batch", c.global_batch);
    if (args.count("optimizer")) c.optimizer = monarch::planner::embedding_optimizer_from_string(args["optimizer"]);
    if (c.optimizer == monarch::planner::EmbeddingOptimizer::adam) {
      throw std::invalid_argument("train_dlrm: --optimizer adam has no one-process reference here (sgd, rowwise_adagrad)");
    }
    std::map<std::string, monarch::planner::EmbeddingSharding> pins;
    if (args.count("pins")) {
      std::stringstream list(args["pins"]);
      std::string item;
      while (std::getline(list, item, ',')) {
        const auto eq = item.find('=');
        if (eq == std::string::npos) throw std::invalid_argument("train_dlrm: --pins takes TABLE=SHARDING,..., got '" + item + "'");
        pins[item.substr(0, eq)] = monarch::planner::embedding_sharding_from_string(item.substr(eq + 1));
      }
    }

    auto world = monarch::World::init();
    const int rank = world->rank(), size = world->size();
    const bool lead = rank == 0;
    if (c.global_batch % size != 0) {
      throw std::invalid_argument("train_dlrm: --batch " + std::to_string(c.global_batch) + " is not a multiple of the " +
                                  std::to_string(size) + " ranks");
    }
    const int64_t local = c.global_batch / size;

    // The tables planned for this job (a CPU cluster of `size` ranks) and sharded; the dense
    // part data-parallel over the same ranks.
    Dlrm model(c);
    monarch::ShardOptions so;
    so.world = world;
    so.batch_per_rank = local;
    so.optimizer.kind = c.optimizer;
    so.optimizer.lr = c.table_lr;
    so.pins = pins;
    model->shard(so);
    if (lead) {
      std::printf("tables:");
      for (const auto& p : model->sharded->plan().placements) {
        std::printf(" %s=%s", p.table.c_str(), monarch::planner::to_string(p.sharding).c_str());
      }
      std::printf("\n");
    }
    monarch::planner::Mesh flat;
    flat.dp = size;
    monarch::DeviceMesh mesh(world, flat);
    monarch::DataParallel dp(model.ptr(), mesh.group("dp"));
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(c.dense_lr).weight_decay(0.0));

    std::vector<double> losses;
    for (int64_t step = 0; step < c.steps; ++step) {
      const Batch mine = slice(make_batch(c, step), rank * local, (rank + 1) * local);
      opt.zero_grad();
      dp.begin_forward();
      auto loss = torch::binary_cross_entropy_with_logits(model->forward(mine.dense, mine.sparse), mine.labels);
      loss.backward();  // dense gradients averaged over the ranks; the tables' rows updated in place
      opt.step();
      auto global = loss.detach().clone().view({1});
      mesh.group("dp").all_reduce(global, /*average=*/true).wait();
      losses.push_back(global.item<double>());
      if (lead) std::printf("step %lld  loss %.6f\n", static_cast<long long>(step), losses.back());
    }
    std::map<std::string, torch::Tensor> trained_tables;
    for (const auto& t : tables(c)) trained_tables[t.name] = model->sharded->full_table(t.name);  // collective

    int status = 0;
    if (lead) {
      Dlrm reference(c);
      torch::optim::AdamW ref_opt(reference->bottom->parameters(), torch::optim::AdamWOptions(c.dense_lr).weight_decay(0.0));
      ref_opt.add_param_group(torch::optim::OptimizerParamGroup(reference->top->parameters()));
      std::map<std::string, torch::Tensor> state;
      for (const auto& t : tables(c)) state[t.name] = torch::zeros({t.rows});
      double worst_loss = 0;
      for (int64_t step = 0; step < c.steps; ++step) {
        const Batch b = make_batch(c, step);
        ref_opt.zero_grad();
        reference->embeddings->zero_grad();
        auto loss = torch::binary_cross_entropy_with_logits(reference->forward(b.dense, b.sparse), b.labels);
        loss.backward();
        ref_opt.step();
        for (const auto& t : tables(c)) {
          auto& w = reference->embeddings->weight(t.name);
          if (c.optimizer == monarch::planner::EmbeddingOptimizer::sgd) {
            torch::NoGradGuard no_grad;
            w.add_(-c.table_lr * w.grad());
          } else {
            rowwise_adagrad(w, w.grad(), state[t.name], c.table_lr);
          }
        }
        worst_loss = std::max(worst_loss, rel(losses[step], loss.item<double>()));
      }
      double worst_table = 0, worst_dense = 0;
      for (const auto& [name, t] : trained_tables) {
        const auto& expected = reference->embeddings->weight(name);
        worst_table = std::max(worst_table, ((t - expected).abs().max() / expected.abs().max()).item<double>());
      }
      auto ours = model->named_parameters(), theirs = reference->named_parameters();
      for (const auto& item : ours) {
        const auto& expected = theirs[item.key()];
        worst_dense = std::max(worst_dense, ((item.value() - expected).abs().max() / expected.abs().max()).item<double>());
      }
      // fp32 sums in another order (all-to-all pooling, gradient all-reduce); Adam's
      // normalization amplifies near-zero gradient differences a little.
      const bool ok = worst_loss < 1e-5 && worst_table < 1e-4 && worst_dense < 1e-3;
      std::printf("parity with 1 process (%d ranks, %lld steps): %s, worst relative difference %.2e (losses), %.2e "
                  "(tables), %.2e (dense)\n",
                  size, static_cast<long long>(c.steps), ok ? "ok" : "FAILED", worst_loss, worst_table, worst_dense);
      status = ok ? 0 : 1;
    }
    return status;
  } catch (const std::exception& e) {
    // One write per line: the ranks share the launcher's stderr, and pieces written apart interleave.
    std::cerr << (std::string("train_dlrm: ") + e.what() + "\n") << std::flush;
    return 1;
  }
}
