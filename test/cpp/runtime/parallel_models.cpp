#include "parallel_models.h"

#include <cstdlib>

#include "harness.h"
#include "monarch/pipeline_parallel.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/schedule.h"
#include "monarch/runtime/device_mesh.h"
#include "monarch/tensor_parallel_modules.h"

namespace monarch::testing {
namespace {

struct FullTpModel {
  torch::nn::Embedding embedding{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr}, head{nullptr};
};

FullTpModel make_full(const TpModelConfig& c) {
  torch::manual_seed(7);
  FullTpModel m;
  m.embedding = torch::nn::Embedding(c.vocab, c.hidden);
  m.up = torch::nn::Linear(c.hidden, c.ffn);
  m.down = torch::nn::Linear(c.ffn, c.hidden);
  m.head = torch::nn::Linear(torch::nn::LinearOptions(c.hidden, c.vocab).bias(false));
  return m;
}

std::pair<torch::Tensor, torch::Tensor> tokens_for_step(const TpModelConfig& c, int step) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  auto t = at::randint(c.vocab, {c.batch, c.seq + 1}, g, at::kLong);
  return {t.narrow(1, 0, c.seq).contiguous(), t.narrow(1, 1, c.seq).contiguous()};
}

std::vector<torch::Tensor> all_params(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::vector<torch::Tensor> out;
  for (const auto& m : modules) {
    for (const auto& p : m->parameters()) out.push_back(p);
  }
  return out;
}

TrainRecord record_of(const std::vector<double>& losses, const std::vector<torch::Tensor>& params) {
  TrainRecord r;
  r.losses = losses;
  for (const auto& p : params) r.params.push_back(p.detach().clone());
  return r;
}

TrainRecord train_tp(DeviceMesh& mesh, bool sequence_parallel) {
  TpModelConfig c;
  Communicator& tp = mesh.group("tp");
  FullTpModel full = make_full(c);
  VocabParallelEmbedding embedding(full.embedding, tp, "embedding");
  ColumnParallelOptions col;
  col.sequence_parallel = sequence_parallel;
  ColumnParallelLinear up(full.up, tp, col, "up");
  RowParallelLinear down(full.down, tp, sequence_parallel, 1, "down");
  ColumnParallelLinear head(full.head, tp, col, "head");
  auto params = all_params({embedding.ptr(), up.ptr(), down.ptr(), head.ptr()});
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(c.lr));
  std::vector<double> losses;
  for (int step = 0; step < c.steps; ++step) {
    auto [inputs, targets] = tokens_for_step(c, step);
    optimizer.zero_grad();
    auto x = embedding->forward(inputs);
    // Sequence parallel: the residual stream holds this rank's part of the sequence.
    if (sequence_parallel) x = tp::scatter_to_group(x, tp, 1);
    x = x + down->forward(torch::gelu(up->forward(x)));
    auto loss = vocab_parallel_cross_entropy(head->forward(x), targets, tp);
    loss.backward();
    optimizer.step();
    losses.push_back(loss.item<double>());
  }
  return record_of(losses, params);
}

struct Chain {
  std::vector<torch::nn::Linear> layers;
};

Chain make_chain() {
  torch::manual_seed(11);
  Chain c;
  for (int i = 0; i < 4; ++i) c.layers.push_back(torch::nn::Linear(8, 8));
  return c;
}

torch::Tensor run_layers(Chain& c, int begin, int end, torch::Tensor x) {
  for (int i = begin; i < end; ++i) x = torch::tanh(c.layers[i]->forward(x));
  return x;
}

std::pair<torch::Tensor, torch::Tensor> chain_batch(int step) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(900 + step);
  return {at::randn({8, 8}, g), at::randn({8, 8}, g)};
}

constexpr int kChainSteps = 4;
constexpr double kChainLr = 0.2;

std::vector<torch::Tensor> chain_params(Chain& c, int begin, int end) {
  std::vector<torch::Tensor> out;
  for (int i = begin; i < end; ++i) {
    for (const auto& p : c.layers[i]->parameters()) out.push_back(p);
  }
  return out;
}

