// Runtime test binary: the Catch2 driver, or, when started by harness.h, one worker rank.
#define MONARCH_CATCH_RUNNER
#include "catch_with_torch.h"

#include <cstdlib>
#include <iostream>

#include "harness.h"
#include "parallel_models.h"
#include "training.h"

namespace monarch::testing {
int run_embedding_worker(const std::string& scenario, const std::string& out);  // test_embeddings.cpp
int run_experts_worker(const std::string& scenario, const std::string& out);    // test_experts.cpp
int run_generate_worker(const std::string& scenario, const std::string& out);   // test_generate.cpp
}

int main(int argc, char** argv) {
  const std::string scenario = monarch::testing::worker_scenario();
  if (!scenario.empty()) {
    try {
      const char* rank = std::getenv("RANK");
      const std::string out = monarch::testing::worker_output_dir() + "/rank" + (rank ? rank : "0") + ".pt";
      int rc = monarch::testing::run_parallel_worker(scenario, out);
      if (rc == -1) rc = monarch::testing::run_embedding_worker(scenario, out);
      if (rc == -1) rc = monarch::testing::run_experts_worker(scenario, out);
      if (rc == -1) rc = monarch::testing::run_generate_worker(scenario, out);
      return rc != -1 ? rc : monarch::testing::run_worker(scenario);
    } catch (const c10::Error& e) {
      std::cerr << "worker error: " << e.what_without_backtrace() << "\n";
      return 1;
    } catch (const std::exception& e) {
      std::cerr << "worker error: " << e.what() << "\n";
      return 1;
    }
  }
  return Catch::Session().run(argc, argv);
}
