#include "monarch/runtime/flight_recorder.h"

#include "monarch/runtime/log.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace monarch::flight {
namespace {

struct Ring {
  std::mutex mutex;
  std::vector<Call> calls;
  size_t capacity = 4096;
  size_t next = 0;
  int64_t dropped = 0;
  int rank = -1;
  std::vector<std::weak_ptr<GroupInfo>> groups;
};

size_t capacity_from_environment() {
  const char* value = std::getenv("MONARCH_FLIGHT_RECORDER_CALLS");
  if (value == nullptr || *value == '\0') return 4096;
  char* end = nullptr;
  const long n = std::strtol(value, &end, 10);
  return (end != value && *end == '\0' && n > 0) ? static_cast<size_t>(n) : 4096;
}

Ring& ring() {
  static Ring* r = [] {
    auto* x = new Ring();  // never destroyed: the termination watcher may read it at exit
    x->capacity = capacity_from_environment();
    return x;
  }();
  return *r;
}

std::string json_string(const std::string& s) {
  std::ostringstream out;
  out << '"';
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out << '\\' << c;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out << buf;
    } else {
      out << c;
    }
  }
  out << '"';
  return out.str();
}

std::string doing_key(const GroupInfo& group, int rank) { return group.key + "/doing/" + std::to_string(rank); }

}  // namespace

void set_rank(int rank) {
  std::lock_guard<std::mutex> lock(ring().mutex);
  ring().rank = rank;
}

void record(const Call& call) {
  Ring& r = ring();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.calls.size() < r.capacity) {
    if (r.calls.capacity() < r.capacity) r.calls.reserve(r.capacity);  // once: no regrowth later
    r.calls.push_back(call);
  } else {
    r.calls[r.next] = call;
    r.next = (r.next + 1) % r.capacity;
    ++r.dropped;
  }
}

std::vector<Call> snapshot() {
  Ring& r = ring();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<Call> out(r.calls.begin() + static_cast<std::ptrdiff_t>(r.next), r.calls.end());
  out.insert(out.end(), r.calls.begin(), r.calls.begin() + static_cast<std::ptrdiff_t>(r.next));
  return out;
}

namespace {

// What dump() does, without logging (the termination watcher may run while the process is
// exiting and its loggers are being destroyed: it writes to stderr itself). Returns the
// path, "" when not configured, or "!" + path when the write failed.
std::string write_dump(const std::string& why) {
  const char* dir = std::getenv("MONARCH_FLIGHT_RECORDER_DIR");
  if (dir == nullptr || *dir == '\0') return "";
  // A later dump (the launcher's SIGTERM after this rank's own failure) keeps the first
  // reason, the root cause, in front.
  static std::mutex reason_mutex;
  static std::string first;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(reason_mutex);
    if (first.empty()) first = why;
    reason = first == why ? why : first + "\nthen: " + why;
  }
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  int rank;
  int64_t dropped;
  {
    std::lock_guard<std::mutex> lock(ring().mutex);
    rank = ring().rank;
    dropped = ring().dropped;
  }
  const auto calls = snapshot();
  ::mkdir(dir, 0777);  // (exists already: fine)
  const std::string path = std::string(dir) + "/rank" + std::to_string(rank) + ".json";
  // (The termination watcher and a failing collective may dump at once: own partial files.)
  const std::string partial =
      path + "." + std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id())) + ".partial";
  std::ofstream out(partial);
  out << "{\"format\": \"monarch-flight-recorder\", \"version\": 1, \"rank\": " << rank
      << ", \"pid\": " << ::getpid() << ", \"attempt\": " << (attempt != nullptr ? std::atoll(attempt) : 0)
      << ", \"reason\": " << json_string(reason) << ", \"dropped\": " << dropped
      << ", \"calls\": [";
  for (size_t i = 0; i < calls.size(); ++i) {
    const Call& c = calls[i];
    static const CallGroup none;
    const CallGroup& g = c.group ? *c.group : none;
    out << (i ? ",\n  " : "\n  ") << "{\"group\": " << json_string(g.name) << ", \"key\": " << json_string(g.key)
        << ", \"ranks\": [";
    for (size_t j = 0; j < g.ranks.size(); ++j) out << (j ? ", " : "") << g.ranks[j];
    out << "], \"seq\": " << c.seq << ", \"op\": " << json_string(c.op) << ", \"numel\": " << c.numel
        << ", \"dtype\": " << json_string(c.dtype) << ", \"phase\": " << json_string(c.phase)
        << ", \"step\": " << c.step << ", \"time_ns\": " << c.time_ns << "}";
  }
  out << "\n]}\n";
  out.close();
  if (!out || std::rename(partial.c_str(), path.c_str()) != 0) return "!" + path;
  return path;
}

std::string dump_line(const std::string& path) {
  if (path.empty()) return "";
  if (path[0] == '!') return "could not write the flight recorder dump " + path.substr(1);
  const std::string dir = path.substr(0, path.rfind('/'));
  return "flight recorder written to " + path + " (merge every rank's: python -m torch_monarch hangs " + dir + ")";
}

}  // namespace

