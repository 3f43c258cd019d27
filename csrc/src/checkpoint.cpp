// monarch::checkpoint (monarch/checkpoint.h): the format of torch_monarch/checkpoint.py,
// written and read from C++. Each phase mirrors the Python one so that either frontend reads
// what the other wrote: the same index keys, slice keys ("<name>@<offsets>"), placements and
// optimizer keys.
#include "monarch/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "checkpoint_optimizer.h"
#include "monarch/embeddings.h"
#include "monarch/parallelize.h"
#include "monarch/planner/plan.h"
#include "monarch/runtime/checksum.h"
#include "safetensors_file.h"

namespace monarch::checkpoint {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace checkpoint_detail;

constexpr const char* kFormat = "monarch-checkpoint";
constexpr int kVersion = 2;  // 1: zlib's CRC-32 per slice ("crc32"); 2: CRC-32C ("crc32c"). Both are read.
constexpr const char* kIndex = "index.json";
constexpr int kRngRanks = 64;  // RNG states are recorded for jobs up to this size (as Python does)

const void* id_of(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }

// -- where each local tensor sits in its global tensor ------------------------------------

struct Segment {
  int64_t local = 0, global = 0, length = 0;
};

struct Box {
  std::vector<int64_t> local, global, lengths;
};

// Per dimension, segments (local start, global start, length): a tp shard of a fused weight
// (q, k, v) has one segment per fused part; ZeRO keeps rows [a, b) of the tp-local tensor.
struct Placement {
  std::vector<int64_t> global_shape;
  std::vector<std::vector<Segment>> segments;
  bool empty = false;  // holds nothing of it (a ZeRO rank past a scalar's one row)

  static Placement whole(const std::vector<int64_t>& shape) {
    Placement p;
    p.global_shape = shape;
    for (int64_t s : shape) p.segments.push_back({{0, 0, s}});
    return p;
  }

  // Every combination of one segment per dimension with no empty length.
  std::vector<Box> boxes() const {
    std::vector<Box> out;
    if (empty) return out;
    std::vector<size_t> pick(segments.size(), 0);
    while (true) {
      Box b;
      bool nonempty = true;
      for (size_t d = 0; d < segments.size(); ++d) {
        if (segments[d].empty()) return out;
        const Segment& s = segments[d][pick[d]];
        b.local.push_back(s.local);
        b.global.push_back(s.global);
        b.lengths.push_back(s.length);
        nonempty = nonempty && s.length > 0;
      }
      if (nonempty) out.push_back(std::move(b));
      size_t d = segments.size();
      while (d > 0 && ++pick[d - 1] == segments[d - 1].size()) pick[--d] = 0;
      if (d == 0) return out;
    }
  }
};

std::vector<Segment> tp_segments(int64_t global_size, int64_t fused_parts, int64_t tp, int64_t rank) {
  const int64_t part = global_size / fused_parts, piece = part / tp;
  std::vector<Segment> out;
  for (int64_t j = 0; j < fused_parts; ++j) out.push_back({j * piece, j * part + rank * piece, piece});
  return out;
}

// Segments of the local rows [start, start + count) of a dimension cut into `segments`,
// renumbered from 0.
std::vector<Segment> take_rows(const std::vector<Segment>& segments, int64_t start, int64_t count) {
  std::vector<Segment> out;
  for (const auto& s : segments) {
    const int64_t a = std::max(s.local, start), b = std::min(s.local + s.length, start + count);
    if (a < b) out.push_back({a - start, s.global + a - s.local, b - a});
  }
  return out;
}

// -- what this rank holds -------------------------------------------------------------------

struct Entry {
  std::string name;
  at::Tensor tensor;
  Placement placement;
  std::string kind;  // param, buffer, optimizer
  bool like_param = false;
};

// The job's ranks: one process, or every rank of a ParallelModule.
struct Job {
  int rank = 0, size = 1;
  Communicator* group = nullptr;

