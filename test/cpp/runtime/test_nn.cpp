// monarch::Linear / monarch::Embedding (monarch/nn.h) before tensor parallelism splits them:
// torch::nn's layers, the same initialization, parameters, state-dict names and outputs; the
// tp style names round-trip and an unknown one is refused by name.
#include "catch_with_torch.h"

#include <torch/torch.h>

#include "monarch/nn.h"
#include "monarch/parallelize.h"

TEST_CASE("monarch::Linear and Embedding are torch::nn's until split", "[runtime][nn]") {
  torch::manual_seed(7);
  torch::nn::Linear plain(torch::nn::LinearOptions(6, 10).bias(true));
  torch::nn::Embedding plain_embedding(12, 6);
  torch::manual_seed(7);
  monarch::Linear ours(6, 10, /*bias=*/true);
  monarch::Embedding our_embedding(12, 6);
  CHECK(torch::equal(ours->weight, plain->weight));
  CHECK(torch::equal(ours->bias, plain->bias));
  CHECK(torch::equal(our_embedding->weight, plain_embedding->weight));
  auto x = torch::randn({3, 6});
  CHECK(torch::allclose(ours(x), plain(x)));
  auto tokens = torch::randint(12, {2, 5}, torch::kLong);
  CHECK(torch::equal(our_embedding(tokens), plain_embedding(tokens)));
  CHECK(ours->named_parameters().keys() == plain->named_parameters().keys());
  CHECK(ours->style() == monarch::TpStyle::replicate);

  // Without a bias: no "bias" parameter, as torch::nn::Linear.
  monarch::Linear no_bias(4, 4, false);
  CHECK(no_bias->named_parameters().size() == 1);
  // Over an existing tensor (a head tied to the embedding): the same tensor, not a copy.
  monarch::Linear head(our_embedding->weight);
  CHECK(head->weight.unsafeGetTensorImpl() == our_embedding->weight.unsafeGetTensorImpl());
  CHECK(head->options.in_features() == 6);
  CHECK(head->options.out_features() == 12);
  CHECK(torch::allclose(head(x), torch::linear(x, our_embedding->weight)));
}

TEST_CASE("tensor-parallel style names round-trip; an unknown one is refused by name", "[runtime][nn]") {
  for (auto s : {monarch::TpStyle::colwise, monarch::TpStyle::rowwise, monarch::TpStyle::vocab_embedding,
                 monarch::TpStyle::vocab_head, monarch::TpStyle::replicate}) {
    CHECK(monarch::tp_style_from_string(monarch::to_string(s)) == s);
  }
  CHECK_THROWS_WITH(monarch::tp_style_from_string("column", "tp_plan['*.q']"),
                    Catch::Contains("tp_plan['*.q']: unknown tensor-parallel style 'column'"));
}

namespace {

// Embedding -> 2 blocks (q column, o row) -> head tied to the embedding, as a chain.
struct TpBlockImpl : torch::nn::Module, monarch::AttentionHeads {
  explicit TpBlockImpl(int64_t heads) : heads(heads) {
    q = register_module("q", monarch::Linear(8, 8, false));
    o = register_module("o", monarch::Linear(8, 8, false));
    plain = register_module("plain", torch::nn::Linear(8, 8));
  }
  at::Tensor forward(const at::Tensor& x) { return x + o(q(x)); }
  int64_t attention_heads() const override { return heads; }
  void set_local_heads(int64_t h, int64_t) override { heads = h; }
  int64_t heads;
  monarch::Linear q{nullptr}, o{nullptr};
  torch::nn::Linear plain{nullptr};
};
TORCH_MODULE(TpBlock);

torch::nn::Sequential tp_model(int64_t heads = 4, int64_t vocab = 16) {
  torch::nn::Sequential m;
  monarch::Embedding embedding(vocab, 8);
  m->push_back("embedding", embedding);
  m->push_back("block0", TpBlock(heads));
  m->push_back("block1", TpBlock(heads));
  m->push_back("head", monarch::Linear(embedding->weight));
  return m;
}

std::string refusal(const torch::nn::Sequential& model, std::vector<monarch::TpRule> rules, bool sp = false) {
  monarch::Layout layout;
  layout.mesh.tp = 2;
  layout.sequence_parallel = sp;
  layout.block_stage = {0, 0};
  monarch::ParallelizeOptions options;
  options.tp_plan = std::move(rules);
  try {
    monarch::ParallelModule(monarch::chain_of(model), layout, options);  // refused before any group exists
  } catch (const std::exception& e) {
    return e.what();
  }
  return "not refused";
}

}  // namespace

TEST_CASE("a tensor-parallel plan the model cannot take is refused whole, by name, before any group",
          "[runtime][nn][tp]") {
  using monarch::TpStyle;
  // A torch::nn::Linear cannot be redirected; a rule matching nothing is a typo.
  auto text = refusal(tp_model(), {{"*.plain", TpStyle::colwise}, {"*.qq", TpStyle::colwise}});
  CHECK_THAT(text, Catch::Contains("block0.plain (torch::nn::LinearImpl) matches '*.plain' (colwise) but is not a "
                                   "monarch::Linear"));
  CHECK_THAT(text, Catch::Contains("tp_plan rule '*.qq' matches no module"));
  // tp not dividing the heads or the vocabulary; a head split while its tied embedding is not.
  text = refusal(tp_model(3, 15), {{"*.q", TpStyle::colwise}, {"*.o", TpStyle::rowwise},
                                   {"head", TpStyle::vocab_head}, {"embedding", TpStyle::vocab_embedding}});
  CHECK_THAT(text, Catch::Contains("block0: 3 attention heads and 3 key/value heads; tp=2 must divide both"));
  CHECK_THAT(text, Catch::Contains("embedding: the vocabulary 15 is not divisible by tp=2"));
  text = refusal(tp_model(), {{"*.q", TpStyle::colwise}, {"*.o", TpStyle::rowwise}, {"head", TpStyle::vocab_head}});
  CHECK_THAT(text, Catch::Contains("embedding.weight is a tensor another layer splits, but embedding uses it whole"));
  // The wrong layer type for a style; sequence parallelism; an empty plan.
  text = refusal(tp_model(), {{"embedding", TpStyle::colwise}, {"*.q", TpStyle::vocab_embedding}});
  CHECK_THAT(text, Catch::Contains("embedding (monarch::EmbeddingImpl) matches 'embedding' (colwise) but is not a "
                                   "monarch::Linear"));
  CHECK_THAT(text, Catch::Contains("matches '*.q' (vocab_embedding) but is not a monarch::Embedding"));
  CHECK_THAT(refusal(tp_model(), {{"*.q", TpStyle::colwise}}, /*sp=*/true),
             Catch::Contains("sequence parallelism is not built in the C++ frontend"));
  CHECK_THAT(refusal(tp_model(), {}), Catch::Contains("ParallelizeOptions::tp_plan is empty"));
}
