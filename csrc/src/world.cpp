#include "monarch/runtime/world.h"

#include "monarch/runtime/flight_recorder.h"
#include "monarch/runtime/gloo_group.h"
#include "monarch/runtime/log.h"
#include "monarch/runtime/trace.h"

#include <csignal>
#include <cstdlib>
#include <map>
#include <sstream>
#include <stdexcept>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace monarch {
namespace {

int env_int(const char* name, int fallback, bool required) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    TORCH_CHECK(!required, "monarch::init: environment variable ", name,
                " is not set (launch with torchrun, or set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)");
    return fallback;
  }
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  TORCH_CHECK(end != value && *end == '\0' && parsed >= 0 && parsed < (1L << 30),
              "monarch::init: environment variable ", name, "='", value, "' is not a non-negative integer");
  return static_cast<int>(parsed);
}

// A peer that died closes its sockets; the next send to it raises SIGPIPE, whose default
// action kills this rank silently (exit 141) before Gloo can report the broken connection
// as an error naming the collective. Python ignores SIGPIPE already; a C++ program that kept
// the default gets it ignored here (a handler of its own is left alone).
void ignore_default_sigpipe() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    std::signal(SIGPIPE, SIG_IGN);
  }
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

}  // namespace

LaunchEnv LaunchEnv::from_environment() {
  LaunchEnv env;
  const char* addr = std::getenv("MASTER_ADDR");
  TORCH_CHECK(addr != nullptr && *addr != '\0',
              "monarch::init: environment variable MASTER_ADDR is not set (launch with torchrun)");
  env.master_addr = addr;
  env.master_port = env_int("MASTER_PORT", 29500, true);
  env.rank = env_int("RANK", 0, true);
  env.world_size = env_int("WORLD_SIZE", 1, true);
  env.local_rank = env_int("LOCAL_RANK", env.rank, false);
  env.local_world_size = env_int("LOCAL_WORLD_SIZE", env.world_size, false);
  const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  env.use_agent_store = agent_store != nullptr && std::string(agent_store) == "True";
  env.restart_count = env_int("TORCHELASTIC_RESTART_COUNT", 0, env.use_agent_store);
  TORCH_CHECK(env.world_size >= 1, "monarch::init: WORLD_SIZE must be >= 1");
  TORCH_CHECK(env.rank < env.world_size, "monarch::init: RANK=", env.rank,
              " is not below WORLD_SIZE=", env.world_size);
  TORCH_CHECK(env.master_port > 0 && env.master_port < 65536, "monarch::init: MASTER_PORT=",
              env.master_port, " is not a TCP port");
  return env;
}

World::World(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
             std::chrono::milliseconds timeout)
    : store_(std::move(store)), rank_(rank), size_(size), timeout_(timeout) {}

std::shared_ptr<World> World::init(const InitOptions& options) {
  const LaunchEnv env = LaunchEnv::from_environment();
  ignore_default_sigpipe();
  log::set_rank(env.rank);
  const auto start = std::chrono::steady_clock::now();
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(env.master_port);
  opts.isServer = env.rank == 0 && !env.use_agent_store;
  opts.numWorkers = static_cast<std::size_t>(env.world_size);
  opts.waitWorkers = !env.use_agent_store;  // the agent's store counts no workers of ours
  opts.timeout = options.timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "monarch::init: rank ", env.rank, " could not rendezvous at ", env.master_addr,
                ":", env.master_port, env.use_agent_store ? " (torchrun's agent store)" : "", " within ",
                options.timeout.count(), " ms: ", e.what());
  }
  if (env.use_agent_store) {
    // The same prefix torch.distributed's env:// rendezvous uses, so a restarted worker
    // group never reads the keys of the attempt before it.
    store = c10::make_intrusive<c10d::PrefixStore>(
        "/worker/attempt_" + std::to_string(env.restart_count), store);
  }
  auto world = from_store(store, env.rank, env.world_size, options);
  log::info("world", "rendezvous with ", env.world_size, " ranks at ", env.master_addr, ":", env.master_port,
            env.use_agent_store ? " (torchrun's agent store)" : "", " in ",
            log::fixed(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 2), " s");
  return world;
}

std::shared_ptr<World> World::from_store(c10::intrusive_ptr<c10d::Store> store, int rank,
                                         int world_size, const InitOptions& options) {
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "monarch: rank ", rank,
              " is not in a world of ", world_size);
  ignore_default_sigpipe();
  flight::set_rank(rank);
  flight::install_termination_report();
  trace::Recorder::instance();  // its ring is allocated now, before any step (trace.cpp)
  store->setTimeout(options.timeout);
  log::set_rank(rank);
  log::debug("world", "joined a world of ", world_size, " ranks (timeout ", options.timeout.count(), " ms)");
  return std::shared_ptr<World>(new World(std::move(store), rank, world_size, options.timeout));
}

compat::BackendPtr World::new_group(const std::vector<int>& ranks, const std::string& name) const {
  int group_rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == rank_) group_rank = static_cast<int>(i);
  }
  TORCH_INTERNAL_ASSERT(group_rank >= 0, "rank ", rank_, " is not a member of group ", name);
  gloo_group::DevicePtr device;
  {
    std::lock_guard<std::mutex> lock(device_mutex_);
    if (!device_) {
      const char* addr = std::getenv("MASTER_ADDR");
      device_ = gloo_group::device_from_environment(addr != nullptr && is_loopback(addr));
    }
    device = device_;
  }
  const int64_t id = groups_created_++;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
      "monarch/" + std::to_string(id) + "/" + name + "/", store_);
  try {
    return gloo_group::connect(prefixed, group_rank, static_cast<int>(ranks.size()), timeout_, device);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "monarch: rank ", rank_, " could not connect group '", name, "' within ",
                timeout_.count(), " ms (a peer may have died): ", e.what());
  }
}

void World::agree(const std::string& what, const std::string& request) const {
  if (size_ == 1) return;
  const std::string prefix = "monarch/agree/" + std::to_string(agreements_++) + "/" + what + "/";
  store_->set(prefix + std::to_string(rank_), std::vector<uint8_t>(request.begin(), request.end()));
  std::map<std::string, std::vector<int>> by_request;
  for (int r = 0; r < size_; ++r) {
    std::vector<uint8_t> bytes;
    try {
      bytes = store_->get(prefix + std::to_string(r));
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "monarch: rank ", rank_, " waited ", timeout_.count(), " ms for rank ", r, "'s ", what,
                  " (a peer may have died or not reached this point): ", e.what());
    }
    by_request[std::string(bytes.begin(), bytes.end())].push_back(r);
  }
  if (by_request.size() == 1) return;
  std::ostringstream msg;
  msg << "monarch: the ranks disagree on the " << what << " (every rank must ask for the same one):";
  for (const auto& [req, ranks] : by_request) {
    msg << "\n  rank" << (ranks.size() > 1 ? "s " : " ");
    for (size_t i = 0; i < ranks.size(); ++i) msg << (i ? "," : "") << ranks[i];
    msg << ": " << req;
  }
  TORCH_CHECK(false, msg.str());
}

}  // namespace monarch
