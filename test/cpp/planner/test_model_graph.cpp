#include "catch_compat.h"
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "monarch/planner/cluster.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/model_graph.h"
#include "test_configs.h"

using namespace monarch::planner;

TEST_CASE("transformer builder lays out embedding, blocks, norm, head", "[model_graph]") {
  TransformerConfig c = transformer_config(3, 64, 4, 32, 100, /*tied=*/true);
  const ModelGraph g = build_transformer(c);
  REQUIRE(g.layers.size() == 6);
  CHECK(g.layers[0].kind == LayerKind::embedding);
  CHECK(g.layers[1].name == "blocks.0");
  CHECK(g.layers[3].name == "blocks.2");
  CHECK(g.layers[4].kind == LayerKind::norm);
  CHECK(g.layers[5].kind == LayerKind::head);
  CHECK(g.layers[1].tp_dims.heads == 4);
  CHECK(g.layers[1].tp_dims.kv_heads == 4);
  CHECK(g.layers[1].tp_dims.ffn == 256);
  CHECK(g.layers[5].tp_dims.vocab == 100);
  // 12 h^2 + 4h per block; tied embedding counted once.
  const int64_t block = 12 * 64 * 64 + 4 * 64;
  CHECK(g.layers[1].params == block);
  CHECK(g.total_params() == 3 * block + 100 * 64 + 2 * 64);
  c.tied_embeddings = false;
  CHECK(build_transformer(c).total_params() == 3 * block + 2 * 100 * 64 + 2 * 64);
  // Forward FLOPs: 24 s h^2 + 4 s^2 h per block, 2 s h V for the logits.
  CHECK(g.layers[1].forward_flops_per_sample == Approx(24.0 * 32 * 64 * 64 + 4.0 * 32 * 32 * 64));
  CHECK(g.layers[5].forward_flops_per_sample == Approx(2.0 * 32 * 64 * 100));
  CHECK_FALSE(g.layers[5].recomputable);
}

TEST_CASE("bad hyperparameters name the field", "[model_graph][errors]") {
  TransformerConfig c = transformer_config(2, 100, 3, 8, 10);
  CHECK_THROWS_WITH(build_transformer(c), Catch::Contains("transformer.hidden") && Catch::Contains("heads=3"));
  c.hidden = 96; c.kv_heads = 2;
  CHECK_THROWS_WITH(build_transformer(c), Catch::Contains("transformer.kv_heads"));
  c.kv_heads = 0; c.layers = 0;
  CHECK_THROWS_WITH(build_transformer(c), Catch::Contains("transformer.layers: must be >= 1"));
}

TEST_CASE("pipeline cuts respect extra edges", "[model_graph]") {
  ModelGraph g;
  g.layers.resize(5);
  CHECK(g.can_cut_before(1));
  CHECK(g.can_cut_before(4));
  CHECK_FALSE(g.can_cut_before(0));
  CHECK_FALSE(g.can_cut_before(5));
  g.edges.push_back({1, 3});  // a skip connection over layer 2
  CHECK(g.can_cut_before(1));
  CHECK(g.can_cut_before(2) == false);
  CHECK(g.can_cut_before(3) == false);
  CHECK(g.can_cut_before(4));
}

TEST_CASE("cluster presets", "[cluster]") {
  const Cluster c = cluster_preset("a100-80gb", 1024);
  CHECK(c.nodes == 128);
  CHECK(c.devices_per_node == 8);
  CHECK(c.peak_flops(DType::bf16) == 312e12);
  CHECK(cluster_preset("h200-141gb", 8).device_memory_bytes == 141e9);
  CHECK(cluster_preset("a100-40gb", 4).devices_per_node == 4);
  CHECK_THROWS_WITH(cluster_preset("a100-80gb", 12), Catch::Contains("do not fill whole nodes"));
  CHECK_THROWS_WITH(cluster_preset("tpu", 8), Catch::Contains("unknown preset 'tpu'"));
  Cluster bad = c;
  bad.nodes = 0;
  CHECK_THROWS_WITH(validate(bad), Catch::Contains("cluster.nodes"));
}

