// monarch::chain_of_blocks: a model whose blocks sit in a ModuleList driven by its own forward
// (monarch::BlockStack) read as pieces before / blocks / after, with every parameter placed
// once under its name in the model; what does not fit is refused by name.
#include "catch_with_torch.h"

#include <torch/torch.h>

#include "monarch/parallelize.h"

namespace {

struct StackImpl : torch::nn::Module, monarch::BlockStack {
  explicit StackImpl(std::vector<std::string> before = {"embed"}, std::string list = "layers")
      : before_(std::move(before)), list_(std::move(list)) {
    embed = register_module("embed", torch::nn::Embedding(10, 4));
    layers = register_module("layers", torch::nn::ModuleList(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4)));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})));
    head = register_module("head", torch::nn::Linear(4, 10));
  }
  std::string blocks_name() const override { return list_; }
  std::vector<std::string> before_names() const override { return before_; }
  at::Tensor forward_before(const at::Tensor& x) override { return embed(x); }
  at::Tensor forward_block(int64_t i, const at::Tensor& h) override { return layers[i]->as<torch::nn::Linear>()->forward(h); }
  at::Tensor forward_after(const at::Tensor& h) override { return head(norm(h)); }
  std::vector<std::string> before_;
  std::string list_;
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Stack);

std::vector<std::string> names(const monarch::Piece& p) {
  std::vector<std::string> out;
  for (const auto& [name, t] : p.parameters) out.push_back(name);
  return out;
}

}  // namespace

TEST_CASE("chain_of_blocks reads a ModuleList model as before / blocks / after", "[runtime][chain]") {
  Stack model;
  auto chain = monarch::chain_of_blocks(model.ptr());
  REQUIRE(chain.pieces.size() == 4);
  CHECK(names(chain.pieces[0]) == std::vector<std::string>{"embed.weight"});
  CHECK(chain.pieces[1].name == "layers.0");
  CHECK(names(chain.pieces[2]) == std::vector<std::string>{"layers.1.weight", "layers.1.bias"});
  CHECK(names(chain.pieces[3]) == std::vector<std::string>{"norm.weight", "norm.bias", "head.weight", "head.bias"});
  CHECK(monarch::find_blocks(chain) == std::vector<int64_t>{1, 2});
  // The pieces run what the model's loop runs.
  auto tokens = torch::randint(10, {2, 3}, torch::kLong);
  at::Tensor out = tokens;
  for (auto& p : chain.pieces) out = p.forward(out);
  auto expected = model->forward_after(model->forward_block(1, model->forward_block(0, model->forward_before(tokens))));
  CHECK(torch::equal(out, expected));
}

TEST_CASE("chain_of_blocks refuses what it cannot place, by name", "[runtime][chain]") {
  CHECK_THROWS_WITH(monarch::chain_of_blocks(Stack(std::vector<std::string>{"embedding"}).ptr()),
                    Catch::Contains("before_names() lists 'embedding', which is not a child"));
  CHECK_THROWS_WITH(monarch::chain_of_blocks(Stack(std::vector<std::string>{"embed"}, "blocks").ptr()),
                    Catch::Contains("has no child 'blocks' (its blocks_name)"));
  CHECK_THROWS_WITH(monarch::chain_of_blocks(Stack(std::vector<std::string>{"embed"}, "norm").ptr()),
                    Catch::Contains("norm is a torch::nn::LayerNormImpl, not a torch::nn::ModuleList"));
  Stack own;
  own->register_parameter("scale", torch::ones({1}));
  CHECK_THROWS_WITH(monarch::chain_of_blocks(own.ptr()), Catch::Contains("holds parameters of its own"));
  CHECK_THROWS_WITH(monarch::chain_of_blocks(torch::nn::Linear(2, 2).ptr()),
                    Catch::Contains("does not implement monarch::BlockStack"));
}
