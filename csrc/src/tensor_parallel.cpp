#include "monarch/runtime/tensor_parallel.h"

#include "group_handle.h"

#include <sstream>

#include <ATen/WrapDimUtils.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

namespace monarch::tp {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

namespace {

using detail::as_handle;  // group_handle.h
using detail::from_handle;
Communicator& group_of(AutogradContext* ctx) { return from_handle(ctx->saved_data["group"].toInt()); }

std::string divisors_of(int64_t n) {
  std::ostringstream out;
  bool first = true;
  for (int64_t d = 1; d <= n && d <= 1024; ++d) {
    if (n % d == 0) {
      out << (first ? "" : ", ") << d;
      first = false;
    }
  }
  return out.str();
}

void require_divisible(const at::Tensor& x, int64_t dim, int64_t n, const char* what) {
  TORCH_CHECK(x.size(dim) % n == 0, "monarch: ", what, ": dimension ", dim, " of size ", x.size(dim),
              " does not split over a tensor-parallel group of ", n, " (legal group sizes: ",
              divisors_of(x.size(dim)), ")");
}

at::Tensor all_reduce_copy(const at::Tensor& x, Communicator& group) {
  auto out = x.contiguous().clone();
  Communicator::Phase phase(group, "a tensor-parallel layer");
  group.all_reduce(out).wait();
  return out;
}

// Every rank's x concatenated along dim, in group order.
at::Tensor gather_along(const at::Tensor& x, Communicator& group, int64_t dim) {
  const int64_t n = group.size();
  if (n == 1) return x;
  auto input = x.contiguous();
  std::vector<int64_t> shape{n};
  for (auto s : input.sizes()) shape.push_back(s);
  auto stacked = at::empty(shape, input.options());
  Communicator::Phase phase(group, "a tensor-parallel layer");
  group.all_gather(stacked, input).wait();
  std::vector<int64_t> merged = input.sizes().vec();
  merged[dim] *= n;
  return stacked.movedim(0, dim).reshape(merged);
}

// The sum over ranks of chunk `group_rank` (along dim) of x.
at::Tensor reduce_scatter_along(const at::Tensor& x, Communicator& group, int64_t dim) {
  const int64_t n = group.size();
  if (n == 1) return x;
  require_divisible(x, dim, n, "reduce-scatter");
  std::vector<int64_t> split = x.sizes().vec();
  split[dim] /= n;
  split.insert(split.begin() + dim, n);
  auto input = x.reshape(split).movedim(dim, 0).contiguous();
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape[dim] /= n;
  auto out = at::empty(out_shape, x.options());
  Communicator::Phase phase(group, "a tensor-parallel layer");
  group.reduce_scatter(out, input).wait();
  return out;
}

at::Tensor own_chunk(const at::Tensor& x, Communicator& group, int64_t dim) {
  const int64_t n = group.size();
  if (n == 1) return x;
  require_divisible(x, dim, n, "split");
  return x.chunk(n, dim)[group.group_rank()].contiguous();
}

struct CopyToGroup : torch::autograd::Function<CopyToGroup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    return {all_reduce_copy(grads[0], group_of(ctx)), at::Tensor()};
  }
};

struct ReduceFromGroup : torch::autograd::Function<ReduceFromGroup> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, int64_t group) {
    return all_reduce_copy(x, from_handle(group));
  }
  static tensor_list backward(AutogradContext*, tensor_list grads) { return {grads[0], at::Tensor()}; }
};

