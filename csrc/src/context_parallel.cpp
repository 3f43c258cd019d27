#include "monarch/runtime/context_parallel.h"

#include "group_handle.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>

#include <ATen/WrapDimUtils.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

namespace monarch::cp {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

namespace {

using detail::as_handle;  // group_handle.h
using detail::from_handle;

// Point-to-point tags of the ring's three kinds of messages. Between two ranks the forward's
// k/v, the backward's k/v and the backward's gradient accumulators may be in flight at once
// (cp = 2: the next rank is also the previous one); a tag keeps each stream to its buffers.
constexpr int kTagForwardKv = 0x6370;  // "cp"
constexpr int kTagBackwardKv = 0x6371;
constexpr int kTagBackwardGrad = 0x6372;

struct Shape {
  int64_t batch = 0, heads = 0, kv_heads = 0, len = 0, d = 0, dv = 0;
  int64_t groups() const { return heads / kv_heads; }
};

std::string shape_text(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

Shape check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* where) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined(), "monarch: ", where, ": q, k and v must be defined tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "monarch: ", where,
              ": q, k and v must be [batch, heads, local sequence, head dim]; got q ", shape_text(q), ", k ",
              shape_text(k), ", v ", shape_text(v));
  Shape s{q.size(0), q.size(1), k.size(1), q.size(2), q.size(3), v.size(3)};
  TORCH_CHECK(k.size(0) == s.batch && v.size(0) == s.batch && k.size(2) == s.len && v.size(2) == s.len &&
                  v.size(1) == s.kv_heads && k.size(3) == s.d,
              "monarch: ", where, ": q ", shape_text(q), ", k ", shape_text(k), ", v ", shape_text(v),
              " do not fit (the same batch and local sequence length; k and v the same heads; q and k the same "
              "head dim)");
  TORCH_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0, "monarch: ", where, ": k and v have ", s.kv_heads,
              " heads, which do not divide q's ", s.heads, " (grouped-query attention needs heads % kv_heads == 0)");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()) && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type(),
              "monarch: ", where, ": q, k and v must share one floating-point dtype; got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), "monarch: ", where,
              ": q, k and v are on different devices (", q.device(), ", ", k.device(), ", ", v.device(), ")");
  return s;
}

at::ScalarType compute_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// Which block of (this rank's queries) x (the keys/values of rank `src`) is visible, in local
// row ranges. Causal, load-balanced layout (chunk length c = L / 2; rank r holds global chunks
// r and R = 2cp-1-r, source s holds s and 2cp-1-s):
//  * src == rank: the local sequence is in global order, so causal over local indices
//    (chunk r sees itself diagonally; chunk R sees all of chunk r and itself diagonally);
//  * src < rank: both query chunks come after chunk src and before chunk 2cp-1-src: every
//    query sees the first half of the keys, none of the second;
//  * src > rank: query chunk r comes before both key chunks (nothing visible); chunk R
//    comes after both: the second half of the queries sees every key.
// So every step after the first is exactly half a block on every rank (the load balance).
struct Block {
  bool diagonal = false;
  int64_t q_begin = 0, q_len = 0, kv_begin = 0, kv_len = 0;
  // Diagonal blocks: key j (from kv_begin) is hidden from query i (from q_begin) when
  // j - i >= mask_from; 1 for a whole diagonal block, larger for a tile of its lower rows.
  int64_t mask_from = 1;
};

Block block_for(int64_t rank, int64_t src, int64_t len, bool causal) {
  if (!causal) return {false, 0, len, 0, len};
  if (src == rank) return {true, 0, len, 0, len};
  const int64_t c = len / 2;
  if (src < rank) return {false, 0, len, 0, c};
  return {false, c, c, 0, len};
}

// A block cut into tiles of query rows, so that one tile's scores and probabilities (fp32,
// b x heads x rows x keys) stay under a fixed size, whatever the sequence: the memory of the
// attention's temporaries then does not grow with (s/cp)^2. A tile of a diagonal block needs
// only the keys up to its last row (the rest are hidden), which also skips the masked half
// of the block's work. `rows` 0: tiles of about kTileElements scores, and at least
// kMinTileRows rows (thinner matrix products waste the GEMM).
constexpr int64_t kTileElements = int64_t{1} << 21;  // 8 MiB of fp32 scores
constexpr int64_t kMinTileRows = 16;

