#pragma once
// Inference (LLM generation): what a layout costs when it serves a model token by token, and
// the search for a tp x pp layout (dp = world / (tp pp) independent replicas) that minimises
// per-token latency or maximises tokens/s under a latency target. docs/cost_model.md,
// "Inference", gives every formula and its source.
//
//   prefill (time to first token): one forward over batch x prompt_len tokens, compute-bound:
//     FLOPs = 2 x active params x tokens + the attention s^2 terms (as the training model's),
//     at peak x matmul_efficiency; 2 tp all-reduces per block; pp point-to-point per boundary.
//   decode (per token): every weight and the KV cache read once per step, bandwidth-bound:
//     per stage max((weight bytes + KV bytes) / (HBM x hbm_efficiency), FLOPs / (peak x eff))
//     + 2 tp all-reduces per block (latency-dominated: small messages) + one pp hop per stage
//     boundary; with pp > 1 and m micro-batches a token takes max(sum of stages + hops,
//     m x the slowest stage).
//   KV cache per sequence: 2 x layers x kv_heads x head_dim x (prompt_len + max_new_tokens) x
//     bytes (pre-allocated), split over tp by kv heads (tp must divide kv_heads: the same
//     rule as training; layouts where it does not are not considered) and over pp by layers.
//   memory per device: weights / tp on the stage + batch x KV + one step's activations.
//   host dispatch (eager frameworks): every operator a forward runs costs host time (Python,
//     the dispatcher, a kernel launch): blocks x ops_per_block x host_seconds_per_op per stage
//     and micro-batch. A GPU runs behind its host (the stage takes the larger of the two); a
//     CPU rank computes on its host thread (the two add). 0 (the default): compiled with the
//     host out of the loop (CUDA graphs), as gpt-fast's measurements. The decode loop's own host
//     work per step (host_seconds_per_step: choosing the token, the cache's bookkeeping, the
//     embedding's and head's operators) adds once per micro-batch step, on the last stage.
#include <cstdint>
#include <string>
#include <vector>

