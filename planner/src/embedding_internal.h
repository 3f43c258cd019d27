#pragma once
// Shared by embedding_cost.cpp and embedding_placement.cpp: per-rank byte counts of one
// table's placement, kept as bytes so the placement can add tables before timing them.
#include <algorithm>
#include <cstdint>
#include <cstring>
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

// Bit for bit the same numbers (what the placement may treat as one rank).
inline bool same_bits(const RankBytes& a, const RankBytes& b) { return std::memcmp(&a, &b, sizeof(RankBytes)) == 0; }

Link all_to_all_link(const Cluster& cluster, int64_t world);
double comm_seconds(const RankBytes& r, const Cluster& cluster, int64_t world);
double rank_seconds(const RankBytes& r, const Cluster& cluster, int64_t world);
// rank_seconds with the memory bandwidth and the all-to-all link's bandwidth looked up once.
inline double rank_seconds(const RankBytes& r, double hbm_bytes_per_s, double link_bytes_per_s) {
  return r.lookup_bytes / hbm_bytes_per_s + (std::max(r.sent, r.received) / link_bytes_per_s + r.latency_s);
}

// One table's per-rank bytes, compactly: `rest` on every rank outside the runs. A placement
// gives a few distinct values (a shard's owner, every other rank; a row split's full blocks,
// its last block), so this is O(shards) where the expanded vector is O(world).
struct RankPattern {
  struct Run {
    int64_t lo = 0, hi = 0;  // ranks [lo, hi)
    RankBytes value;
  };
  RankBytes rest;
  std::vector<Run> runs;  // ascending, disjoint, within [0, world)
  const RankBytes& at(int64_t rank) const {
    auto it = std::upper_bound(runs.begin(), runs.end(), rank, [](int64_t r, const Run& run) { return r < run.lo; });
    if (it != runs.begin() && rank < (it - 1)->hi) return (it - 1)->value;
    return rest;
  }
  std::vector<RankBytes> expand(int64_t world) const {
    std::vector<RankBytes> out(world, rest);
    for (const Run& run : runs) std::fill(out.begin() + run.lo, out.begin() + run.hi, run.value);
    return out;
  }
};

// What `p` adds to each rank, bit for bit embedding_rank_bytes(...)[r] at every rank r.
RankPattern embedding_rank_pattern(const EmbeddingTable& t, const EmbeddingPlacement& p, const Cluster& cluster,
                                   const EmbeddingOptions& o);
// The same for a data-parallel table, or for a row split over ranks [first, first + n) (the
// shards rows_split gives: blocks of ceil(rows / n)), without listing the shards.
RankPattern embedding_data_parallel_pattern(const EmbeddingTable& t, const Cluster& cluster,
                                            const EmbeddingOptions& o);
RankPattern embedding_row_split_pattern(const EmbeddingTable& t, EmbeddingSharding sharding, int64_t first,
                                        int64_t n, const Cluster& cluster, const EmbeddingOptions& o);
std::vector<RankBytes> embedding_rank_bytes(const EmbeddingTable& t, const EmbeddingPlacement& p,
                                            const Cluster& cluster, const EmbeddingOptions& o);

}  // namespace monarch::planner::embedding_detail
