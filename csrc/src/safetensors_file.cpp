// Safetensors files for checkpoints (safetensors_file.h).
#include "safetensors_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "monarch/runtime/checksum.h"

namespace monarch::checkpoint_detail {
namespace {

const std::vector<std::pair<at::ScalarType, const char*>>& dtype_names() {
  static const std::vector<std::pair<at::ScalarType, const char*>> names = {
      {at::kFloat, "F32"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"}, {at::kDouble, "F64"}, {at::kLong, "I64"},
      {at::kInt, "I32"},   {at::kShort, "I16"}, {at::kChar, "I8"},       {at::kByte, "U8"},     {at::kBool, "BOOL"}};
  return names;
}

std::runtime_error io_error(const std::string& what, const std::string& path) {
  return std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}

void write_all(int fd, const void* data, size_t size, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw io_error("cannot write", path);
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
}

}  // namespace

std::string dtype_name(at::ScalarType dtype) {
  for (const auto& [t, name] : dtype_names()) {
    if (t == dtype) return name;
  }
  throw std::invalid_argument(std::string("cannot store dtype ") + c10::toString(dtype));
}

at::ScalarType dtype_from_name(const std::string& name) {
  for (const auto& [t, n] : dtype_names()) {
    if (name == n) return t;
  }
  throw std::invalid_argument("unknown stored dtype '" + name + "'");
}

bool storable(at::ScalarType dtype) {
  for (const auto& entry : dtype_names()) {
    if (entry.first == dtype) return true;
  }
  return false;
}

std::map<std::string, uint32_t> write_safetensors(const std::string& path,
                                                  const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  int64_t offset = 0;
  for (const auto& [key, t] : tensors) {
    const int64_t n = t.numel() * static_cast<int64_t>(t.element_size());
    header[key] = {{"dtype", dtype_name(t.scalar_type())}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw io_error("cannot create", path);
  std::map<std::string, uint32_t> crcs;
  try {
    const uint64_t length = text.size();  // little-endian: the hosts we build for are
    write_all(fd, &length, sizeof(length), path);
    write_all(fd, text.data(), text.size(), path);
    for (const auto& [key, t] : tensors) {
      const at::Tensor host = t.detach().to(at::kCPU).contiguous();
      const size_t n = static_cast<size_t>(host.numel()) * host.element_size();
      crcs[key] = crc32c(host.data_ptr(), n);
      write_all(fd, host.data_ptr(), n, path);
    }
    if (::fsync(fd) != 0) throw io_error("cannot fsync", path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) throw io_error("cannot close", path);
  return crcs;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw io_error("cannot open", path);
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    ::close(fd_);
    throw io_error("cannot stat", path);
  }
  size_ = static_cast<size_t>(st.st_size);
  auto fail = [&](const std::string& why) {
    if (map_ != nullptr) ::munmap(map_, size_);
    ::close(fd_);
    return std::runtime_error(path + (why.rfind(":", 0) == 0 ? "" : " ") + why);
  };
  if (size_ < 8) throw fail("is truncated (" + std::to_string(size_) + " bytes, no header)");
  map_ = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw fail(std::string("cannot be mapped: ") + std::strerror(errno));
  }
  uint64_t n = 0;
  std::memcpy(&n, map_, sizeof(n));
  if (n > size_ - 8) throw fail("is truncated (header of " + std::to_string(n) + " bytes, file of " + std::to_string(size_) + ")");
  try {
    header_ = nlohmann::json::parse(static_cast<const char*>(map_) + 8, static_cast<const char*>(map_) + 8 + n);
  } catch (const nlohmann::json::exception& e) {
    throw fail(std::string(": the header is not JSON (") + e.what() + ")");
  }
  start_ = 8 + n;
  // Every entry's offsets checked here (a malformed or crafted header is an error, never a
  // read outside the mapping).
  std::string problem;
  try {
    if (!header_.is_object()) problem = ": the header is not a JSON object";
    for (const auto& [key, v] : header_.items()) {
      if (!problem.empty()) break;
      if (key == "__metadata__") continue;
      const auto& offsets = v.at("data_offsets");
      const int64_t begin = offsets.at(0).get<int64_t>(), end = offsets.at(1).get<int64_t>();
      if (begin < 0 || end < begin) {
        problem = ": tensor '" + key + "' has data offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "]";
      } else if (start_ + static_cast<size_t>(end) > size_) {
        problem = "is truncated: its tensors need " + std::to_string(start_ + static_cast<size_t>(end)) +
                  " bytes, the file has " + std::to_string(size_);
      }
      v.at("dtype").get<std::string>();
      v.at("shape").get<std::vector<int64_t>>();
    }
  } catch (const nlohmann::json::exception& e) {
    problem = std::string(": a header entry is malformed (") + e.what() + ")";
  }
  if (!problem.empty()) throw fail(problem);
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, size_);
  if (fd_ >= 0) ::close(fd_);
}

at::Tensor SafetensorsFile::tensor(const std::string& key, std::optional<uint32_t> crc) {
  if (!header_.contains(key) || key == "__metadata__") throw std::runtime_error(path_ + " has no tensor '" + key + "'");
  const auto& h = header_[key];
  const size_t begin = h.at("data_offsets").at(0).get<size_t>(), end = h.at("data_offsets").at(1).get<size_t>();
  char* data = static_cast<char*>(map_) + start_ + begin;
  if (crc && !checked_[key]) {
    if (crc32c(data, end - begin) != *crc) {
      throw std::runtime_error(path_ + ": tensor '" + key + "' fails its checksum (the file is corrupt)");
    }
    checked_[key] = true;
  }
  const auto dtype = dtype_from_name(h.at("dtype").get<std::string>());
  const auto shape = h.at("shape").get<std::vector<int64_t>>();
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  if (static_cast<size_t>(numel) * c10::elementSize(dtype) != end - begin) {
    throw std::runtime_error(path_ + ": tensor '" + key + "' has " + std::to_string(end - begin) + " bytes, its shape and "
                             "dtype need " + std::to_string(numel * c10::elementSize(dtype)));
  }
  // Read only: every use copies out of it.
  return at::from_blob(data, shape, at::TensorOptions().dtype(dtype));
}

void SafetensorsFile::release(const std::string& key) {
  if (!header_.contains(key) || key == "__metadata__") return;
  const auto& h = header_[key];
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t begin = (start_ + h.at("data_offsets").at(0).get<size_t>()) / page * page;
  const size_t end = start_ + h.at("data_offsets").at(1).get<size_t>();
  if (end > begin) ::madvise(static_cast<char*>(map_) + begin, end - begin, MADV_DONTNEED);
}

}  // namespace monarch::checkpoint_detail