TEST_CASE("hyperparameters whose counts overflow are refused naming the field",
          "[model_graph][errors]") {
  TransformerConfig c = transformer_config(2, 64, 4, 16, 100);
  // vocab * hidden and 4 * hidden used to overflow int64 silently.
  TransformerConfig wide = c;
  wide.hidden = 4000000000;
  CHECK_THROWS_WITH(
      build_transformer(wide),
      Catch::StartsWith("transformer.hidden: 4000000000 is too large: a block would hold"));
  wide.hidden = int64_t{1} << 62;  // 4 * hidden alone overflows
  CHECK_THROWS_WITH(build_transformer(wide), Catch::StartsWith("transformer.hidden:"));
  TransformerConfig big_vocab = c;
  big_vocab.vocab = int64_t{1} << 50;
  CHECK_THROWS_WITH(
      build_transformer(big_vocab),
      Catch::StartsWith("transformer.vocab: 1125899906842624 is too large: the embedding"));
  TransformerConfig big_ffn = c;
  big_ffn.ffn = int64_t{1} << 50;
  CHECK_THROWS_WITH(build_transformer(big_ffn), Catch::StartsWith("transformer.ffn:"));
  TransformerConfig deep = c;
  deep.layers = 200000000;  // used to allocate 200 M layers
  CHECK_THROWS_WITH(build_transformer(deep),
                    "transformer.layers: 200000000 is too large (at most 100000 blocks)");
  // Every block fits, the model does not.
  TransformerConfig many = c;
  many.layers = kMaxTransformerLayers;
  many.hidden = 1 << 17;
  many.heads = 1;
  CHECK_THROWS_WITH(build_transformer(many),
                    Catch::StartsWith("transformer.layers: 100000 is too large: the model"));
  // The largest sizes accepted build, and their counts are exact.
  TransformerConfig large = c;
  large.layers = kMaxTransformerLayers;
  const ModelGraph g = build_transformer(large);
  CHECK(g.layers.size() == kMaxTransformerLayers + 3);
  CHECK(g.total_params() ==
        kMaxTransformerLayers * (12 * 64 * 64 + 4 * 64) + 2 * 100 * 64 + 2 * 64);
}

TEST_CASE("validate(ModelGraph) names the broken field", "[model_graph][errors]") {
  TransformerConfig c = transformer_config(2, 64, 4, 16, 100, /*tied=*/true);
  const ModelGraph good = build_transformer(c);
  REQUIRE_NOTHROW(validate(good));
  auto field_of = [](const ModelGraph& g) -> std::string {
    try {
      validate(g);
    } catch (const ValidationError& e) {
      return e.field();
    }
    return "(accepted)";
  };
  ModelGraph g = good;
  g.layers.clear();
  CHECK(field_of(g) == "layers");
  g = good;
  g.layers[2].params = -1;
  CHECK(field_of(g) == "layers[2].params");
  g = good;
  g.layers[1].forward_flops_per_sample = std::nan("");
  CHECK(field_of(g) == "layers[1].forward_flops_per_sample");
  g = good;
  g.layers[1].activations.attention_scores = -5;
  CHECK(field_of(g) == "layers[1].activations.attention_scores");
  g = good;
  g.layers[3].output_bytes_per_sample = std::numeric_limits<double>::infinity();
  CHECK(field_of(g) == "layers[3].output_bytes_per_sample");
  g = good;
  g.layers[1].tp_dims.heads = -4;
  CHECK(field_of(g) == "layers[1].tp_dims.heads");
  g = good;
  g.layers[0].params = g.layers[1].params = kMaxParams - 1;  // each fits, the sum does not
  CHECK(field_of(g) == "layers");
  g = good;
  g.tied_groups[0][1] = 5;  // five layers: 0..4
  CHECK(field_of(g) == "tied_groups[0][1]");
  g.tied_groups[0] = {1, 1};
  CHECK(field_of(g) == "tied_groups[0][1]");
  g.tied_groups[0] = {};
  CHECK(field_of(g) == "tied_groups[0]");
  g = good;
  g.edges = {{0, 2}, {3, 1}};
  CHECK(field_of(g) == "edges[1]");
  g.edges = {{0, 7}};
  CHECK(field_of(g) == "edges[0]");
}

TEST_CASE("total_params refuses to overflow", "[model_graph][errors]") {
  ModelGraph g;
  g.layers.resize(2);
  g.layers[0].params = g.layers[1].params = INT64_MAX / 2 + 1;
  CHECK_THROWS_AS(g.total_params(), ValidationError);
}

TEST_CASE("cluster sizes whose world size overflows are refused", "[cluster][errors]") {
  Cluster c = cluster_preset("a100-80gb", 8);
  c.nodes = int64_t{1} << 61;  // x 8 devices overflows int64
  CHECK_THROWS_WITH(
      validate(c),
      Catch::StartsWith("cluster.nodes: 2305843009213693952 nodes x 8 devices exceed"));
  c.nodes = (kMaxWorldSize / 8) + 1;
  CHECK_THROWS_WITH(validate(c), Catch::StartsWith("cluster.nodes:"));
  c.nodes = kMaxWorldSize / 8;
  CHECK_NOTHROW(validate(c));
  c.nodes = 1;
  c.devices_per_node = kMaxWorldSize + 1;
  CHECK_THROWS_WITH(validate(c),
                    Catch::StartsWith("cluster.devices_per_node: must be in [1, 2147483648]"));
  CHECK_THROWS_WITH(cluster_preset("cpu", INT64_MAX),
                    Catch::StartsWith("cluster.devices: must be in [1, 2147483648]"));
  CHECK_THROWS_WITH(cluster_preset("a100-80gb", 0), Catch::StartsWith("cluster.devices"));
}

