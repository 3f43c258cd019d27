#pragma once
// The measured timeline: the pipeline executor and the communicators record the start and
// end of each action and collective into one process-wide ring buffer (a clock read and a
// locked store per event: cheap enough to leave on), and save() writes every rank's events
// as one Chrome trace-event JSON file that Perfetto and chrome://tracing open and
// `monarch-plan report --trace` draws under the predicted timeline (docs/report.md).
//
// Environment: MONARCH_TRACE=off records nothing; MONARCH_TRACE_EVENTS=N keeps the last N
// events per process (default 65536, about 6 MB).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace monarch {

class DeviceMesh;

namespace trace {

struct Event {
  const char* name = "";      // a string literal: an action type name, "step", a collective kind
  const char* category = "";  // "pipeline" or "collective"
  int64_t start_ns = 0;       // steady clock
  int64_t end_ns = 0;
  int64_t step = -1;          // pipeline step on this rank
  int64_t micro_batch = -1;
  int64_t stage = -1;
  double bytes = 0;           // collectives: bytes this rank sent
  std::string group;          // collectives: the group's name
};

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class Recorder {
 public:
  static Recorder& instance();
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  void set_enabled(bool on) { enabled_.store(on, std::memory_order_relaxed); }
  // Keeps the newest `events` events (older ones are dropped and counted); clears the buffer.
  void set_capacity(size_t events);
  void record(Event event);
  std::vector<Event> snapshot() const;  // oldest first
  int64_t dropped() const;
  void clear();

 private:
  Recorder();
  mutable std::mutex mutex_;
  std::atomic<bool> enabled_{true};
  std::vector<Event> ring_;
  size_t capacity_ = 65536;
  size_t next_ = 0;      // where the next event goes once the ring is full
  int64_t dropped_ = 0;
};

inline void record(Event event) {
  Recorder& r = Recorder::instance();
  if (r.enabled()) r.record(std::move(event));
}

// This rank's events as Chrome trace-event objects (one JSON object per line, comma
// separated, no brackets), with `pid` = `rank`. Times are microseconds on the system clock
// (the steady clock shifted by the system clock's offset at the time of the call), so ranks
// on different hosts line up as well as their clocks are synchronised (NTP/PTP).
std::string chrome_events(const std::vector<Event>& events, int rank);

// Collective over every rank of the mesh's world: each rank publishes its events through the
// job's store, and rank 0 writes one trace file to `path` with the mesh coordinates of every
// rank ("otherData": format "monarch-trace"). Throws on every rank, naming the missing ranks,
// when some rank does not call it within the world's timeout.
void save(const std::string& path, DeviceMesh& mesh);

}  // namespace trace
}  // namespace monarch
