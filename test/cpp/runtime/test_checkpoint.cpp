// monarch::checkpoint on one process (csrc/src/checkpoint.cpp): every torch::optim optimizer's
// state round trip, the files in the Python format, refusals that change nothing (a corrupt
// slice, a checkpoint of another model, another optimizer's state), the .old fallback of an
// interrupted replacement, latest(). Multi-rank layouts and the C++ <-> Python round trip
// run through the launcher (test/python/test_cpp_frontend.py).
#include "catch_with_torch.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "monarch/checkpoint.h"

namespace fs = std::filesystem;
namespace ckpt = monarch::checkpoint;

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    norm = register_module("norm", torch::nn::BatchNorm1d(8));  // buffers: running mean, var, count
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(norm(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(Net);

Net make_net(int seed) {
  torch::manual_seed(seed);
  return Net();
}

void train(Net& net, torch::optim::Optimizer& opt, int steps, int first = 0) {
  for (int s = first; s < first + steps; ++s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + s);
    auto x = torch::randn({5, 6}, gen);
    opt.zero_grad();
    net->forward(x).pow(2).mean().backward();
    opt.step();
  }
}

std::string temp_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("monarch_ckpt_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

double max_diff(Net& a, Net& b) {
  double worst = 0;
  auto pa = a->named_parameters(), pb = b->named_parameters();
  for (const auto& item : pa) worst = std::max(worst, (item.value() - pb[item.key()]).abs().max().item<double>());
  auto ba = a->named_buffers(), bb = b->named_buffers();
  for (const auto& item : ba) {
    worst = std::max(worst, (item.value().to(at::kDouble) - bb[item.key()].to(at::kDouble)).abs().max().item<double>());
  }
  return worst;
}

template <typename Opt, typename Options>
void round_trip(const Options& options, const std::string& name) {
  const std::string dir = temp_dir(name);
  // The uninterrupted run: 5 steps.
  Net a = make_net(1);
  Opt opt_a(a->parameters(), options);
  train(a, opt_a, 3);
  ckpt::SaveOptions so;
  so.step = 3;
  so.extra_json = R"({"epoch": 2})";
  ckpt::save(*a, &opt_a, dir + "/step3", so);
  train(a, opt_a, 2, 3);
  // Resumed into another model's weights and a fresh optimizer: the same 2 steps, bit for bit.
  Net b = make_net(2);
  Opt opt_b(b->parameters(), options);
  auto info = ckpt::load(*b, &opt_b, dir + "/step3");
  CHECK(info.step == 3);
  CHECK(nlohmann::json::parse(info.extra_json)["epoch"] == 2);
  CHECK(info.world_size == 1);
  train(b, opt_b, 2, 3);
  CHECK(max_diff(a, b) == 0.0);
  fs::remove_all(dir);
}

}  // namespace

TEST_CASE("checkpoint: every torch::optim optimizer resumes bit for bit", "[runtime][checkpoint]") {
  round_trip<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2).weight_decay(0.1), "adamw");
  round_trip<torch::optim::Adam>(torch::optim::AdamOptions(1e-2).amsgrad(true), "adam");
  round_trip<torch::optim::SGD>(torch::optim::SGDOptions(1e-2).momentum(0.9).nesterov(true), "sgd");
  // No momentum: SGD keeps no state; the checkpoint has none for any parameter, and loads.
  round_trip<torch::optim::SGD>(torch::optim::SGDOptions(1e-2), "sgd-plain");
  round_trip<torch::optim::Adagrad>(torch::optim::AdagradOptions(1e-2), "adagrad");
  round_trip<torch::optim::RMSprop>(torch::optim::RMSpropOptions(1e-2).momentum(0.5).centered(true), "rmsprop");
}

