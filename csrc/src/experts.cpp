#include "monarch/runtime/experts.h"

#include "group_handle.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace monarch::experts {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

namespace {

using detail::as_handle;  // group_handle.h
using detail::from_handle;

// Rows of a [rows, hidden] tensor exchanged over the ep group: rank j gets send_rows[j] rows.
at::Tensor exchange_rows(const at::Tensor& x, Communicator& group, const std::vector<int64_t>& send_rows,
                         const std::vector<int64_t>& recv_rows) {
  const int64_t hidden = x.size(1);
  std::vector<int64_t> in_splits, out_splits;
  int64_t out_rows = 0;
  for (size_t j = 0; j < send_rows.size(); ++j) {
    in_splits.push_back(send_rows[j] * hidden);
    out_splits.push_back(recv_rows[j] * hidden);
    out_rows += recv_rows[j];
  }
  auto input = x.contiguous();
  auto output = at::empty({out_rows, hidden}, input.options());
  Communicator::Phase phase(group, "an expert-parallel layer");
  group.all_to_all_v(output, input, out_splits, in_splits).wait();
  return output;
}

// The all-to-all of rows; its backward sends the gradients back the way the rows came.
struct ExchangeRows : torch::autograd::Function<ExchangeRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group, std::vector<int64_t> send_rows,
                            std::vector<int64_t> recv_rows) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["send"] = send_rows;
    ctx->saved_data["recv"] = recv_rows;
    return exchange_rows(x, from_handle(group), send_rows, recv_rows);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto& group = from_handle(ctx->saved_data["group"].toInt());
    const auto send = ctx->saved_data["send"].toIntVector();
    const auto recv = ctx->saved_data["recv"].toIntVector();
    return {exchange_rows(grads[0], group, recv, send), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Sum over the group in both directions: the forward sums every rank's partial sums; the
// backward sums every rank's gradient of the (replicated) result, which is what each rank's
// partial sum contributed to (see load_balancing_loss in the header).
struct SumOverGroup : torch::autograd::Function<SumOverGroup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    auto out = x.contiguous().clone();
    auto& g = from_handle(group);
    Communicator::Phase phase(g, "a load-balancing loss");
    g.all_reduce(out).wait();
    return out;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto out = grads[0].contiguous().clone();
    auto& g = from_handle(ctx->saved_data["group"].toInt());
    Communicator::Phase phase(g, "a load-balancing loss");
    g.all_reduce(out).wait();
    return {out, at::Tensor()};
  }
};

std::vector<int64_t> to_vector(const at::Tensor& t) {
  auto c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

at::Tensor index_tensor(const std::vector<int64_t>& v) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong));
}

}  // namespace

