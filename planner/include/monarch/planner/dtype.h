#pragma once
// Numeric formats the planner reasons about, with their sizes.
#include <cstdint>
#include <string>

namespace monarch::planner {

enum class DType { fp32, tf32, bf16, fp16, fp8 };

// Bytes per element of a tensor stored in `dtype` (tf32 is stored as fp32).
double bytes_of(DType dtype);
std::string to_string(DType dtype);
// Throws ValidationError(field, ...) for an unknown name.
DType dtype_from_string(const std::string& name, const std::string& field = "dtype");

}  // namespace monarch::planner