  // Every rank's `value`, in rank order.
  std::vector<json> all_gather(const json& value) const {
    if (group == nullptr) return {value};
    // Invalid UTF-8 (a path or strerror text in another encoding) is replaced, not thrown
    // about: a throw here on one rank would leave the others in the collective below.
    const std::string data = value.dump(-1, ' ', false, json::error_handler_t::replace);
    auto lengths = at::zeros({size}, at::kLong);
    lengths[rank] = static_cast<int64_t>(data.size());
    group->all_reduce(lengths).wait();
    const int64_t width = std::max<int64_t>(lengths.max().item<int64_t>(), 1);
    auto mine = at::zeros({width}, at::kByte);
    std::memcpy(mine.data_ptr(), data.data(), data.size());
    auto all = at::empty({size * width}, at::kByte);
    group->all_gather(all, mine).wait();
    std::vector<json> out;
    const char* bytes = static_cast<const char*>(all.data_ptr());
    for (int r = 0; r < size; ++r) out.push_back(json::parse(bytes + r * width, bytes + r * width + lengths[r].item<int64_t>()));
    return out;
  }
};

// Runs fn() on every rank; if it failed anywhere, every rank throws one CheckpointError naming
// the ranks (the same message from several ranks is said once). The ranks stay in step.
template <typename Fn>
auto agree(const Job& job, const std::string& what, Fn&& fn) -> decltype(fn()) {
  using Result = decltype(fn());
  std::string error;
  std::optional<Result> value;
  try {
    value.emplace(fn());
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "an error without a message";
  } catch (...) {
    error = "an exception that is not a std::exception";
  }
  std::vector<std::pair<std::string, std::vector<int>>> by_error;
  const auto all = job.all_gather(error);
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    const std::string e = all[r].get<std::string>();
    if (e.empty()) continue;
    auto it = std::find_if(by_error.begin(), by_error.end(), [&](const auto& x) { return x.first == e; });
    if (it == by_error.end()) {
      by_error.push_back({e, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  if (!by_error.empty()) {
    std::string message = "checkpoint: " + what + ": ";
    for (size_t i = 0; i < by_error.size(); ++i) {
      const auto& [e, ranks] = by_error[i];
      message += (i ? "; " : "") + std::string(ranks.size() == 1 ? "rank " : "ranks ");
      for (size_t k = 0; k < ranks.size(); ++k) message += (k ? ", " : "") + std::to_string(ranks[k]);
      message += ": " + e;
    }
    throw CheckpointError(message);
  }
  return std::move(*value);
}

struct Unit {};  // what agree() returns for a phase with no value

std::vector<Entry> model_entries(ParallelModule& model) {
  auto& mesh = model.mesh();
  const int64_t tp_rank = mesh.coordinate("tp"), tp = mesh.size("tp");
  const int64_t dp_rank = mesh.coordinate("dp"), dp = mesh.size("dp");
  std::vector<Entry> out;
  for (const auto& held : model.held_tensors()) {
    Placement p;
    if (held.zero_shard && held.shape.empty()) {  // a scalar: ZeRO keeps it as one row, on the first rank
      p.empty = held.tensor.numel() == 0;
    } else {
      p = Placement::whole(held.shape);
      if (held.tp && tp > 1) {
        const int64_t dim = held.tp->dim < 0 ? held.tp->dim + static_cast<int64_t>(held.shape.size()) : held.tp->dim;
        p.global_shape[dim] = held.shape[dim] * tp;
        p.segments[dim] = tp_segments(p.global_shape[dim], held.tp->fused_parts, tp, tp_rank);
      }
      if (held.zero_shard) {
        const int64_t rows = held.shape[0], chunk = (rows + dp - 1) / dp, start = dp_rank * chunk;
        p.segments[0] = take_rows(p.segments[0], start, std::max<int64_t>(0, std::min(rows - start, chunk)));
      }
    }
    out.push_back({held.name, held.tensor, p, held.buffer ? "buffer" : "param", false});
  }
  return out;
}

std::vector<Entry> module_entries(torch::nn::Module& module) {
  std::vector<Entry> out;
  std::set<const void*> seen;
  for (const auto& item : module.named_parameters(true)) {
    if (!seen.insert(id_of(item.value())).second) continue;
    out.push_back({item.key(), item.value(), Placement::whole(item.value().sizes().vec()), "param", false});
  }
  for (const auto& item : module.named_buffers(true)) {
    if (!seen.insert(id_of(item.value())).second) continue;
    out.push_back({item.key(), item.value(), Placement::whole(item.value().sizes().vec()), "buffer", false});
  }
  return out;
}

// name and placement of every parameter entry, by tensor.
std::map<const void*, const Entry*> params_by_id(const std::vector<Entry>& entries) {
  std::map<const void*, const Entry*> out;
  for (const auto& e : entries) {
    if (e.kind == "param") out[id_of(e.tensor)] = &e;
  }
  return out;
}

const Entry& param_entry(const std::map<const void*, const Entry*>& by_id, const at::Tensor& p) {
  auto it = by_id.find(id_of(p));
  if (it == by_id.end()) {
    std::ostringstream shape;
    shape << p.sizes();
    throw std::invalid_argument("the optimizer steps on a tensor of shape " + shape.str() +
                                " that is not one of the model's parameters (build it over model->parameters())");
  }
  return *it->second;
}

std::vector<Entry> optimizer_entries(torch::optim::Optimizer* optimizer, const std::vector<Entry>& entries) {
  std::vector<Entry> out;
  if (optimizer == nullptr) return out;
  const auto by_id = params_by_id(entries);
  for (const auto& group : optimizer->param_groups()) {
    for (const auto& p : group.params()) {
      const Entry& param = param_entry(by_id, p);
      for (auto& v : optimizer_state(*optimizer, p)) {
        const bool like = v.like_param && v.value.sizes() == p.sizes() && v.value.dim() > 0;
        out.push_back({"optimizer." + param.name + "." + v.key, v.value,
                       like ? param.placement : Placement::whole(v.value.sizes().vec()), "optimizer", like});
      }
    }
  }
  return out;
}

std::vector<std::vector<std::string>> group_param_names(torch::optim::Optimizer* optimizer,
                                                        const std::vector<Entry>& entries) {
  std::vector<std::vector<std::string>> out;
  if (optimizer == nullptr) return out;
  const auto by_id = params_by_id(entries);
  for (const auto& group : optimizer->param_groups()) {
    out.emplace_back();
    for (const auto& p : group.params()) out.back().push_back(param_entry(by_id, p).name);
  }
  return out;
}

std::string box_key(const std::string& name, const std::vector<int64_t>& global, const std::vector<int64_t>& lengths) {
  std::string out = name + "|";
  for (int64_t g : global) out += std::to_string(g) + ",";
  out += "|";
  for (int64_t n : lengths) out += std::to_string(n) + ",";
  return out;
}

at::Tensor box_of(const at::Tensor& t, const std::vector<int64_t>& offsets, const std::vector<int64_t>& lengths) {
  at::Tensor out = t;
  for (size_t d = 0; d < offsets.size(); ++d) out = out.narrow(static_cast<int64_t>(d), offsets[d], lengths[d]);
  return out;
}

// -- files and directories ----------------------------------------------------------------------

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// <path>.partial -> <path>, the checkpoint already there through <path>.old.
void put_in_place(const std::string& partial, const std::string& path) {
  const std::string old = path + ".old";
  if (fs::exists(path)) {
    fs::remove_all(old);
    fs::rename(path, old);
  }
  fs::rename(partial, path);
  fsync_dir(fs::absolute(path).parent_path());
  std::error_code ignored;
  fs::remove_all(old, ignored);
}

std::string trimmed(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

std::vector<uint8_t> rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto state = gen.get_state();
  const auto* p = state.data_ptr<uint8_t>();
  return std::vector<uint8_t>(p, p + state.numel());
}

void set_rng_state(const std::vector<uint8_t>& bytes) {
  auto gen = at::detail::getDefaultCPUGenerator();
  auto state = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(state.data_ptr(), bytes.data(), bytes.size());
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// zlib's CRC-32 (reflected 0xEDB88320), which version-1 checkpoints recorded per slice.
uint32_t crc32_zlib(const void* data, size_t size) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < size; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

// -- save ------------------------------------------------------------------------------------

std::string save_entries(const Job& job, const std::vector<Entry>& model, torch::optim::Optimizer* optimizer,
                         const std::string& raw_path, const SaveOptions& options, const std::string& plan_json) {
  const std::string path = trimmed(raw_path);
  const std::string partial = path + ".partial";
  const std::string failed = "save failed, nothing was replaced";

  // Collective: what every rank holds; the lowest rank holding a box writes it.
  std::vector<Entry> tensors;
  json extra;
  json mine = agree(job, failed, [&] {
    extra = json::parse(options.extra_json);
    tensors = model;
    auto state = optimizer_entries(optimizer, model);
    tensors.insert(tensors.end(), state.begin(), state.end());
    json declared = json::array(), boxes = json::array();
    for (const auto& e : tensors) {
      if (!storable(e.tensor.scalar_type())) {
        throw std::invalid_argument("'" + e.name + "' has dtype " + std::string(c10::toString(e.tensor.scalar_type())) +
                                    ", which a checkpoint cannot store");
      }
      declared.push_back({e.name, e.kind, dtype_name(e.tensor.scalar_type()), e.placement.global_shape, e.like_param});
      for (const auto& b : e.placement.boxes()) boxes.push_back({e.name, b.global, b.lengths});
    }
    return json{{"declared", declared}, {"boxes", boxes}, {"groups", group_param_names(optimizer, model)}};
  });
  const auto everyone = job.all_gather(mine);
  std::map<std::string, int> writer;
  for (int r = 0; r < static_cast<int>(everyone.size()); ++r) {
    for (const auto& b : everyone[r]["boxes"]) {
      writer.emplace(box_key(b[0].get<std::string>(), b[1].get<std::vector<int64_t>>(), b[2].get<std::vector<int64_t>>()), r);
    }
  }

  agree(job, failed, [&] {
    if (job.rank == 0) {
      std::error_code ignored;
      fs::remove_all(partial, ignored);  // left by a save that crashed
      fs::create_directories(partial);
    }
    return Unit{};
  });

  auto remove_partial = [&] {
    if (job.rank == 0) {
      std::error_code ignored;
      fs::remove_all(partial, ignored);
    }
  };
  json report;
  try {
    report = agree(job, failed, [&] {
      std::vector<std::pair<std::string, at::Tensor>> out;
      json slices = json::array();
      for (const auto& e : tensors) {
        for (const auto& b : e.placement.boxes()) {
          if (writer.at(box_key(e.name, b.global, b.lengths)) != job.rank) continue;
          std::string key = e.name;
          if (!b.global.empty()) {
            key += "@";
            for (size_t d = 0; d < b.global.size(); ++d) key += (d ? "," : "") + std::to_string(b.global[d]);
          }
          out.emplace_back(key, box_of(e.tensor.detach(), b.local, b.lengths));
          slices.push_back({e.name, key, b.global, b.lengths});
        }
      }
      const std::string file = "rank" + [&] {
        char buf[16];
        std::snprintf(buf, sizeof(buf), "%05d", job.rank);
        return std::string(buf);
      }() + ".safetensors";
      json crcs = json::object();
      if (!out.empty()) {
        for (const auto& [key, crc] : write_safetensors((fs::path(partial) / file).string(), out)) crcs[key] = crc;
      }
      return json{{"file", out.empty() ? json() : json(file)},
                  {"slices", slices},
                  {"crcs", crcs},
                  {"rng", job.size <= kRngRanks ? json(rng_state()) : json()}};
    });
  } catch (const CheckpointError&) {
    remove_partial();
    throw;
  }
  const auto reports = job.all_gather(report);

  try {
    agree(job, failed, [&] {
      if (job.rank != 0) return Unit{};
      json meta = json::object();
      for (const auto& info : everyone) {
        for (const auto& d : info["declared"]) {
          const std::string name = d[0].get<std::string>();
          if (meta.contains(name)) continue;
          json entry = {{"kind", d[1]}, {"dtype", d[2]}, {"shape", d[3]}, {"slices", json::array()}};
          if (d[4].get<bool>()) entry["like_param"] = true;  // sliced as its parameter is
          meta[name] = entry;
        }
      }
      json rng = json::array();
      for (const auto& rep : reports) {
        for (const auto& s : rep["slices"]) {
          const std::string key = s[1].get<std::string>();
          meta[s[0].get<std::string>()]["slices"].push_back(
              {{"file", rep["file"]}, {"key", key}, {"offsets", s[2]}, {"lengths", s[3]}, {"crc32c", rep["crcs"][key]}});
        }
        rng.push_back(rep["rng"]);
      }
      json optimizer_json;
      if (optimizer != nullptr) {
        json groups = json::array();
        const auto& param_groups = optimizer->param_groups();
        for (size_t g = 0; g < param_groups.size(); ++g) {
          // Each group's parameters over every rank (a pipeline rank holds only its stages').
          std::set<std::string> names;
          for (const auto& info : everyone) {
            for (const auto& n : info["groups"].at(g)) names.insert(n.get<std::string>());
          }
          json group = group_hyperparameters(param_groups[g].options());
          group["params"] = std::vector<std::string>(names.begin(), names.end());
          groups.push_back(group);
        }
        optimizer_json = {{"param_groups", groups}};
      }
      json index = {{"format", kFormat},          {"version", kVersion},    {"step", options.step},
                    {"world_size", job.size},     {"tensors", meta},        {"plan", json::parse(plan_json)},
                    {"extra", extra},             {"optimizer", optimizer_json}, {"rng", {{"cpu", rng}}}};
      const fs::path file = fs::path(partial) / kIndex;
      {
        std::ofstream f(file);
        f << index.dump();
        f.flush();
        if (!f) throw std::runtime_error("cannot write " + file.string());
      }
      const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd >= 0) {
        ::fsync(fd);
        ::close(fd);
      }
      put_in_place(partial, path);
      return Unit{};
    });
  } catch (const CheckpointError&) {
    remove_partial();
    throw;
  }
  return path;
}

// -- load ------------------------------------------------------------------------------------

// The index at `path` (or `path.old` when a replacement was interrupted between its renames).
std::pair<std::string, json> read_index(const std::string& raw_path) {
  const std::string path = trimmed(raw_path);
  for (const std::string& dir : {path, path + ".old"}) {
    const fs::path file = fs::path(dir) / kIndex;
    if (!fs::exists(file)) continue;
    std::ifstream f(file);
    json index;
    try {
      index = json::parse(f);
    } catch (const json::exception& e) {
      throw std::runtime_error(file.string() + " is not valid JSON (" + e.what() + ")");
    }
    if (!index.is_object() || index.value("format", "") != kFormat) {
      throw std::runtime_error(file.string() + " is not a " + std::string(kFormat) + " index");
    }
    const int version = index.value("version", 0);
    if (version != 1 && version != 2) {
      throw std::runtime_error(file.string() + " has version " + std::to_string(version) + "; this build reads versions 1, 2");
    }
    return {dir, index};
  }
  throw std::runtime_error("no complete checkpoint at " + path + " (no " + kIndex + ")");
}

class Reader {
 public:
  Reader(std::string directory, const json& index) : directory_(std::move(directory)), index_(index) {}

  // A new CPU tensor of `shape` and `dtype` holding this rank's part (placement) of `name`.
  at::Tensor fill(const std::string& name, const std::vector<int64_t>& shape, at::ScalarType dtype,
                  const Placement& placement) {
    const auto& tensors = index_.at("tensors");
    if (!tensors.contains(name)) {
      throw std::runtime_error(directory_ + " has no tensor '" + name + "' (a checkpoint of another model, or of a "
                               "model without it)");
    }
    const json& meta = tensors[name];
    const auto stored_shape = meta.at("shape").get<std::vector<int64_t>>();
    if (stored_shape != placement.global_shape) {
      std::ostringstream a, b;
      a << at::IntArrayRef(stored_shape);
      b << at::IntArrayRef(placement.global_shape);
      throw std::runtime_error("tensor '" + name + "' is " + a.str() + " in " + directory_ + ", the model has " + b.str());
    }
    at::Tensor out = at::empty(shape, at::TensorOptions().dtype(dtype));
    for (const auto& box : placement.boxes()) {
      int64_t covered = 0;
      for (const auto& s : meta.at("slices")) {
        const auto offsets = s.at("offsets").get<std::vector<int64_t>>();
        const auto lengths = s.at("lengths").get<std::vector<int64_t>>();
        std::vector<int64_t> lo, n;
        bool overlap = offsets.size() == box.global.size();
        for (size_t d = 0; overlap && d < offsets.size(); ++d) {
          const int64_t a = std::max(box.global[d], offsets[d]);
          const int64_t b = std::min(box.global[d] + box.lengths[d], offsets[d] + lengths[d]);
          overlap = a < b;
          lo.push_back(a);
          n.push_back(b - a);
        }
        if (!overlap) continue;
        SafetensorsFile& file = this->file(s.at("file").get<std::string>());
        const std::string key = s.at("key").get<std::string>();
        at::Tensor stored = file.tensor(key, checksum(file, key, s));
        std::vector<int64_t> src_off, dst_off;
        for (size_t d = 0; d < lo.size(); ++d) {
          src_off.push_back(lo[d] - offsets[d]);
          dst_off.push_back(box.local[d] + lo[d] - box.global[d]);
        }
        at::Tensor dst = box_of(out, dst_off, n);
        dst.copy_(box_of(stored, src_off, n).reshape(dst.sizes()));
        file.release(key);
        int64_t count = 1;
        for (int64_t k : n) count *= k;
        covered += count;
        if (box.global.empty()) break;  // a single value: the first copy is it
      }
      int64_t want = 1;
      for (int64_t k : box.lengths) want *= k;
      if (covered != want) {
        throw std::runtime_error("tensor '" + name + "' in " + directory_ + ": the stored slices cover " +
                                 std::to_string(covered) + " of the " + std::to_string(want) +
                                 " elements this rank needs");
      }
    }
    return out;
  }

 private:
  SafetensorsFile& file(const std::string& name) {
    auto it = files_.find(name);
    if (it == files_.end()) {
      it = files_.emplace(name, std::make_unique<SafetensorsFile>((fs::path(directory_) / name).string())).first;
    }
    return *it->second;
  }

  // The checksum to check a slice against: CRC-32C as recorded, or a version-1 CRC-32 checked
  // here (the file's tensor() is then asked for none).
  std::optional<uint32_t> checksum(SafetensorsFile& file, const std::string& key, const json& slice) {
    if (slice.value("unchecked", false)) return std::nullopt;
    if (slice.contains("crc32c")) return slice["crc32c"].get<uint32_t>();
    if (slice.contains("crc32")) {
      if (checked_crc32_.insert(file.path() + "\n" + key).second) {
        at::Tensor t = file.tensor(key);
        if (crc32_zlib(t.data_ptr(), t.numel() * t.element_size()) != slice["crc32"].get<uint32_t>()) {
          throw std::runtime_error(file.path() + ": tensor '" + key + "' fails its checksum (the file is corrupt)");
        }
      }
      return std::nullopt;
    }
    throw std::runtime_error("slice '" + key + "' records no checksum");
  }

  std::string directory_;
  const json& index_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  std::set<std::string> checked_crc32_;
};

LoadResult load_entries(const Job& job, const std::vector<Entry>& model, torch::optim::Optimizer* optimizer,
                        const std::string& path, const LoadOptions& options) {
  std::string directory;
  json index;
  // Everything staged first: (target, value) copies and actions on the optimizer.
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  std::vector<std::function<void()>> actions;
  agree(job, "load failed, nothing was changed", [&] {
    std::tie(directory, index) = read_index(path);
    Reader reader(directory, index);
    const auto& tensors = index.at("tensors");
    for (const auto& e : model) {
      if (!tensors.contains(e.name) && !options.strict) continue;
      copies.emplace_back(e.tensor, reader.fill(e.name, e.tensor.sizes().vec(), e.tensor.scalar_type(), e.placement));
    }
    const json rng = index.contains("rng") && index["rng"].is_object() ? index["rng"].value("cpu", json()) : json();
    if (options.restore_rng && rng.is_array() && index.value("world_size", int64_t{0}) == job.size &&
        static_cast<int>(rng.size()) > job.rank && rng[job.rank].is_array() &&
        rng[job.rank].size() != rng_state().size()) {
      throw std::runtime_error(directory + ": rank " + std::to_string(job.rank) + "'s RNG state has " +
                               std::to_string(rng[job.rank].size()) + " bytes, this build's generator " +
                               std::to_string(rng_state().size()));
    }
    if (optimizer == nullptr) return Unit{};
    const auto by_id = params_by_id(model);
    const json saved_groups = index.contains("optimizer") && index["optimizer"].is_object()
                                  ? index["optimizer"].value("param_groups", json::array())
                                  : json::array();
    for (auto& group : optimizer->param_groups()) {
      std::set<std::string> names;
      for (const auto& p : group.params()) names.insert(param_entry(by_id, p).name);
      for (const auto& saved : saved_groups) {
        std::set<std::string> has;
        for (const auto& n : saved.value("params", json::array())) has.insert(n.get<std::string>());
        if (!std::includes(has.begin(), has.end(), names.begin(), names.end())) continue;
        auto* options_ptr = &group.options();
        set_group_hyperparameters(*group.options().clone(), saved);  // a bad value throws here, before anything changes
        actions.push_back([options_ptr, saved] { set_group_hyperparameters(*options_ptr, saved); });
        break;
      }
      for (const auto& p : group.params()) {
        const Entry& param = param_entry(by_id, p);
        const std::string prefix = "optimizer." + param.name + ".";
        std::map<std::string, at::Tensor> values;
        for (const auto& [name, meta] : tensors.items()) {
          if (name.rfind(prefix, 0) != 0) continue;
          const auto dtype = dtype_from_name(meta.at("dtype").get<std::string>());
          values[name.substr(prefix.size())] =
              meta.value("like_param", false) ? reader.fill(name, p.sizes().vec(), dtype, param.placement)
                                              : reader.fill(name, {}, dtype, Placement::whole({}));
        }
        void* key = p.unsafeGetTensorImpl();
        if (values.empty()) {
          // Saved with an optimizer that kept no state for it (SGD without momentum, a
          // parameter that never had a gradient): it has none after the load either.
          if (!index.contains("optimizer") || !index["optimizer"].is_object()) {
            throw std::runtime_error(directory + " has no optimizer state for '" + param.name + "' (saved without an "
                                     "optimizer)");
          }
          actions.push_back([optimizer, key] { optimizer->state().erase(key); });
          continue;
        }
        for (auto& [name, v] : values) {
          // Moments in the parameter's dtype and device, as torch.optim's load_state_dict casts them.
          if (v.dim() > 0) v = v.to(p.device(), p.scalar_type());
        }
        std::shared_ptr<torch::optim::OptimizerParamState> state = make_optimizer_state(*optimizer, values, param.name);
        actions.push_back([optimizer, key, state] { optimizer->state()[key] = state->clone(); });
      }
    }
    return Unit{};
  });
  {
    at::NoGradGuard no_grad;
    for (auto& [target, value] : copies) target.copy_(value);
  }
  for (auto& action : actions) action();
  const json rng = index.contains("rng") && index["rng"].is_object() ? index["rng"].value("cpu", json()) : json();
  if (options.restore_rng && rng.is_array() && index.value("world_size", int64_t{0}) == job.size &&
      static_cast<int>(rng.size()) > job.rank && rng[job.rank].is_array()) {
    set_rng_state(rng[job.rank].get<std::vector<uint8_t>>());
  }
  LoadResult out;
  out.step = index.value("step", int64_t{0});
  out.extra_json = index.value("extra", json()).dump();
  out.world_size = index.value("world_size", int64_t{0});
  out.plan_json = index.value("plan", json()).dump();
  out.path = directory;
  return out;
}

// The one-process overloads see a module's parameters and buffers only: sharded embedding
// tables (not parameters, and spread over the ranks) would be left out without a word.
void refuse_distributed_parts(torch::nn::Module& model) {
  auto refuse = [](const std::string& name) {
    throw CheckpointError("checkpoint: '" + name + "' is a ShardedEmbeddingBagCollection: its tables are spread over "
                          "the ranks and are not parameters, which this one-process save and load cannot hold (not "
                          "built in C++ yet; Python's torch_monarch.checkpoint saves sharded tables)");
  };
  // The model itself by address (it may live on the stack: named_modules cannot include it).
  if (dynamic_cast<ShardedEmbeddingBagCollectionImpl*>(&model) != nullptr) refuse("the model");
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (dynamic_cast<ShardedEmbeddingBagCollectionImpl*>(item.value().get()) != nullptr) refuse(item.key());
  }
}

Job job_of(ParallelModule& model) {
  Job job;
  job.rank = model.mesh().rank();
  job.size = model.mesh().size();
  if (job.size > 1) job.group = &model.world_group();
  return job;
}

std::string plan_json(ParallelModule& model) {
  return model.plan() ? planner::to_json(*model.plan(), -1) : "null";
}

}  // namespace

std::string save(ParallelModule& model, torch::optim::Optimizer* optimizer, const std::string& path,
                 const SaveOptions& options) {
  const Job job = job_of(model);
  return save_entries(job, model_entries(model), optimizer, path, options, plan_json(model));
}

LoadResult load(ParallelModule& model, torch::optim::Optimizer* optimizer, const std::string& path,
                const LoadOptions& options) {
  const Job job = job_of(model);
  return load_entries(job, model_entries(model), optimizer, path, options);
}

std::string save(torch::nn::Module& model, torch::optim::Optimizer* optimizer, const std::string& path,
                 const SaveOptions& options) {
  refuse_distributed_parts(model);
  return save_entries(Job{}, module_entries(model), optimizer, path, options, "null");
}

LoadResult load(torch::nn::Module& model, torch::optim::Optimizer* optimizer, const std::string& path,
                const LoadOptions& options) {
  refuse_distributed_parts(model);
  return load_entries(Job{}, module_entries(model), optimizer, path, options);
}

std::string latest(const std::string& root) {
  std::string best;
  int64_t best_step = 0;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return best;
  std::vector<fs::path> dirs;
  for (const auto& d : fs::directory_iterator(root, ec)) dirs.push_back(d.path());
  std::sort(dirs.begin(), dirs.end());
  for (const auto& d : dirs) {
    const std::string name = d.filename().string();
    auto ends_with = [&](const std::string& suffix) {
      return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    std::error_code missing;
    if (ends_with(".partial") || ends_with(".old") || !fs::exists(d / kIndex, missing)) continue;
    try {
      const auto [dir, index] = read_index(d.string());
      const int64_t step = index.value("step", int64_t{0});
      if (best.empty() || step > best_step) {
        best = d.string();
        best_step = step;
      }
    } catch (const std::exception&) {
      continue;
    }
  }
  return best;
}

}  // namespace monarch::checkpoint
