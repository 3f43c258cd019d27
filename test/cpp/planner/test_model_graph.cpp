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