TrainRecord train_chain(DeviceMesh& mesh, planner::ScheduleKind kind) {
  Chain chain = make_chain();
  const int rank = mesh.coordinate("pp");
  const int begin = rank * 2, end = begin + 2;
  auto params = chain_params(chain, begin, end);
  auto schedule = planner::make_schedule(kind, 2, 4);
  std::map<int64_t, PipelineParallel::StageFn> stages{
      {rank, [&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{run_layers(chain, begin, end, in.at(0))}; }}};
  PipelineParallel pipe(schedule, mesh, stages, {{rank, params}});
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(kChainLr));
  std::vector<double> losses;
  for (int step = 0; step < kChainSteps; ++step) {
    auto [x, y] = chain_batch(step);
    optimizer.zero_grad();
    losses.push_back(pipe.train_step(x, y, [](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out, t); }));
    optimizer.step();
  }
  TrainRecord r = record_of(losses, params);
  // The executed compute actions, then the program's, as (type, micro-batch, stage) rows.
  auto encode = [](const std::vector<planner::Action>& actions) {
    std::vector<int64_t> flat;
    for (const auto& a : actions) {
      if (a.type == planner::ActionType::forward || a.type == planner::ActionType::backward ||
          a.type == planner::ActionType::backward_input || a.type == planner::ActionType::backward_weight) {
        flat.insert(flat.end(), {static_cast<int64_t>(a.type), a.micro_batch, a.stage});
      }
    }
    return torch::tensor(flat, torch::kLong);
  };
  r.params.push_back(encode(pipe.last_stats().trace));
  r.params.push_back(encode(pipe.executor().program()));
  return r;
}

}  // namespace

TrainRecord train_tp_reference(const TpModelConfig& c) {
  torch::set_num_threads(1);
  FullTpModel m = make_full(c);
  auto params = all_params({m.embedding.ptr(), m.up.ptr(), m.down.ptr(), m.head.ptr()});
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(c.lr));
  std::vector<double> losses;
  for (int step = 0; step < c.steps; ++step) {
    auto [inputs, targets] = tokens_for_step(c, step);
    optimizer.zero_grad();
    auto x = m.embedding->forward(inputs);
    x = x + m.down->forward(torch::gelu(m.up->forward(x)));
    auto logits = m.head->forward(x);
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, c.vocab}), targets.reshape({-1}));
    loss.backward();
    optimizer.step();
    losses.push_back(loss.item<double>());
  }
  return record_of(losses, params);
}

std::vector<torch::Tensor> tp_expected_shards(const TrainRecord& ref, int64_t rank, int64_t size) {
  const auto& p = ref.params;
  return {tp::shard_tensor(p[0], 0, rank, size), tp::shard_tensor(p[1], 0, rank, size),
          tp::shard_tensor(p[2], 0, rank, size), tp::shard_tensor(p[3], 1, rank, size), p[4],
          tp::shard_tensor(p[5], 0, rank, size)};
}

TrainRecord train_chain_reference() {
  torch::set_num_threads(1);
  Chain chain = make_chain();
  auto params = chain_params(chain, 0, 4);
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(kChainLr));
  std::vector<double> losses;
  for (int step = 0; step < kChainSteps; ++step) {
    auto [x, y] = chain_batch(step);
    optimizer.zero_grad();
    auto loss = torch::mse_loss(run_layers(chain, 0, 4, x), y);
    loss.backward();
    optimizer.step();
    losses.push_back(loss.item<double>());
  }
  return record_of(losses, params);
}

int run_parallel_worker(const std::string& scenario, const std::string& out_path) {
  const bool tp = scenario == "tp_mlp" || scenario == "tp_mlp_sp";
  const bool pp = scenario.rfind("pp_chain_", 0) == 0 || scenario == "pp_bad_schedule";
  if (!tp && !pp) return -1;
  torch::set_num_threads(1);
  InitOptions o;
  if (const char* ms = std::getenv("MONARCH_TIMEOUT_MS")) o.timeout = std::chrono::milliseconds(std::atol(ms));
  auto world = World::init(o);
  planner::Mesh shape;
  shape.dp = 1;
  (tp ? shape.tp : shape.pp) = world->size();
  DeviceMesh mesh(world, shape);
  if (tp) {
    save_record(train_tp(mesh, scenario == "tp_mlp_sp"), out_path);
  } else if (scenario == "pp_bad_schedule") {
    auto schedule = planner::make_schedule(planner::ScheduleKind::one_f_one_b, 2, 4);
    // Rank 0 drops its first activation send: run as is, rank 1 would wait forever.
    auto& prog = schedule.per_rank[0];
    for (auto it = prog.begin(); it != prog.end(); ++it) {
      if (it->type == planner::ActionType::send_activation) {
        prog.erase(it);
        break;
      }
    }
    PipelineExecutor executor(schedule, mesh.group("pp"));  // must throw on every rank
  } else {
    save_record(train_chain(mesh, planner::schedule_from_string(scenario.substr(9))), out_path);
  }
  return 0;
}

}  // namespace monarch::testing
