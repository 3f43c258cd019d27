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
