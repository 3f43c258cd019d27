// The measured timeline (trace.h): a process-wide ring buffer and the Chrome trace writer.
#include "monarch/runtime/trace.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>


#include "monarch/runtime/communicator.h"
#include "monarch/runtime/log.h"
#include "monarch/runtime/device_mesh.h"
#include "monarch/runtime/world.h"

namespace monarch::trace {
namespace {

size_t capacity_from_environment() {
  const char* value = std::getenv("MONARCH_TRACE_EVENTS");
  if (value == nullptr || *value == '\0') return 65536;
  char* end = nullptr;
  const long long n = std::strtoll(value, &end, 10);
  TORCH_CHECK(end != value && *end == '\0' && n > 0, "monarch: MONARCH_TRACE_EVENTS must be a positive integer, got '",
              value, "'");
  return static_cast<size_t>(n);
}

bool enabled_from_environment() {
  const char* value = std::getenv("MONARCH_TRACE");
  if (value == nullptr) return true;
  const std::string v(value);
  return !(v == "off" || v == "0" || v == "false");
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// Steady-clock nanoseconds to system-clock microseconds, as of now.
double system_offset_us() {
  const auto system = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  return static_cast<double>(system - now_ns()) / 1e3;
}

}  // namespace

// The ring's slots are allocated once, when recording is on (the constructor, or the first
// event after recording was turned on): a vector left to grow would reallocate and copy
// itself at random collectives of the first thousands of steps, the old and new buffers
// both alive for that moment, and pile its growth onto the steps' peaks. Once is 96 bytes
// an event (6 MiB for 65536); a fresh allocation of that size is mapped, not touched, so
// its pages become resident only as events fill them.
Recorder::Recorder() : enabled_(enabled_from_environment()), capacity_(capacity_from_environment()) {
  if (enabled_) ring_.reserve(capacity_);
}

Recorder& Recorder::instance() {
  static Recorder recorder;
  return recorder;
}

void Recorder::set_capacity(size_t events) {
  TORCH_CHECK(events > 0, "monarch: trace capacity must be positive");
  std::lock_guard<std::mutex> lock(mutex_);
  capacity_ = events;
  ring_ = {};  // the old slots go, whatever their number
  if (enabled()) ring_.reserve(capacity_);
  next_ = 0;
  dropped_ = 0;
}

void Recorder::record(Event event) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (ring_.size() < capacity_) {
    if (ring_.capacity() < capacity_) ring_.reserve(capacity_);  // recording turned on since
    ring_.push_back(std::move(event));
    return;
  }
  ring_[next_] = std::move(event);
  next_ = (next_ + 1) % capacity_;
  ++dropped_;
}

std::vector<Event> Recorder::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Event> out;
  out.reserve(ring_.size());
  for (size_t i = 0; i < ring_.size(); ++i) out.push_back(ring_[(next_ + i) % ring_.size()]);
  return out;
}

int64_t Recorder::dropped() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return dropped_;
}

void Recorder::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  ring_.clear();
  next_ = 0;
  dropped_ = 0;
}

std::string chrome_events(const std::vector<Event>& events, int rank) {
  const double offset = system_offset_us();
  std::ostringstream o;
  o.precision(3);
  o << std::fixed;
  bool first = true;
  for (const Event& e : events) {
    if (!first) o << ",\n";
    first = false;
    const bool pipeline = std::string(e.category) == "pipeline";
    o << "{\"name\":" << json_string(e.name) << ",\"cat\":" << json_string(e.category)
      << ",\"ph\":\"X\",\"pid\":" << rank << ",\"tid\":" << (pipeline ? 0 : 1)
      << ",\"ts\":" << static_cast<double>(e.start_ns) / 1e3 + offset
      << ",\"dur\":" << static_cast<double>(e.end_ns - e.start_ns) / 1e3 << ",\"args\":{";
    bool any = false;
    auto arg = [&](const char* key, const std::string& value) {
      o << (any ? "," : "") << "\"" << key << "\":" << value;
      any = true;
    };
    if (e.step >= 0) arg("step", std::to_string(e.step));
    if (e.micro_batch >= 0) arg("mb", std::to_string(e.micro_batch));
    if (e.stage >= 0) arg("stage", std::to_string(e.stage));
    if (!pipeline) {
      char bytes[32];
      std::snprintf(bytes, sizeof bytes, "%.0f", e.bytes);
      arg("bytes", bytes);
      arg("group", json_string(e.group));
    }
    o << "}}";
  }
  return o.str();
}

