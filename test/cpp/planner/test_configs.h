#pragma once
// Transformer configurations the planner tests build; one constructor instead of the same
// six assignments in every test.
#include <cstdint>

#include "monarch/planner/model_graph.h"
#include "monarch/planner/training_config.h"

namespace monarch::planner {

inline TransformerConfig transformer_config(int64_t layers, int64_t hidden, int64_t heads, int64_t seq,
                                            int64_t vocab, bool tied_embeddings = false) {
  TransformerConfig c;
  c.layers = layers;
  c.hidden = hidden;
  c.heads = heads;
  c.seq = seq;
  c.vocab = vocab;
  c.tied_embeddings = tied_embeddings;
  return c;
}

// GPT-3 175B (Brown et al. 2020; Narayanan et al. 2021 Table 1): 96 layers, hidden 12288, 96
// heads, 2048 tokens, vocabulary 51200.
inline ModelGraph gpt3_175b() {
  TransformerConfig c = transformer_config(96, 12288, 96, 2048, 51200);
  c.name = "gpt3-175b";
  return build_transformer(c);
}

// Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1; the released config.json):
// 32 layers, hidden 4096, 32 heads, 8 kv heads, SwiGLU experts of width 14336, 8 experts,
// top-2, vocabulary 32000, 32K context (seq given here). 46.7B parameters, 12.9B active.
inline TransformerConfig mixtral_8x7b_config(int64_t seq = 4096) {
  TransformerConfig c = transformer_config(32, 4096, 32, seq, 32000);
  c.name = "mixtral-8x7b";
  c.kv_heads = 8;
  c.ffn = 14336;
  c.gated_mlp = true;
  c.moe.experts = 8;
  c.moe.top_k = 2;
  return c;
}

// Mixtral 8x22B (Mistral AI's release notes and config.json): 56 layers, hidden 6144, 48 heads,
// 8 kv heads, experts of width 16384, 8 experts, top-2, vocabulary 32768. 141B, 39B active.
inline TransformerConfig mixtral_8x22b_config(int64_t seq = 4096) {
  TransformerConfig c = transformer_config(56, 6144, 48, seq, 32768);
  c.name = "mixtral-8x22b";
  c.kv_heads = 8;
  c.ffn = 16384;
  c.gated_mlp = true;
  c.moe.experts = 8;
  c.moe.top_k = 2;
  return c;
}

// DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 4.2; config.json): 61
// layers, hidden 7168, the first 3 dense (SwiGLU 18432), then 256 routed experts (width 2048,
// top-8) and 1 shared expert; vocabulary 129280, untied. MLA (128 heads, q LoRA rank 1536, kv
// LoRA rank 512, qk 128 + 64 rope dims, v 128) is approximated as attention with MLA's weight
// count, 187,107,328 per layer (W_DQ 7168x1536, W_UQ 1536x128x192, W_DKV+W_KR 7168x576,
// W_UK/W_UV 512x128x256, W_O 16384x7168, two norms), and 128 heads of width 128 (the value
// width) for the s^2 core and k/v sizes. 671B parameters, 37B activated (the MTP module
// is left out, as the report's 671B does).
inline TransformerConfig deepseek_v3_config(int64_t seq = 4096) {
  TransformerConfig c = transformer_config(61, 7168, 128, seq, 129280);
  c.name = "deepseek-v3";
  c.head_dim = 128;
  c.attention_params = 187107328;
  c.ffn = 18432;
  c.gated_mlp = true;
  c.moe.experts = 256;
  c.moe.top_k = 8;
  c.moe.expert_ffn = 2048;
  c.moe.shared_experts = 1;
  c.moe.first_dense_layers = 3;
  return c;
}

// Qwen3-235B-A22B (Qwen team 2025, "Qwen3 Technical Report", Table 2; config.json): 94 layers,
// hidden 4096, 64 query heads and 4 kv heads of width 128 (heads x head_dim = 8192 != hidden),
// 128 experts of width 1536, top-8, no shared expert, vocabulary 151936, untied. 235B, 22B active.
inline TransformerConfig qwen3_235b_config(int64_t seq = 4096) {
  TransformerConfig c = transformer_config(94, 4096, 64, seq, 151936);
  c.name = "qwen3-235b-a22b";
  c.kv_heads = 4;
  c.head_dim = 128;
  c.ffn = 1536;
  c.gated_mlp = true;
  c.moe.experts = 128;
  c.moe.top_k = 8;
  return c;
}

// Parameters a token passes through in one forward (the "activated" count MoE papers report):
// each layer's weight FLOPs (its forward FLOPs without the s^2 attention core) / 2 per token,
// plus the embedding (a lookup).
inline double activated_params(const ModelGraph& g) {
  const double s = static_cast<double>(g.seq_len());
  double active = 0;
  for (const auto& l : g.layers) {
    active += (l.forward_flops_per_sample - l.attention_flops_per_sample) / (2.0 * s);
    if (l.kind == LayerKind::embedding) active += static_cast<double>(l.params);
  }
  return active;
}

inline TrainingConfig global_batch(int64_t b) {
  TrainingConfig t;
  t.global_batch = b;
  return t;
}

// Pins for one fully given layout (what evaluate_layout scores).
inline Pins layout_pins(int64_t tp, int64_t pp, int64_t dp, int64_t zero, int64_t micro_batch, ScheduleKind schedule) {
  Pins pins;
  pins.tp = tp;
  pins.pp = pp;
  pins.dp = dp;
  pins.zero_stage = zero;
  pins.micro_batch_size = micro_batch;
  pins.schedule = schedule;
  return pins;
}

}  // namespace monarch::planner
