// monarch::Linear / monarch::Embedding (monarch/nn.h) before tensor parallelism splits them:
// torch::nn's layers, the same initialization, parameters, state-dict names and outputs; the
// tp style names round-trip and an unknown one is refused by name.
#include "catch_with_torch.h"

#include <torch/torch.h>

#include "monarch/nn.h"

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
