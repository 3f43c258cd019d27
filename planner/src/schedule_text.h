#pragma once
// How schedule errors name actions, shared by the checker (schedule.cpp) and the simulator
// (schedule_simulator.cpp) so both report the same text. Private to planner/src.
#include <cstddef>
#include <cstdint>
#include <string>

#include "monarch/planner/schedule.h"

namespace monarch::planner::detail {

// "forward(micro_batch=0, stage=1)", with ", peer=2" for communication. A type outside the
// enum (a corrupted program handed to check_schedule) is shown as its number.
std::string describe(const Action& a);
// "schedule.per_rank[r][i]": the field path of one action.
std::string action_field(int64_t rank, size_t index);

}  // namespace monarch::planner::detail
