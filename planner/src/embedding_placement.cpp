// Choosing each table's sharding and placing the shards (TorchRec's enumerate -> estimate ->
// propose -> partition, done as one greedy pass plus local search, with a lower bound).
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <tuple>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>

#include "embedding_internal.h"
#include "monarch/planner/embeddings.h"
#include "monarch/planner/errors.h"

namespace monarch::planner {

using embedding_detail::RankBytes;
using embedding_detail::RankPattern;

// ---- names --------------------------------------------------------------------------------

std::string to_string(EmbeddingSharding s) {
  switch (s) {
    case EmbeddingSharding::data_parallel: return "data_parallel";
    case EmbeddingSharding::table_wise: return "table_wise";
    case EmbeddingSharding::row_wise: return "row_wise";
    case EmbeddingSharding::column_wise: return "column_wise";
    case EmbeddingSharding::table_row_wise: return "table_row_wise";
  }
  return "?";
}

EmbeddingSharding embedding_sharding_from_string(const std::string& name, const std::string& field) {
  for (auto s : {EmbeddingSharding::data_parallel, EmbeddingSharding::table_wise, EmbeddingSharding::row_wise,
                 EmbeddingSharding::column_wise, EmbeddingSharding::table_row_wise}) {
    if (to_string(s) == name) return s;
  }
  throw ValidationError(field, "unknown sharding '" + name +
                                   "' (data_parallel, table_wise, row_wise, column_wise, table_row_wise)");
}

std::string to_string(EmbeddingOptimizer o) {
  switch (o) {
    case EmbeddingOptimizer::sgd: return "sgd";
    case EmbeddingOptimizer::rowwise_adagrad: return "rowwise_adagrad";
    case EmbeddingOptimizer::adam: return "adam";
  }
  return "?";
}

EmbeddingOptimizer embedding_optimizer_from_string(const std::string& name, const std::string& field) {
  for (auto o : {EmbeddingOptimizer::sgd, EmbeddingOptimizer::rowwise_adagrad, EmbeddingOptimizer::adam}) {
    if (to_string(o) == name) return o;
  }
  throw ValidationError(field, "unknown optimizer '" + name + "' (sgd, rowwise_adagrad, adam)");
}

std::string to_string(EmbeddingPooling p) {
  switch (p) {
    case EmbeddingPooling::sum: return "sum";
    case EmbeddingPooling::mean: return "mean";
    case EmbeddingPooling::none: return "none";
  }
  return "?";
}

EmbeddingPooling embedding_pooling_from_string(const std::string& name, const std::string& field) {
  for (auto p : {EmbeddingPooling::sum, EmbeddingPooling::mean, EmbeddingPooling::none}) {
    if (to_string(p) == name) return p;
  }
  throw ValidationError(field, "unknown pooling '" + name + "' (sum, mean, none)");
}

bool EmbeddingTable::operator==(const EmbeddingTable& o) const {
  return name == o.name && rows == o.rows && dim == o.dim && bytes_per_element == o.bytes_per_element &&
         features == o.features && pooling_factor == o.pooling_factor && pooling == o.pooling;
}
bool EmbeddingShard::operator==(const EmbeddingShard& o) const {
  return rank == o.rank && row_offset == o.row_offset && rows == o.rows && col_offset == o.col_offset &&
         cols == o.cols;
}
bool EmbeddingPlacement::operator==(const EmbeddingPlacement& o) const {
  return table == o.table && sharding == o.sharding && shards == o.shards;
}
bool EmbeddingRankLoad::operator==(const EmbeddingRankLoad& o) const {
  return storage_bytes == o.storage_bytes && lookup_s == o.lookup_s && comm_s == o.comm_s &&
         sent_bytes == o.sent_bytes && received_bytes == o.received_bytes;
}
bool EmbeddingPlan::operator==(const EmbeddingPlan& o) const {
  return optimizer == o.optimizer && world_size == o.world_size && batch_per_rank == o.batch_per_rank &&
         tables == o.tables && placements == o.placements && ranks == o.ranks && max_rank_s == o.max_rank_s &&
         lower_bound_s == o.lower_bound_s;
}

namespace {

std::string table_field(const EmbeddingTable& t) { return "embeddings.tables." + t.name; }

void validate_table(const EmbeddingTable& t) {
  const std::string f = table_field(t);
  if (t.name.empty()) throw ValidationError("embeddings.tables", "a table has no name");
  if (t.rows <= 0) throw ValidationError(f + ".rows", "must be > 0");
  if (t.dim <= 0) throw ValidationError(f + ".dim", "must be > 0");
  if (!(t.bytes_per_element > 0 && t.bytes_per_element <= 8)) {
    throw ValidationError(f + ".bytes_per_element", "must be in (0, 8]");
  }
  if (t.features.empty()) throw ValidationError(f + ".features", "no feature looks this table up");
  if (!(t.pooling_factor > 0) || !std::isfinite(t.pooling_factor)) {
    throw ValidationError(f + ".pooling_factor", "must be > 0");
  }
}

void validate_options(const EmbeddingOptions& o) {
  if (o.world_size < 1) throw ValidationError("embeddings.world_size", "must be >= 1");
  if (o.batch_per_rank < 1) throw ValidationError("embeddings.batch_per_rank", "must be >= 1");
  if (o.memory_budget_bytes < 0) throw ValidationError("embeddings.memory_budget_bytes", "must be >= 0");
  if (o.column_chunk < 0) throw ValidationError("embeddings.column_chunk", "must be >= 0");
}

int64_t chunk_width(const EmbeddingTable& t, const EmbeddingOptions& o) {
  if (o.column_chunk > 0) return o.column_chunk;
  return std::max<int64_t>(4, (t.dim / 4) / 4 * 4);
}

int64_t node_size(const Cluster& c, int64_t world) { return std::max<int64_t>(1, std::min(c.devices_per_node, world)); }

// The shards of `sharding` for a table, placed at `rank` (table-wise), `node` (table-row-wise:
// its first rank), or starting at `rank` for column chunks (chunk i on ranks[i]).
std::vector<EmbeddingShard> rows_split(int64_t rows, int64_t cols, const std::vector<int64_t>& ranks) {
  std::vector<EmbeddingShard> out;
  const int64_t n = static_cast<int64_t>(ranks.size());
  const int64_t block = (rows + n - 1) / n;  // block row sharding: rank i owns [i b, (i+1) b)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t begin = i * block, end = std::min(rows, begin + block);
    if (end <= begin) break;
    out.push_back({ranks[i], begin, end - begin, 0, cols});
  }
  return out;
}

struct Candidate {
  EmbeddingSharding sharding;
  // Placeable pieces: for table-wise one, for column-wise one per chunk, for the spread
  // shardings none (their shards are fixed: every rank, or one node chosen at placement).
  int64_t pieces = 0;
};

std::vector<EmbeddingSharding> allowed(const EmbeddingTable& t, const Cluster& c, const EmbeddingOptions& o,
                                       double budget, std::string* why_not_pinned) {
  std::vector<EmbeddingSharding> out;
  const double state = embedding_optimizer_bytes_per_row(o.optimizer, t.dim);
  const double whole = static_cast<double>(t.rows) * (static_cast<double>(t.dim) * t.bytes_per_element + state);
  const int64_t chunk = chunk_width(t, o);
  const int64_t W = o.world_size;
  const int64_t N = node_size(c, W);
  auto consider = [&](EmbeddingSharding s, bool ok, const std::string& reason) {
    if (ok) {
      out.push_back(s);
    } else if (why_not_pinned) {
      auto it = o.pins.find(t.name);
      if (it != o.pins.end() && it->second == s) *why_not_pinned = reason;
    }
  };
  auto gib = [](double b) {
    std::ostringstream s;
    s.precision(3);
    s << b / (1024.0 * 1024 * 1024) << " GiB";
    return s.str();
  };
  // Data-parallel also holds the table's dense fp32 gradient and row flags during backward.
  const double replicated = whole + static_cast<double>(t.rows) * (static_cast<double>(t.dim) * 4 + 4);
  consider(EmbeddingSharding::data_parallel, replicated <= budget,
           "data_parallel needs the whole table and its dense gradient (" + gib(replicated) +
               ") on every rank; the budget is " + gib(budget));
  consider(EmbeddingSharding::table_wise, whole <= budget,
           "table_wise needs the whole table (" + gib(whole) + ") on one rank; the budget is " + gib(budget));
  const double chunk_bytes = static_cast<double>(t.rows) *
      (static_cast<double>(std::min(chunk, t.dim)) * t.bytes_per_element +
       embedding_optimizer_bytes_per_row(o.optimizer, std::min(chunk, t.dim)));
  consider(EmbeddingSharding::column_wise, W > 1 && t.dim >= 2 * chunk && chunk_bytes <= budget,
           W <= 1 ? "column_wise needs more than one rank"
           : t.dim < 2 * chunk
               ? "column_wise needs dim >= 2 chunks of " + std::to_string(chunk) + " (dim is " + std::to_string(t.dim) + ")"
               : "column_wise needs a chunk (" + gib(chunk_bytes) + ") on one rank; the budget is " + gib(budget));
  const double rw = whole / static_cast<double>(std::min<int64_t>(W, t.rows));
  consider(EmbeddingSharding::row_wise, W > 1 && rw <= budget,
           W <= 1 ? "row_wise needs more than one rank"
                  : "row_wise puts " + gib(rw) + " on a rank; the budget is " + gib(budget));
  const double twrw = whole / static_cast<double>(std::min<int64_t>(N, t.rows));
  consider(EmbeddingSharding::table_row_wise, N > 1 && W % N == 0 && twrw <= budget,
           N <= 1 ? "table_row_wise needs more than one rank per node"
                  : "table_row_wise puts " + gib(twrw) + " on a rank of one node; the budget is " + gib(budget));
  return out;
}

// Ranks grouped by their load. Ranks that every table so far treated alike hold bit for bit
// the same bytes (the same additions in the same order), so a question about every rank is
// one evaluation per group: 1000 tables on 16384 ranks leave about 1300 groups. Each group
// lists its ranks in ascending order; its first rank is the one a tie-break on rank names.
class RankGroups {
 public:
  explicit RankGroups(int64_t world) : of_(static_cast<size_t>(world), 0), groups_(1) {
    groups_[0].ranks.resize(static_cast<size_t>(world));
    std::iota(groups_[0].ranks.begin(), groups_[0].ranks.end(), int64_t{0});
    spans_.push_back({0, world - 1, world});
  }
  size_t size() const { return groups_.size(); }
  const RankBytes& load(size_t g) const { return groups_[g].load; }
  const std::vector<int64_t>& ranks(size_t g) const { return groups_[g].ranks; }
  int64_t first(size_t g) const { return spans_[g].first; }
  int64_t count(size_t g) const { return spans_[g].count; }
  size_t group_of(int64_t rank) const { return of_[static_cast<size_t>(rank)]; }

