// Runtime logging (log.h).
#include "monarch/runtime/log.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace monarch::log {
namespace {

std::mutex mutex;
int current_rank = -1;
std::map<std::string, std::shared_ptr<spdlog::logger>> loggers;

const std::vector<std::string>& level_names() {
  static const std::vector<std::string> names = {"trace", "debug", "info", "warn", "error", "off"};
  return names;
}

bool is_level(const std::string& s) {
  for (const auto& n : level_names()) {
    if (n == s) return true;
  }
  return false;
}

std::string environment_spec() {
  const char* value = std::getenv("MONARCH_LOG_LEVEL");
  return value == nullptr ? "" : value;
}

std::string pattern() {
  return "[%H:%M:%S.%e] [rank " + (current_rank < 0 ? std::string("?") : std::to_string(current_rank)) +
         "] [%n] [%l] %v";
}

void configure(spdlog::logger& logger, const std::string& component) {
  logger.set_level(spdlog::level::from_str(level_for(environment_spec(), component, current_rank)));
  logger.set_pattern(pattern());
}

}  // namespace

std::string level_for(const std::string& spec, const std::string& component, int rank) {
  std::string level = rank <= 0 ? "info" : "warn";
  std::string overridden;
  std::stringstream items(spec);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (item.empty()) continue;
    const auto eq = item.find('=');
    const std::string name = eq == std::string::npos ? "" : item.substr(0, eq);
    const std::string value = eq == std::string::npos ? item : item.substr(eq + 1);
    if (!is_level(value) || (eq != std::string::npos && name.empty())) {
      throw std::invalid_argument("monarch: MONARCH_LOG_LEVEL: '" + item +
                                  "' is neither a level (trace, debug, info, warn, error, off) nor component=level");
    }
    if (eq == std::string::npos) {
      level = value;
    } else if (name == component) {
      overridden = value;
    }
  }
  return overridden.empty() ? level : overridden;
}

namespace {

// The component's logger, created on first use at the level the environment gives it. The
// caller holds `mutex`.
spdlog::logger& get_locked(const std::string& component) {
  auto it = loggers.find(component);
  if (it != loggers.end()) return *it->second;
  // stderr: the launcher keeps each rank's stderr in its own log file.
  auto logger = std::make_shared<spdlog::logger>(component, std::make_shared<spdlog::sinks::stderr_sink_mt>());
  configure(*logger, component);
  loggers[component] = logger;
  return *logger;
}

spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::trace: return spdlog::level::trace;
    case Level::debug: return spdlog::level::debug;
    case Level::info: return spdlog::level::info;
    case Level::warn: return spdlog::level::warn;
    case Level::error: return spdlog::level::err;
  }
  return spdlog::level::err;
}

}  // namespace

bool enabled(const std::string& component, Level level) {
  std::lock_guard<std::mutex> lock(mutex);
  return get_locked(component).should_log(to_spdlog(level));
}

void write(const std::string& component, Level level, const std::string& message) {
  std::shared_ptr<spdlog::logger> logger;
  {
    std::lock_guard<std::mutex> lock(mutex);
    get_locked(component);
    logger = loggers.at(component);  // shared: a line is written outside the lock
  }
  logger->log(to_spdlog(level), "{}", message);
}

void set_rank(int rank) {
  std::lock_guard<std::mutex> lock(mutex);
  current_rank = rank;
  for (auto& [component, logger] : loggers) configure(*logger, component);
}

int rank() {
  std::lock_guard<std::mutex> lock(mutex);
  return current_rank;
}

}  // namespace monarch::log