// ---- Mixture-of-Experts and attention shapes (transformer_builder.cpp) ----------------------

TEST_CASE("MoE builders match the published parameter counts, total and activated", "[model_graph][moe]") {
  // Published: Mixtral 8x7B 46.7B / 12.9B active (Jiang et al. 2024, Sec. 1); Mixtral 8x22B
  // 141B / 39B (Mistral AI, 2024-04-17 release); DeepSeek-V3 671B / 37B (technical report,
  // abstract); Qwen3-235B-A22B 235B / 22B (Qwen3 technical report, Table 2). The builder's
  // norms carry biases (4h per block, not RMSNorm's 2h) and Qwen3's q/k norms are left out:
  // well under 0.1% here. Active counts: 2% (the papers round to 0.1B-1B).
  struct Row { TransformerConfig config; double total, active; };
  const Row rows[] = {{mixtral_8x7b_config(), 46.7e9, 12.9e9},
                      {mixtral_8x22b_config(), 141e9, 39e9},
                      {deepseek_v3_config(), 671e9, 37e9},
                      {qwen3_235b_config(), 235e9, 22e9}};
  for (const Row& r : rows) {
    INFO(r.config.name);
    const ModelGraph g = build_transformer(r.config);
    CHECK(static_cast<double>(g.total_params()) == Approx(r.total).epsilon(0.005));
    CHECK(activated_params(g) == Approx(r.active).epsilon(0.02));
  }
  // DeepSeek-V3 block by block: 3 dense layers, then MoE layers holding 256 experts of
  // 3 x 7168 x 2048 weights, the shared one and the router.
  const ModelGraph ds = build_transformer(deepseek_v3_config());
  CHECK(ds.layers[3].moe.experts == 0);
  CHECK(ds.layers[4].moe.experts == 256);
  CHECK(ds.layers[4].moe.expert_params == 256LL * 3 * 7168 * 2048);
  CHECK(ds.layers[4].params == 187107328LL + 257LL * 3 * 7168 * 2048 + 7168LL * 256 + 4 * 7168);
  CHECK(ds.layers[3].params == 187107328LL + 3LL * 7168 * 18432 + 4 * 7168);
  // Routed FLOPs: top-8 experts per token, 2 x weights each.
  CHECK(ds.layers[4].moe.routed_flops_per_sample == Approx(2.0 * 4096 * 8 * 3 * 7168 * 2048));
  CHECK(ds.layers[4].moe.dispatch_bytes_per_sample == Approx(2.0 * 4096 * 7168 * 8));
}

TEST_CASE("MoE every N layers, head_dim and invalid MoE fields", "[model_graph][moe][errors]") {
  TransformerConfig c = mixtral_8x7b_config();
  c.moe.every = 2;
  c.moe.first_dense_layers = 1;
  const ModelGraph g = build_transformer(c);
  // layers[0] is the embedding: blocks.i is layers[i + 1].
  CHECK(g.layers[1].moe.experts == 0);
  CHECK(g.layers[2].moe.experts == 8);
  CHECK(g.layers[3].moe.experts == 0);
  CHECK(g.layers[4].moe.experts == 8);
  // Qwen3's heads x head_dim (8192) is twice its hidden size: q and o are 4096 x 8192.
  const ModelGraph q = build_transformer(qwen3_235b_config());
  const double attention = 4096.0 * 8192 * 2 + 2 * 4096.0 * 512;
  CHECK(q.layers[1].attention_flops_per_sample == Approx(4.0 * 4096 * 4096 * 8192));
  CHECK(q.layers[1].kv_elements_per_token == Approx(2 * 512));
  CHECK(static_cast<double>(q.layers[1].params) ==
        Approx(attention + 128.0 * 3 * 4096 * 1536 + 4096.0 * 128 + 4 * 4096));
  // A dense model's blocks are what they were (no MoE fields, k/v per token = 2 kv width).
  const ModelGraph dense = build_transformer(transformer_config(2, 64, 4, 16, 100));
  CHECK(dense.layers[1].moe.experts == 0);
  CHECK(dense.layers[1].kv_elements_per_token == Approx(128));

  auto refused = [](TransformerConfig bad, const char* field) {
    CHECK_THROWS_WITH(build_transformer(bad), Catch::Contains(field));
  };
  TransformerConfig bad = mixtral_8x7b_config();
  bad.moe.top_k = 9;
  refused(bad, "transformer.moe.top_k");
  bad = mixtral_8x7b_config();
  bad.moe.capacity_factor = 0.5;
  refused(bad, "transformer.moe.capacity_factor");
  bad = mixtral_8x7b_config();
  bad.moe.imbalance = 0.9;
  refused(bad, "transformer.moe.imbalance");
  bad = mixtral_8x7b_config();
  bad.moe.first_dense_layers = 32;
  refused(bad, "transformer.moe.first_dense_layers");
  bad = mixtral_8x7b_config();
  bad.head_dim = -1;
  refused(bad, "transformer.head_dim");
}
