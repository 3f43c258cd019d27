#pragma once
// What every replica of a wrapped model must agree on at wrap time: the same parameter
// structure, and (by default) rank 0's values. Shared by the data-parallel and the
// fully-sharded engines.
#include <ATen/ATen.h>

#include <vector>

#include "monarch/runtime/communicator.h"

namespace monarch {

// Refuses, on every rank, parameters whose count or shapes differ across the group, naming
// both ranks. `who` prefixes the message.
void check_same_parameters(const std::vector<at::Tensor>& params, Communicator& group, const char* who);

// Overwrites every tensor with the group's root's values (empty tensors are skipped).
void broadcast_from_root(const std::vector<at::Tensor>& tensors, Communicator& group);

}  // namespace monarch
