// EmbeddingPlan <-> JSON: the plan's "embeddings" section, and on its own
// (monarch-plan embeddings). Same rules as the rest of the plan: fixed key order, strict
// reading with field paths in errors.
#include <string>

#include "embedding_json.h"
#include "monarch/planner/errors.h"

namespace monarch::planner {
namespace json_detail {

Json embeddings_to_json_value(const EmbeddingPlan& p) {
  Json j;
  j["optimizer"] = to_string(p.optimizer);
  j["world_size"] = p.world_size;
  j["batch_per_rank"] = p.batch_per_rank;
  Json tables = Json::array();
  for (const auto& t : p.tables) {
    Json x;
    x["name"] = t.name;
    x["rows"] = t.rows;
    x["dim"] = t.dim;
    x["bytes_per_element"] = t.bytes_per_element;
    x["features"] = t.features;
    x["pooling_factor"] = t.pooling_factor;
    x["pooling"] = to_string(t.pooling);
    tables.push_back(x);
  }
  j["tables"] = tables;
  Json placements = Json::array();
  for (const auto& pl : p.placements) {
    Json x;
    x["table"] = pl.table;
    x["sharding"] = to_string(pl.sharding);
    Json shards = Json::array();
    for (const auto& s : pl.shards) {
      Json y;
      y["rank"] = s.rank;
      y["row_offset"] = s.row_offset;
      y["rows"] = s.rows;
      y["col_offset"] = s.col_offset;
      y["cols"] = s.cols;
      shards.push_back(y);
    }
    x["shards"] = shards;
    placements.push_back(x);
  }
  j["placements"] = placements;
  Json ranks = Json::array();
  for (const auto& r : p.ranks) {
    Json x;
    x["storage_bytes"] = r.storage_bytes;
    x["lookup_s"] = r.lookup_s;
    x["comm_s"] = r.comm_s;
    x["sent_bytes"] = r.sent_bytes;
    x["received_bytes"] = r.received_bytes;
    ranks.push_back(x);
  }
  j["ranks"] = ranks;
  j["max_rank_s"] = p.max_rank_s;
  j["lower_bound_s"] = p.lower_bound_s;
  return j;
}

EmbeddingPlan embeddings_from_fields(const Fields& f) {
  EmbeddingPlan p;
  p.optimizer = embedding_optimizer_from_string(f.string("optimizer"), f.path("optimizer"));
  p.world_size = f.integer("world_size");
  p.batch_per_rank = f.integer("batch_per_rank");
  const Json& tables = f.array("tables");
  for (size_t i = 0; i < tables.size(); ++i) {
    const Fields x(tables[i], element(f.path("tables"), i),
                   {"name", "rows", "dim", "bytes_per_element", "features", "pooling_factor", "pooling"});
    EmbeddingTable t;
    t.name = x.string("name");
    t.rows = x.integer("rows");
    t.dim = x.integer("dim");
    t.bytes_per_element = x.number("bytes_per_element");
    const Json& features = x.array("features");
    for (size_t k = 0; k < features.size(); ++k) {
      t.features.push_back(as_string(features[k], element(x.path("features"), k)));
    }
    t.pooling_factor = x.number("pooling_factor");
    t.pooling = embedding_pooling_from_string(x.string("pooling"), x.path("pooling"));
    p.tables.push_back(std::move(t));
  }
  const Json& placements = f.array("placements");
  for (size_t i = 0; i < placements.size(); ++i) {
    const Fields x(placements[i], element(f.path("placements"), i), {"table", "sharding", "shards"});
    EmbeddingPlacement pl;
    pl.table = x.string("table");
    pl.sharding = embedding_sharding_from_string(x.string("sharding"), x.path("sharding"));
    const Json& shards = x.array("shards");
    for (size_t k = 0; k < shards.size(); ++k) {
      const Fields y(shards[k], element(x.path("shards"), k), {"rank", "row_offset", "rows", "col_offset", "cols"});
      pl.shards.push_back({y.integer("rank"), y.integer("row_offset"), y.integer("rows"), y.integer("col_offset"),
                           y.integer("cols")});
    }
    p.placements.push_back(std::move(pl));
  }
  const Json& ranks = f.array("ranks");
  for (size_t i = 0; i < ranks.size(); ++i) {
    const Fields x(ranks[i], element(f.path("ranks"), i),
                   {"storage_bytes", "lookup_s", "comm_s", "sent_bytes", "received_bytes"});
    EmbeddingRankLoad r;
    r.storage_bytes = x.number("storage_bytes");
    r.lookup_s = x.number("lookup_s");
    r.comm_s = x.number("comm_s");
    r.sent_bytes = x.number("sent_bytes");
    r.received_bytes = x.number("received_bytes");
    p.ranks.push_back(r);
  }
  p.max_rank_s = f.number("max_rank_s");
  p.lower_bound_s = f.number("lower_bound_s");
  return p;
}

}  // namespace json_detail

std::string embeddings_to_json(const EmbeddingPlan& plan, int indent) {
  return json_detail::embeddings_to_json_value(plan).dump(indent);
}

std::vector<EmbeddingTable> embedding_tables_from_json(const std::string& text) {
  json_detail::Json root;
  try {
    root = json_detail::Json::parse(text);
  } catch (const json_detail::Json::parse_error& e) {
    throw FormatError(std::string("tables JSON: ") + e.what());
  }
  if (root.is_object() && root.contains("tables")) root = root["tables"];
  const auto& list = json_detail::as_array(root, "tables");
  std::vector<EmbeddingTable> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const json_detail::Fields x(list[i], json_detail::element("tables", i),
                                {"name", "rows", "dim", "bytes_per_element", "dtype", "features", "pooling_factor",
                                 "pooling"});
    EmbeddingTable t;
    t.name = x.string("name");
    t.rows = x.integer("rows");
    t.dim = x.integer("dim");
    if (x.has("bytes_per_element")) t.bytes_per_element = x.number("bytes_per_element");
    if (x.has("dtype")) {  // fp32, fp16, bf16, int8
      const std::string d = x.string("dtype");
      if (d == "fp32") t.bytes_per_element = 4;
      else if (d == "fp16" || d == "bf16") t.bytes_per_element = 2;
      else if (d == "int8") t.bytes_per_element = 1;
      else throw ValidationError(x.path("dtype"), "unknown '" + d + "' (fp32, fp16, bf16, int8)");
    }
    if (x.has("features")) {
      const auto& features = x.array("features");
      for (size_t k = 0; k < features.size(); ++k) {
        t.features.push_back(json_detail::as_string(features[k], json_detail::element(x.path("features"), k)));
      }
    } else {
      t.features = {t.name};
    }
    if (x.has("pooling_factor")) t.pooling_factor = x.number("pooling_factor");
    if (x.has("pooling")) t.pooling = embedding_pooling_from_string(x.string("pooling"), x.path("pooling"));
    out.push_back(std::move(t));
  }
  return out;
}

EmbeddingPlan embeddings_from_json(const std::string& text) {
  json_detail::Json root;
  try {
    root = json_detail::Json::parse(text);
  } catch (const json_detail::Json::parse_error& e) {
    throw FormatError(std::string("embeddings JSON: ") + e.what());
  }
  return json_detail::embeddings_from_fields(json_detail::Fields(root, "embeddings", json_detail::kEmbeddingKeys));
}

}  // namespace monarch::planner