std::string dump(const std::string& reason) {
  const std::string path = write_dump(reason);
  if (!path.empty()) log::error("flight", dump_line(path));
  return path.empty() || path[0] == '!' ? "" : path;
}

void register_group(const std::shared_ptr<GroupInfo>& group) {
  Ring& r = ring();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::weak_ptr<GroupInfo>> alive;
  for (auto& g : r.groups) {
    if (!g.expired()) alive.push_back(g);
  }
  alive.push_back(group);
  r.groups = std::move(alive);
}

void announce(const GroupInfo& group, const std::string& doing) {
  if (group.set) group.set(doing_key(group, group.global_rank), doing);
}

void withdraw(const GroupInfo& group) {
  if (group.set) group.set(doing_key(group, group.global_rank), "");
}

std::string others(const GroupInfo& group) {
  if (!group.check || !group.get) return "";
  std::ostringstream out;
  try {
    for (int r : group.ranks) {
      if (r == group.global_rank) continue;
      const std::string key = doing_key(group, r);
      if (!group.check(key)) continue;
      const std::string doing = group.get(key);
      if (doing.empty()) continue;
      out << (out.tellp() > 0 ? "; " : "") << "rank " << r << " is in " << doing;
    }
  } catch (const std::exception& e) {
    return "";  // the store is gone (the rank hosting it died): nothing to add
  }
  const std::string text = out.str();
  if (text.empty()) return "";
  return text + ": every rank must make that call (it is collective on a sharded or parallel model)";
}

namespace {

int termination_pipe[2] = {-1, -1};
std::atomic<bool> exiting{false};  // set at exit(): the report then stays silent

void write_stderr(const std::string& text) {
  const std::string line = text + "\n";
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(2, line.data() + done, line.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
}

pid_t watcher_pid = 0;  // the process whose thread reads the pipe

void on_sigterm(int) {
  if (::getpid() != watcher_pid) {
    // A child forked after init (multiprocessing) inherited this handler but not the
    // watcher thread: it dies of SIGTERM as it would have, and never wakes its parent's.
    std::signal(SIGTERM, SIG_DFL);
    std::raise(SIGTERM);
    return;
  }
  const char byte = 'T';
  [[maybe_unused]] ssize_t n = ::write(termination_pipe[1], &byte, 1);
}

void report_termination() {
  std::vector<std::shared_ptr<GroupInfo>> groups;
  int rank;
  {
    std::lock_guard<std::mutex> lock(ring().mutex);
    rank = ring().rank;
    for (auto& g : ring().groups) {
      if (auto p = g.lock()) groups.push_back(p);
    }
  }
  std::ostringstream msg;
  msg << "rank " << rank
      << " was terminated (SIGTERM: the launcher stopping the job, e.g. after another rank failed, or a "
         "scheduler's preemption)";
  const auto calls = snapshot();
  if (!calls.empty()) {
    const Call& c = calls.back();
    msg << "; its last collective: " << c.op << " of " << c.numel << " " << c.dtype << " on group '" << (c.group ? c.group->name : std::string())
        << "' (call #" << c.seq << ") in " << c.phase << ", step " << c.step;
  }
  // What needs no store first (the store may be slow or gone): the line and the dump.
  const std::string prefix = "[rank " + std::to_string(rank) + "] [flight] [error] ";
  write_stderr(prefix + msg.str());
  const std::string line = dump_line(write_dump(msg.str()));
  if (!line.empty()) write_stderr(prefix + line);
  std::string seen;
  for (const auto& g : groups) {
    const std::string o = others(*g);
    if (!o.empty() && seen.find(o) == std::string::npos) {
      write_stderr(prefix + "on group '" + g->name + "': " + o);
      seen += o;
    }
  }
}

}  // namespace

void install_termination_report() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGTERM, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) return;
    if (::pipe2(termination_pipe, O_CLOEXEC) != 0) return;
    watcher_pid = ::getpid();
    std::atexit([] { exiting.store(true); });
    std::thread([] {
      char byte;
      while (true) {
        const ssize_t n = ::read(termination_pipe[0], &byte, 1);
        if (n == 1) break;
        if (n < 0 && errno == EINTR) continue;
        return;
      }
      // The report reads the store, which may be slow or gone: whatever happens, the process
      // dies of SIGTERM within 2 s, as the launcher expects.
      try {
        std::thread([] {
          std::this_thread::sleep_for(std::chrono::seconds(2));
          std::signal(SIGTERM, SIG_DFL);
          std::raise(SIGTERM);
        }).detach();
        if (!exiting.load()) report_termination();
      } catch (...) {
      }
      std::signal(SIGTERM, SIG_DFL);
      std::raise(SIGTERM);
    }).detach();
    struct sigaction action {};
    action.sa_handler = on_sigterm;
    action.sa_flags = SA_RESTART;  // the interrupted thread's system calls go on as before
    sigemptyset(&action.sa_mask);
    sigaction(SIGTERM, &action, nullptr);
  });
}

}  // namespace monarch::flight
