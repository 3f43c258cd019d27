// Expert parallelism's engine from C++ (monarch/runtime/experts.h): on 2 ranks with ep=2, a MoE
// layer computed by plan_dispatch -> dispatch -> grouped_mlp -> combine equals a loop over the
// experts on all tokens in one process (outputs, input and weight gradients), dropless and
// under a capacity; bad routes are refused. The Python frontend's parity over whole models is
// test/python/test_experts.py.
#include "catch_with_torch.h"

#include <cmath>
#include <string>

#include <torch/torch.h>

#include "harness.h"
#include "monarch/runtime/device_mesh.h"
#include "monarch/runtime/experts.h"
#include "monarch/runtime/world.h"

namespace {

constexpr int64_t kTokensPerRank = 12, kHidden = 8, kFfn = 6, kExperts = 4, kTopK = 2;

struct Layer {
  at::Tensor x, index, weights, gate_up, down;  // every rank's tokens (all ranks make the same)
};

Layer make_layer(int ranks) {
  torch::manual_seed(11);
  Layer l;
  const int64_t tokens = kTokensPerRank * ranks;
  l.x = torch::randn({tokens, kHidden}, torch::kDouble);
  l.index = torch::stack({torch::randint(kExperts, {tokens}), torch::randint(kExperts, {tokens})}, 1);
  // Second choice differs from the first (as top-k gives).
  l.index.select(1, 1).copy_((l.index.select(1, 0) + 1 + l.index.select(1, 1) % (kExperts - 1)) % kExperts);
  l.weights = torch::rand({tokens, kTopK}, torch::kDouble);
  l.gate_up = torch::randn({kExperts, 2 * kFfn, kHidden}, torch::kDouble) * 0.3;
  l.down = torch::randn({kExperts, kHidden, kFfn}, torch::kDouble) * 0.3;
  return l;
}

// One process: each token's kept choices through their expert, weighted and summed. The
// capacity rule: choice-major, then token order, ceil(factor * tokens * top_k / experts).
at::Tensor reference(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights, const at::Tensor& gate_up,
                     const at::Tensor& down, double capacity_factor, int64_t* dropped) {
  const int64_t tokens = x.size(0);
  const int64_t capacity = static_cast<int64_t>(std::ceil(capacity_factor * tokens * kTopK / kExperts));
  std::vector<int64_t> used(kExperts, 0);
  auto out = torch::zeros_like(x);
  *dropped = 0;
  for (int64_t k = 0; k < kTopK; ++k) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t e = index[t][k].item<int64_t>();
      if (capacity_factor > 0 && used[e]++ >= capacity) {
        ++*dropped;
        continue;
      }
      auto h = torch::matmul(x[t], gate_up[e].t());
      auto parts = h.chunk(2, -1);
      auto y = torch::matmul(torch::silu(parts[0]) * parts[1], down[e].t());
      out[t] = out[t] + weights[t][k] * y;
    }
  }
  return out;
}

}  // namespace

