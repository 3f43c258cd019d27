#include "training.h"

#include <cstdlib>
#include <iostream>

#include "harness.h"
#include "monarch/runtime/data_parallel.h"
#include "monarch/runtime/device_mesh.h"

namespace monarch::testing {
namespace {

torch::optim::AdamW make_optimizer(std::vector<torch::Tensor> params, double lr) {
  return torch::optim::AdamW(params, torch::optim::AdamWOptions(lr).weight_decay(0.01));
}

TrainRecord finish(TinyGpt& model, std::vector<double> losses) {
  TrainRecord r;
  r.losses = std::move(losses);
  for (const auto& p : model->parameters()) r.params.push_back(p.detach().clone());
  return r;
}

InitOptions init_options() {
  InitOptions o;
  if (const char* ms = std::getenv("MONARCH_TIMEOUT_MS")) o.timeout = std::chrono::milliseconds(std::atol(ms));
  return o;
}

}  // namespace

TrainRecord train_reference(const TrainOptions& o) {
  torch::set_num_threads(1);  // the workers run single-threaded: same reduction order
  GptConfig config;
  TinyGpt model = make_model(config);
  auto optimizer = make_optimizer(model->parameters(), o.lr);
  std::vector<double> losses;
  for (int step = 0; step < o.steps; ++step) {
    auto [inputs, targets] = batch_for_step(config, step, o.global_batch);
    optimizer.zero_grad();
    auto loss = lm_loss(model->forward(inputs), targets);
    loss.backward();
    optimizer.step();
    losses.push_back(loss.item<double>());
  }
  return finish(model, losses);
}

void save_record(const TrainRecord& record, const std::string& path) {
  std::vector<torch::Tensor> tensors{torch::tensor(record.losses, torch::kDouble)};
  tensors.insert(tensors.end(), record.params.begin(), record.params.end());
  torch::save(tensors, path);
}

TrainRecord load_record(const std::string& path) {
  std::vector<torch::Tensor> tensors;
  torch::load(tensors, path);
  TrainRecord r;
  auto losses = tensors.at(0);
  for (int64_t i = 0; i < losses.numel(); ++i) r.losses.push_back(losses[i].item<double>());
  r.params.assign(tensors.begin() + 1, tensors.end());
  return r;
}

namespace {

// Data-parallel training on this rank's slice of every global batch.
TrainRecord train_data_parallel(Communicator& dp, const TrainOptions& o, DataParallelOptions dpo) {
  GptConfig config;
  TinyGpt model = make_model(config, /*seed=*/1234 + dp.group_rank());  // broadcast fixes it
  DataParallelEngine engine(model->parameters(), model->buffers(), dp, dpo);
  auto optimizer = make_optimizer(model->parameters(), o.lr);
  const int64_t local = o.global_batch / dp.size();
  const int64_t micro = local / o.accumulation;
  std::vector<double> losses;
  for (int step = 0; step < o.steps; ++step) {
    auto [inputs, targets] = batch_for_step(config, step, o.global_batch);
    optimizer.zero_grad();
    double local_loss = 0;
    for (int k = 0; k < o.accumulation; ++k) {
      engine.set_sync(k == o.accumulation - 1);
      const int64_t begin = dp.group_rank() * local + k * micro;
      auto loss = lm_loss(model->forward(inputs.narrow(0, begin, micro)), targets.narrow(0, begin, micro)) /
                  o.accumulation;
      loss.backward();
      local_loss += loss.item<double>();
    }
    optimizer.step();
    auto global = torch::tensor({local_loss}, torch::kDouble);
    dp.all_reduce(global, /*average=*/true).wait();
    losses.push_back(global.item<double>());
    if (std::getenv("MONARCH_TEST_DIE_AT_STEP") &&
        std::atoi(std::getenv("MONARCH_TEST_DIE_AT_STEP")) == step + 1 && dp.group_rank() == 1) {
      std::cerr << "rank " << dp.global_rank() << ": dying on purpose before step " << step + 1 << "\n";
      std::_Exit(3);
    }
  }
  return finish(model, losses);
}

}  // namespace

int run_worker(const std::string& scenario) {
  torch::set_num_threads(1);
  auto world = World::init(init_options());
  const std::string out = worker_output_dir() + "/rank" + std::to_string(world->rank()) + ".pt";
  planner::Mesh shape;
  shape.dp = world->size();
  if (scenario == "mesh_too_big") shape.dp = world->size() + 1;
  DeviceMesh mesh(world, shape);
  Communicator& dp = mesh.group("dp");
  TrainOptions o;
  DataParallelOptions dpo;
  dpo.bucket_bytes = 16 * 1024;  // several buckets even for the tiny model
  if (scenario == "dp") {
    save_record(train_data_parallel(dp, o, dpo), out);
  } else if (scenario == "dp_accumulate") {
    o.accumulation = 2;
    save_record(train_data_parallel(dp, o, dpo), out);
  } else if (scenario == "dp_bf16") {
    dpo.bf16_compression = true;
    auto record = train_data_parallel(dp, o, dpo);
    record.params.insert(record.params.begin(),
                         torch::tensor({dp.counters().bytes(CollectiveKind::all_reduce)}, torch::kDouble));
    save_record(record, out);
  } else if (scenario == "dp_bytes") {
    auto record = train_data_parallel(dp, o, dpo);
    record.params.insert(record.params.begin(),
                         torch::tensor({dp.counters().bytes(CollectiveKind::all_reduce)}, torch::kDouble));
    save_record(record, out);
  } else if (scenario == "dp_mismatch") {
    GptConfig config;
    if (dp.group_rank() == 1) config.hidden = 16;
    TinyGpt model = make_model(config);
    DataParallelEngine engine(model->parameters(), model->buffers(), dp, dpo);
  } else {
    std::cerr << "unknown scenario '" << scenario << "'\n";
    return 2;
  }
  return 0;
}

}  // namespace monarch::testing