std::vector<Block> tiles(const Block& blk, int64_t batch_heads, int64_t rows) {
  if (rows <= 0) {
    rows = std::max<int64_t>(kMinTileRows, kTileElements / std::max<int64_t>(1, batch_heads * blk.kv_len));
  }
  std::vector<Block> out;
  for (int64_t a = 0; a < blk.q_len; a += rows) {
    Block t = blk;
    t.q_begin = blk.q_begin + a;
    t.q_len = std::min(rows, blk.q_len - a);
    if (blk.diagonal) {  // q and kv rows share local indices (src == rank, q_begin = kv_begin = 0)
      t.kv_len = std::min(blk.kv_len, a + t.q_len);
      t.mask_from = a + 1;
    }
    out.push_back(t);
  }
  return out;
}

// q as [b, kv_heads, groups, L, d] in the compute dtype: query head kv * groups + g is served
// by kv head kv, so a block's scores are one broadcast matmul with no repeated keys.
at::Tensor grouped(const at::Tensor& t, const Shape& s, int64_t last) {
  return t.contiguous().to(compute_type(t.scalar_type())).view({s.batch, s.kv_heads, s.groups(), s.len, last});
}

// Scaled scores of queries qb [b, kv, g, lq, d] against keys kb [b, kv, lk, d]; on a diagonal
// block, the keys after each query are -inf (every row keeps its own key, so no row is empty).
at::Tensor block_scores(const at::Tensor& qb, const at::Tensor& kb, double scale, const Block& blk) {
  auto scores = at::matmul(qb, kb.unsqueeze(2).transpose(-2, -1));
  scores.mul_(scale);
  if (blk.diagonal) {
    const int64_t lq = scores.size(-2), lk = scores.size(-1);
    auto above = at::ones({lq, lk}, scores.options().dtype(at::kBool)).triu(blk.mask_from);
    scores.masked_fill_(above, -std::numeric_limits<double>::infinity());
  }
  return scores;
}

// The running output (normalized) and log-sum-exp of every query row, compute dtype:
// out [b, kv, g, L, dv], lse [b, kv, g, L].
struct Accumulator {
  at::Tensor out, lse;
};

// Folds one block into the accumulator (online softmax in log-sum-exp form): with the block's
// own normalized output o_b and log-sum-exp l_b, new = logaddexp(l, l_b) and
// out = out * exp(l - new) + o_b * exp(l_b - new). `first`: the block is the first for its
// rows (ring step 0 covers every row, causal or not), so it is stored as is.
void forward_block(Accumulator& acc, const at::Tensor& qg, const at::Tensor& k, const at::Tensor& v, const Block& blk,
                   double scale, bool first) {
  auto qb = qg.narrow(3, blk.q_begin, blk.q_len);
  auto kb = k.narrow(2, blk.kv_begin, blk.kv_len);
  auto vb = v.narrow(2, blk.kv_begin, blk.kv_len);
  auto scores = block_scores(qb, kb, scale, blk);
  auto lse_b = scores.logsumexp(-1);
  auto probs = scores.sub_(lse_b.unsqueeze(-1)).exp_();
  auto out_b = at::matmul(probs, vb.unsqueeze(2));
  auto out = acc.out.narrow(3, blk.q_begin, blk.q_len);
  auto lse = acc.lse.narrow(3, blk.q_begin, blk.q_len);
  if (first) {
    out.copy_(out_b);
    lse.copy_(lse_b);
    return;
  }
  auto merged = at::logaddexp(lse, lse_b);
  out.mul_((lse - merged).exp_().unsqueeze(-1));
  out.add_(out_b.mul_((lse_b - merged).exp_().unsqueeze(-1)));
  lse.copy_(merged);
}

