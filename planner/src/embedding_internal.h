#pragma once
// Shared by embedding_cost.cpp and embedding_placement.cpp: per-rank byte counts of one
// table's placement, kept as bytes so the placement can add tables before timing them.
#include <vector>

#include "monarch/planner/collectives.h"
#include "monarch/planner/embeddings.h"

namespace monarch::planner::embedding_detail {

struct RankBytes {
  double storage = 0;       // table shard + optimizer state
  double lookup_bytes = 0;  // device-memory traffic of lookups and sparse updates
  double sent = 0, received = 0;  // over the all-to-all link
  double latency_s = 0;     // per-message latencies of collectives only this table needs
  RankBytes& operator+=(const RankBytes& o) {
    storage += o.storage;
    lookup_bytes += o.lookup_bytes;
    sent += o.sent;
    received += o.received;
    latency_s += o.latency_s;
    return *this;
  }
  RankBytes& operator-=(const RankBytes& o) {
    storage -= o.storage;
    lookup_bytes -= o.lookup_bytes;
    sent -= o.sent;
    received -= o.received;
    latency_s -= o.latency_s;
    return *this;
  }
};

Link all_to_all_link(const Cluster& cluster, int64_t world);
double comm_seconds(const RankBytes& r, const Cluster& cluster, int64_t world);
double rank_seconds(const RankBytes& r, const Cluster& cluster, int64_t world);
std::vector<RankBytes> embedding_rank_bytes(const EmbeddingTable& t, const EmbeddingPlacement& p,
                                            const Cluster& cluster, const EmbeddingOptions& o);

}  // namespace monarch::planner::embedding_detail