// kind: 0 gather / split, 1 split / gather, 2 gather / reduce-scatter, 3 reduce-scatter / gather
struct AlongDim : torch::autograd::Function<AlongDim> {
  static at::Tensor run(int64_t kind, bool forward, const at::Tensor& x, Communicator& g, int64_t dim) {
    switch (kind) {
      case 0: return forward ? gather_along(x, g, dim) : own_chunk(x, g, dim);
      case 1: return forward ? own_chunk(x, g, dim) : gather_along(x, g, dim);
      case 2: return forward ? gather_along(x, g, dim) : reduce_scatter_along(x, g, dim);
      default: return forward ? reduce_scatter_along(x, g, dim) : gather_along(x, g, dim);
    }
  }
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group, int64_t dim,
                            int64_t kind) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["kind"] = kind;
    return run(kind, true, x, from_handle(group), dim);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto out = run(ctx->saved_data["kind"].toInt(), false, grads[0], group_of(ctx),
                   ctx->saved_data["dim"].toInt());
    return {out, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor along(const at::Tensor& x, Communicator& group, int64_t dim, int64_t kind) {
  dim = at::maybe_wrap_dim(dim, x.dim());
  return AlongDim::apply(x, as_handle(group), dim, kind);
}

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocab_start, int64_t group_handle, int64_t ignore_index) {
    Communicator& group = from_handle(group_handle);
    const int64_t local = logits.size(-1);
    auto x = logits.reshape({-1, local}).to(at::promote_types(logits.scalar_type(), at::kFloat));
    auto t = targets.reshape({-1}).to(at::kLong);
    TORCH_CHECK(x.size(0) == t.size(0), "monarch: vocab_parallel_cross_entropy: ", x.size(0),
                " rows of logits but ", t.size(0), " targets");
    // Softmax stabilised by the global row max (one all-reduce of N numbers).
    auto row_max = std::get<0>(x.max(1)).contiguous();
    Communicator::Phase phase(group, "the vocabulary-parallel loss");
    group.all_reduce_max(row_max).wait();
    auto shifted = x - row_max.unsqueeze(1);
    auto exp = shifted.exp();
    auto ignored = t.eq(ignore_index);
    auto mine = t.ge(vocab_start).logical_and(t.lt(vocab_start + local));
    auto local_t = (t - vocab_start).masked_fill(mine.logical_not(), 0);
    auto target_logit = shifted.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(mine.logical_not(), 0);
    // The sum of exponentials and the target logit ride in one all-reduce of 2N numbers.
    auto both = at::stack({exp.sum(1), target_logit}).contiguous();
    group.all_reduce(both).wait();
    auto sum_exp = both[0];
    auto loss = (sum_exp.log() - both[1]).masked_fill(ignored, 0);
    exp.div_(sum_exp.unsqueeze(1));  // now the local slice of the softmax
    ctx->save_for_backward({exp, local_t, mine, ignored});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    ctx->saved_data["shape"] = logits.sizes().vec();
    return loss.view(targets.sizes());
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto softmax = saved[0], local_t = saved[1], mine = saved[2], ignored = saved[3];
    auto g = grads[0].reshape({-1}).to(softmax.scalar_type()).masked_fill(ignored, 0);
    auto grad = softmax.clone();
    grad.scatter_add_(1, local_t.unsqueeze(1), mine.to(softmax.scalar_type()).neg().unsqueeze(1));
    grad.mul_(g.unsqueeze(1));
    auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    auto shape = ctx->saved_data["shape"].toIntVector();
    return {grad.view(shape).to(dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor copy_to_group(const at::Tensor& x, Communicator& group) {
  if (group.size() == 1) return x;
  return CopyToGroup::apply(x, as_handle(group));
}

at::Tensor reduce_from_group(const at::Tensor& x, Communicator& group) {
  if (group.size() == 1) return x;
  return ReduceFromGroup::apply(x, as_handle(group));
}

at::Tensor gather_from_group(const at::Tensor& x, Communicator& group, int64_t dim) {
  return group.size() == 1 ? x : along(x, group, dim, 0);
}
at::Tensor scatter_to_group(const at::Tensor& x, Communicator& group, int64_t dim) {
  return group.size() == 1 ? x : along(x, group, dim, 1);
}
at::Tensor sequence_gather(const at::Tensor& x, Communicator& group, int64_t dim) {
  return group.size() == 1 ? x : along(x, group, dim, 2);
}
at::Tensor sequence_reduce_scatter(const at::Tensor& x, Communicator& group, int64_t dim) {
  return group.size() == 1 ? x : along(x, group, dim, 3);
}

at::Tensor vocab_parallel_embedding(const at::Tensor& tokens, const at::Tensor& weight_shard,
                                    int64_t vocab_start, Communicator& group, int64_t sequence_dim,
                                    int64_t padding_idx) {
  const int64_t rows = weight_shard.size(0);
  auto outside = tokens.lt(vocab_start).logical_or(tokens.ge(vocab_start + rows));
  auto local = (tokens - vocab_start).masked_fill(outside, 0);
  // Out-of-range tokens read row 0 and are zeroed below (no gradient reaches row 0 from them).
  const bool pad_here = padding_idx >= vocab_start && padding_idx < vocab_start + rows;
  auto partial = at::embedding(weight_shard, local, pad_here ? padding_idx - vocab_start : -1)
                     .masked_fill(outside.unsqueeze(-1), 0);
  if (sequence_dim >= 0) return sequence_reduce_scatter(partial, group, sequence_dim);
  return reduce_from_group(partial, group);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_shard, const at::Tensor& targets,
                                        int64_t vocab_start, Communicator& group, int64_t ignore_index) {
  TORCH_CHECK(logits_shard.dim() == targets.dim() + 1, "monarch: vocab_parallel_cross_entropy: logits ",
              logits_shard.sizes(), " must have one more dimension (the vocabulary) than targets ",
              targets.sizes());
  return VocabParallelCrossEntropy::apply(logits_shard, targets, vocab_start, as_handle(group), ignore_index);
}

at::Tensor shard_tensor(const at::Tensor& full, int64_t dim, int64_t rank, int64_t size,
                        int64_t fused_parts, const std::string& what) {
  dim = at::maybe_wrap_dim(dim, full.dim());
  TORCH_CHECK(fused_parts >= 1 && full.size(dim) % fused_parts == 0, "monarch: ", what, ": dimension ",
              dim, " of size ", full.size(dim), " is not ", fused_parts, " equal fused parts");
  const int64_t part = full.size(dim) / fused_parts;
  TORCH_CHECK(part % size == 0, "monarch: ", what, ": ", (fused_parts > 1 ? "each fused part of " : ""),
              "size ", part, " along dimension ", dim, " does not split over tp=", size,
              " (legal tp: ", divisors_of(part), ")");
  std::vector<at::Tensor> pieces;
  for (const auto& p : full.chunk(fused_parts, dim)) pieces.push_back(p.chunk(size, dim)[rank]);
  return at::cat(pieces, dim).contiguous();
}

at::Tensor unshard_tensor(const std::vector<at::Tensor>& shards, int64_t dim, int64_t fused_parts) {
  TORCH_CHECK(!shards.empty(), "monarch: unshard_tensor needs at least one shard");
  dim = at::maybe_wrap_dim(dim, shards[0].dim());
  std::vector<std::vector<at::Tensor>> parts(fused_parts);
  for (const auto& s : shards) {
    auto chunks = s.chunk(fused_parts, dim);
    for (int64_t p = 0; p < fused_parts; ++p) parts[p].push_back(chunks[p]);
  }
  std::vector<at::Tensor> whole;
  for (auto& p : parts) whole.push_back(at::cat(p, dim));
  return at::cat(whole, dim);
}

}  // namespace monarch::tp