// One block's gradients (FlashAttention-2's backward, Dao 2023): the block's probabilities
// are recomputed against the final log-sum-exp, p = exp(s - lse); then
//   dv += p^T do,  dp = do v^T,  ds = p * (dp - delta)  with delta = rowsum(do * out),
//   dq += ds k * scale,  dk += ds^T q * scale,
// the query-head groups summed into their kv head. dq [b, kv, g, L, d] and dk / dv
// [b, kv, L, d] / [b, kv, L, dv] are compute-dtype accumulators.
void backward_block(const at::Tensor& qg, const at::Tensor& dog, const at::Tensor& lse, const at::Tensor& delta,
                    const at::Tensor& k, const at::Tensor& v, const Block& blk, double scale, at::Tensor& dq,
                    at::Tensor& dk, at::Tensor& dv) {
  auto qb = qg.narrow(3, blk.q_begin, blk.q_len);
  auto dob = dog.narrow(3, blk.q_begin, blk.q_len);
  auto kb = k.narrow(2, blk.kv_begin, blk.kv_len);
  auto vb = v.narrow(2, blk.kv_begin, blk.kv_len);
  auto probs = block_scores(qb, kb, scale, blk);
  probs.sub_(lse.narrow(3, blk.q_begin, blk.q_len).unsqueeze(-1)).exp_();
  // [b, kv, g, lq, lk] -> the groups folded into the rows: [b, kv, g * lq, lk].
  const auto b = probs.size(0), kvh = probs.size(1), g = probs.size(2), lq = probs.size(3);
  auto folded = [&](const at::Tensor& t) { return t.reshape({b, kvh, g * lq, t.size(-1)}); };
  dv.narrow(2, blk.kv_begin, blk.kv_len).add_(at::matmul(folded(probs).transpose(-2, -1), folded(dob)));
  auto ds = at::matmul(dob, vb.unsqueeze(2).transpose(-2, -1));  // dp
  ds.sub_(delta.narrow(3, blk.q_begin, blk.q_len).unsqueeze(-1)).mul_(probs);
  dq.narrow(3, blk.q_begin, blk.q_len).add_(at::matmul(ds, kb.unsqueeze(2)), scale);
  dk.narrow(2, blk.kv_begin, blk.kv_len).add_(at::matmul(folded(ds).transpose(-2, -1), folded(qb)), scale);
}

double scale_of(const RingAttentionOptions& o, const Shape& s) {
  return o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(s.d));
}

void check_layout(const Shape& s, int64_t cp, bool causal, const char* where) {
  TORCH_CHECK(!causal || cp == 1 || s.len % 2 == 0, "monarch: ", where, ": the local sequence length ", s.len,
              " is odd, but causal context parallelism over cp=", cp,
              " holds two equal chunks per rank (the sequence cut into 2*cp chunks, rank i holding chunks i "
              "and 2cp-1-i); shard the sequence with shard_sequence, whose length must divide by 2*cp = ",
              2 * cp);
}

// Every member of the group calls ring_attention with the same shapes: the ring's sends and
// receives carry no fingerprint (communicator.h), and Gloo aborts the process on a size
// mismatch, so the shapes are all-gathered first (one small checked collective) and any
// difference is one error on every rank naming each rank's shapes.
void agree_shapes(Communicator& group, const Shape& s, bool causal, at::ScalarType dtype) {
  const int64_t n = group.size();
  auto mine = at::tensor({s.batch, s.heads, s.kv_heads, s.len, s.d, s.dv, static_cast<int64_t>(causal),
                          static_cast<int64_t>(dtype)},
                         at::kLong);
  auto all = at::empty({n * mine.numel()}, at::kLong);
  group.all_gather(all, mine).wait();
  auto rows = all.view({n, mine.numel()});
  if (rows.eq(mine.unsqueeze(0)).all().item<bool>()) return;
  std::ostringstream msg;
  msg << "monarch: ring_attention: the ranks of cp group '" << group.name()
      << "' called it with different inputs (every rank must pass its chunk of the same batch):";
  for (int64_t r = 0; r < n; ++r) {
    auto x = rows[r];
    msg << " rank " << group.ranks()[r] << ": q [" << x[0].item<int64_t>() << ", " << x[1].item<int64_t>() << ", "
        << x[3].item<int64_t>() << ", " << x[4].item<int64_t>() << "], k/v heads " << x[2].item<int64_t>()
        << ", v head dim " << x[5].item<int64_t>() << ", causal " << (x[6].item<int64_t>() ? "true" : "false")
        << ", dtype " << static_cast<at::ScalarType>(x[7].item<int64_t>()) << (r + 1 < n ? ";" : "");
  }
  TORCH_CHECK(false, msg.str());
}