TEST_CASE("checkpoint: the files are torch_monarch.checkpoint's format, keys as Python's torch.optim",
          "[runtime][checkpoint]") {
  const std::string dir = temp_dir("format");
  Net a = make_net(1);
  torch::optim::AdamW opt(a->parameters(), torch::optim::AdamWOptions(3e-3));
  train(a, opt, 2);
  ckpt::save(*a, &opt, dir + "/c");
  std::ifstream f(dir + "/c/index.json");
  auto index = nlohmann::json::parse(f);
  CHECK(index["format"] == "monarch-checkpoint");
  CHECK(index["version"] == 2);
  CHECK(index["world_size"] == 1);
  const auto& t = index["tensors"];
  CHECK(t["fc1.weight"]["kind"] == "param");
  CHECK(t["fc1.weight"]["dtype"] == "F32");
  CHECK(t["fc1.weight"]["shape"] == nlohmann::json::array({8, 6}));
  CHECK(t["norm.num_batches_tracked"]["kind"] == "buffer");
  CHECK(t["norm.num_batches_tracked"]["dtype"] == "I64");
  CHECK(t["optimizer.fc1.weight.exp_avg"]["like_param"] == true);
  CHECK(t["optimizer.fc1.weight.step"]["dtype"] == "F32");  // Python keeps Adam's step as a float32 tensor
  CHECK(t["optimizer.fc1.weight.step"]["shape"] == nlohmann::json::array());
  CHECK(!t.contains("optimizer.fc1.weight.max_exp_avg_sq"));  // amsgrad off: no such state
  const auto& slice = t["fc1.weight"]["slices"][0];
  CHECK(slice["file"] == "rank00000.safetensors");
  CHECK(slice["key"] == "fc1.weight@0,0");
  CHECK(slice.contains("crc32c"));
  const auto& group = index["optimizer"]["param_groups"][0];
  CHECK(group["lr"] == 3e-3);
  CHECK(group["betas"] == nlohmann::json::array({0.9, 0.999}));
  CHECK(group["params"].size() == 6);
  // The safetensors header: 8-byte length, JSON, data 8-byte aligned.
  std::ifstream st(dir + "/c/rank00000.safetensors", std::ios::binary);
  uint64_t n = 0;
  st.read(reinterpret_cast<char*>(&n), 8);
  CHECK(n % 8 == 0);
  std::string header(n, ' ');
  st.read(header.data(), static_cast<std::streamsize>(n));
  auto h = nlohmann::json::parse(header);
  CHECK(h["fc1.weight@0,0"]["dtype"] == "F32");
  CHECK(h["fc1.weight@0,0"]["shape"] == nlohmann::json::array({8, 6}));
  CHECK(!fs::exists(dir + "/c.partial"));
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: a corrupt slice, another model, another optimizer: one error, nothing changed",
          "[runtime][checkpoint]") {
  const std::string dir = temp_dir("refusals");
  Net a = make_net(1);
  torch::optim::SGD opt(a->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
  train(a, opt, 1);
  ckpt::save(*a, &opt, dir + "/c");

  Net b = make_net(2);
  Net untouched = make_net(2);
  torch::optim::SGD opt_b(b->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
  {
    // A byte of the data flipped (the last byte of the file: the last tensor's data).
    std::fstream file(dir + "/c/rank00000.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-1, std::ios::end);
    char byte = 0;
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x5a);
    file.seekp(-1, std::ios::end);
    file.write(&byte, 1);
  }
  try {
    ckpt::load(*b, &opt_b, dir + "/c");
    FAIL("a corrupt checkpoint loaded");
  } catch (const ckpt::CheckpointError& e) {
    const std::string what = e.what();
    CHECK(what.find("load failed, nothing was changed") != std::string::npos);
    CHECK(what.find("rank00000.safetensors") != std::string::npos);
    CHECK(what.find("fails its checksum") != std::string::npos);
  }
  CHECK(max_diff(b, untouched) == 0.0);
  CHECK(opt_b.state().empty());

  // A checkpoint of another model: its names are not this model's.
  torch::manual_seed(3);
  auto other = torch::nn::Sequential(torch::nn::Linear(6, 8));
  torch::optim::SGD opt_o(other->parameters(), torch::optim::SGDOptions(1e-2));
  ckpt::save(*other, &opt_o, dir + "/other");
  try {
    ckpt::load(*b, nullptr, dir + "/other");
    FAIL("another model's checkpoint loaded");
  } catch (const ckpt::CheckpointError& e) {
    CHECK(std::string(e.what()).find("has no tensor 'fc1.weight'") != std::string::npos);
  }
  CHECK(max_diff(b, untouched) == 0.0);

  // Another optimizer's state: SGD's momentum into Adam.
  ckpt::save(*a, &opt, dir + "/sgd");
  torch::optim::Adam adam(b->parameters(), torch::optim::AdamOptions(1e-3));
  try {
    ckpt::load(*b, &adam, dir + "/sgd");
    FAIL("SGD's state loaded into Adam");
  } catch (const ckpt::CheckpointError& e) {
    const std::string what = e.what();
    CHECK(what.find("'momentum_buffer'") != std::string::npos);
    CHECK(what.find("torch::optim::Adam") != std::string::npos);
  }
  CHECK(max_diff(b, untouched) == 0.0);
  CHECK(adam.state().empty());

  // A crafted header (offsets outside the file): refused, never read.
  {
    const std::string header = R"({"fc1.weight@0,0":{"dtype":"F32","shape":[8,6],"data_offsets":[4096,4288]}})";
    std::ofstream f(dir + "/sgd/rank00000.safetensors", std::ios::binary | std::ios::trunc);
    const uint64_t n = header.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f.write(header.data(), static_cast<std::streamsize>(n));
  }
  torch::optim::SGD sgd_b(b->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
  try {
    ckpt::load(*b, &sgd_b, dir + "/sgd");
    FAIL("a crafted header loaded");
  } catch (const ckpt::CheckpointError& e) {
    CHECK(std::string(e.what()).find("rank00000.safetensors is truncated: its tensors need") != std::string::npos);
  }
  CHECK(max_diff(b, untouched) == 0.0);

  try {
    ckpt::load(*b, nullptr, dir + "/none");
    FAIL("a missing checkpoint loaded");
  } catch (const ckpt::CheckpointError& e) {
    CHECK(std::string(e.what()).find("no complete checkpoint at " + dir + "/none") != std::string::npos);
  }
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: a replacement interrupted between its renames loads from .old; latest() finds the newest",
          "[runtime][checkpoint]") {
  const std::string dir = temp_dir("replace");
  Net a = make_net(1);
  torch::optim::SGD opt(a->parameters(), torch::optim::SGDOptions(1e-2));
  ckpt::SaveOptions so;
  so.step = 1;
  ckpt::save(*a, &opt, dir + "/run/step_1", so);
  so.step = 7;
  ckpt::save(*a, &opt, dir + "/run/step_7", so);
  so.step = 4;
  ckpt::save(*a, &opt, dir + "/run/step_4", so);
  fs::create_directories(dir + "/run/step_9.partial");  // a save that crashed: not a checkpoint
  CHECK(ckpt::latest(dir + "/run") == dir + "/run/step_7");
  CHECK(ckpt::latest(dir + "/nothing").empty());

  // Saving over an existing checkpoint replaces it; a crash between the two renames leaves
  // only <path>.old, which load falls back to.
  so.step = 8;
  ckpt::save(*a, &opt, dir + "/run/step_7", so);
  CHECK(!fs::exists(dir + "/run/step_7.old"));
  fs::rename(dir + "/run/step_7", dir + "/run/step_7.old");
  Net b = make_net(2);
  auto info = ckpt::load(*b, nullptr, dir + "/run/step_7");
  CHECK(info.step == 8);
  CHECK(info.path == dir + "/run/step_7.old");
  CHECK(max_diff(a, b) == 0.0);
  fs::remove_all(dir);
}
