#pragma once
// The safetensors layout the checkpoints use (docs/checkpoints.md): an 8-byte little-endian
// header length, a JSON header {key: {dtype, shape, data_offsets}} padded to 8 bytes, then the
// raw little-endian tensor bytes. Written whole and fsynced; read memory-mapped with the
// header checked against the file's size.
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace monarch::checkpoint_detail {

// "F32", "BF16", ... for the dtypes a checkpoint stores; throws for another.
std::string dtype_name(at::ScalarType dtype);
// The inverse; throws naming an unknown name.
at::ScalarType dtype_from_name(const std::string& name);
bool storable(at::ScalarType dtype);

// Writes `tensors` (CPU or not: copied to host contiguous one at a time) to `path` and
// fsyncs it; returns each key's CRC-32C. Throws naming the file on an I/O error.
std::map<std::string, uint32_t> write_safetensors(const std::string& path,
                                                  const std::vector<std::pair<std::string, at::Tensor>>& tensors);

class SafetensorsFile {
 public:
  // Maps `path`; throws naming it when it is missing, truncated or its header is not JSON.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // The stored tensor `key`: a read-only view of the mapping (valid while this file lives).
  // With `crc`, its bytes are checked against it once (throws: "fails its checksum").
  at::Tensor tensor(const std::string& key, std::optional<uint32_t> crc = std::nullopt);
  // Drops the pages of `key` from this process's resident memory (they stay in the page cache).
  void release(const std::string& key);
  const nlohmann::json& header() const { return header_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  void* map_ = nullptr;
  size_t size_ = 0;
  size_t start_ = 0;  // of the data
  nlohmann::json header_;
  std::map<std::string, bool> checked_;
};

}  // namespace monarch::checkpoint_detail