Dispatch plan_dispatch(const at::Tensor& top_k_index, const DispatchOptions& options, Communicator& ep_group,
                       Communicator* token_group) {
  TORCH_CHECK(top_k_index.dim() == 2, "monarch: experts: top_k_index must be [tokens, top_k], got ",
              top_k_index.dim(), " dimensions");
  TORCH_CHECK(!at::isFloatingType(top_k_index.scalar_type()), "monarch: experts: top_k_index must hold integers");
  const int64_t ep = ep_group.size();
  const int64_t experts = options.num_experts;
  TORCH_CHECK(experts >= 1, "monarch: experts: num_experts must be >= 1, got ", experts);
  TORCH_CHECK(experts % ep == 0, "monarch: experts: ", experts, " experts do not split over an ep group of ", ep,
              " ranks (", ep_group.name(), "); ep must divide the number of experts");
  TORCH_CHECK(options.capacity_factor >= 0 && std::isfinite(options.capacity_factor),
              "monarch: experts: capacity_factor must be >= 0 (0: dropless), got ", options.capacity_factor);
  Dispatch d;
  d.tokens = top_k_index.size(0);
  d.top_k = top_k_index.size(1);
  d.num_experts = experts;
  d.ep = ep;
  d.local_experts = experts / ep;
  d.ep_group = &ep_group;
  const std::vector<int64_t> choice = to_vector(top_k_index.cpu());
  const int64_t slots = d.tokens * d.top_k;
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(choice[s] >= 0 && choice[s] < experts, "monarch: experts: token ", s / d.top_k, " choice ",
                s % d.top_k, " names expert ", choice[s], ", outside [0, ", experts, ")");
  }

  // Which slots are kept. Dropless: all. Under a capacity: a slot's place in its expert's queue
  // is counted over the whole token group in the order (choice, rank, token).
  std::vector<char> kept(slots, 1);
  if (options.capacity_factor > 0) {
    // counts[choice][expert] of this rank, then every rank's (all-gathered).
    std::vector<int64_t> mine(d.top_k * experts + 1, 0);
    for (int64_t s = 0; s < slots; ++s) ++mine[(s % d.top_k) * experts + choice[s]];
    mine.back() = d.tokens;
    const int64_t width = static_cast<int64_t>(mine.size());
    Communicator* group = token_group;
    int64_t ranks = 1, me = 0;
    std::vector<int64_t> all = mine;
    if (group != nullptr && group->size() > 1) {
      ranks = group->size();
      me = group->group_rank();
      auto local = index_tensor(mine);
      auto gathered = at::empty({ranks * width}, local.options());
      Communicator::Phase phase(*group, "an expert-parallel layer's capacity");
      group->all_gather(gathered, local).wait();
      all = to_vector(gathered);
    }
    int64_t total_tokens = 0;
    for (int64_t r = 0; r < ranks; ++r) total_tokens += all[r * width + width - 1];
    d.capacity = static_cast<int64_t>(
        std::ceil(options.capacity_factor * static_cast<double>(total_tokens * d.top_k) / static_cast<double>(experts)));
    // Queue position before this rank's first slot of (choice k, expert e): every rank's slots
    // of earlier choices, then lower ranks' slots of this choice.
    std::vector<int64_t> position(d.top_k * experts, 0);
    for (int64_t k = 0; k < d.top_k; ++k) {
      for (int64_t e = 0; e < experts; ++e) {
        int64_t before = 0;
        for (int64_t r = 0; r < ranks; ++r) {
          for (int64_t k2 = 0; k2 < k; ++k2) before += all[r * width + k2 * experts + e];
          if (r < me) before += all[r * width + k * experts + e];
        }
        position[k * experts + e] = before;
      }
    }
    for (int64_t k = 0; k < d.top_k; ++k) {
      for (int64_t t = 0; t < d.tokens; ++t) {
        const int64_t s = t * d.top_k + k;
        int64_t& p = position[k * experts + choice[s]];
        kept[s] = p < d.capacity;
        d.dropped_slots += kept[s] ? 0 : 1;
        ++p;
      }
    }
  }

  // The kept slots sorted by expert, stably (token order within an expert).
  std::vector<int64_t> order;
  order.reserve(slots);
  for (int64_t s = 0; s < slots; ++s) {
    if (kept[s]) order.push_back(s);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return choice[a] < choice[b]; });
  std::vector<int64_t> tokens(order.size());
  std::vector<int64_t> per_expert(experts, 0);
  for (size_t i = 0; i < order.size(); ++i) {
    tokens[i] = order[i] / d.top_k;
    ++per_expert[choice[order[i]]];
  }
  d.sent_slots = index_tensor(order);
  d.sent_tokens = index_tensor(tokens);
  d.send_rows.assign(ep, 0);
  for (int64_t e = 0; e < experts; ++e) d.send_rows[e / d.local_experts] += per_expert[e];

  // Counts per (source rank, local expert): my per-expert counts, chunk r to ep rank r.
  std::vector<int64_t> received(experts, 0);  // [ep][local_experts]
  {
    auto send = index_tensor(per_expert);
    auto recv = at::empty_like(send);
    Communicator::Phase phase(ep_group, "an expert-parallel layer's row counts");
    ep_group.all_to_all(recv, send).wait();
    received = to_vector(recv);
  }
  d.recv_rows.assign(ep, 0);
  d.rows_per_local_expert.assign(d.local_experts, 0);
  for (int64_t r = 0; r < ep; ++r) {
    for (int64_t j = 0; j < d.local_experts; ++j) {
      d.recv_rows[r] += received[r * d.local_experts + j];
      d.rows_per_local_expert[j] += received[r * d.local_experts + j];
    }
  }
  // Received rows: source-major. Grouped: expert-major (expert j's rows from rank 0, 1, ...).
  std::vector<int64_t> start(experts, 0);  // offset of (r, j) in the received rows
  for (int64_t i = 1; i < experts; ++i) start[i] = start[i - 1] + received[i - 1];
  std::vector<int64_t> grouped;
  grouped.reserve(std::accumulate(received.begin(), received.end(), int64_t{0}));
  for (int64_t j = 0; j < d.local_experts; ++j) {
    for (int64_t r = 0; r < ep; ++r) {
      const int64_t at_ = start[r * d.local_experts + j];
      for (int64_t i = 0; i < received[r * d.local_experts + j]; ++i) grouped.push_back(at_ + i);
    }
  }
  std::vector<int64_t> ungrouped(grouped.size());
  for (size_t i = 0; i < grouped.size(); ++i) ungrouped[grouped[i]] = static_cast<int64_t>(i);
  d.grouped_order = index_tensor(grouped);
  d.ungrouped_order = index_tensor(ungrouped);
  return d;
}

at::Tensor dispatch(const at::Tensor& x, const Dispatch& route) {
  TORCH_CHECK(route.ep_group != nullptr, "monarch: experts: dispatch needs a route from plan_dispatch");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == route.tokens, "monarch: experts: dispatch expects [", route.tokens,
              ", hidden] tokens (the routed ones), got ", x.sizes());
  auto rows = x.index_select(0, route.sent_tokens.to(x.device()));
  auto received = ExchangeRows::apply(rows, as_handle(*route.ep_group), route.send_rows, route.recv_rows);
  return received.index_select(0, route.grouped_order.to(x.device()));
}

