#pragma once
// Expert parallelism: a Mixture-of-Experts layer's experts split over the mesh's ep ranks
// (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021), tokens sent to the
// ranks holding their experts and back by all-to-all.
//
// The model keeps its own router (it computes each token's top-k experts and weights, as
// Hugging Face's MoE blocks do); this engine moves the tokens:
//
//   auto route = monarch::experts::plan_dispatch(top_k_index, options, mesh.group("ep"),
//                                                &mesh.group("dp_cp"));
//   auto rows = monarch::experts::dispatch(x, route);             // [rows, hidden], by local expert
//   auto out = monarch::experts::grouped_mlp(rows, route.rows_per_local_expert, gate_up, down, "silu");
//   auto y = monarch::experts::combine(out, top_k_weights, route);  // [tokens, hidden]
//
// Experts are laid out in ep-rank order: ep rank r holds experts [r * E / ep, (r + 1) * E / ep).
// Every step is differentiable (the all-to-alls run backwards through autograd), so the
// router's weights and the experts' weights get their gradients.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "monarch/runtime/communicator.h"

namespace monarch::experts {

struct DispatchOptions {
  int64_t num_experts = 0;  // all experts of the layer (over every ep rank)
  // 0: dropless (every token reaches its experts). > 0: each expert takes at most
  // ceil(capacity_factor * tokens * top_k / num_experts) token slots, `tokens` counted over the
  // whole token group (the global micro-batch); the rest are dropped (their slot adds nothing
  // to the output), first choices before second ones, earlier tokens first, ranks in group
  // order: the rule one process applies to the whole batch (GShard's capacity, Sec. 2.2).
  // (Under context parallelism a rank's tokens are chunks i and 2cp-1-i of each sequence, so
  // "earlier tokens" follows that order, not the sequence's.)
  double capacity_factor = 0;
};

// Where this rank's token slots go, for one forward (and its backward).
struct Dispatch {
  int64_t tokens = 0, top_k = 0, num_experts = 0, ep = 1, local_experts = 0;
  // The kept slots (flat index token * top_k + choice), sorted by expert (stably), and the token
  // each came from: the rows this rank sends, in the order it sends them.
  at::Tensor sent_slots, sent_tokens;
  std::vector<int64_t> send_rows;  // rows to each ep rank
  std::vector<int64_t> recv_rows;  // rows from each ep rank
  // Received rows come grouped by source rank, then local expert; grouped_order reorders them
  // to local expert, then source rank (what grouped_mlp reads), ungrouped_order back.
  at::Tensor grouped_order, ungrouped_order;
  std::vector<int64_t> rows_per_local_expert;
  int64_t dropped_slots = 0;        // this rank's slots over capacity
  int64_t capacity = 0;             // slots per expert (0: dropless)
  Communicator* ep_group = nullptr;  // not owned: the mesh owns its groups
};

// Routes this rank's tokens: top_k_index [tokens, top_k] (int64, experts in [0, num_experts)).
// Exchanges row counts with the ep group (and, under a capacity, the per-expert counts of every
// rank of `token_group`, which decides which slots are kept: pass the group of ranks whose
// tokens form one batch, e.g. the mesh's "dp_cp"). Collective over both groups.
Dispatch plan_dispatch(const at::Tensor& top_k_index, const DispatchOptions& options, Communicator& ep_group,
                       Communicator* token_group = nullptr);

// x [tokens, hidden] -> the rows this rank's local experts compute, grouped by local expert
// ([sum(rows_per_local_expert), hidden]). Differentiable.
at::Tensor dispatch(const at::Tensor& x, const Dispatch& route);

// expert outputs (dispatch's rows, same order) -> [tokens, hidden]: each token's kept slots,
// weighted by top_k_weights [tokens, top_k], summed. Differentiable (also in the weights).
at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& top_k_weights, const Dispatch& route);

// The local experts' gated MLP over their rows: for expert j (rows_per_expert[j] consecutive
// rows), act(x W_gate^T) * (x W_up^T) W_down^T with gate_up [experts, 2 * ffn, hidden] (gate
// rows first) and down [experts, hidden, ffn], the layout of Hugging Face's MoE experts. A
// loop of GEMMs, one per expert (the CPU reference of a grouped GEMM); an expert without rows
// still takes part so every weight gets a (zero) gradient. Activations: silu, gelu, gelu_tanh,
// relu.
at::Tensor grouped_mlp(const at::Tensor& x, const std::vector<int64_t>& rows_per_expert, const at::Tensor& gate_up,
                       const at::Tensor& down, const std::string& activation);
bool known_activation(const std::string& activation);

// The load-balancing loss of Switch Transformer (Fedus et al. 2021, eq. 4) in the form Hugging
// Face's MoE models use: num_experts * sum_e f_e * P_e, f_e the fraction of tokens whose top-k
// choices include e (counted per choice, so sum_e f_e = top_k), P_e the mean router
// probability of e. router_probs [tokens, num_experts]. With `token_group`, f and P are over
// every rank's tokens (the loss one process computes on the whole batch), and its gradient
// reaches every rank's probabilities: the value is the same on every rank, so under gradient
// averaging each rank's share is scaled by the group size to keep the sum right.
at::Tensor load_balancing_loss(const at::Tensor& router_probs, const at::Tensor& top_k_index, int64_t num_experts,
                               Communicator* token_group = nullptr);

}  // namespace monarch::experts
