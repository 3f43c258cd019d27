#include "monarch/runtime/sharded_embeddings.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <set>
#include <sstream>

namespace monarch {

using planner::EmbeddingOptimizer;
using planner::EmbeddingPooling;
using planner::EmbeddingSharding;

int64_t JaggedBatch::batch_size() const {
  TORCH_CHECK(!keys.empty(), "monarch: a JaggedBatch needs at least one feature key");
  TORCH_CHECK(lengths.defined() && lengths.numel() % static_cast<int64_t>(keys.size()) == 0,
              "monarch: JaggedBatch lengths hold ", lengths.defined() ? lengths.numel() : 0, " entries for ",
              keys.size(), " features: expected features x batch size");
  return lengths.numel() / static_cast<int64_t>(keys.size());
}

// What one forward call leaves for its backward.
struct ShardedEmbeddingTables::Step : torch::CustomClassHolder {
  ShardedEmbeddingTables* owner = nullptr;
  int64_t batch_size = 0;
  // Owner side, per source rank, per segment of segments_[rank_]: local rows, the sample of
  // each id in the source's batch, the id's weight (undefined: 1).
  std::vector<std::vector<at::Tensor>> rows, samples, weights;
  // Data-parallel tables, per output feature (undefined when the feature's table is sharded).
  std::vector<at::Tensor> dp_rows, dp_samples, dp_weights;
  std::vector<at::Tensor> lengths;  // per output feature, this rank's [B] lengths (mean pooling)
  // Requester side, per destination, per segment of segments_[d]: rows it sends back (B for a
  // pooled feature, the ids sent for a sequence feature) and, for a sequence feature split by
  // rows, which of the feature's ids went there.
  std::vector<std::vector<int64_t>> sent_rows;
  std::vector<std::vector<at::Tensor>> positions;
  // Owner side, per source, per segment of segments_[rank_]: rows it sent back.
  std::vector<std::vector<int64_t>> served_rows;
  std::vector<int64_t> sequence_ids;  // per output feature: this rank's ids (sequence features)
  bool weighted = false;
  bool done = false;
  std::shared_ptr<int> pending;  // the engine's count of lookups awaiting backward
  void finish() {
    if (pending && !done) --*pending;
    done = true;
  }
  ~Step() override {
    if (pending && !done) --*pending;  // the output was dropped without a backward
  }
};

namespace {

struct LookupFunction : torch::autograd::Function<LookupFunction> {
  // Outputs: the pooled features [B, pooled width] and every sequence feature's rows, flat.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& anchor,
                                                at::Tensor pooled, at::Tensor sequences,
                                                c10::intrusive_ptr<ShardedEmbeddingTables::Step> step) {
    ctx->saved_data["step"] = c10::IValue::make_capsule(step);
    return {pooled, sequences};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto step = c10::static_intrusive_pointer_cast<ShardedEmbeddingTables::Step>(ctx->saved_data["step"].toCapsule());
    TORCH_CHECK(!step->done,
                "monarch: backward through the same embedding lookup twice: the tables were already updated "
                "(their optimizer runs inside backward); run forward again");
    step->finish();
    step->owner->backward(*step, grads[0].defined() ? grads[0].contiguous() : grads[0],
                          grads[1].defined() ? grads[1].contiguous() : grads[1]);
    return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

bool row_split(EmbeddingSharding s) {
  return s == EmbeddingSharding::row_wise || s == EmbeddingSharding::table_row_wise;
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  auto c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

at::Tensor exclusive_offsets(const at::Tensor& lengths) {
  auto offsets = at::zeros({lengths.numel()}, at::kLong);
  if (lengths.numel() > 1) offsets.slice(0, 1).copy_(lengths.slice(0, 0, lengths.numel() - 1).cumsum(0));
  return offsets;
}

// Sum-pooled rows of `weight` for each bag.
at::Tensor pool(const at::Tensor& weight, const at::Tensor& rows, const at::Tensor& lengths, const at::Tensor& w) {
  if (rows.numel() == 0) return at::zeros({lengths.numel(), weight.size(1)}, weight.options());
  auto result = at::embedding_bag(weight, rows, exclusive_offsets(lengths), false, /*mode=sum*/ 0, false,
                                  w.defined() ? c10::optional<at::Tensor>(w) : c10::nullopt, false);
  return std::get<0>(result);
}

}  // namespace

ShardedEmbeddingTables::ShardedEmbeddingTables(planner::EmbeddingPlan plan, Communicator& group,
                                               EmbeddingOptimizerConfig optimizer)
    : plan_(std::move(plan)), group_(group), optimizer_(optimizer) {
  rank_ = group_.group_rank();
  world_ = group_.size();
  planner::check_embedding_placements(plan_);  // shapes the routing below relies on
  TORCH_CHECK(plan_.world_size == world_, "monarch: the embedding plan is for ", plan_.world_size,
              " ranks, the group '", group_.name(), "' has ", world_);
  TORCH_CHECK(plan_.placements.size() == plan_.tables.size(), "monarch: the embedding plan has ",
              plan_.placements.size(), " placements for ", plan_.tables.size(), " tables");
  TORCH_CHECK(optimizer_.kind == plan_.optimizer, "monarch: the embedding plan was made for optimizer ",
              planner::to_string(plan_.optimizer), ", the engine was given ", planner::to_string(optimizer_.kind));
  std::set<std::string> seen;
  for (size_t t = 0; t < plan_.tables.size(); ++t) {
    const auto& table = plan_.tables[t];
    TORCH_CHECK(plan_.placements[t].table == table.name, "monarch: embedding placement ", t, " is for '",
                plan_.placements[t].table, "', table ", t, " is '", table.name, "'");
    // What the plan may say and this runtime does not do is refused, naming the table.
    TORCH_CHECK(table.bytes_per_element == 4, "monarch: table '", table.name, "' is planned with ",
                table.bytes_per_element, "-byte elements; the runtime stores fp32 tables only");
    for (const auto& f : table.features) {
      TORCH_CHECK(seen.insert(f).second, "monarch: feature '", f, "' looks up two tables; each feature names one");
      feature_table_.push_back(static_cast<int64_t>(t));
      const bool sequence = table.pooling == EmbeddingPooling::none;
      sequence_.push_back(sequence);
      feature_offset_.push_back(sequence ? -1 : output_width_);
      output_keys_.push_back(f);
      if (!sequence) output_width_ += table.dim;
    }
    const auto& shards = plan_.placements[t].shards;
    for (size_t s = 0; s < shards.size(); ++s) {
      const auto& where = shards[s];
      TORCH_CHECK(where.rank >= 0 && where.rank < world_, "monarch: table '", table.name, "' has a shard on rank ",
                  where.rank, " outside the group of ", world_);
      if (where.rank != rank_) continue;
      Shard local;
      local.table = static_cast<int64_t>(t);
      local.where = where;
      local.weight = at::zeros({where.rows, where.cols}, at::kFloat);
      if (optimizer_.kind == EmbeddingOptimizer::rowwise_adagrad) local.state = at::zeros({where.rows}, at::kFloat);
      if (optimizer_.kind == EmbeddingOptimizer::adam) local.state = at::zeros({2, where.rows, where.cols}, at::kFloat);
      shards_.push_back(std::move(local));
    }
  }
  segments_.resize(world_);
  for (int64_t d = 0; d < world_; ++d) segments_[d] = segments_to(d);
  anchor_ = at::empty({0}, at::kFloat).set_requires_grad(true);
}

std::vector<std::string> ShardedEmbeddingTables::sequence_keys() const {
  std::vector<std::string> keys;
  for (size_t o = 0; o < output_keys_.size(); ++o) {
    if (sequence_[o]) keys.push_back(output_keys_[o]);
  }
  return keys;
}

std::vector<int64_t> ShardedEmbeddingTables::output_dims() const {
  std::vector<int64_t> dims;
  for (int64_t t : feature_table_) dims.push_back(plan_.tables[t].dim);
  return dims;
}

std::vector<ShardedEmbeddingTables::Segment> ShardedEmbeddingTables::segments_to(int64_t rank) const {
  std::vector<Segment> out;
  for (size_t t = 0; t < plan_.tables.size(); ++t) {
    const auto& p = plan_.placements[t];
    if (p.sharding == EmbeddingSharding::data_parallel) continue;
    for (size_t s = 0; s < p.shards.size(); ++s) {
      if (p.shards[s].rank != rank) continue;
      for (size_t o = 0; o < output_keys_.size(); ++o) {
        if (feature_table_[o] == static_cast<int64_t>(t)) {
          out.push_back({static_cast<int64_t>(t), static_cast<int64_t>(s), static_cast<int64_t>(o)});
        }
      }
    }
  }
  return out;
}

ShardedEmbeddingTables::Shard* ShardedEmbeddingTables::local_shard(int64_t table, int64_t shard) {
  const auto& where = plan_.placements[table].shards[shard];
  for (auto& s : shards_) {
    if (s.table == table && s.where == where) return &s;
  }
  return nullptr;
}

void ShardedEmbeddingTables::check_batch(const JaggedBatch& batch) const {
  (void)batch.batch_size();  // checks the lengths fit the keys
  TORCH_CHECK(batch.values.defined() && batch.values.dim() == 1 && batch.values.scalar_type() == at::kLong,
              "monarch: JaggedBatch values must be a 1-D int64 tensor");
  TORCH_CHECK(batch.lengths.dim() == 1 && batch.lengths.scalar_type() == at::kLong,
              "monarch: JaggedBatch lengths must be a 1-D int64 tensor");
  if (batch.lengths.numel() > 0) {
    TORCH_CHECK(batch.lengths.min().item<int64_t>() >= 0, "monarch: JaggedBatch has a negative length");
  }
  const int64_t total = batch.lengths.sum().item<int64_t>();
  TORCH_CHECK(total == batch.values.numel(), "monarch: JaggedBatch lengths sum to ", total, " but there are ",
              batch.values.numel(), " values");
  TORCH_CHECK(!batch.weights.defined() || batch.weights.numel() == batch.values.numel(), "monarch: JaggedBatch has ",
              batch.weights.defined() ? batch.weights.numel() : 0, " weights for ", batch.values.numel(), " values");
  std::set<std::string> keys(batch.keys.begin(), batch.keys.end());
  TORCH_CHECK(keys.size() == batch.keys.size(), "monarch: JaggedBatch names a feature twice");
  for (const auto& k : batch.keys) {
    TORCH_CHECK(std::find(output_keys_.begin(), output_keys_.end(), k) != output_keys_.end(),
                "monarch: JaggedBatch feature '", k, "' is not looked up by any table");
  }
  for (const auto& k : output_keys_) {
    TORCH_CHECK(keys.count(k), "monarch: JaggedBatch lacks feature '", k, "'");
  }
}

at::Tensor ShardedEmbeddingTables::forward(const JaggedBatch& batch) {
  TORCH_CHECK(std::none_of(sequence_.begin(), sequence_.end(), [](bool v) { return v; }),
              "monarch: these tables have sequence features (pooling none): use forward_all");
  return forward_all(batch).pooled;
}

EmbeddingLookup ShardedEmbeddingTables::forward_all(const JaggedBatch& batch) {
  const bool training = at::GradMode::is_enabled();
  // The fused optimizer runs in each lookup's backward: a second lookup whose backward would
  // come before the first one's would update the rows twice (gradient accumulation is not
  // the sum of the gradients under row-wise Adagrad or Adam). Checked before any collective,
  // the same way on every rank.
  // Whether a previous output is still alive can differ by rank (one rank keeps it for
  // logging): the refusal goes through the counts exchange like a bad batch.
  std::string refused;
  if (training && *pending_ > 0) {
    refused =
        "monarch: embedding lookup while the previous lookup's backward has not run: the tables' optimizer "
        "runs inside backward, once per lookup, so gradient accumulation over several lookups is not "
        "supported. Run backward (or drop the previous output) first; look up without training under "
        "torch.no_grad()";
  }
  // This rank's batch, checked. A refused batch is not thrown at once: every rank first learns
  // of it in the counts exchange, so all of them stop at the same place instead of the others
  // waiting in the next collective until the timeout.
  int64_t B = 0;
  const int64_t F = static_cast<int64_t>(output_keys_.size());
  std::vector<at::Tensor> ids(F), lens(F), samples(F), wts(F);
  try {
    TORCH_CHECK(refused.empty(), refused);
    check_batch(batch);
    B = batch.batch_size();
    const auto lengths = batch.lengths.view({static_cast<int64_t>(batch.keys.size()), B});
    const auto per_key = lengths.sum(1);
    const auto starts = to_vector(exclusive_offsets(per_key));
    const auto totals = to_vector(per_key);
    const auto arange = at::arange(B, at::kLong);
    for (int64_t o = 0; o < F; ++o) {
      const int64_t k = std::find(batch.keys.begin(), batch.keys.end(), output_keys_[o]) - batch.keys.begin();
      ids[o] = batch.values.slice(0, starts[k], starts[k] + totals[k]);
      lens[o] = lengths[k].contiguous();
      samples[o] = at::repeat_interleave(arange, lens[o]);
      const auto& table = plan_.tables[feature_table_[o]];
      if (batch.weights.defined()) {
        TORCH_CHECK(!sequence_[o], "monarch: feature '", output_keys_[o], "' has per-id weights but its table '",
                    table.name, "' is a sequence table (pooling none: nn.Embedding takes no weights)");
        TORCH_CHECK(table.pooling != EmbeddingPooling::mean, "monarch: feature '", output_keys_[o],
                    "' has per-id weights but its table '", table.name, "' is mean-pooled (weights need sum pooling, "
                    "as nn.EmbeddingBag)");
        wts[o] = batch.weights.slice(0, starts[k], starts[k] + totals[k]).to(at::kFloat);
      }
      if (ids[o].numel() > 0) {
        const int64_t lo = ids[o].min().item<int64_t>(), hi = ids[o].max().item<int64_t>();
        TORCH_CHECK(lo >= 0 && hi < table.rows, "monarch: feature '", output_keys_[o], "': id ", lo < 0 ? lo : hi,
                    " is out of range for table '", table.name, "' (", table.rows, " rows)");
      }
    }
  } catch (const c10::Error& e) {
    refused = e.what_without_backtrace();
  } catch (const std::exception& e) {
    refused = e.what();
  }
  if (!refused.empty()) {
    auto flags = at::zeros({world_, 4}, at::kLong);
    flags.select(1, 3).fill_(1);
    auto got = at::empty_like(flags);
    group_.all_to_all(got.view({-1}), flags.view({-1})).wait();
    TORCH_CHECK(false, refused);
  }
  auto step = c10::make_intrusive<Step>();
  step->owner = this;
  step->batch_size = B;
  step->lengths = lens;
  const auto arange = at::arange(B, at::kLong);

  // Counts first: batch size, ids to each rank, whether this rank has weights.
  std::vector<at::Tensor> send_lens(world_), send_ids(world_), send_w(world_);
  auto counts = at::zeros({world_, 4}, at::kLong);  // batch size, ids to it, weights?, refused?
  step->sent_rows.assign(world_, {});
  step->positions.assign(world_, {});
  for (int64_t d = 0; d < world_; ++d) {
    std::vector<at::Tensor> l, i, w;
    for (const auto& seg : segments_[d]) {
      const auto& where = plan_.placements[seg.table].shards[seg.shard];
      at::Tensor at_positions;
      if (row_split(plan_.placements[seg.table].sharding)) {
        const auto mask = ids[seg.feature].ge(where.row_offset).logical_and(ids[seg.feature].lt(where.row_offset + where.rows));
        i.push_back(ids[seg.feature].masked_select(mask) - where.row_offset);
        l.push_back(at::bincount(samples[seg.feature].masked_select(mask), {}, B));
        w.push_back(wts[seg.feature].defined() ? wts[seg.feature].masked_select(mask)
                                               : at::ones({i.back().numel()}, at::kFloat));
        if (sequence_[seg.feature]) at_positions = mask.nonzero().view({-1});
      } else {
        i.push_back(ids[seg.feature]);
        l.push_back(lens[seg.feature]);
        w.push_back(wts[seg.feature].defined() ? wts[seg.feature] : at::ones({ids[seg.feature].numel()}, at::kFloat));
      }
      step->sent_rows[d].push_back(sequence_[seg.feature] ? i.back().numel() : B);
      step->positions[d].push_back(at_positions);
    }
    send_lens[d] = l.empty() ? at::zeros({0}, at::kLong) : at::cat(l).to(at::kLong);
    send_ids[d] = i.empty() ? at::zeros({0}, at::kLong) : at::cat(i);
    send_w[d] = w.empty() ? at::zeros({0}, at::kFloat) : at::cat(w);
    counts[d][0] = B;
    counts[d][1] = send_ids[d].numel();
    counts[d][2] = batch.weights.defined() ? 1 : 0;
  }
  auto got = at::empty_like(counts);
  group_.all_to_all(got.view({-1}), counts.view({-1})).wait();
  std::vector<int64_t> in_ids(world_), out_ids(world_), in_lens(world_), out_lens(world_);
  const int64_t mine = static_cast<int64_t>(segments_[rank_].size());
  for (int64_t q = 0; q < world_; ++q) {
    TORCH_CHECK(got[q][3].item<int64_t>() == 0, "monarch: rank ", group_.ranks()[q],
                " refused its batch or this lookup (its own error says why); every rank stops this lookup");
  }
  for (int64_t q = 0; q < world_; ++q) {
    const int64_t their_batch = got[q][0].item<int64_t>();
    TORCH_CHECK(their_batch == B, "monarch: rank ", group_.ranks()[q], " brought a batch of ", their_batch,
                " samples, rank ", group_.ranks()[rank_], " ", B, ": every rank must bring the same batch size");
    step->weighted = step->weighted || got[q][2].item<int64_t>() != 0;
    out_ids[q] = send_ids[q].numel();
    in_ids[q] = got[q][1].item<int64_t>();
    out_lens[q] = send_lens[q].numel();
    in_lens[q] = mine * B;
  }
  auto flat_lens = at::cat(send_lens), flat_ids = at::cat(send_ids);
  // Lengths travel as int32 (a bag holds fewer than 2^31 ids), ids as int64.
  flat_lens = flat_lens.to(at::kInt);
  auto recv_lens = at::empty({std::accumulate(in_lens.begin(), in_lens.end(), int64_t{0})}, at::kInt);
  auto recv_ids = at::empty({std::accumulate(in_ids.begin(), in_ids.end(), int64_t{0})}, at::kLong);
  group_.all_to_all_v(recv_lens, flat_lens, in_lens, out_lens).wait();
  group_.all_to_all_v(recv_ids, flat_ids, in_ids, out_ids).wait();
  recv_lens = recv_lens.to(at::kLong);
  at::Tensor recv_w;
  if (step->weighted) {
    recv_w = at::empty({recv_ids.numel()}, at::kFloat);
    group_.all_to_all_v(recv_w, at::cat(send_w), in_ids, out_ids).wait();
  }

  // Owner side: pool each source's ids of each segment on the local shard.
  std::vector<at::Tensor> pooled_to(world_);
  std::vector<int64_t> out_rows(world_), in_rows(world_);
  step->rows.assign(world_, {});
  step->samples.assign(world_, {});
  step->weights.assign(world_, {});
  step->served_rows.assign(world_, {});
  int64_t lens_at = 0, ids_at = 0;
  for (int64_t q = 0; q < world_; ++q) {
    std::vector<at::Tensor> pieces;
    for (const auto& seg : segments_[rank_]) {
      Shard* shard = local_shard(seg.table, seg.shard);
      TORCH_CHECK(shard, "monarch: internal: no local shard for a segment sent to rank ", rank_);
      const auto l = recv_lens.slice(0, lens_at, lens_at + B);
      lens_at += B;
      const int64_t n = l.sum().item<int64_t>();
      const auto r = recv_ids.slice(0, ids_at, ids_at + n);
      const auto w = step->weighted ? recv_w.slice(0, ids_at, ids_at + n) : at::Tensor();
      ids_at += n;
      TORCH_CHECK(n == 0 || (r.min().item<int64_t>() >= 0 && r.max().item<int64_t>() < shard->where.rows),
                  "monarch: internal: a received id is outside the local shard of '", plan_.tables[seg.table].name, "'");
      if (sequence_[seg.feature]) {
        // A sequence feature: every id is its own row back, no pooling.
        pieces.push_back(shard->weight.index_select(0, r).reshape({-1}));
        step->samples[q].push_back(at::arange(n, at::kLong));
        step->served_rows[q].push_back(n);
      } else {
        pieces.push_back(pool(shard->weight, r, l, w).reshape({-1}));
        step->samples[q].push_back(at::repeat_interleave(arange, l));
        step->served_rows[q].push_back(B);
      }
      step->rows[q].push_back(r);
      step->weights[q].push_back(w);
    }
    pooled_to[q] = pieces.empty() ? at::zeros({0}, at::kFloat) : at::cat(pieces);
    out_rows[q] = pooled_to[q].numel();
    int64_t expect = 0;
    for (size_t j = 0; j < segments_[q].size(); ++j) {
      const auto& seg = segments_[q][j];
      expect += step->sent_rows[q][j] * plan_.placements[seg.table].shards[seg.shard].cols;
    }
    in_rows[q] = expect;
  }
  auto recv_pooled = at::empty({std::accumulate(in_rows.begin(), in_rows.end(), int64_t{0})}, at::kFloat);
  group_.all_to_all_v(recv_pooled, at::cat(pooled_to), in_rows, out_rows).wait();

  // Assemble: column-wise chunks side by side, row-wise partial sums added.
  auto out = at::zeros({B, output_width_}, at::kFloat);
  std::vector<at::Tensor> seq(F);
  for (int64_t o = 0; o < F; ++o) {
    if (sequence_[o]) seq[o] = at::zeros({ids[o].numel(), plan_.tables[feature_table_[o]].dim}, at::kFloat);
  }
  int64_t at_ = 0;
  for (int64_t d = 0; d < world_; ++d) {
    for (size_t j = 0; j < segments_[d].size(); ++j) {
      const auto& seg = segments_[d][j];
      const auto& where = plan_.placements[seg.table].shards[seg.shard];
      const int64_t rows = step->sent_rows[d][j];
      const auto piece = recv_pooled.slice(0, at_, at_ + rows * where.cols).view({rows, where.cols});
      at_ += rows * where.cols;
      const bool by_rows = row_split(plan_.placements[seg.table].sharding);
      if (sequence_[seg.feature]) {
        if (by_rows) {
          seq[seg.feature].index_copy_(0, step->positions[d][j], piece);
        } else {
          seq[seg.feature].slice(1, where.col_offset, where.col_offset + where.cols).copy_(piece);
        }
        continue;
      }
      const int64_t c0 = feature_offset_[seg.feature] + (by_rows ? 0 : where.col_offset);
      out.slice(1, c0, c0 + where.cols).add_(piece);
    }
  }
  // Data-parallel tables: looked up here.
  step->dp_rows.assign(F, at::Tensor());
  step->dp_samples.assign(F, at::Tensor());
  step->dp_weights.assign(F, at::Tensor());
  for (int64_t o = 0; o < F; ++o) {
    const int64_t t = feature_table_[o];
    if (plan_.placements[t].sharding != EmbeddingSharding::data_parallel) continue;
    Shard* shard = nullptr;
    for (auto& s : shards_) {
      if (s.table == t) shard = &s;
    }
    TORCH_CHECK(shard, "monarch: data-parallel table '", plan_.tables[t].name, "' has no copy on rank ", rank_);
    step->dp_rows[o] = ids[o];
    step->dp_weights[o] = wts[o];
    if (sequence_[o]) {
      seq[o] = shard->weight.index_select(0, ids[o]);
      step->dp_samples[o] = at::arange(ids[o].numel(), at::kLong);
      continue;
    }
    out.slice(1, feature_offset_[o], feature_offset_[o] + plan_.tables[t].dim).copy_(pool(shard->weight, ids[o], lens[o], wts[o]));
    step->dp_samples[o] = samples[o];
  }
  for (int64_t o = 0; o < F; ++o) {
    const auto& table = plan_.tables[feature_table_[o]];
    if (table.pooling != EmbeddingPooling::mean) continue;
    out.slice(1, feature_offset_[o], feature_offset_[o] + table.dim)
        .div_(lens[o].clamp_min(1).to(at::kFloat).unsqueeze(1));
  }
  // Every sequence feature's rows, flat, in output_keys() order.
  std::vector<at::Tensor> flat;
  step->sequence_ids.assign(F, 0);
  for (int64_t o = 0; o < F; ++o) {
    if (!sequence_[o]) continue;
    flat.push_back(seq[o].view({-1}));
    step->sequence_ids[o] = ids[o].numel();
  }
  at::Tensor sequences = flat.empty() ? at::zeros({0}, at::kFloat) : at::cat(flat);
  if (training) {
    step->pending = pending_;
    ++*pending_;
    auto outs = LookupFunction::apply(anchor_, out, sequences, step);
    out = outs[0];
    sequences = outs[1];
  }  // else nothing to update: no autograd node, nothing kept
  EmbeddingLookup result;
  result.pooled = out;
  int64_t at_seq = 0;
  for (int64_t o = 0; o < F; ++o) {
    if (!sequence_[o]) continue;
    const int64_t n = ids[o].numel(), dim = plan_.tables[feature_table_[o]].dim;
    result.sequences.push_back(sequences.slice(0, at_seq, at_seq + n * dim).view({n, dim}));
    at_seq += n * dim;
  }
  return result;
}

void ShardedEmbeddingTables::backward(Step& step, const at::Tensor& pooled_grad, const at::Tensor& sequence_grad) {
  const int64_t B = step.batch_size;
  const int64_t F = static_cast<int64_t>(output_keys_.size());
  // Gradients are divided by the world size, as data-parallel gradients are averaged: the
  // tables then train as on one process with the global batch (TorchRec's gradient division).
  auto grad = pooled_grad.defined() ? pooled_grad.to(at::kFloat).clone() : at::zeros({B, output_width_}, at::kFloat);
  for (int64_t o = 0; o < F; ++o) {
    const auto& table = plan_.tables[feature_table_[o]];
    if (table.pooling != EmbeddingPooling::mean) continue;
    grad.slice(1, feature_offset_[o], feature_offset_[o] + table.dim)
        .div_(step.lengths[o].clamp_min(1).to(at::kFloat).unsqueeze(1));
  }
  // Each sequence feature's row gradients [ids, dim].
  std::vector<at::Tensor> seq_grad(F);
  int64_t at_seq = 0;
  for (int64_t o = 0; o < F; ++o) {
    if (!sequence_[o]) continue;
    const int64_t n = step.sequence_ids[o], dim = plan_.tables[feature_table_[o]].dim;
    seq_grad[o] = sequence_grad.defined() ? sequence_grad.slice(0, at_seq, at_seq + n * dim).view({n, dim}).to(at::kFloat)
                                          : at::zeros({n, dim}, at::kFloat);
    at_seq += n * dim;
  }
  // Back to the owners: the reverse of the rows' path.
  std::vector<at::Tensor> to(world_);
  std::vector<int64_t> out_n(world_), in_n(world_);
  for (int64_t d = 0; d < world_; ++d) {
    std::vector<at::Tensor> pieces;
    for (size_t j = 0; j < segments_[d].size(); ++j) {
      const auto& seg = segments_[d][j];
      const auto [c0, width] = gradient_columns(seg);
      if (!sequence_[seg.feature]) {
        const int64_t base = feature_offset_[seg.feature];
        pieces.push_back(grad.slice(1, base + c0, base + c0 + width).contiguous().view({-1}));
      } else if (step.positions[d][j].defined()) {
        pieces.push_back(seq_grad[seg.feature].index_select(0, step.positions[d][j]).view({-1}));
      } else {
        pieces.push_back(seq_grad[seg.feature].slice(1, c0, c0 + width).contiguous().view({-1}));
      }
    }
    to[d] = pieces.empty() ? at::zeros({0}, at::kFloat) : at::cat(pieces);
    out_n[d] = to[d].numel();
  }
  for (int64_t q = 0; q < world_; ++q) {
    int64_t expect = 0;
    for (size_t j = 0; j < segments_[rank_].size(); ++j) {
      expect += step.served_rows[q][j] * gradient_columns(segments_[rank_][j]).second;
    }
    in_n[q] = expect;
  }
  auto recv = at::empty({std::accumulate(in_n.begin(), in_n.end(), int64_t{0})}, at::kFloat);
  group_.all_to_all_v(recv, at::cat(to), in_n, out_n).wait();
  recv.div_(static_cast<double>(world_));

  // Per local shard: every source's rows and their gradients, duplicates combined once.
  std::map<Shard*, std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> touched;
  int64_t at_ = 0;
  for (int64_t q = 0; q < world_; ++q) {
    for (size_t j = 0; j < segments_[rank_].size(); ++j) {
      const auto& seg = segments_[rank_][j];
      Shard* shard = local_shard(seg.table, seg.shard);
      const int64_t cols = gradient_columns(seg).second;
      const int64_t rows = step.served_rows[q][j];
      const auto g = recv.slice(0, at_, at_ + rows * cols).view({rows, cols});
      at_ += rows * cols;
      auto per_id = g.index_select(0, step.samples[q][j]);
      if (step.weights[q][j].defined()) per_id = per_id * step.weights[q][j].unsqueeze(1);
      touched[shard].first.push_back(step.rows[q][j]);
      touched[shard].second.push_back(per_id);
    }
  }
  for (auto& [shard, parts] : touched) {
    const auto rows = at::cat(parts.first);
    if (rows.numel() == 0) continue;
    const auto grads = at::cat(parts.second);
    at::Tensor unique, inverse;
    std::tie(unique, inverse, std::ignore) = at::_unique2(rows, /*sorted=*/true, /*return_inverse=*/true, false);
    auto summed = at::zeros({unique.numel(), grads.size(1)}, at::kFloat).index_add_(0, inverse, grads);
    apply_optimizer(*shard, unique, summed);
  }
  // Data-parallel tables: dense gradients averaged over the ranks; rows any rank touched are
  // updated (lazy optimizers skip the others, as the sharded ones do).
  for (auto& shard : shards_) {
    const int64_t t = shard.table;
    if (plan_.placements[t].sharding != EmbeddingSharding::data_parallel) continue;
    const auto& table = plan_.tables[t];
    auto dense = at::zeros({table.rows, table.dim}, at::kFloat);
    auto hit = at::zeros({table.rows}, at::kFloat);
    for (int64_t o = 0; o < F; ++o) {
      if (feature_table_[o] != t || !step.dp_rows[o].defined()) continue;
      auto per_id = sequence_[o] ? seq_grad[o]
                                 : grad.slice(1, feature_offset_[o], feature_offset_[o] + table.dim)
                                       .index_select(0, step.dp_samples[o]);
      if (step.dp_weights[o].defined()) per_id = per_id * step.dp_weights[o].unsqueeze(1);
      dense.index_add_(0, step.dp_rows[o], per_id);
      hit.index_fill_(0, step.dp_rows[o], 1.0);
    }
    group_.all_reduce(dense, /*average=*/true).wait();
    group_.all_reduce_max(hit).wait();
    const auto rows = hit.nonzero().view({-1});
    if (rows.numel() > 0) apply_optimizer(shard, rows, dense.index_select(0, rows));
  }
  if (optimizer_.kind == EmbeddingOptimizer::adam) {
    for (auto& s : shards_) s.adam_step += 1;
    adam_step_ += 1;
  }
}

std::pair<int64_t, int64_t> ShardedEmbeddingTables::gradient_columns(const Segment& seg) const {
  const auto& p = plan_.placements[seg.table];
  const auto& where = p.shards[seg.shard];
  if (row_split(p.sharding)) return {0, where.cols};
  // A column chunk under row-wise Adagrad gets the whole row's gradient: the row's
  // accumulator is the mean over all the table's columns, as on one process.
  if (p.sharding == EmbeddingSharding::column_wise && optimizer_.kind == EmbeddingOptimizer::rowwise_adagrad) {
    return {0, plan_.tables[seg.table].dim};
  }
  return {where.col_offset, where.cols};
}

void ShardedEmbeddingTables::apply_optimizer(Shard& s, const at::Tensor& rows, const at::Tensor& g_in) {
  const double lr = optimizer_.lr;
  // g_in is either the shard's columns or (column chunks under row-wise Adagrad) the row.
  const bool whole_row = g_in.size(1) != s.where.cols;
  const at::Tensor g = whole_row ? g_in.slice(1, s.where.col_offset, s.where.col_offset + s.where.cols) : g_in;
  switch (optimizer_.kind) {
    case EmbeddingOptimizer::sgd:
      s.weight.index_add_(0, rows, g * (-lr));
      break;
    case EmbeddingOptimizer::rowwise_adagrad: {
      // FBGEMM's row-wise Adagrad: one accumulator per row, the mean of the squared gradient.
      const auto acc = s.state.index_select(0, rows) + g_in.pow(2).mean(1);
      s.state.index_copy_(0, rows, acc);
      s.weight.index_add_(0, rows, g * (-lr) / (acc.sqrt() + optimizer_.eps).unsqueeze(1));
      break;
    }
    case EmbeddingOptimizer::adam: {
      // Lazy Adam: moments of touched rows only; bias correction by the table's step count.
      const double t = static_cast<double>(s.adam_step + 1);
      auto m = s.state[0].index_select(0, rows) * optimizer_.beta1 + g * (1 - optimizer_.beta1);
      auto v = s.state[1].index_select(0, rows) * optimizer_.beta2 + g.pow(2) * (1 - optimizer_.beta2);
      s.state[0].index_copy_(0, rows, m);
      s.state[1].index_copy_(0, rows, v);
      const double c1 = 1 - std::pow(optimizer_.beta1, t), c2 = 1 - std::pow(optimizer_.beta2, t);
      s.weight.index_add_(0, rows, (m / c1) * (-lr) / ((v / c2).sqrt() + optimizer_.eps));
      break;
    }
  }
}

void ShardedEmbeddingTables::load_table(const std::string& name, const at::Tensor& full) {
  int64_t t = -1;
  for (size_t i = 0; i < plan_.tables.size(); ++i) {
    if (plan_.tables[i].name == name) t = static_cast<int64_t>(i);
  }
  TORCH_CHECK(t >= 0, "monarch: no embedding table named '", name, "'");
  const auto& table = plan_.tables[t];
  TORCH_CHECK(full.dim() == 2 && full.size(0) == table.rows && full.size(1) == table.dim, "monarch: table '", name,
              "' is ", table.rows, " x ", table.dim, ", the tensor given is ", full.sizes());
  for (auto& s : shards_) {
    if (s.table != t) continue;
    s.weight.copy_(full.slice(0, s.where.row_offset, s.where.row_offset + s.where.rows)
                       .slice(1, s.where.col_offset, s.where.col_offset + s.where.cols));
  }
}

void ShardedEmbeddingTables::init_uniform(double bound, uint64_t seed) {
  for (auto& s : shards_) {
    const uint64_t mix = seed ^ (static_cast<uint64_t>(s.table) * 0x9E3779B97F4A7C15ull) ^
                         (static_cast<uint64_t>(s.where.row_offset) << 20) ^ static_cast<uint64_t>(s.where.col_offset);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(mix);
    const double b = bound > 0 ? bound : 1.0 / std::sqrt(static_cast<double>(plan_.tables[s.table].rows));
    s.weight.uniform_(-b, b, gen);
  }
}

at::Tensor ShardedEmbeddingTables::full_table(const std::string& name) {
  int64_t t = -1;
  for (size_t i = 0; i < plan_.tables.size(); ++i) {
    if (plan_.tables[i].name == name) t = static_cast<int64_t>(i);
  }
  TORCH_CHECK(t >= 0, "monarch: no embedding table named '", name, "'");
  const auto& table = plan_.tables[t];
  auto full = at::zeros({table.rows, table.dim}, at::kFloat);
  const bool replicated = plan_.placements[t].sharding == EmbeddingSharding::data_parallel;
  for (auto& s : shards_) {
    if (s.table != t) continue;
    full.slice(0, s.where.row_offset, s.where.row_offset + s.where.rows)
        .slice(1, s.where.col_offset, s.where.col_offset + s.where.cols)
        .copy_(s.weight);
  }
  if (!replicated) group_.all_reduce(full).wait();  // disjoint shards: the sum is the table
  return full;
}

std::map<std::string, at::Tensor> ShardedEmbeddingTables::local_shards() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& s : shards_) {
    std::ostringstream key;
    key << plan_.tables[s.table].name << "/rows " << s.where.row_offset << "+" << s.where.rows << "/cols "
        << s.where.col_offset << "+" << s.where.cols;
    out[key.str()] = s.weight;
  }
  return out;
}

std::vector<ShardedEmbeddingTables::ShardView> ShardedEmbeddingTables::shard_views() {
  std::vector<ShardView> out;
  for (auto& s : shards_) out.push_back({plan_.tables[s.table].name, s.where, s.weight, s.state});
  return out;
}

void ShardedEmbeddingTables::set_adam_step(int64_t step) {
  TORCH_CHECK(step >= 0, "monarch: Adam's step count must be >= 0, got ", step);
  adam_step_ = step;
  for (auto& s : shards_) s.adam_step = step;
}

int64_t ShardedEmbeddingTables::local_bytes() const {
  int64_t bytes = 0;
  for (const auto& s : shards_) {
    bytes += s.weight.numel() * s.weight.element_size();
    if (s.state.defined()) bytes += s.state.numel() * s.state.element_size();
  }
  return bytes;
}

}  // namespace monarch
