#include <algorithm>
#include "training.h"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <set>
#include <thread>

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
TrainRecord train_data_parallel(Communicator& dp, const TrainOptions& o, DataParallelOptions dpo,
                                NodeGroups* nodes = nullptr) {
  GptConfig config;
  TinyGpt model = make_model(config, /*seed=*/1234 + dp.group_rank());  // broadcast fixes it
  DataParallelEngine engine(model->parameters(), model->buffers(), dp, dpo, nodes);
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

// Fully-sharded training (ZeRO stage 1-3): blocks are the sharding units, the optimizer
// steps on the shards. Also records memory facts and the state-dict round trip.
TrainRecord train_fully_sharded(Communicator& dp, const TrainOptions& o, FullyShardOptions fso,
                                std::vector<double>& facts, NodeGroups* nodes = nullptr) {
  GptConfig config;
  TinyGpt model = make_model(config, /*seed=*/1234 + dp.group_rank());
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (const auto& block : *model->blocks) units.push_back(block);
  FullyShard sharded(model.ptr(), units, dp, fso, nodes);
  model->sharded = &sharded;
  auto optimizer = make_optimizer(sharded.shards(), o.lr);
  const int64_t local = o.global_batch / dp.size();
  std::vector<double> losses;
  for (int step = 0; step < o.steps; ++step) {
    auto [inputs, targets] = batch_for_step(config, step, o.global_batch);
    optimizer.zero_grad();
    const int64_t begin = dp.group_rank() * local;
    auto loss = lm_loss(model->forward(inputs.narrow(0, begin, local)), targets.narrow(0, begin, local));
    loss.backward();
    optimizer.step();
    auto global = torch::tensor({loss.item<double>()}, torch::kDouble);
    dp.all_reduce(global, /*average=*/true).wait();
    losses.push_back(global.item<double>());
  }
  // Memory facts, from the real local tensors: [shard elements, shard grad elements,
  // optimizer state elements per shard (exp_avg + exp_avg_sq) / 2, model-parameter elements
  // held, model-gradient elements held, expected ceil(unit / N) summed, ..., shard elements
  // stored apart from the parameters].
  double shard = 0, shard_grad = 0, state = 0, held = 0, held_grad = 0, expected = 0, apart = 0;
  const auto shards = sharded.shards();
  std::set<const void*> param_storages;
  for (const auto& p : model->parameters()) param_storages.insert(p.storage().unsafeGetStorageImpl());
  for (const auto& s : shards) {
    shard += s.numel();
    // Shard elements in a storage of their own, not the parameters' (a second fp32 copy).
    if (s.numel() > 0 && !param_storages.count(s.storage().unsafeGetStorageImpl())) apart += s.numel();
    shard_grad += s.grad().defined() ? s.grad().numel() : 0;
    auto& st = static_cast<torch::optim::AdamWParamState&>(
        monarch::compat::optimizer_state(optimizer, s));
    state += (st.exp_avg().numel() + st.exp_avg_sq().numel()) / 2.0;
  }
  for (const auto& p : model->parameters()) {
    held += p.numel();
    held_grad += p.grad().defined() ? p.grad().numel() : 0;
  }
  // This rank's rows of every parameter (dim 0 split in ceil(rows / N) chunks), from an
  // unsharded copy (the sharded model's parameters may hold nothing).
  TinyGpt shape = make_model(config);
  for (const auto& p : shape->parameters()) {
    const int64_t rows = p.dim() == 0 ? 1 : p.size(0), chunk = (rows + dp.size() - 1) / dp.size();
    const int64_t mine = std::clamp<int64_t>(rows - dp.group_rank() * chunk, 0, chunk);
    expected += static_cast<double>(mine * (p.numel() / std::max<int64_t>(rows, 1)));
  }
  // State dict: the full parameters load into a plain model that then computes the same
  // logits as the sharded one.
  auto state_dict = sharded.state_dict();
  TinyGpt plain = make_model(config, 99);
  {
    torch::NoGradGuard no_grad;
    auto named = plain->named_parameters();
    for (const auto& [name, value] : state_dict) named[name].copy_(value);
  }
  auto [inputs, targets] = batch_for_step(config, 1000, o.global_batch);
  torch::Tensor sharded_logits, plain_logits;
  {
    torch::NoGradGuard no_grad;
    sharded_logits = model->forward(inputs);
    model->sharded = nullptr;
    plain_logits = plain->forward(inputs);
  }
  const double logits_diff = (sharded_logits - plain_logits).abs().max().item<double>();
  facts = {shard, shard_grad, state, held, held_grad, expected, logits_diff,
           static_cast<double>(state_dict.size()), apart};
  return finish(plain, losses);  // the loaded plain model: parameters in module order
}

// Every collective once with values each rank can predict; the results and the byte
// counters go back to the driver (as `params`, in a fixed order).
TrainRecord exercise_collectives(Communicator& g) {
  const int64_t n = g.size(), r = g.group_rank();
  TrainRecord out;
  auto ar = torch::full({6}, static_cast<float>(r + 1));
  g.all_reduce(ar).wait();
  out.params.push_back(ar);
  auto ar16 = torch::full({5}, static_cast<float>(r + 1)).to(torch::kBFloat16);
  g.all_reduce(ar16, /*average=*/true).wait();
  out.params.push_back(ar16.to(torch::kFloat));
  auto rs_in = torch::arange(n * 3, torch::kFloat) + 100 * r;  // chunk j: 3j..3j+2 + 100r
  auto rs_out = torch::empty({3});
  g.reduce_scatter(rs_out, rs_in).wait();
  out.params.push_back(rs_out);
  auto ag_out = torch::empty({n * 2});
  g.all_gather(ag_out, torch::full({2}, static_cast<float>(r))).wait();
  out.params.push_back(ag_out);
  auto bc = torch::full({4}, static_cast<float>(r == 0 ? 7 : -1));
  g.broadcast(bc, 0).wait();
  out.params.push_back(bc);
  auto a2a_in = torch::arange(n, torch::kFloat) + 10 * r;  // element j goes to rank j
  auto a2a_out = torch::empty({n});
  g.all_to_all(a2a_out, a2a_in).wait();
  out.params.push_back(a2a_out);
  // Ring of send/recv: to the next rank, from the previous one.
  auto received = torch::empty({3});
  auto send = g.send(torch::full({3}, static_cast<float>(r)), (r + 1) % n, 5);
  g.recv(received, (r + n - 1) % n, 5).wait();
  send.wait();
  out.params.push_back(received);
  std::vector<double> bytes;
  for (auto kind : {CollectiveKind::all_reduce, CollectiveKind::reduce_scatter, CollectiveKind::all_gather,
                    CollectiveKind::broadcast, CollectiveKind::send, CollectiveKind::all_to_all}) {
    bytes.push_back(g.counters().bytes(kind));
  }
  out.params.push_back(torch::tensor(bytes, torch::kDouble));
  // A reduce-scatter whose output is this rank's own chunk of its input (in place).
  auto rs_inplace = torch::arange(n * 3, torch::kFloat) + 100 * r;
  auto own = rs_inplace.narrow(0, 3 * r, 3);
  g.reduce_scatter(own, rs_inplace).wait();
  out.params.push_back(own.clone());
  return out;
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
  } else if (scenario.rfind("dp_hier_", 0) == 0) {
    // Hierarchical reduction (LOCAL_WORLD_SIZE from the driver sets the nodes); the record
    // starts with [bytes sent inside the node, bytes sent between nodes, flat all-reduce bytes
    // of the same buckets on this group].
    dpo.hierarchical = true;
    dpo.inter_node_compression = planner::compression_from_string(scenario.substr(8), "scenario");
    NodeGroups& nodes = mesh.node_groups("dp");
    auto record = train_data_parallel(dp, o, dpo, &nodes);
    double flat = 0;
    {
      GptConfig config;
      for (const auto& p : make_model(config, 0)->parameters()) flat += 4.0 * p.numel();
    }
    const double n = dp.size();
    flat *= 2 * (n - 1) / n * o.steps;
    record.params.insert(record.params.begin(),
                         torch::tensor({nodes.intra->counters().total(), nodes.inter->counters().total(), flat},
                                       torch::kDouble));
    save_record(record, out);
  } else if (scenario == "dp_bytes") {
    auto record = train_data_parallel(dp, o, dpo);
    record.params.insert(record.params.begin(),
                         torch::tensor({dp.counters().bytes(CollectiveKind::all_reduce)}, torch::kDouble));
    save_record(record, out);
  } else if (scenario.rfind("zero3_hier_", 0) == 0) {
    // ZeRO++ (LOCAL_WORLD_SIZE from the driver sets the nodes); the record starts with the
    // memory facts, then [bytes sent inside the node, bytes sent between nodes].
    FullyShardOptions fso;
    fso.zero_stage = 3;
    fso.hierarchical = true;
    fso.inter_node_compression = planner::compression_from_string(scenario.substr(11), "scenario");
    NodeGroups& nodes = mesh.node_groups("dp");
    std::vector<double> facts;
    auto record = train_fully_sharded(dp, o, fso, facts, &nodes);
    record.params.insert(record.params.begin(),
                         torch::tensor({nodes.intra->counters().total(), nodes.inter->counters().total()},
                                       torch::kDouble));
    record.params.insert(record.params.begin(), torch::tensor(facts, torch::kDouble));
    save_record(record, out);
  } else if (scenario.rfind("zero", 0) == 0) {
    FullyShardOptions fso;
    fso.zero_stage = scenario[4] - '0';
    std::vector<double> facts;
    auto record = train_fully_sharded(dp, o, fso, facts);
    record.params.insert(record.params.begin(), torch::tensor(facts, torch::kDouble));
    save_record(record, out);
  } else if (scenario == "collectives") {
    save_record(exercise_collectives(dp), out);
  } else if (scenario == "node_all_reduce") {
    // The shared-memory all-reduce (the mesh marks tp groups node-local): every rank makes
    // every rank's data from its seed and checks the result bit for bit against the sum in
    // group order. Sizes: small ones, one that regrows the slots past 64 KiB, one over the
    // 256 KiB limit (Gloo's path); some ranks late on some calls. Record: [calls that took
    // the shared path, calls checked, mismatches, largest difference on the Gloo path].
    planner::Mesh tp_shape;  // the mesh gives tp groups the shared-memory path
    tp_shape.tp = world->size();
    DeviceMesh tp_mesh(world, tp_shape);
    Communicator& tp = tp_mesh.group("tp");
    const int64_t n = tp.size();
    int64_t checked = 0, mismatches = 0;
    double gloo_difference = 0;
    const auto data = [&](int64_t rank, int64_t call, int64_t numel, torch::ScalarType dtype) {
      torch::manual_seed(1000 * call + rank);
      auto t = torch::randn({numel}, torch::kDouble) * 100;
      return dtype == torch::kLong ? t.round().to(dtype) : t.to(dtype);
    };
    const std::vector<std::pair<int64_t, torch::ScalarType>> cases{
        {2048, torch::kFloat}, {7, torch::kFloat},      {3000, torch::kBFloat16}, {513, torch::kDouble},
        {999, torch::kLong},   {30000, torch::kFloat},  {100000, torch::kFloat},  {40000, torch::kHalf}};
    for (int64_t call = 0; call < 600; ++call) {
      const auto [numel, dtype] = cases[static_cast<size_t>(call) % cases.size()];
      const bool average = call % 5 == 3 && dtype != torch::kLong;
      if (call % 7 == tp.group_rank()) std::this_thread::sleep_for(std::chrono::microseconds(300 * (call % 3)));
      auto buffer = data(tp.group_rank(), call, numel, dtype);
      tp.all_reduce(buffer, average).wait();
      const bool narrow = dtype == torch::kBFloat16 || dtype == torch::kHalf;
      auto expect = data(0, call, numel, dtype).to(narrow ? torch::kFloat : dtype);
      for (int64_t q = 1; q < n; ++q) expect.add_(data(q, call, numel, dtype));
      if (average) expect.div_(n);
      expect = expect.to(dtype);
      if (numel * buffer.element_size() <= 256 * 1024) {
        ++checked;
        if (!torch::equal(buffer, expect)) ++mismatches;
      } else {
        gloo_difference = std::max(gloo_difference, (buffer.to(torch::kDouble) - expect.to(torch::kDouble)).abs().max().item<double>());
      }
    }
    TrainRecord record;
    record.params.push_back(torch::tensor({static_cast<double>(tp.node_all_reduces()), static_cast<double>(checked),
                                           static_cast<double>(mismatches), gloo_difference},
                                          torch::kDouble));
    save_record(record, out);
  } else if (scenario == "node_all_reduce_dead") {
    // Rank 1 exits before its third all-reduce (checks off: the data path itself must notice).
    planner::Mesh tp_shape;
    tp_shape.tp = world->size();
    DeviceMesh tp_mesh(world, tp_shape);
    Communicator& tp = tp_mesh.group("tp");
    std::ofstream text(out + ".txt");
    auto t = torch::ones({16});
    tp.all_reduce(t).wait();
    tp.set_checks_collectives(false);
    tp.all_reduce(t).wait();
    if (tp.group_rank() == 1) std::_Exit(0);
    const auto start = std::chrono::steady_clock::now();
    try {
      tp.all_reduce(t).wait();
      text << "no error\n";
    } catch (const c10::Error& e) {
      text << e.what_without_backtrace() << "\n";
    }
    text << "seconds " << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << "\n";
    try {
      tp.all_reduce(t).wait();
    } catch (const c10::Error& e) {
      text << "---\n" << e.what_without_backtrace() << "\n";
    }
    text.flush();
    std::_Exit(0);  // the group's other threads wait for a peer that is gone
  } else if (scenario == "collective_mismatch") {
    // Rank 0 all-reduces 4 numbers, rank 1 eight, then each tries again: every call fails
    // with the first error naming both sides (no abort in Gloo's I/O thread).
    std::ofstream text(out + ".txt");
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        auto t = torch::ones({dp.group_rank() == 0 ? 4 : 8});
        dp.all_reduce(t).wait();
        text << "no error\n";
      } catch (const c10::Error& e) {
        text << e.what_without_backtrace() << "\n---\n";
      }
    }
  } else if (scenario == "expect_all_alone") {
    std::ofstream text(out + ".txt");
    if (dp.group_rank() == 0) {
      const auto start = std::chrono::steady_clock::now();
      try {
        dp.expect_all("state_dict()", std::chrono::milliseconds(1000));
        text << "no error\n";
      } catch (const c10::Error& e) {
        text << e.what_without_backtrace() << "\n";
      }
      text << "seconds " << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << "\n";
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(3));
    }
    // Nothing is left pending: both ranks can still use the group.
    auto t = torch::ones({3});
    dp.all_reduce(t).wait();
    text << "after " << t.sum().item<float>() << "\n";
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