  // Every rank's load plus (or minus) p's bytes for it, as rank-by-rank arithmetic would
  // give: a group whose ranks p treats alike changes in place, others split.
  void apply(const RankPattern& p, bool subtract) {
    const uint64_t stamp = next_stamp();
    auto op = [subtract](RankBytes x, const RankBytes& v) {
      if (subtract) {
        x -= v;
      } else {
        x += v;
      }
      return x;
    };
    std::vector<size_t> hit;
    for (const auto& run : p.runs) {
      hit.clear();
      groups_in(run.lo, run.hi, [&](size_t g, int64_t) { hit.push_back(g); });
      for (size_t g : hit) {
        std::vector<int64_t>& rs = groups_[g].ranks;
        const auto a = std::lower_bound(rs.begin(), rs.end(), run.lo);
        const auto b = std::lower_bound(a, rs.end(), run.hi);
        if (a == rs.begin() && b == rs.end()) {
          groups_[g].load = op(groups_[g].load, run.value);
          mark_[g] = stamp;
          continue;
        }
        Group split;
        split.load = op(groups_[g].load, run.value);
        split.ranks = std::vector<int64_t>(a, b);
        rs.erase(a, b);
        spans_[g] = span_of(rs);
        const size_t id = groups_.size();
        for (int64_t r : split.ranks) of_[static_cast<size_t>(r)] = id;
        spans_.push_back(span_of(split.ranks));
        groups_.push_back(std::move(split));
        mark_.push_back(stamp);
        seen_.push_back(0);
        covered_.push_back(0);
      }
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (mark_[g] != stamp) groups_[g].load = op(groups_[g].load, p.rest);
    }
  }

  // fn(group, value) for each group and each of p's values that some rank of the group takes.
  template <class Fn>
  void for_each_pair(const RankPattern& p, Fn fn) const {
    const uint64_t stamp = next_stamp();
    for (const auto& run : p.runs) {
      groups_in(run.lo, run.hi, [&](size_t g, int64_t count) {
        fn(g, run.value);
        if (mark_[g] != stamp) {
          mark_[g] = stamp;
          covered_[g] = 0;
        }
        covered_[g] += count;
      });
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      const int64_t covered = mark_[g] == stamp ? covered_[g] : 0;
      if (covered < spans_[g].count) fn(g, p.rest);
    }
  }

