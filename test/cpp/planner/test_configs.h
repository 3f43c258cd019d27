#pragma once
// Transformer configurations the planner tests build; one constructor instead of the same
// six assignments in every test.
#include <cstdint>

#include "monarch/planner/model_graph.h"

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

}  // namespace monarch::planner
