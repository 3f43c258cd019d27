#pragma once
// The plan's "embeddings" section (docs/plan_format.md), read and written by plan_json.cpp.
#include "json_fields.h"
#include "monarch/planner/embeddings.h"

namespace monarch::planner::json_detail {

Json embeddings_to_json_value(const EmbeddingPlan& plan);
EmbeddingPlan embeddings_from_fields(const Fields& f);
inline constexpr std::initializer_list<const char*> kEmbeddingKeys = {
    "optimizer", "world_size", "batch_per_rank", "tables", "placements", "ranks", "max_rank_s", "lower_bound_s"};

}  // namespace monarch::planner::json_detail