// k and v as one flat buffer in their dtype (what one ring hop sends), and back.
at::Tensor pack(const at::Tensor& k, const at::Tensor& v) {
  return at::cat({k.contiguous().view(-1), v.contiguous().view(-1)});
}
std::pair<at::Tensor, at::Tensor> unpack(const at::Tensor& flat, const Shape& s) {
  const int64_t nk = s.batch * s.kv_heads * s.len * s.d;
  const int64_t nv = s.batch * s.kv_heads * s.len * s.dv;
  const auto ct = compute_type(flat.scalar_type());
  return {flat.narrow(0, 0, nk).view({s.batch, s.kv_heads, s.len, s.d}).to(ct),
          flat.narrow(0, nk, nv).view({s.batch, s.kv_heads, s.len, s.dv}).to(ct)};
}

// One hop of the ring, both directions at once: `out` to the next rank, a buffer like it from
// the previous one. The caller keeps both until wait().
struct Hop {
  std::vector<Handle> handles;
  at::Tensor sent, received;
  void start(Communicator& group, at::Tensor buffer, int tag) {
    const int n = group.size(), r = group.group_rank();
    sent = std::move(buffer);
    received = at::empty_like(sent);
    // One grouped call (Communicator::send_recv): over NCCL a ring of separate sends and
    // receives deadlocks once a hop outgrows NCCL's buffers.
    handles = group.send_recv(sent, (r + 1) % n, received, (r + n - 1) % n, tag);
  }
  at::Tensor finish() {
    for (auto& h : handles) h.wait();
    handles.clear();
    sent = at::Tensor();
    return std::move(received);
  }
};

Accumulator new_accumulator(const Shape& s, at::ScalarType ct, const at::Device& device) {
  auto opts = at::TensorOptions().dtype(ct).device(device);
  return {at::empty({s.batch, s.kv_heads, s.groups(), s.len, s.dv}, opts),
          at::empty({s.batch, s.kv_heads, s.groups(), s.len}, opts)};
}