at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& top_k_weights, const Dispatch& route) {
  TORCH_CHECK(route.ep_group != nullptr, "monarch: experts: combine needs a route from plan_dispatch");
  const int64_t rows = route.grouped_order.numel();
  TORCH_CHECK(expert_out.dim() == 2 && expert_out.size(0) == rows, "monarch: experts: combine expects the ", rows,
              " rows dispatch returned, got ", expert_out.sizes());
  TORCH_CHECK(top_k_weights.dim() == 2 && top_k_weights.size(0) == route.tokens &&
                  top_k_weights.size(1) == route.top_k,
              "monarch: experts: top_k_weights must be [", route.tokens, ", ", route.top_k, "], got ",
              top_k_weights.sizes());
  const auto device = expert_out.device();
  auto source_major = expert_out.index_select(0, route.ungrouped_order.to(device));
  auto back = ExchangeRows::apply(source_major, as_handle(*route.ep_group), route.recv_rows, route.send_rows);
  auto weights = top_k_weights.reshape({-1}).index_select(0, route.sent_slots.to(device));
  auto weighted = back * weights.to(back.scalar_type()).unsqueeze(1);
  auto out = at::zeros({route.tokens, expert_out.size(1)}, expert_out.options());
  return out.index_add(0, route.sent_tokens.to(device), weighted);
}

bool known_activation(const std::string& a) {
  return a == "silu" || a == "gelu" || a == "gelu_tanh" || a == "relu";
}

at::Tensor grouped_mlp(const at::Tensor& x, const std::vector<int64_t>& rows_per_expert, const at::Tensor& gate_up,
                       const at::Tensor& down, const std::string& activation) {
  TORCH_CHECK(known_activation(activation), "monarch: experts: activation '", activation,
              "' is not one of silu, gelu, gelu_tanh, relu");
  const int64_t experts = static_cast<int64_t>(rows_per_expert.size());
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == experts && down.size(0) == experts,
              "monarch: experts: gate_up [experts, 2 * ffn, hidden] and down [experts, hidden, ffn] must hold ",
              experts, " experts, got ", gate_up.sizes(), " and ", down.sizes());
  TORCH_CHECK(gate_up.size(1) % 2 == 0 && gate_up.size(1) / 2 == down.size(2) && gate_up.size(2) == down.size(1) &&
                  x.dim() == 2 && x.size(1) == gate_up.size(2),
              "monarch: experts: shapes do not chain: x ", x.sizes(), ", gate_up ", gate_up.sizes(), ", down ",
              down.sizes());
  const int64_t total = std::accumulate(rows_per_expert.begin(), rows_per_expert.end(), int64_t{0});
  TORCH_CHECK(total == x.size(0), "monarch: experts: ", total, " rows by expert, x holds ", x.size(0));
  std::vector<at::Tensor> outs;
  int64_t offset = 0;
  for (int64_t j = 0; j < experts; ++j) {
    auto rows = x.narrow(0, offset, rows_per_expert[j]);
    offset += rows_per_expert[j];
    auto h = at::matmul(rows, gate_up[j].t());
    auto parts = h.chunk(2, -1);
    at::Tensor gate;
    if (activation == "silu") {
      gate = at::silu(parts[0]);
    } else if (activation == "gelu") {
      gate = at::gelu(parts[0]);
    } else if (activation == "gelu_tanh") {
      gate = at::gelu(parts[0], "tanh");
    } else {
      gate = at::relu(parts[0]);
    }
    outs.push_back(at::matmul(gate * parts[1], down[j].t()));
  }
  return at::cat(outs, 0);
}

at::Tensor load_balancing_loss(const at::Tensor& router_probs, const at::Tensor& top_k_index, int64_t num_experts,
                               Communicator* token_group) {
  TORCH_CHECK(router_probs.dim() == 2 && router_probs.size(1) == num_experts,
              "monarch: experts: router_probs must be [tokens, ", num_experts, "], got ", router_probs.sizes());
  TORCH_CHECK(top_k_index.dim() == 2 && top_k_index.size(0) == router_probs.size(0),
              "monarch: experts: top_k_index must be [", router_probs.size(0), ", top_k], got ", top_k_index.sizes());
  auto probs = router_probs.to(at::kFloat);
  // Per expert: summed probability (differentiable), slots routed there and tokens (counts).
  auto prob_sum = probs.sum(0);
  auto counts = at::zeros({num_experts + 1}, probs.options());
  counts.narrow(0, 0, num_experts)
      .index_add_(0, top_k_index.reshape({-1}).to(at::kLong).to(probs.device()),
                  at::ones({top_k_index.numel()}, probs.options()));
  counts[num_experts] = static_cast<double>(router_probs.size(0));
  if (token_group != nullptr && token_group->size() > 1) {
    prob_sum = SumOverGroup::apply(prob_sum, as_handle(*token_group));
    Communicator::Phase phase(*token_group, "a load-balancing loss");
    token_group->all_reduce(counts).wait();
  }
  auto tokens = counts[num_experts].clamp_min(1.0);
  auto fraction = counts.narrow(0, 0, num_experts) / tokens;
  return (fraction * (prob_sum / tokens)).sum() * static_cast<double>(num_experts);
}

}  // namespace monarch::experts
