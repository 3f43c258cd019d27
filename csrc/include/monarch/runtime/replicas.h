#pragma once
// What every replica of a wrapped model must agree on at wrap time: the same parameter
// structure, and (by default) rank 0's values. Shared by the data-parallel and the
// fully-sharded engines.
#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "monarch/runtime/communicator.h"

namespace monarch {

// Refuses, on every rank, parameters whose count or shapes differ across the group, naming
// both ranks. `who` prefixes the message.
void check_same_parameters(const std::vector<at::Tensor>& params, Communicator& group, const char* who);

// Refuses, on every rank, options that differ across the group (e.g. a bucket size read
// from a per-host config): each option's name and every rank's value. Values as doubles.
void check_same_options(const std::vector<std::pair<std::string, double>>& options, Communicator& group,
                        const char* who);

// Overwrites every tensor with the group's root's values (empty tensors are skipped).
void broadcast_from_root(const std::vector<at::Tensor>& tensors, Communicator& group);

// Weights tied across pipeline stages (an embedding shared with the output head), one copy
// per end: each copy's gradient becomes the average over `dp` (when given) summed over
// `ends` (when given: null where both ends are on one rank, as under ZB-V, whose one copy
// already accumulated both uses), so identical optimizers keep the copies equal. A missing
// gradient counts as zeros. Every rank of both groups passes its copies in the same order.
void sync_tied_gradients(const std::vector<at::Tensor>& params, Communicator* dp, Communicator* ends);

}  // namespace monarch