 private:
  struct Group {
    RankBytes load;
    std::vector<int64_t> ranks;  // ascending
  };
  struct Span {
    int64_t first, last, count;  // of the group's ranks
  };
  static Span span_of(const std::vector<int64_t>& rs) {
    return {rs.front(), rs.back(), static_cast<int64_t>(rs.size())};
  }

  uint64_t next_stamp() const {
    mark_.resize(groups_.size(), 0);
    covered_.resize(groups_.size(), 0);
    seen_.resize(groups_.size(), 0);
    return ++stamp_;
  }

  // fn(group, how many of its ranks) for each group with ranks in [lo, hi): by walking the
  // ranks when the range is short, else from each group's first and last rank (searching
  // its ranks only when they straddle the range).
  template <class Fn>
  void groups_in(int64_t lo, int64_t hi, Fn fn) const {
    if (hi - lo <= 64) {
      const uint64_t visit = ++stamp_;
      size_t found[64];
      size_t n = 0;
      for (int64_t r = lo; r < hi; ++r) {
        const size_t g = of_[static_cast<size_t>(r)];
        if (seen_[g] != visit) {
          seen_[g] = visit;
          found[n++] = g;
        }
      }
      for (size_t i = 0; i < n; ++i) fn(found[i], count_in(found[i], lo, hi));
      return;
    }
    const size_t n = groups_.size();  // fn may add groups: not those
    for (size_t g = 0; g < n; ++g) {
      const Span& s = spans_[g];
      if (s.last < lo || s.first >= hi) continue;
      const int64_t k = s.first >= lo && s.last < hi ? s.count : count_in(g, lo, hi);
      if (k > 0) fn(g, k);
    }
  }
  int64_t count_in(size_t g, int64_t lo, int64_t hi) const {
    const auto& rs = groups_[g].ranks;
    const auto a = std::lower_bound(rs.begin(), rs.end(), lo);
    return std::lower_bound(a, rs.end(), hi) - a;
  }

  std::vector<size_t> of_;  // each rank's group
  std::vector<Group> groups_;
  std::vector<Span> spans_;
  mutable uint64_t stamp_ = 0;
  mutable std::vector<uint64_t> mark_, seen_;
  mutable std::vector<int64_t> covered_;
};

// Where one table went, compactly: the shards are written out once, for the proposal kept
// (a row-wise table on 16384 ranks has 16384 of them).
struct Placed {
  EmbeddingSharding sharding = EmbeddingSharding::table_wise;
  std::vector<EmbeddingShard> shards;  // table- and column-wise: the pieces
  int64_t first_rank = 0;              // table-row-wise: the node's first rank
};

struct State {
  const std::vector<EmbeddingTable>& tables;
  const Cluster& cluster;
  const EmbeddingOptions& options;
  double budget;
  RankGroups load;  // all tables placed so far
  std::vector<Placed> placements;
  std::vector<RankPattern> contribution;  // per table
  // Spread placements (data-parallel, row-wise, table-row-wise on a node) do not depend on the
  // load: their bytes are computed once per table, kind and first rank.
  std::shared_ptr<std::map<std::tuple<size_t, int, int64_t>, RankPattern>> spread =
      std::make_shared<std::map<std::tuple<size_t, int, int64_t>, RankPattern>>();
  double hbm_bytes_per_s = cluster.hbm_bytes_per_s;
  double link_bytes_per_s = embedding_detail::all_to_all_link(cluster, options.world_size).bytes_per_s;

  State(const std::vector<EmbeddingTable>& tables, const Cluster& cluster, const EmbeddingOptions& options,
        double budget)
      : tables(tables), cluster(cluster), options(options), budget(budget), load(options.world_size),
        placements(tables.size()), contribution(tables.size()) {}

