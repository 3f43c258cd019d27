#include <catch2/catch.hpp>

#include "monarch/planner/errors.h"
#include "monarch/planner/cluster.h"
#include "monarch/planner/model_graph.h"

using namespace monarch::planner;

TEST_CASE("transformer builder lays out embedding, blocks, norm, head", "[model_graph]") {
  TransformerConfig c;
  c.layers = 3; c.hidden = 64; c.heads = 4; c.seq = 32; c.vocab = 100; c.tied_embeddings = true;
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
  TransformerConfig c;
  c.layers = 2; c.hidden = 100; c.heads = 3; c.seq = 8; c.vocab = 10;
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
