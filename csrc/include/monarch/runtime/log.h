#pragma once
// Logging of the C++ runtime (spdlog): one logger per component ("world", "mesh",
// "pipeline", "zero", "data_parallel", "embeddings", "trace", ...), the rank in every line:
//
//   [12:00:01.234] [rank 3] [pipeline] [info] step 12: 1.204 s, 0.310 s waiting
//
// MONARCH_LOG_LEVEL sets the levels: a level (trace, debug, info, warn, error, off) for every
// component, then component=level pairs, comma separated ("warn,pipeline=debug"). Unset:
// info on rank 0 and warn on the other ranks, so a job's output is not N copies of it.
// Python's torch_monarch logger follows the same variable (torch_monarch/log.py).
#include <memory>
#include <string>

namespace spdlog {
class logger;
}

namespace monarch::log {

// The component's logger (created on first use, at the level the environment gives it).
spdlog::logger& get(const std::string& component);

// The rank shown in every line; levels are re-derived from the environment (the default
// depends on the rank). World calls it once the rank is known; before, lines say "rank ?".
void set_rank(int rank);
int rank();

// Parses a MONARCH_LOG_LEVEL value; throws (naming the variable and the bad item) when it is
// malformed. The level of `component` under that value, for rank `rank`.
std::string level_for(const std::string& spec, const std::string& component, int rank);

}  // namespace monarch::log