  double rank_time(const RankBytes& r) const {
    return embedding_detail::rank_seconds(r, hbm_bytes_per_s, link_bytes_per_s);
  }
  double max_time() const {
    double m = 0;
    for (size_t g = 0; g < load.size(); ++g) m = std::max(m, rank_time(load.load(g)));
    return m;
  }
  // The first rank among the most loaded.
  int64_t hot_rank() const {
    int64_t hot = -1;
    double most = 0;
    for (size_t g = 0; g < load.size(); ++g) {
      const double v = rank_time(load.load(g));
      const int64_t r = load.first(g);
      if (hot < 0 || v > most || (v == most && r < hot)) {
        hot = r;
        most = v;
      }
    }
    return hot;
  }
  RankPattern bytes_of(size_t t, const EmbeddingPlacement& p) const {
    return embedding_detail::embedding_rank_pattern(tables[t], p, cluster, options);
  }
  // Data-parallel (first 0), row-wise (first 0), or table-row-wise on the node from `first`.
  const RankPattern& spread_bytes_of(size_t t, EmbeddingSharding s, int64_t first) const {
    const auto key = std::make_tuple(t, static_cast<int>(s), first);
    auto it = spread->find(key);
    if (it == spread->end()) {
      const int64_t W = options.world_size;
      RankPattern p = s == EmbeddingSharding::data_parallel
                          ? embedding_detail::embedding_data_parallel_pattern(tables[t], cluster, options)
                      : s == EmbeddingSharding::row_wise
                          ? embedding_detail::embedding_row_split_pattern(tables[t], s, 0, W, cluster, options)
                          : embedding_detail::embedding_row_split_pattern(tables[t], s, first, node_size(cluster, W),
                                                                          cluster, options);
      it = spread->emplace(key, std::move(p)).first;
    }
    return it->second;
  }
  void add(size_t t, Placed p, RankPattern bytes) {
    contribution[t] = std::move(bytes);
    load.apply(contribution[t], false);
    placements[t] = std::move(p);
  }
  void remove(size_t t) {
    load.apply(contribution[t], true);
    contribution[t] = RankPattern{};
  }
  bool fits(const RankPattern& extra) const {
    bool ok = true;
    load.for_each_pair(extra, [&](size_t g, const RankBytes& v) {
      if (load.load(g).storage + v.storage > budget * (1 + 1e-12)) ok = false;
    });
    return ok;
  }
  // Max rank time if `extra` were added.
  double max_with(const RankPattern& extra) const {
    double m = 0;
    load.for_each_pair(extra, [&](size_t g, const RankBytes& v) {
      RankBytes x = load.load(g);
      x += v;
      m = std::max(m, rank_time(x));
    });
    return m;
  }
};

std::vector<int64_t> all_ranks(int64_t n, int64_t first = 0) {
  std::vector<int64_t> r(n);
  std::iota(r.begin(), r.end(), first);
  return r;
}

// A table's placement written out.
EmbeddingPlacement write_out(const State& st, size_t t, const Placed& p) {
  const EmbeddingTable& table = st.tables[t];
  const int64_t W = st.options.world_size;
  EmbeddingPlacement q;
  q.table = table.name;
  q.sharding = p.sharding;
  switch (p.sharding) {
    case EmbeddingSharding::data_parallel:
      for (int64_t r = 0; r < W; ++r) q.shards.push_back({r, 0, table.rows, 0, table.dim});
      break;
    case EmbeddingSharding::row_wise: q.shards = rows_split(table.rows, table.dim, all_ranks(W)); break;
    case EmbeddingSharding::table_row_wise:
      q.shards = rows_split(table.rows, table.dim, all_ranks(node_size(st.cluster, W), p.first_rank));
      break;
    case EmbeddingSharding::table_wise:
    case EmbeddingSharding::column_wise: q.shards = p.shards; break;
  }
  return q;
}

// The best placement of table t with sharding s given the current load (greedy: each
// piece on the rank that keeps the maximum lowest, among ranks with memory for it).
struct Scored {
  Placed placement;
  RankPattern bytes;  // what it adds to each rank
  double max_s = 0;   // the most loaded rank's time with it added
};

// The best placement of table t with sharding s given the current load: each piece (a
// table-wise table, a column chunk) on the rank that keeps the maximum lowest among ranks
// with memory for it; a table-row-wise table on the best node. A piece adds the same bytes to
// every rank but its owner, so each rank is scored in O(1) from the two largest times of the
// others. Every rank's time is read from its group (RankGroups): the values and the ranks
// chosen on ties (the first) are those of scoring each rank alone.
std::optional<Scored> best_placement(const State& st, size_t t, EmbeddingSharding s) {
  const EmbeddingTable& table = st.tables[t];
  const int64_t W = st.options.world_size;
  const RankGroups& groups = st.load;
  const double limit = st.budget * (1 + 1e-12);
  Scored out;
  out.placement.sharding = s;
  auto finish_with = [&](RankPattern bytes) -> std::optional<Scored> {
    out.bytes = std::move(bytes);
    if (!st.fits(out.bytes)) return std::nullopt;
    out.max_s = st.max_with(out.bytes);
    return out;
  };
  switch (s) {
    case EmbeddingSharding::data_parallel:
    case EmbeddingSharding::row_wise: return finish_with(st.spread_bytes_of(t, s, 0));
    case EmbeddingSharding::table_row_wise: {
      // On node k the table adds node 0's bytes shifted by k*N: its ranks hold the same
      // shards, and every rank outside the node sends and receives the same bytes (storage
      // none). So node 0's bytes are computed (and cached) once, and each node is scored
      // from its own ranks, plus the largest time outside it, read from the N + 1 largest
      // times of all ranks with the outside bytes added. (Scoring each node with a whole
      // W-long vector, cached per node, took O(W^2 / N) time and memory per table: 5.4 GB
      // for 1000 tables on 1024 ranks.) The same values as the direct computation, and the
      // same node on ties (the first).
      const int64_t N = node_size(st.cluster, W);
      const int64_t nodes = W / N;
      const RankPattern& base = st.spread_bytes_of(t, s, 0);
      const RankBytes outside = nodes > 1 ? base.at(N) : RankBytes{};
      const size_t G = groups.size();
      std::vector<double> with_outside(G);
      for (size_t g = 0; g < G; ++g) {
        RankBytes x = groups.load(g);
        x += outside;
        with_outside[g] = st.rank_time(x);
      }
      // The `keep` largest (rank, time) by time, then rank. The groups that can hold them: the
      // `keep` largest groups by (time, first rank) walked until `keep` ranks are in hand, and
      // every group as slow as the last one walked (it may hold lower ranks); up to `keep`
      // ranks of each, sorted.
      const int64_t keep = std::min<int64_t>(W, N + 1);
      auto slower = [&](size_t a, size_t b) {
        return with_outside[a] > with_outside[b] ||
               (with_outside[a] == with_outside[b] && groups.first(a) < groups.first(b));
      };
      std::vector<size_t> by_time(G);
      std::iota(by_time.begin(), by_time.end(), size_t{0});
      const size_t head = std::min<size_t>(G, static_cast<size_t>(keep));
      std::partial_sort(by_time.begin(), by_time.begin() + static_cast<std::ptrdiff_t>(head), by_time.end(), slower);
      std::vector<std::pair<int64_t, double>> top;  // (rank, time)
      auto take = [&](size_t g) {
        const auto& rs = groups.ranks(g);
        for (size_t k = 0; k < rs.size() && static_cast<int64_t>(k) < keep; ++k) top.push_back({rs[k], with_outside[g]});
      };
      int64_t taken = 0;
      size_t walked = 0;
      while (walked < head && taken < keep) {
        take(by_time[walked]);
        taken += groups.count(by_time[walked]);
        ++walked;
      }
      const double last = with_outside[by_time[walked - 1]];
      for (size_t i = walked; i < G; ++i) {
        if (with_outside[by_time[i]] == last) take(by_time[i]);
      }
      std::sort(top.begin(), top.end(), [](const auto& a, const auto& b) {
        return a.second > b.second || (a.second == b.second && a.first < b.first);
      });
      top.resize(static_cast<size_t>(std::min<int64_t>(keep, static_cast<int64_t>(top.size()))));
      // Node 0's bytes per position, as indices into its distinct values; each (group, value)
      // scored once.
      std::vector<RankBytes> values;
      std::vector<size_t> value_at(static_cast<size_t>(N));
      for (int64_t i = 0; i < N; ++i) {
        const RankBytes& v = base.at(i);
        size_t j = 0;
        while (j < values.size() && !embedding_detail::same_bits(values[j], v)) ++j;
        if (j == values.size()) values.push_back(v);
        value_at[static_cast<size_t>(i)] = j;
      }
      const size_t J = values.size();
      std::vector<double> time(G * J);
      std::vector<char> scored(G * J, 0), fit(G * J, 0);
      int64_t best_node = -1;
      double best_max = 0;
      for (int64_t node = 0; node < nodes; ++node) {
        const int64_t lo = node * N, hi = lo + N;
        bool fits = true;
        double m = 0;
        for (int64_t i = 0; i < N && fits; ++i) {
          const size_t g = groups.group_of(lo + i), j = value_at[static_cast<size_t>(i)];
          const size_t k = g * J + j;
          if (!scored[k]) {
            RankBytes x = groups.load(g);
            x += values[j];
            fit[k] = x.storage <= limit;
            time[k] = st.rank_time(x);
            scored[k] = 1;
          }
          fits = fit[k];
          m = std::max(m, time[k]);
        }
        if (!fits) continue;
        for (const auto& [rank, v] : top) {
          if (rank < lo || rank >= hi) {
            m = std::max(m, v);
            break;
          }
        }
        if (best_node < 0 || m < best_max) {
          best_node = node;
          best_max = m;
        }
      }
      if (best_node < 0) return std::nullopt;
      out.placement.first_rank = best_node * N;
      out.bytes.rest = outside;
      for (int64_t i = 0; i < N; ++i) {
        const RankBytes& v = values[value_at[static_cast<size_t>(i)]];
        const int64_t r = best_node * N + i;
        if (!out.bytes.runs.empty() && out.bytes.runs.back().hi == r &&
            embedding_detail::same_bits(out.bytes.runs.back().value, v)) {
          ++out.bytes.runs.back().hi;
        } else {
          out.bytes.runs.push_back({r, r + 1, v});
        }
      }
      out.max_s = best_max;
      return out;
    }
    case EmbeddingSharding::table_wise:
    case EmbeddingSharding::column_wise: {
      const int64_t chunk = s == EmbeddingSharding::table_wise ? table.dim : chunk_width(table, st.options);
      // The load with this table's pieces chosen so far: each group's ranks that own no piece
      // (they got every piece's `other` bytes), and the owners, split off (one per piece).
      const size_t G = groups.size();
      std::vector<RankBytes> group_load(G);
      std::vector<int64_t> left(G);
      for (size_t g = 0; g < G; ++g) {
        group_load[g] = groups.load(g);
        left[g] = groups.count(g);
      }
      struct Owner {
        int64_t rank;
        size_t group;
        RankBytes load;
      };
      std::vector<Owner> owners;
      // The first rank of group g that owns no piece.
      auto first_free = [&](size_t g) {
        if (left[g] == groups.count(g)) return groups.first(g);
        for (int64_t r : groups.ranks(g)) {
          if (std::none_of(owners.begin(), owners.end(), [&](const Owner& o) { return o.rank == r; })) return r;
        }
        return int64_t{-1};
      };
      std::vector<EmbeddingShard> shards;
      for (int64_t col = 0; col < table.dim; col += chunk) {
        const int64_t cols = std::min(chunk, table.dim - col);
        EmbeddingPlacement piece;
        piece.sharding = s;
        piece.shards = {{0, 0, table.rows, col, cols}};
        const RankPattern b = st.bytes_of(t, piece);
        const RankBytes owner = b.at(0);
        const RankBytes other = W > 1 ? b.at(1) : RankBytes{};
        // Every rank's time with `other` added: the largest (`top_s`, on the first rank with
        // it, `top_rank`) and the largest of the other ranks (`second`; 0 when there are
        // none). Candidates: each group's free ranks (one time, `left[g]` ranks), each owner.
        int64_t top_rank = -1, top_count = 0;
        double top_s = 0, second = 0;
        bool second_exists = false;
        auto consider_other = [&](int64_t rank, int64_t count, const RankBytes& load) {
          RankBytes x = load;
          x += other;
          const double v = st.rank_time(x);
          if (top_rank < 0 || v > top_s || (v == top_s && rank < top_rank)) {
            if (top_rank >= 0) {
              second = second_exists ? std::max(second, top_s) : top_s;
              second_exists = true;
            }
            top_rank = rank;
            top_s = v;
            top_count = count;
          } else {
            second = second_exists ? std::max(second, v) : v;
            second_exists = true;
          }
        };
        for (size_t g = 0; g < G; ++g) {
          if (left[g] > 0) consider_other(first_free(g), left[g], group_load[g]);
        }
        for (const auto& o : owners) consider_other(o.rank, 1, o.load);
        if (top_count > 1) second = second_exists ? std::max(second, top_s) : top_s;  // top's group-mates
        // Each rank with the piece: the others' largest time, or its own. The lowest wins,
        // the first rank on ties.
        double best = std::numeric_limits<double>::infinity();
        int64_t where = -1;
        size_t where_group = 0, where_owner = owners.size();
        auto consider_owner = [&](int64_t rank, const RankBytes& load, size_t group, size_t owner_index) {
          if (load.storage + owner.storage > limit) return;
          RankBytes x = load;
          x += owner;
          const double rest = rank == top_rank ? second : top_s;
          const double v = std::max(rest, st.rank_time(x));
          if (v < best || (v == best && rank < where)) {
            best = v;
            where = rank;
            where_group = group;
            where_owner = owner_index;
          }
        };
        for (size_t g = 0; g < G; ++g) {
          if (left[g] > 0) consider_owner(first_free(g), group_load[g], g, owners.size());
        }
        for (size_t k = 0; k < owners.size(); ++k) consider_owner(owners[k].rank, owners[k].load, 0, k);
        if (where < 0) return std::nullopt;
        if (where_owner < owners.size()) {
          owners[where_owner].load += owner;
        } else {
          RankBytes x = group_load[where_group];
          x += owner;
          owners.push_back({where, where_group, x});
          --left[where_group];
        }
        for (auto& l : group_load) l += other;
        for (auto& o : owners) {
          if (o.rank != where) o.load += other;
        }
        shards.push_back({where, 0, table.rows, col, cols});
      }
      EmbeddingPlacement whole;
      whole.sharding = s;
      whole.shards = shards;
      out.placement.shards = std::move(shards);
      return finish_with(st.bytes_of(t, whole));
    }
  }
  return std::nullopt;
}

// The table's bytes with no other table around: the placement's shape, on the first ranks.
RankPattern canonical_bytes(const State& st, size_t t, EmbeddingSharding s) {
  const int64_t W = st.options.world_size;
  const EmbeddingTable& table = st.tables[t];
  EmbeddingPlacement q;
  q.sharding = s;
  switch (s) {
    case EmbeddingSharding::data_parallel:
    case EmbeddingSharding::row_wise:
    case EmbeddingSharding::table_row_wise: return st.spread_bytes_of(t, s, 0);
    case EmbeddingSharding::table_wise: q.shards = {{0, 0, table.rows, 0, table.dim}}; break;
    case EmbeddingSharding::column_wise: {
      const int64_t chunk = chunk_width(table, st.options);
      int64_t i = 0;
      for (int64_t col = 0; col < table.dim; col += chunk, ++i) {
        q.shards.push_back({i % W, 0, table.rows, col, std::min(chunk, table.dim - col)});
      }
      break;
    }
  }
  return st.bytes_of(t, q);
}

// Two bounds from one table alone with each sharding in `kinds`: its total work summed over
// ranks, taking lookup + (sent + received) / 2 / bw per rank (max(S, R) >= (S + R) / 2, so
// this adds up over tables and never exceeds the table's share of all ranks' time); and its
// most loaded rank. The sums run rank by rank, as they always did (the same rounding), all
// kinds side by side.
std::vector<std::pair<double, double>> table_bounds(const State& st, size_t t,
                                                    const std::vector<EmbeddingSharding>& kinds) {
  constexpr size_t kKinds = 5;
  const int64_t W = st.options.world_size;
  const size_t K = kinds.size();
  std::vector<RankPattern> bytes;
  std::vector<int64_t> cuts = {0, W};
  for (auto k : kinds) {
    bytes.push_back(canonical_bytes(st, t, k));
    for (const auto& run : bytes.back().runs) {
      cuts.push_back(run.lo);
      cuts.push_back(run.hi);
    }
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  const Link link = embedding_detail::all_to_all_link(st.cluster, W);
  double total[kKinds] = {}, most[kKinds] = {}, work[kKinds] = {};
  for (size_t c = 0; c + 1 < cuts.size(); ++c) {
    for (size_t k = 0; k < K; ++k) {
      const RankBytes& r = bytes[k].at(cuts[c]);
      work[k] = r.lookup_bytes / st.cluster.hbm_bytes_per_s + (r.sent + r.received) / 2 / link.bytes_per_s + r.latency_s;
      most[k] = std::max(most[k], st.rank_time(r));
    }
    for (int64_t i = cuts[c]; i < cuts[c + 1]; ++i) {
      for (size_t k = 0; k < kKinds; ++k) total[k] += work[k];  // kinds past K add zeros, unread
    }
  }
  std::vector<std::pair<double, double>> out;
  for (size_t k = 0; k < K; ++k) out.push_back({total[k], most[k]});
  return out;
}

double fixed_latency(const Cluster& c, int64_t W) {
  // Every step: counts, lengths, ids and pooled rows forward, their gradients backward: five
  // all-to-alls for all tables together (the runtime makes them even when every table is
  // data-parallel), each W - 1 messages per rank. The same for every placement.
  return W > 1 ? 5 * static_cast<double>(W - 1) * embedding_detail::all_to_all_link(c, W).latency_s : 0.0;
}

EmbeddingPlan finish(const std::vector<EmbeddingTable>& tables, const Cluster& cluster, const EmbeddingOptions& o,
                     std::vector<EmbeddingPlacement> placements, double lower_bound) {
  EmbeddingPlan plan;
  plan.optimizer = o.optimizer;
  plan.world_size = o.world_size;
  plan.batch_per_rank = o.batch_per_rank;
  plan.tables = tables;
  plan.ranks.assign(o.world_size, EmbeddingRankLoad{});
  RankGroups load(o.world_size);
  for (size_t t = 0; t < tables.size(); ++t) {
    load.apply(embedding_detail::embedding_rank_pattern(tables[t], placements[t], cluster, o), false);
  }
  const double fixed = fixed_latency(cluster, o.world_size);
  // Before the ids, every rank tells every other its batch size, id count, whether it has
  // weights and whether its batch was refused (four int64).
  const double counts = 32.0 * static_cast<double>(o.world_size - 1);
  std::vector<EmbeddingRankLoad> per_group(load.size());
  for (size_t g = 0; g < load.size(); ++g) {
    RankBytes x = load.load(g);
    x.sent += counts;
    x.received += counts;
    auto& out = per_group[g];
    out.storage_bytes = x.storage;
    out.lookup_s = x.lookup_bytes / cluster.hbm_bytes_per_s;
    out.comm_s = embedding_detail::comm_seconds(x, cluster, o.world_size) + fixed;
    out.sent_bytes = x.sent;
    out.received_bytes = x.received;
  }
  for (int64_t r = 0; r < o.world_size; ++r) {
    plan.ranks[r] = per_group[load.group_of(r)];
    plan.max_rank_s = std::max(plan.max_rank_s, plan.ranks[r].total_s());
  }
  plan.placements = std::move(placements);
  plan.lower_bound_s = lower_bound + fixed;
  return plan;
}

double budget_of(const Cluster& c, double budget) { return budget > 0 ? budget : c.usable_memory_bytes(); }

// Places the tables in `order` (largest first: longest-processing-time first, Graham 1969),
// each with the sharding (`uniform` where the table can take it) and place that keep the
// most loaded rank lowest. False, with the reason, when a table fits nowhere.
bool propose(State& st, const std::vector<size_t>& order,
             const std::vector<std::vector<EmbeddingSharding>>& options_of,
             std::optional<EmbeddingSharding> uniform, std::string* why) {
  for (size_t t : order) {
    std::vector<EmbeddingSharding> kinds = options_of[t];
    if (uniform && std::find(kinds.begin(), kinds.end(), *uniform) != kinds.end()) kinds = {*uniform};
    std::optional<Scored> chosen;
    for (auto k : kinds) {
      auto p = best_placement(st, t, k);
      if (p && (!chosen || p->max_s < chosen->max_s * (1 - 1e-12))) chosen = std::move(p);
    }
    if (!chosen) {
      *why = table_field(st.tables[t]) + ": no rank has memory left for it after placing the larger tables";
      return false;
    }
    st.add(t, std::move(chosen->placement), std::move(chosen->bytes));
  }
  return true;
}

// Local search: take a table off the most loaded rank and put it back where (and as) it
// lowers the maximum; stop when no move helps. Tables spread over every rank are tried too
// (as another sharding); bounded so planning time stays near linear.
void improve(State& st, const std::vector<std::vector<EmbeddingSharding>>& options_of) {
  const size_t n = st.tables.size();
  const int rounds = std::min<int>(4 * static_cast<int>(n) + 8, 512);
  for (int round = 0; round < rounds; ++round) {
    const double current = st.max_time();
    const int64_t hot = st.hot_rank();
    // Candidates: the tables loading the hot rank most, at most 16 a round.
    std::vector<std::pair<double, size_t>> loads;
    for (size_t t = 0; t < n; ++t) {
      const auto& c = st.contribution[t].at(hot);
      const double v = c.lookup_bytes + c.sent + c.received;
      if (v > 0 && options_of[t].size() + (st.placements[t].sharding == EmbeddingSharding::table_wise ||
                                           st.placements[t].sharding == EmbeddingSharding::column_wise ||
                                           st.placements[t].sharding == EmbeddingSharding::table_row_wise) > 1) {
        loads.push_back({v, t});
      }
    }
    const size_t k = std::min<size_t>(loads.size(), 16);
    std::partial_sort(loads.begin(), loads.begin() + k, loads.end(), std::greater<>());
    bool improved = false;
    for (size_t i = 0; i < k && !improved; ++i) {
      const size_t t = loads[i].second;
      Placed before = st.placements[t];
      RankPattern before_bytes = st.contribution[t];
      st.remove(t);
      std::optional<Scored> better;
      for (auto kind : options_of[t]) {
        auto p = best_placement(st, t, kind);
        if (p && p->max_s < current * (1 - 1e-9) && (!better || p->max_s < better->max_s)) better = std::move(p);
      }
      if (better) {
        st.add(t, std::move(better->placement), std::move(better->bytes));
        improved = true;
      } else {
        st.add(t, std::move(before), std::move(before_bytes));
      }
    }
    if (!improved) break;
  }
}

}  // namespace

EmbeddingPlan plan_embeddings(const std::vector<EmbeddingTable>& tables, const Cluster& cluster,
                              const EmbeddingOptions& options) {
  validate(cluster);
  validate_options(options);
  std::set<std::string> names;
  for (const auto& t : tables) {
    validate_table(t);
    if (!names.insert(t.name).second) throw ValidationError(table_field(t), "two tables have this name");
  }
  for (const auto& [name, _] : options.pins) {
    if (!names.count(name)) throw ValidationError("embeddings.pins." + name, "no table has this name");
  }
  const double budget = budget_of(cluster, options.memory_budget_bytes);

  State st(tables, cluster, options, budget);

  // Enumerate and estimate: each table's shardings, each with its total work.
  std::vector<std::vector<EmbeddingSharding>> options_of(tables.size());
  std::vector<double> cheapest(tables.size(), std::numeric_limits<double>::infinity());
  double bound_sum = 0, bound_max = 0;
  for (size_t t = 0; t < tables.size(); ++t) {
    std::string why;
    auto kinds = allowed(tables[t], cluster, options, budget, &why);
    auto pin = options.pins.find(tables[t].name);
    if (pin != options.pins.end()) {
      if (std::find(kinds.begin(), kinds.end(), pin->second) == kinds.end()) {
        throw ValidationError(table_field(tables[t]) + ".sharding",
                              "pinned to " + to_string(pin->second) + ", which it cannot take: " + why);
      }
      kinds = {pin->second};
    }
    if (kinds.empty()) {
      throw InfeasibleError(table_field(tables[t]) + ": no sharding fits the per-rank budget");
    }
    // Most promising first: least total work.
    std::vector<std::pair<double, EmbeddingSharding>> scored;
    double alone = std::numeric_limits<double>::infinity();
    const auto bounds = table_bounds(st, t, kinds);
    for (size_t i = 0; i < kinds.size(); ++i) {
      scored.push_back({bounds[i].first, kinds[i]});
      alone = std::min(alone, bounds[i].second);
    }
    bound_max = std::max(bound_max, alone);
    std::sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) {
      return a.first < b.first || (a.first == b.first && a.second < b.second);
    });
    for (const auto& [v, k] : scored) options_of[t].push_back(k);
    cheapest[t] = scored.front().first;
    bound_sum += cheapest[t];
  }
  const int64_t W = options.world_size;
  const double lower_bound = std::max(bound_sum / static_cast<double>(W), bound_max);
  // (finish adds the placement-independent all-to-all latency to both the plan and the bound.)

  std::vector<size_t> order(tables.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cheapest[a] > cheapest[b]; });

  // Propose several starting points and keep the best after local search: the free greedy
  // (each table the sharding and place that keep the maximum lowest) and, for each sharding
  // kind, every table that can take it taking it. Single moves cannot leave a balanced
  // all-row-wise layout for a cheaper all-table-wise one (the first table moved makes its
  // owner the maximum), so the uniform proposals are not redundant.
  std::optional<State> best;
  std::string why;
  const std::vector<std::optional<EmbeddingSharding>> proposals = {
      std::nullopt, EmbeddingSharding::table_wise, EmbeddingSharding::row_wise, EmbeddingSharding::column_wise,
      EmbeddingSharding::table_row_wise, EmbeddingSharding::data_parallel};
  for (const auto& uniform : proposals) {
    State trial(tables, cluster, options, budget);
    trial.spread = st.spread;
    if (uniform) {
      bool applies = false;
      for (size_t t = 0; t < tables.size() && !applies; ++t) {
        applies = options_of[t].size() > 1 &&
                  std::find(options_of[t].begin(), options_of[t].end(), *uniform) != options_of[t].end();
      }
      if (!applies) continue;  // the free greedy covers it
    }
    if (!propose(trial, order, options_of, uniform, &why)) continue;
    improve(trial, options_of);
    if (!best || trial.max_time() < best->max_time() * (1 - 1e-12)) {
      best.reset();
      best.emplace(std::move(trial));
    }
  }
  if (!best) {
    throw InfeasibleError(why + " (budget per rank " + std::to_string(budget / (1024.0 * 1024 * 1024)) + " GiB)");
  }
  std::vector<EmbeddingPlacement> placements;
  placements.reserve(tables.size());
  for (size_t t = 0; t < tables.size(); ++t) placements.push_back(write_out(*best, t, best->placements[t]));
  return finish(tables, cluster, options, std::move(placements), lower_bound);
}

