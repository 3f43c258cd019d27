#pragma once
// A Communicator carried through an autograd context as an int64 (AutogradContext::saved_data
// holds IValues): its address. The mesh owning the group must outlive the autograd graph
// (the tensor-parallel, context-parallel and expert-parallel functions all rely on it).
#include <cstdint>

#include "monarch/runtime/communicator.h"

namespace monarch::detail {

inline int64_t as_handle(Communicator& group) { return reinterpret_cast<int64_t>(&group); }
inline Communicator& from_handle(int64_t handle) { return *reinterpret_cast<Communicator*>(handle); }

}  // namespace monarch::detail
