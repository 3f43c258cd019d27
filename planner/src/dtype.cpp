#include "monarch/planner/dtype.h"

#include "monarch/planner/errors.h"

namespace monarch::planner {

double bytes_of(DType dtype) {
  switch (dtype) {
    case DType::fp32: return 4;
    case DType::tf32: return 4;  // stored as fp32; only the matmul inputs are rounded
    case DType::bf16: return 2;
    case DType::fp16: return 2;
    case DType::fp8: return 1;
  }
  throw ValidationError("dtype", "unknown dtype value " + std::to_string(static_cast<int>(dtype)));
}

std::string to_string(DType dtype) {
  switch (dtype) {
    case DType::fp32: return "fp32";
    case DType::tf32: return "tf32";
    case DType::bf16: return "bf16";
    case DType::fp16: return "fp16";
    case DType::fp8: return "fp8";
  }
  return "unknown";
}

DType dtype_from_string(const std::string& name, const std::string& field) {
  for (DType d : {DType::fp32, DType::tf32, DType::bf16, DType::fp16, DType::fp8}) {
    if (to_string(d) == name) return d;
  }
  throw ValidationError(field,
                        "unknown dtype '" + name + "' (expected one of fp32, tf32, bf16, fp16, fp8)");
}

}  // namespace monarch::planner
