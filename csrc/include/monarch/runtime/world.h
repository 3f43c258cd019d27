#pragma once
// Process-group bootstrap: torchrun's environment, a c10d TCPStore rendezvous, and Gloo
// groups over any subset of ranks.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "monarch/runtime/compat.h"
#include "monarch/runtime/gloo_group.h"

namespace monarch {

// What torchrun exports (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, and TORCHELASTIC_USE_AGENT_STORE / TORCHELASTIC_RESTART_COUNT when its
// agent already serves the store). Missing or malformed variables are reported by name.
struct LaunchEnv {
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  // torchrun's agent serves the TCPStore on MASTER_PORT: every rank joins it as a client,
  // under the key prefix of the agent's current restart attempt (as torch.distributed's
  // env:// rendezvous does), instead of rank 0 serving a store of its own.
  bool use_agent_store = false;
  int restart_count = 0;
  static LaunchEnv from_environment();
};

struct InitOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // rendezvous and every collective
};

// The job's ranks and the store they share. Groups are Gloo process groups made on that
// store under distinct prefixes, so several groups (one per mesh axis slice) share one port.
class World {
 public:
  // Rendezvous from the environment: rank 0 serves the TCPStore on MASTER_PORT, or, under
  // torchrun's agent, every rank joins the agent's store.
  static std::shared_ptr<World> init(const InitOptions& options = {});
  // Join an existing store (e.g. Python's torch.distributed default store): no new port.
  static std::shared_ptr<World> from_store(c10::intrusive_ptr<c10d::Store> store, int rank,
                                           int world_size, const InitOptions& options = {});

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  // A Gloo group over `ranks` (global ranks, this rank among them) named `name`. Every
  // member must create its groups in the same order (a per-world counter keeps the store
  // keys of successive groups with the same name apart).
  compat::BackendPtr new_group(const std::vector<int>& ranks, const std::string& name) const;
  // For ranks outside a group the others are creating: keeps group ids aligned everywhere.
  void skip_group() const { ++groups_created_; }
  // Groups created (or skipped) so far: with a group's name, a store key unique to it.
  int64_t groups_created() const { return groups_created_.load(); }
  // Every rank publishes `request` (what it is about to build) under a key only this call
  // uses, reads every rank's, and throws on every rank, naming each rank's request, when
  // they differ: ranks that would connect different groups fail within seconds instead of
  // waiting out the timeout. Collective: every rank calls it at the same point.
  void agree(const std::string& what, const std::string& request) const;

 private:
  World(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout);
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  mutable std::atomic<int64_t> groups_created_{0};
  // The Gloo transport device every group of this process shares (made by the first
  // new_group). A device runs one event-loop thread that wakes every few milliseconds even
  // when idle; with one per group, the groups of a few parallelized models kept alive took
  // a tenth of a core per rank doing nothing.
  mutable std::mutex device_mutex_;
  mutable gloo_group::DevicePtr device_;
  mutable std::atomic<int64_t> agreements_{0};
};

}  // namespace monarch
