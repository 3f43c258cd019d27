// The composition engine's rules that need no second process: a plan resolved into a
// layout for a model and a world (every difference listed), hand layouts, and how the C++
// frontend reads a torch::nn::Sequential (blocks, plan differences). Multi-rank training
// through monarch::parallelize is tested end to end with examples/cpp/train_gpt
// (test/python/test_cpp_frontend.py, launched by the launcher).
#include "catch_with_torch.h"

#include "monarch/parallelize.h"
#include "monarch/planner/search.h"

using namespace monarch;

namespace {

planner::Plan gpt_plan(int64_t layers, int64_t pp, int64_t dp) {
  planner::TransformerConfig c;
  c.layers = layers;
  c.hidden = 32;
  c.heads = 4;
  c.seq = 16;
  c.vocab = 64;
  c.dtype = planner::DType::fp32;
  auto graph = planner::build_transformer(c);
  planner::restrict_cuts_to_blocks(graph);
  planner::TrainingConfig t;
  t.global_batch = 16;
  t.compute_dtype = planner::DType::fp32;
  t.allow_recompute = false;
  t.allow_sequence_parallel = false;
  planner::Pins pins;
  pins.pp = pp;
  pins.dp = dp;
  pins.tp = 1;
  pins.zero_stage = 1;
  pins.micro_batch_size = 2;
  pins.schedule = pp > 1 ? planner::ScheduleKind::one_f_one_b : planner::ScheduleKind::none;
  return planner::evaluate_layout(graph, planner::cluster_preset("cpu", pp * dp), t, pins, true);
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a plan resolves into the layout the runtime builds", "[runtime][composition]") {
  const auto plan = gpt_plan(4, 2, 2);
  const Layout l = layout_from_plan(plan, 4, 4);
  CHECK(l.mesh.pp == 2);
  CHECK(l.mesh.dp == 2);
  CHECK(l.block_stage == std::vector<int64_t>{0, 0, 1, 1});
  CHECK(l.schedule == planner::ScheduleKind::one_f_one_b);
  CHECK(l.micro_batches == plan.num_micro_batches);
  CHECK(l.micro_batches == 16 / (2 * 2));
  CHECK(l.zero_stage == 1);
  // Cuts only between blocks: the embedding joins the first block's stage, the head the last's.
  for (const auto& layer : plan.layers) {
    if (layer.name == "embedding") CHECK(layer.stage == 0);
    if (layer.name == "lm_head" || layer.name == "final_norm") CHECK(layer.stage == 1);
  }
}

TEST_CASE("a plan for another model or world is refused with every difference", "[runtime][composition]") {
  const auto plan = gpt_plan(4, 2, 2);
  const std::string e = error_of([&] { layout_from_plan(plan, 3, 8); });
  CHECK(e.find("the plan is for 4 ranks (pp=2 dp=2 tp=1), this job has 8") != std::string::npos);
  CHECK(e.find("the plan has 4 blocks, the model 3") != std::string::npos);

  auto reordered = plan;
  for (auto& layer : reordered.layers) {
    if (layer.name == "blocks.1") layer.stage = 1;
    if (layer.name == "blocks.2") layer.stage = 0;
  }
  const std::string e2 = error_of([&] { layout_from_plan(reordered, 4, 4, {"h.0", "h.1", "h.2", "h.3"}); });
  CHECK(e2.find("h.2 (stage 0) comes after h.1 (stage 1)") != std::string::npos);
}

TEST_CASE("hand layouts split blocks evenly and refuse impossible ones", "[runtime][composition]") {
  CHECK(even_block_stages(5, 2) == std::vector<int64_t>{0, 0, 0, 1, 1});
  CHECK(even_block_stages(4, 4) == std::vector<int64_t>{0, 1, 2, 3});
  CHECK_THROWS_WITH(even_block_stages(2, 3), Catch::Contains("2 blocks cannot fill 3 pipeline stages"));
  LayoutPins pins;
  pins.pp = 2;
  const Layout l = layout_from_pins(pins, 6, 8);
  CHECK(l.mesh.dp == 4);
  CHECK(l.schedule == planner::ScheduleKind::one_f_one_b);
  CHECK(l.block_stage == std::vector<int64_t>{0, 0, 0, 1, 1, 1});
  pins.pp = 3;
  CHECK_THROWS_WITH(layout_from_pins(pins, 6, 8), Catch::Contains("does not divide the world of 8 ranks"));
  pins.pp = 2;
  pins.block_stage = {0, 1, 1, 0, 1, 1};
  CHECK_THROWS_WITH(layout_from_pins(pins, 6, 8), Catch::Contains("stages may only be cut between consecutive blocks"));
  LayoutPins none;
  CHECK(layout_from_pins(none, 0, 2).block_stage.empty());  // no blocks: one stage, nothing to cut
}

TEST_CASE("the C++ frontend reads a Sequential: its blocks and how a plan differs from it",
          "[runtime][composition]") {
  torch::nn::Sequential model(torch::nn::Embedding(64, 32), torch::nn::Linear(32, 32), torch::nn::Linear(32, 32),
                              torch::nn::Linear(32, 32), torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})),
                              torch::nn::Linear(32, 64));
  const auto chain = chain_of(model);
  REQUIRE(chain.pieces.size() == 6);
  CHECK(chain.pieces[1].parameters[0].first == "1.weight");
  CHECK(find_blocks(chain) == std::vector<int64_t>{1, 2, 3});
  auto x = torch::randint(64, {2, 3});
  auto y = chain.pieces[0].forward(x);
  CHECK(y.sizes() == torch::IntArrayRef({2, 3, 32}));

  // The plan lists one layer per piece: parameter counts are compared layer by layer.
  const auto plan = gpt_plan(3, 1, 2);
  const auto diffs = plan_differences(plan, chain, find_blocks(chain));
  REQUIRE(!diffs.empty());
  bool embedding = false, block_params = false;
  for (const auto& d : diffs) {
    embedding |= d.find("layer 0 ") != std::string::npos;  // 64 x 32 in both
    block_params |= d.find("layer 1 (plan: blocks.0, model: 1) has " + std::to_string(plan.layers[1].params) +
                           " parameters in the plan, 1056 in the model") != std::string::npos;
  }
  CHECK_FALSE(embedding);
  CHECK(block_params);
}