void check_embedding_placements(const EmbeddingPlan& plan) {
  EmbeddingOptions o;
  o.world_size = plan.world_size;
  o.batch_per_rank = plan.batch_per_rank;
  o.optimizer = plan.optimizer;
  validate_options(o);
  if (plan.placements.size() != plan.tables.size()) {
    throw ValidationError("embeddings.placements", std::to_string(plan.placements.size()) + " placements for " +
                                                       std::to_string(plan.tables.size()) + " tables");
  }
  std::set<std::string> names, features;
  for (size_t t = 0; t < plan.tables.size(); ++t) {
    const EmbeddingTable& table = plan.tables[t];
    validate_table(table);
    if (!names.insert(table.name).second) throw ValidationError(table_field(table), "two tables have this name");
    for (const auto& f : table.features) {
      if (!features.insert(f).second) {
        throw ValidationError(table_field(table) + ".features", "feature '" + f + "' looks up two tables");
      }
    }
    const EmbeddingPlacement& p = plan.placements[t];
    const std::string f = "embeddings.placements." + table.name;
    if (p.table != table.name) throw ValidationError(f, "placement " + std::to_string(t) + " is for '" + p.table + "'");
    if (p.shards.empty()) throw ValidationError(f + ".shards", "no shards");
    std::set<int64_t> ranks;
    for (const auto& s : p.shards) {
      if (s.rank < 0 || s.rank >= plan.world_size) {
        throw ValidationError(f + ".shards", "rank " + std::to_string(s.rank) + " outside the world of " +
                                                 std::to_string(plan.world_size));
      }
      if (s.rows <= 0 || s.cols <= 0 || s.row_offset < 0 || s.col_offset < 0 || s.row_offset + s.rows > table.rows ||
          s.col_offset + s.cols > table.dim) {
        throw ValidationError(f + ".shards", "a shard on rank " + std::to_string(s.rank) + " is outside the " +
                                                 std::to_string(table.rows) + " x " + std::to_string(table.dim) + " table");
      }
      // Each kind's shape, as the runtime routes ids by it: whole rows for table- and
      // column-wise (ids go to every shard), whole columns for row splits (ids go to the
      // shard holding their row).
      const bool whole_rows = s.row_offset == 0 && s.rows == table.rows;
      const bool whole_cols = s.col_offset == 0 && s.cols == table.dim;
      const std::string kind = to_string(p.sharding);
      switch (p.sharding) {
        case EmbeddingSharding::data_parallel:
        case EmbeddingSharding::table_wise:
          if (!whole_rows || !whole_cols) throw ValidationError(f + ".shards", kind + " shards hold the whole table");
          break;
        case EmbeddingSharding::column_wise:
          if (!whole_rows) throw ValidationError(f + ".shards", "column_wise shards hold every row");
          break;
        case EmbeddingSharding::row_wise:
        case EmbeddingSharding::table_row_wise:
          if (!whole_cols) throw ValidationError(f + ".shards", kind + " shards hold every column");
          break;
      }
      ranks.insert(s.rank);
    }
    if (p.sharding == EmbeddingSharding::table_wise && p.shards.size() != 1) {
      throw ValidationError(f + ".shards", "table_wise puts the table on one rank, not " + std::to_string(p.shards.size()));
    }
    double area = 0;
    for (const auto& s : p.shards) area += static_cast<double>(s.rows) * static_cast<double>(s.cols);
    const double whole = static_cast<double>(table.rows) * static_cast<double>(table.dim);
    if (p.sharding == EmbeddingSharding::data_parallel) {
      if (static_cast<int64_t>(p.shards.size()) != plan.world_size || static_cast<int64_t>(ranks.size()) != plan.world_size) {
        throw ValidationError(f + ".shards", "data_parallel needs the whole table on every rank");
      }
      continue;
    }
    for (size_t i = 0; i < p.shards.size(); ++i) {
      for (size_t j = i + 1; j < p.shards.size(); ++j) {
        const auto& a = p.shards[i];
        const auto& b = p.shards[j];
        const bool rows = a.row_offset < b.row_offset + b.rows && b.row_offset < a.row_offset + a.rows;
        const bool cols = a.col_offset < b.col_offset + b.cols && b.col_offset < a.col_offset + a.cols;
        if (rows && cols) throw ValidationError(f + ".shards", "two shards overlap (ranks " + std::to_string(a.rank) + " and " + std::to_string(b.rank) + ")");
      }
    }
    if (area != whole) throw ValidationError(f + ".shards", "the shards do not cover the table");
  }
}

