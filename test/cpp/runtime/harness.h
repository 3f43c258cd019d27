#pragma once
// Starts N local ranks of this test binary on loopback with a free port, each running one
// worker scenario, and collects their exit status, stderr and output directory.
#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace monarch::testing {

struct RankOutcome {
  int exit_code = -1;  // -1: killed (timed out)
  std::string stderr_text;
};

struct LaunchResult {
  std::vector<RankOutcome> ranks;
  std::string output_dir;  // workers write rank<r>.pt here
  bool timed_out = false;
  bool all_ok() const;
  std::string describe() const;  // exit codes and the tail of each rank's stderr
};

// Runs `scenario` on `world_size` ranks (env: MASTER_ADDR=127.0.0.1, MASTER_PORT=<free>,
// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MONARCH_TEST_SCENARIO,
// MONARCH_TEST_OUTPUT) and waits at most `timeout`; stragglers are killed.
LaunchResult launch_ranks(int world_size, const std::string& scenario,
                          std::chrono::seconds timeout,
                          const std::map<std::string, std::string>& extra_env = {});

int free_port();

// In a worker: the scenario to run, or "" when this process is the test driver.
std::string worker_scenario();
std::string worker_output_dir();

}  // namespace monarch::testing