void save(const std::string& path, DeviceMesh& mesh) {
  const auto& world = mesh.world();
  const int rank = world->rank(), size = world->size();
  const planner::Mesh& shape = mesh.shape();
  std::ostringstream coords;
  coords << "{\"rank\":" << rank << ",\"pp\":" << mesh.coordinate("pp") << ",\"dp\":" << mesh.coordinate("dp")
         << ",\"tp\":" << mesh.coordinate("tp") << "}";
  Recorder& recorder = Recorder::instance();
  const std::string events = chrome_events(recorder.snapshot(), rank);
  const int64_t dropped = recorder.dropped();
  // Process names, so Perfetto labels each rank with its coordinates.
  std::ostringstream meta;
  meta << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << rank << ",\"tid\":0,\"args\":{\"name\":\"rank " << rank
       << " (pp " << mesh.coordinate("pp") << ", dp " << mesh.coordinate("dp") << ", tp " << mesh.coordinate("tp")
       << ")\"}}";
  const std::string part = coords.str() + "\n" + std::to_string(dropped) + "\n" + meta.str() +
                           (events.empty() ? "" : ",\n" + events);
  if (size == 1) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out, "monarch: cannot write trace '", path, "'");
    out << "{\"traceEvents\":[\n" << meta.str() << (events.empty() ? "" : ",\n" + events)
        << "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"format\":\"monarch-trace\",\"version\":1,\"ranks\":["
        << coords.str() << "],\"dropped\":" << dropped << ",\"mesh\":{\"pp\":" << shape.pp << ",\"dp\":" << shape.dp
        << ",\"tp\":" << shape.tp << "}}}\n";
    out.close();
    TORCH_CHECK(out, "monarch: cannot write trace '", path, "' (disk full?)");
    return;
  }
  // Through the job's store: each rank's part under a key of this call, rank 0 writes.
  // Every rank numbers its saves alike (a rank that skipped one would pair with the others'
  // next: every rank must call it, as for any collective).
  static std::atomic<int64_t> calls{0};
  const std::string prefix = "monarch/trace/" + std::to_string(calls++) + "/";
  const auto& store = world->store();
  store->set(prefix + std::to_string(rank), std::vector<uint8_t>(part.begin(), part.end()));
  const auto deadline = Communicator::entry_timeout(world->timeout());
  // Waits for `keys` until `limit`; returns the ones still missing.
  auto wait_for = [&](const std::vector<std::string>& keys, std::chrono::milliseconds limit) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::string> missing = keys;
    while (!missing.empty() && std::chrono::steady_clock::now() - start <= limit) {
      std::vector<std::string> still;
      for (const auto& k : missing) {
        if (!store->check({k})) still.push_back(k);
      }
      missing = std::move(still);
      if (!missing.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return missing;
  };
  const std::string done = prefix + "done", read = prefix + "read";
  if (rank == 0) {
    // Whatever happens here, the others learn it through `done`: they never wait out their
    // own timeout for a rank 0 that already gave up.
    std::string error;
    int64_t dropped_total = 0;
    try {
      std::vector<std::string> keys;
      for (int r = 0; r < size; ++r) keys.push_back(prefix + std::to_string(r));
      const auto missing = wait_for(keys, deadline);
      if (!missing.empty()) {
        std::ostringstream msg;
        msg << "the events of rank(s)";
        for (const auto& k : missing) msg << " " << k.substr(prefix.size());
        msg << " did not arrive within " << deadline.count() << " ms (every rank must call trace save)";
        error = msg.str();
      }
      std::string ranks_json, events_json;
      for (int r = 0; r < size && error.empty(); ++r) {
        const auto bytes = store->get(keys[r]);
        const std::string text(bytes.begin(), bytes.end());
        const size_t a = text.find('\n'), b = a == std::string::npos ? a : text.find('\n', a + 1);
        if (b == std::string::npos) {
          error = "rank " + std::to_string(r) + " published a malformed trace part";
          break;
        }
        ranks_json += (r ? "," : "") + text.substr(0, a);
        dropped_total += std::stoll(text.substr(a + 1, b - a - 1));
        events_json += (r ? ",\n" : "") + text.substr(b + 1);
      }
      for (const auto& k : keys) store->deleteKey(k);
      if (error.empty()) {
        std::ofstream out(path, std::ios::binary | std::ios::trunc);
        if (out) {
          out << "{\"traceEvents\":[\n" << events_json
              << "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"format\":\"monarch-trace\",\"version\":1,\"ranks\":["
              << ranks_json << "],\"dropped\":" << dropped_total << ",\"mesh\":{\"pp\":" << shape.pp
              << ",\"dp\":" << shape.dp << ",\"tp\":" << shape.tp << "}}}\n";
          out.close();
        }
        if (!out) error = "cannot write trace '" + path + "'";
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    store->set(done, std::vector<uint8_t>(error.begin(), error.end()));
    TORCH_CHECK(error.empty(), "monarch: rank 0 saving trace '", path, "': ", error);
    log::info("trace", "wrote ", path, " (", size, " ranks, ", dropped_total, " events dropped by the ring buffers)");
  } else {
    // Twice rank 0's deadline: rank 0 reports a missing rank first, by name.
    if (!wait_for({done}, 2 * deadline).empty()) {
      TORCH_CHECK(false, "monarch: rank ", rank, " saving trace '", path, "': no word from rank 0 within ",
                  2 * deadline.count(), " ms (every rank must call trace save)");
    }
    const auto bytes = store->get(done);
    // The last rank to read rank 0's word removes it.
    if (store->add(read, 1) == size - 1) {
      store->deleteKey(done);
      store->deleteKey(read);
    }
    TORCH_CHECK(bytes.empty(), "monarch: rank ", rank, ": rank 0 failed to save the trace: ",
                std::string(bytes.begin(), bytes.end()));
  }
}

}  // namespace monarch::trace