EmbeddingPlan evaluate_embeddings(EmbeddingPlan plan, const Cluster& cluster, double memory_budget_bytes) {
  validate(cluster);
  check_embedding_placements(plan);
  EmbeddingOptions o;
  o.world_size = plan.world_size;
  o.batch_per_rank = plan.batch_per_rank;
  o.optimizer = plan.optimizer;
  const double budget = budget_of(cluster, memory_budget_bytes);
  EmbeddingPlan out = finish(plan.tables, cluster, o, plan.placements, 0);
  for (int64_t r = 0; r < plan.world_size; ++r) {
    if (out.ranks[r].storage_bytes > budget * (1 + 1e-12)) {
      throw ValidationError("embeddings.ranks." + std::to_string(r),
                            "holds " + std::to_string(out.ranks[r].storage_bytes / (1024.0 * 1024 * 1024)) +
                                " GiB of tables, over the budget of " + std::to_string(budget / (1024.0 * 1024 * 1024)) + " GiB");
    }
  }
  out.lower_bound_s = plan.lower_bound_s;
  return out;
}

std::string format_embedding_report(const EmbeddingPlan& plan) {
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(3);
  s << "embedding tables: " << plan.tables.size() << " on " << plan.world_size << " ranks, batch " << plan.batch_per_rank
    << " per rank, optimizer " << to_string(plan.optimizer) << "\n";
  for (size_t t = 0; t < plan.tables.size(); ++t) {
    const auto& p = plan.placements[t];
    s << "  " << plan.tables[t].name << " (" << plan.tables[t].rows << " x " << plan.tables[t].dim << "): "
      << to_string(p.sharding) << " on ranks";
    std::set<int64_t> ranks;
    for (const auto& sh : p.shards) ranks.insert(sh.rank);
    for (int64_t r : ranks) s << " " << r;
    s << "\n";
  }
  s.precision(2);
  for (int64_t r = 0; r < plan.world_size; ++r) {
    const auto& l = plan.ranks[r];
    s << "  rank " << r << ": " << l.storage_bytes / (1024.0 * 1024) << " MiB, lookup " << l.lookup_s * 1e3
      << " ms, all-to-all " << l.comm_s * 1e3 << " ms, sends " << l.sent_bytes / (1024.0 * 1024) << " MiB\n";
  }
  s << "  most loaded rank " << plan.max_rank_s * 1e3 << " ms per step; lower bound " << plan.lower_bound_s * 1e3 << " ms";
  if (plan.lower_bound_s > 0) s << " (" << 100 * (plan.max_rank_s / plan.lower_bound_s - 1) << "% above it)";
  s << "\n";
  return s.str();
}

}  // namespace monarch::planner