namespace monarch::planner {

struct Plan;            // plan.h
struct ModelGraph;      // model_graph.h
struct Cluster;         // cluster.h

enum class InferenceObjective {
  latency,     // minimise per-token decode latency at the batch
  throughput,  // maximise generated tokens/s, per-token latency under latency_target_s
};
std::string to_string(InferenceObjective objective);
InferenceObjective inference_objective_from_string(const std::string& name,
                                                   const std::string& field = "objective");

// What is asked of the layout.
struct InferenceConfig {
  InferenceObjective objective = InferenceObjective::latency;
  int64_t batch = 1;           // sequences decoded together per replica (latency objective: exactly)
  int64_t prompt_len = 0;      // tokens per prompt (prefill)
  int64_t max_new_tokens = 0;  // tokens generated per sequence (the KV cache holds prompt + these)
  // Throughput: the largest per-token latency allowed (seconds); 0: none.
  double latency_target_s = 0;
  // Throughput: the largest batch per replica tried (batch, 2 batch, 4 batch, ... up to it);
  // 0: 256 (vLLM's default max_num_seqs).
  int64_t max_batch = 0;
  double weight_bytes = 0;  // bytes per weight; 0: the graph's dtype
  double kv_bytes = 0;      // bytes per KV-cache element; 0: the graph's dtype
  // Share of the HBM bandwidth a decode step's reads reach. 0.7: gpt-fast (PyTorch Labs 2023)
  // decodes Llama-2-7B in bf16 on an A100-80GB at 1397 GB/s of its 2039 (0.69).
  double hbm_efficiency = 0.7;
  // Host time per operator a decoder block runs (seconds): 0, the host out of the loop
  // (compiled with CUDA graphs). Horace He ("Making Deep Learning Go Brrrr From First
  // Principles", 2022) measures PyTorch eager's overhead at about 10 us per operator on a GPU
  // host; bench/generate.py measures this machine's.
  double host_seconds_per_op = 0;
  // Operators a decoder block runs per forward in eager mode (counted at the dispatcher: aten
  // ops, views included). 0: 71, Hugging Face's LlamaDecoderLayer counted this way in one
  // decode step with a DynamicCache (transformers 5.18; docs/cost_model.md, Inference).
  double ops_per_block = 0;
  // Host time per decode step outside the decoder blocks (seconds): the generate loop's own
  // work (choosing and appending the token, the cache's and mask's bookkeeping) and the
  // operators of the embedding, final norm and head. 0: none (a compiled loop). Measured as the
  // intercept of an eager decode step's time over its block count (bench/generate.py).
  double host_seconds_per_step = 0;
  // The device computes behind the host (a GPU's launches are asynchronous): a stage takes
  // max(host, device); false (CPU ranks): host + device.
  bool host_overlaps_device = true;
  double effective_ops_per_block() const { return ops_per_block > 0 ? ops_per_block : 71.0; }
  int64_t effective_max_batch() const { return max_batch > 0 ? max_batch : 256; }
  bool operator==(const InferenceConfig& o) const;
};

// What the cost model expects of one layout (per replica; every replica is the same).
struct InferencePrediction {
  double ttft_s = 0;         // time to first token: the prefill of the batch
  double per_token_s = 0;    // decode: time between two tokens of one sequence (mean context)
  double tokens_per_s = 0;   // generated tokens/s of all replicas: dp x batch x new tokens / request time
  double request_s = 0;      // ttft + (max_new_tokens - 1) x per_token
  // Per device, on the most loaded pipeline stage: weights, KV cache (the batch's, allocated
  // for prompt + new tokens), activations of one step; memory_bytes = their sum.
  double weights_bytes = 0;
  double kv_cache_bytes = 0;
  double activation_bytes = 0;
  double memory_bytes = 0;
  // One decode step, summed over the stages one micro-batch passes: reading weights and KV
  // (bandwidth), compute (when it is the larger), tp all-reduces, pp hops.
  double decode_weights_s = 0, decode_kv_s = 0, decode_compute_s = 0;
  double decode_tp_comm_s = 0, decode_pp_comm_s = 0;
  // Host dispatch of one decode step over the stages (each micro-batch's); the part the device
  // does not hide is in per_token_s.
  double decode_host_s = 0;
  // The prefill: compute (or weight reads when larger), tp all-reduces, pp hops.
  double prefill_compute_s = 0, prefill_tp_comm_s = 0, prefill_pp_comm_s = 0;
  bool operator==(const InferencePrediction& o) const;
};

// An inference plan's own section (Plan::inference).
struct InferencePlan {
  InferenceConfig config;
  int64_t batch_per_replica = 1;     // sequences one replica decodes together
  int64_t decode_micro_batches = 1;  // pp > 1: micro-batches in flight round the pipeline
  InferencePrediction prediction;
  bool operator==(const InferencePlan& o) const;
};

// KV-cache bytes of one sequence on one device: sum over `layers` of kv_elements_per_token x
// tokens x kv_bytes / tp (kv heads split over tp).
double kv_cache_bytes_per_sequence(const ModelGraph& graph, int64_t tokens, double kv_bytes,
                                   int64_t tp = 1);

// Scores one layout: tp, pp (dp = world / (tp pp)), batch per replica and decode
// micro-batches. Throws ValidationError for an impossible layout (tp not dividing kv heads,
// more stages than layers). Does not check memory: prediction.memory_bytes says.
InferencePlan evaluate_inference(const ModelGraph& graph, const Cluster& cluster,
                                 const InferenceConfig& config, int64_t tp, int64_t pp,
                                 int64_t batch_per_replica, int64_t decode_micro_batches = 1);

struct InferenceOptions {
  // Pins: 0 = searched.
  int64_t tp = 0, pp = 0;
  int64_t alternatives = 5;  // runners-up kept in Plan::alternatives
  // Layouts within this fraction of the best (per-token latency, or tokens/s) count as tied:
  // latency then takes the fewest devices per replica, throughput the lowest per-token latency
  // (Plan::tie_break says so). 0: always the best.
  double tie_tolerance = 0.03;
};

// The layout for the objective: every tp (dividing heads, kv heads, ffn, vocab) x pp (at most
// the layers) filling the world with dp replicas, batch per replica (throughput) and decode
// micro-batches; the feasible one (fits memory; throughput: per-token under the target) with
// the lowest per-token latency (latency) or the most tokens/s (throughput). Plan::inference is
// set, Plan::choices says why this tp / pp / batch (the deciding quantities). Throws
// InfeasibleError naming the memory (or the latency target) when nothing qualifies.
Plan plan_inference(const ModelGraph& graph, const Cluster& cluster, const InferenceConfig& config,
                    const InferenceOptions& options = {});

// Checks the config (batch, prompt_len, max_new_tokens >= 1; target, bytes >= 0; efficiency
// in (0, 1]). Throws ValidationError("inference.<field>", ...).
void validate(const InferenceConfig& config);

}  // namespace monarch::planner
