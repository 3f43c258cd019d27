#pragma once
// Logging of the C++ runtime: one logger per component ("world", "mesh", "pipeline", "zero",
// "data_parallel", "embeddings", "trace", ...), the rank in every line:
//
//   [12:00:01.234] [rank 3] [pipeline] [info] step 12: 1.204 s, 0.310 s waiting
//
// MONARCH_LOG_LEVEL sets the levels: a level (trace, debug, info, warn, error, off) for every
// component, then component=level pairs, comma separated ("warn,pipeline=debug"). Unset:
// info on rank 0 and warn on the other ranks, so a job's output is not N copies of it.
// Python's torch_monarch logger follows the same variable (torch_monarch/log.py).
//
// spdlog writes the lines, behind this header only: log.cpp is compiled in a target of its own
// that sees no torch header. torch's wheels ship their own fmt (12.x) in their include folder,
// while Debian's spdlog is built against Debian's fmt (9.x on Debian 12); a file that saw both
// would format with one and link the other. Lines are therefore built here with iostreams.
#include <iomanip>
#include <sstream>
#include <string>

namespace monarch::log {

enum class Level { trace, debug, info, warn, error };

// Whether `component` writes lines of `level` (the level the environment gives it).
bool enabled(const std::string& component, Level level);
// Writes one line (stderr: the launcher keeps each rank's stderr in its own file).
void write(const std::string& component, Level level, const std::string& message);

// The rank shown in every line; levels are re-derived from the environment (the default
// depends on the rank). World calls it once the rank is known; before, lines say "rank ?".
void set_rank(int rank);
int rank();

// Parses a MONARCH_LOG_LEVEL value; throws std::invalid_argument (naming the variable and the
// bad item) when it is malformed. The level of `component` under that value, for rank `rank`.
std::string level_for(const std::string& spec, const std::string& component, int rank);

// `value` with `digits` digits after the point ("1.2040").
inline std::string fixed(double value, int digits) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(digits) << value;
  return out.str();
}

// A line from its parts, each as an ostream prints it; built only when the level is on.
template <class... Parts>
void line(const std::string& component, Level level, const Parts&... parts) {
  if (!enabled(component, level)) return;
  std::ostringstream out;
  (out << ... << parts);
  write(component, level, out.str());
}

template <class... Parts>
void debug(const std::string& component, const Parts&... parts) {
  line(component, Level::debug, parts...);
}
template <class... Parts>
void info(const std::string& component, const Parts&... parts) {
  line(component, Level::info, parts...);
}
template <class... Parts>
void warn(const std::string& component, const Parts&... parts) {
  line(component, Level::warn, parts...);
}
template <class... Parts>
void error(const std::string& component, const Parts&... parts) {
  line(component, Level::error, parts...);
}

}  // namespace monarch::log