namespace monarch::testing {

// Returns -1 when `scenario` is not an experts scenario.
int run_experts_worker(const std::string& scenario, const std::string& out) {
  if (scenario.rfind("experts:", 0) != 0) return -1;
  const double capacity = std::stod(scenario.substr(std::string("experts:").size()));
  torch::set_num_threads(1);
  auto world = World::init(InitOptions{});
  planner::Mesh shape;
  shape.dp = world->size();
  shape.ep = world->size();
  DeviceMesh mesh(world, shape);
  const Layer l = make_layer(world->size());
  const int64_t r = world->rank();
  auto mine = [&](const at::Tensor& t) { return t.narrow(0, r * kTokensPerRank, kTokensPerRank); };
  auto x = mine(l.x).clone().requires_grad_();
  auto weights = mine(l.weights).clone().requires_grad_();
  const int64_t local = kExperts / world->size();
  auto gate_up = l.gate_up.narrow(0, r * local, local).clone().requires_grad_();
  auto down = l.down.narrow(0, r * local, local).clone().requires_grad_();

  experts::DispatchOptions options;
  options.num_experts = kExperts;
  options.capacity_factor = capacity;
  const auto route = experts::plan_dispatch(mine(l.index), options, mesh.group("ep"), &mesh.group("dp"));
  auto rows = experts::dispatch(x, route);
  auto y = experts::combine(experts::grouped_mlp(rows, route.rows_per_local_expert, gate_up, down, "silu"), weights,
                            route);
  y.pow(2).sum().backward();  // a loss whose gradient differs per element

  std::vector<at::Tensor> saved{y.detach(), x.grad(), weights.grad(), gate_up.grad(), down.grad(),
                                torch::tensor({route.dropped_slots, route.capacity})};
  // Bad routes: an expert outside the layer; experts that do not split over ep.
  std::string outside, uneven;
  try {
    experts::plan_dispatch(torch::full({2, kTopK}, kExperts, torch::kLong), options, mesh.group("ep"));
  } catch (const c10::Error& e) {
    outside = e.what_without_backtrace();
  }
  try {
    experts::DispatchOptions three = options;
    three.num_experts = 3;
    experts::plan_dispatch(torch::zeros({2, kTopK}, torch::kLong), three, mesh.group("ep"));
  } catch (const c10::Error& e) {
    uneven = e.what_without_backtrace();
  }
  saved.push_back(torch::tensor(std::vector<int64_t>(outside.begin(), outside.end())));
  saved.push_back(torch::tensor(std::vector<int64_t>(uneven.begin(), uneven.end())));
  torch::save(saved, out);
  return 0;
}

}  // namespace monarch::testing

TEST_CASE("C++ expert parallelism: a MoE layer on ep=2 equals the loop over experts", "[runtime][experts]") {
  for (double capacity : {0.0, 0.75}) {
    INFO("capacity_factor " << capacity);
    const auto r = monarch::testing::launch_ranks(2, "experts:" + std::to_string(capacity), std::chrono::seconds(120));
    INFO(r.describe());
    REQUIRE(r.all_ok());
    const Layer l = make_layer(2);
    auto x = l.x.clone().requires_grad_();
    auto weights = l.weights.clone().requires_grad_();
    auto gate_up = l.gate_up.clone().requires_grad_();
    auto down = l.down.clone().requires_grad_();
    int64_t dropped = 0;
    auto want = reference(x, l.index, weights, gate_up, down, capacity, &dropped);
    want.pow(2).sum().backward();
    if (capacity > 0) CHECK(dropped > 0);  // the capacity is tight enough to drop slots
    int64_t dropped_total = 0;
    for (int rank = 0; rank < 2; ++rank) {
      std::vector<at::Tensor> got;
      torch::load(got, r.output_dir + "/rank" + std::to_string(rank) + ".pt");
      REQUIRE(got.size() == 8);
      auto rows = [&](const at::Tensor& t) { return t.narrow(0, rank * kTokensPerRank, kTokensPerRank); };
      auto experts = [&](const at::Tensor& t) { return t.narrow(0, rank * kExperts / 2, kExperts / 2); };
      // fp64: only the order of sums differs, 1e-12 is a real bound.
      CHECK(torch::allclose(got[0], rows(want.detach()), 1e-12, 1e-12));
      CHECK(torch::allclose(got[1], rows(x.grad()), 1e-12, 1e-12));
      CHECK(torch::allclose(got[2], rows(weights.grad()), 1e-12, 1e-12));
      CHECK(torch::allclose(got[3], experts(gate_up.grad()), 1e-12, 1e-12));
      CHECK(torch::allclose(got[4], experts(down.grad()), 1e-12, 1e-12));
      dropped_total += got[5][0].item<int64_t>();
      if (capacity > 0) CHECK(got[5][1].item<int64_t>() == static_cast<int64_t>(std::ceil(capacity * 24 * 2 / 4)));
      const auto text = [](const at::Tensor& t) {
        std::string s;
        for (int64_t i = 0; i < t.numel(); ++i) s.push_back(static_cast<char>(t[i].item<int64_t>()));
        return s;
      };
      CHECK_THAT(text(got[6]), Catch::Matchers::Contains("names expert 4, outside [0, 4)"));
      CHECK_THAT(text(got[7]), Catch::Matchers::Contains("3 experts do not split over an ep group of 2 ranks"));
    }
    CHECK(dropped_total == dropped);
  }
}
