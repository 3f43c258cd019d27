#pragma once
// Strict reading of JSON objects for the plan formats: every field's type checked, unknown
// keys refused, errors naming the field path. Shared by plan_json.cpp and embedding_json.cpp.
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "monarch/planner/errors.h"

namespace monarch::planner::json_detail {

using Json = nlohmann::ordered_json;

inline std::string type_name(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "integer";
    case Json::value_t::number_float: return "number";
    case Json::value_t::string: return "string";
    case Json::value_t::array: return "array";
    case Json::value_t::object: return "object";
    default: return "unknown";
  }
}

[[noreturn]] inline void wrong_type(const Json& j, const char* expected, const std::string& path) {
  std::string got = type_name(j);
  if (j.is_number_float()) got += " " + j.dump();  // "expected integer, got number 2.5"
  throw ValidationError(path, std::string("expected ") + expected + ", got " + got);
}

inline int64_t as_integer(const Json& j, const std::string& path) {
  if (j.is_number_unsigned()) {
    if (j.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw ValidationError(path, j.dump() + " is out of range for a 64-bit integer");
    }
    return static_cast<int64_t>(j.get<uint64_t>());
  }
  if (!j.is_number_integer()) wrong_type(j, "integer", path);
  return j.get<int64_t>();
}

// Integers are accepted where a real number is expected (hand-written "bytes": 1000).
inline double as_number(const Json& j, const std::string& path) {
  if (!j.is_number()) wrong_type(j, "number", path);
  return j.get<double>();
}

inline bool as_bool(const Json& j, const std::string& path) {
  if (!j.is_boolean()) wrong_type(j, "boolean", path);
  return j.get<bool>();
}

inline std::string as_string(const Json& j, const std::string& path) {
  if (!j.is_string()) wrong_type(j, "string", path);
  return j.get<std::string>();
}

inline const Json& as_array(const Json& j, const std::string& path) {
  if (!j.is_array()) wrong_type(j, "array", path);
  return j;
}

inline std::string join(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

inline std::string element(const std::string& path, size_t i) {
  return path + "[" + std::to_string(i) + "]";
}

// One JSON object being read: checks it is an object with no unknown keys, and reads
// its fields with their full paths in error messages.
class Fields {
 public:
  Fields(const Json& j, std::string path, std::initializer_list<const char*> allowed)
      : j_(j), path_(std::move(path)) {
    if (!j_.is_object()) wrong_type(j_, "object", path_.empty() ? "plan" : path_);
    for (const auto& item : j_.items()) {
      bool known = false;
      for (const char* key : allowed) known = known || item.key() == key;
      if (!known) throw ValidationError(join(path_, item.key()), "unknown field");
    }
  }

  std::string path(const char* key) const { return join(path_, key); }
  bool has(const char* key) const { return j_.contains(key); }
  const Json& at(const char* key) const {
    if (!has(key)) throw ValidationError(path(key), "missing required field");
    return j_.at(key);
  }

  int64_t integer(const char* key) const { return as_integer(at(key), path(key)); }
  double number(const char* key) const { return as_number(at(key), path(key)); }
  bool boolean(const char* key) const { return as_bool(at(key), path(key)); }
  std::string string(const char* key) const { return as_string(at(key), path(key)); }
  const Json& array(const char* key) const { return as_array(at(key), path(key)); }
  Fields object(const char* key, std::initializer_list<const char*> allowed) const {
    return Fields(at(key), path(key), allowed);
  }

 private:
  const Json& j_;
  std::string path_;
};

}  // namespace monarch::planner::json_detail