struct RingAttention : torch::autograd::Function<RingAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            int64_t group_handle, bool causal, double scale, int64_t rows) {
    Communicator& group = from_handle(group_handle);
    const Shape s = check_inputs(q, k, v, "ring_attention");
    const int64_t n = group.size(), r = group.group_rank();
    const auto ct = compute_type(q.scalar_type());
    auto qg = grouped(q, s, s.d);
    Accumulator acc = new_accumulator(s, ct, q.device());
    // Ring with send/recv rather than one all-gather of every rank's k/v: the same bytes per
    // rank ((cp-1) chunks), but only two chunks are held at a time (an all-gather holds the
    // whole sequence's k/v, which is what cp is there to avoid), and each hop overlaps the
    // block computed meanwhile.
    Communicator::Phase phase(group, "ring attention forward");
    at::Tensor current = pack(k, v);
    for (int64_t t = 0; t < n; ++t) {
      Hop hop;
      if (t + 1 < n) hop.start(group, current, kTagForwardKv);  // the next step's k/v, meanwhile
      const int64_t src = (r - t + n) % n;
      auto [kk, vv] = t == 0 ? std::make_pair(k.contiguous().to(ct), v.contiguous().to(ct)) : unpack(current, s);
      for (const Block& tile : tiles(block_for(r, src, s.len, causal), s.batch * s.heads, rows)) {
        forward_block(acc, qg, kk, vv, tile, scale, t == 0);
      }
      if (t + 1 < n) current = hop.finish();
    }
    auto out = acc.out.view({s.batch, s.heads, s.len, s.dv}).to(q.scalar_type());
    ctx->save_for_backward({q, k, v, out, acc.lse});
    ctx->saved_data["group"] = group_handle;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["rows"] = rows;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    Communicator& group = from_handle(ctx->saved_data["group"].toInt());
    const bool causal = ctx->saved_data["causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t rows = ctx->saved_data["rows"].toInt();
    const Shape s = check_inputs(q, k, v, "ring_attention backward");
    const int64_t n = group.size(), r = group.group_rank();
    const auto ct = compute_type(q.scalar_type());
    at::Tensor dout = grads[0];
    if (!dout.defined()) dout = at::zeros_like(out);
    auto qg = grouped(q, s, s.d);
    auto dog = grouped(dout, s, s.dv);
    auto delta = (dog * grouped(out, s, s.dv)).sum(-1);
    auto dq = at::zeros_like(qg);
    auto opts = qg.options();
    const int64_t nk = s.batch * s.kv_heads * s.len * s.d;
    const int64_t nv = s.batch * s.kv_heads * s.len * s.dv;
    // The gradient of each k/v chunk is the sum of every rank's contribution. It travels
    // with the chunk: rank r adds its part for the chunk it holds at step t >= 1 and passes
    // the sum on; the chunk's owner keeps its own (step 0) part, and the sum of the other
    // cp-1 ranks' parts reaches it after the last step. Started at step 1 rather than at
    // the owner, each accumulator makes cp-1 hops, not cp (ring-flash-attention's order, one
    // hop more), so backward sends exactly as many bytes of gradients as of keys/values.
    auto own = at::zeros({nk + nv}, opts);
    Communicator::Phase phase(group, "ring attention backward");
    at::Tensor current = pack(k, v);
    Hop incoming;        // the accumulator for the chunk of the next step, from the previous rank
    for (int64_t t = 0; t < n; ++t) {
      Hop hop;
      if (t + 1 < n) hop.start(group, current, kTagBackwardKv);
      const int64_t src = (r - t + n) % n;
      auto [kk, vv] = t == 0 ? std::make_pair(k.contiguous().to(ct), v.contiguous().to(ct)) : unpack(current, s);
      auto part = t == 0 ? own : at::zeros({nk + nv}, opts);
      auto dk = part.narrow(0, 0, nk).view({s.batch, s.kv_heads, s.len, s.d});
      auto dv = part.narrow(0, nk, nv).view({s.batch, s.kv_heads, s.len, s.dv});
      for (const Block& tile : tiles(block_for(r, src, s.len, causal), s.batch * s.heads, rows)) {
        backward_block(qg, dog, lse, delta, kk, vv, tile, scale, dq, dk, dv);
      }
      if (t >= 1) {
        // Received after this rank's part was computed: the hop overlapped that block.
        if (t >= 2) part.add_(incoming.finish());
        Hop next;
        next.start(group, part, kTagBackwardGrad);  // on to the next rank; the next accumulator in
        incoming = std::move(next);
      }
      if (t + 1 < n) current = hop.finish();
    }
    if (n > 1) own.add_(incoming.finish());  // the other ranks' parts for this rank's chunk
    auto dq_out = dq.view({s.batch, s.heads, s.len, s.d}).to(q.scalar_type());
    auto dk_out = own.narrow(0, 0, nk).view({s.batch, s.kv_heads, s.len, s.d}).to(k.scalar_type());
    auto dv_out = own.narrow(0, nk, nv).view({s.batch, s.kv_heads, s.len, s.dv}).to(v.scalar_type());
    return {dq_out, dk_out, dv_out, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

int64_t check_split(const at::Tensor& x, int64_t dim, int64_t size, const char* where) {
  TORCH_CHECK(size >= 1, "monarch: ", where, ": cp size ", size, " must be >= 1");
  const int64_t len = x.size(dim);
  TORCH_CHECK(size == 1 || len % (2 * size) == 0, "monarch: ", where, ": the sequence length ", len, " (dim ", dim,
              " of ", shape_text(x), ") does not split into 2*cp = ", 2 * size,
              " equal chunks (cp=", size, ", load-balanced layout: rank i holds chunks i and 2cp-1-i); pad the "
              "sequence to a multiple of ", 2 * size);
  return len / (2 * size);
}

// x's chunks in global sequence order, given every rank's part (each two chunks).
at::Tensor in_sequence_order(const std::vector<at::Tensor>& parts, int64_t dim) {
  const int64_t n = static_cast<int64_t>(parts.size());
  if (n == 1) return parts[0];
  std::vector<at::Tensor> chunks(2 * n);
  for (int64_t r = 0; r < n; ++r) {
    auto halves = parts[r].chunk(2, dim);
    chunks[r] = halves[0];
    chunks[2 * n - 1 - r] = halves[1];
  }
  return at::cat(chunks, dim);
}

struct GatherSequence : torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group_handle, int64_t dim) {
    Communicator& group = from_handle(group_handle);
    const int64_t n = group.size();
    ctx->saved_data["group"] = group_handle;
    ctx->saved_data["dim"] = dim;
    TORCH_CHECK(x.size(dim) % 2 == 0, "monarch: gather_sequence: dimension ", dim, " of ", shape_text(x),
                " is odd; a rank's part is two equal chunks (shard_sequence)");
    auto input = x.contiguous();
    std::vector<int64_t> shape{n};
    for (auto d : input.sizes()) shape.push_back(d);
    auto stacked = at::empty(shape, input.options());
    {
      Communicator::Phase phase(group, "gather_sequence");
      group.all_gather(stacked, input).wait();
    }
    return in_sequence_order(stacked.unbind(0), dim);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    Communicator& group = from_handle(ctx->saved_data["group"].toInt());
    auto g = shard_sequence(grads[0], ctx->saved_data["dim"].toInt(), group.group_rank(), group.size());
    return {g.contiguous(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Communicator& group,
                          const RingAttentionOptions& options) {
  const Shape s = check_inputs(q, k, v, "ring_attention");
  check_layout(s, group.size(), options.causal, "ring_attention");
  if (group.size() > 1) agree_shapes(group, s, options.causal, q.scalar_type());
  TORCH_CHECK(options.block_rows >= 0, "monarch: ring_attention: block_rows ", options.block_rows, " must be >= 0");
  return RingAttention::apply(q, k, v, as_handle(group), options.causal, scale_of(options, s), options.block_rows);
}

at::Tensor shard_sequence(const at::Tensor& x, int64_t dim, int64_t rank, int64_t size) {
  TORCH_CHECK(x.defined() && x.dim() > 0, "monarch: shard_sequence: x must be a tensor with a sequence dimension");
  dim = at::maybe_wrap_dim(dim, x.dim());
  TORCH_CHECK(rank >= 0 && rank < size, "monarch: shard_sequence: rank ", rank, " is not in [0, ", size, ")");
  const int64_t c = check_split(x, dim, size, "shard_sequence");
  if (size == 1) return x;
  return at::cat({x.narrow(dim, rank * c, c), x.narrow(dim, (2 * size - 1 - rank) * c, c)}, dim);
}

at::Tensor local_sequence_positions(int64_t local_len, int64_t rank, int64_t size) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "monarch: sequence positions: rank ", rank, " is not in [0, ",
              size, ")");
  if (size == 1) return at::arange(local_len, at::kLong);
  TORCH_CHECK(local_len % 2 == 0, "monarch: sequence positions: the local length ", local_len,
              " is odd; under cp=", size, " a rank holds two equal chunks (the sequence length must divide by 2*cp = ",
              2 * size, ")");
  const int64_t c = local_len / 2;
  return at::cat({at::arange(rank * c, (rank + 1) * c, at::kLong),
                  at::arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, at::kLong)});
}

at::Tensor sequence_positions(int64_t seq_len, int64_t rank, int64_t size) {
  TORCH_CHECK(size >= 1 && (size == 1 || seq_len % (2 * size) == 0), "monarch: sequence positions: the sequence length ",
              seq_len, " does not split into 2*cp = ", 2 * size, " equal chunks (cp=", size, ")");
  return local_sequence_positions(seq_len / size, rank, size);
}

at::Tensor unshard_sequence(const std::vector<at::Tensor>& shards, int64_t dim) {
  TORCH_CHECK(!shards.empty(), "monarch: unshard_sequence: no shards");
  dim = at::maybe_wrap_dim(dim, shards[0].dim());
  for (const auto& s : shards) {
    TORCH_CHECK(s.sizes() == shards[0].sizes(), "monarch: unshard_sequence: shards of different shapes (",
                shape_text(shards[0]), " and ", shape_text(s), ")");
  }
  TORCH_CHECK(shards.size() == 1 || shards[0].size(dim) % 2 == 0, "monarch: unshard_sequence: dimension ", dim,
              " of ", shape_text(shards[0]), " is odd; a rank's part is two equal chunks");
  return in_sequence_order(shards, dim);
}

at::Tensor gather_sequence(const at::Tensor& x, Communicator& group, int64_t dim) {
  TORCH_CHECK(x.defined() && x.dim() > 0, "monarch: gather_sequence: x must be a tensor with a sequence dimension");
  dim = at::maybe_wrap_dim(dim, x.dim());
  if (group.size() == 1) return x;
  return GatherSequence::apply(x, as_handle(group), dim);
}

SimulatedRing simulate_ring_attention(const std::vector<at::Tensor>& qs, const std::vector<at::Tensor>& ks,
                                      const std::vector<at::Tensor>& vs, const std::vector<at::Tensor>& douts,
                                      const RingAttentionOptions& options) {
  const int64_t n = static_cast<int64_t>(qs.size());
  TORCH_CHECK(n >= 1 && ks.size() == qs.size() && vs.size() == qs.size() &&
                  (douts.empty() || douts.size() == qs.size()),
              "monarch: simulate_ring_attention: one q, k, v (and output gradient, if any) per simulated rank");
  std::vector<Shape> shapes;
  for (int64_t r = 0; r < n; ++r) {
    shapes.push_back(check_inputs(qs[r], ks[r], vs[r], "simulate_ring_attention"));
    check_layout(shapes.back(), n, options.causal, "simulate_ring_attention");
    TORCH_CHECK(qs[r].sizes() == qs[0].sizes() && ks[r].sizes() == ks[0].sizes() && vs[r].sizes() == vs[0].sizes(),
                "monarch: simulate_ring_attention: simulated rank ", r, " has shapes different from rank 0's");
  }
  const Shape& s = shapes[0];
  const auto ct = compute_type(qs[0].scalar_type());
  const double scale = scale_of(options, s);
  SimulatedRing result;
  std::vector<at::Tensor> kc, vc, lses;
  for (int64_t r = 0; r < n; ++r) {
    kc.push_back(ks[r].contiguous().to(ct));
    vc.push_back(vs[r].contiguous().to(ct));
  }
  for (int64_t r = 0; r < n; ++r) {
    auto qg = grouped(qs[r], s, s.d);
    Accumulator acc = new_accumulator(s, ct, qs[r].device());
    for (int64_t t = 0; t < n; ++t) {
      const int64_t src = (r - t + n) % n;
      for (const Block& tile : tiles(block_for(r, src, s.len, options.causal), s.batch * s.heads, options.block_rows)) {
        forward_block(acc, qg, kc[src], vc[src], tile, scale, t == 0);
      }
    }
    result.out.push_back(acc.out.view({s.batch, s.heads, s.len, s.dv}).to(qs[r].scalar_type()));
    lses.push_back(acc.lse);
  }
  if (douts.empty()) return result;
  std::vector<at::Tensor> dk(n), dv(n);
  for (int64_t r = 0; r < n; ++r) {
    dk[r] = at::zeros_like(kc[r]);
    dv[r] = at::zeros_like(vc[r]);
  }
  for (int64_t r = 0; r < n; ++r) {
    auto qg = grouped(qs[r], s, s.d);
    auto dog = grouped(douts[r], s, s.dv);
    auto delta = (dog * grouped(result.out[r], s, s.dv)).sum(-1);
    auto dq = at::zeros_like(qg);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t src = (r - t + n) % n;
      for (const Block& tile : tiles(block_for(r, src, s.len, options.causal), s.batch * s.heads, options.block_rows)) {
        backward_block(qg, dog, lses[r], delta, kc[src], vc[src], tile, scale, dq, dk[src], dv[src]);
      }
    }
    result.dq.push_back(dq.view({s.batch, s.heads, s.len, s.d}).to(qs[r].scalar_type()));
  }
  for (int64_t r = 0; r < n; ++r) {
    result.dk.push_back(dk[r].to(ks[r].scalar_type()));
    result.dv.push_back(dv[r].to(vs[r].scalar_type()));
  }
  return result;
}

RingBytes ring_attention_bytes(int64_t batch, int64_t local_len, int64_t kv_heads, int64_t head_dim,
                               int64_t v_head_dim, int64_t cp, at::ScalarType dtype) {
  const double elements = static_cast<double>(batch) * local_len * kv_heads * (head_dim + v_head_dim);
  const double hops = static_cast<double>(cp - 1);
  const double value_bytes = static_cast<double>(c10::elementSize(dtype));
  const double grad_bytes = static_cast<double>(c10::elementSize(compute_type(dtype)));
  return {hops * elements * value_bytes, hops * elements * (value_bytes + grad_bytes)};
}

}  // namespace monarch::cp