// LibTorch nests a Sequential only through a subclass with a concrete forward.
struct BodyImpl : torch::nn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return SequentialImpl::forward(x); }
};
TORCH_MODULE(Body);

TEST_CASE("a body of blocks nested in a Sequential is opened, names kept", "[runtime][composition]") {
  Body body(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8), torch::nn::Linear(8, 8));
  torch::nn::Sequential model;
  model->push_back("embed", torch::nn::Embedding(16, 8));
  model->push_back("h", body);
  model->push_back("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
  model->push_back("head", torch::nn::Linear(8, 16));
  const auto chain = chain_of(model);
  REQUIRE(chain.pieces.size() == 6);
  CHECK(chain.pieces[2].name == "h.1");
  CHECK(chain.pieces[2].parameters[0].first == "h.1.weight");
  CHECK(find_blocks(chain) == std::vector<int64_t>{1, 2, 3});
  const at::Tensor tokens = torch::randint(16, {2, 3});
  at::Tensor x = tokens;
  for (const auto& p : chain.pieces) x = p.forward(x);
  CHECK(torch::equal(x, model->forward(tokens)));
}

TEST_CASE("each pipeline rank runs stages s with s % pp == its rank", "[runtime][composition]") {
  LayoutPins pins;
  pins.pp = 2;
  pins.virtual_stages = 2;
  pins.schedule = planner::ScheduleKind::interleaved_1f1b;
  const Layout l = layout_from_pins(pins, 4, 2);
  CHECK(l.stages_of(0) == std::vector<int64_t>{0, 2});
  CHECK(l.stages_of(1) == std::vector<int64_t>{1, 3});
}
