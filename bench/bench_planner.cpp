// Planner benchmark: how long planning takes (median of several single-threaded runs) and
// what the planner predicts for the published GPT-3 175B run it is calibrated against.
// Prints a table and writes JSON (default bench/results/planner.json, or argv[1]).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "monarch/planner/cluster.h"
#include "monarch/planner/embeddings.h"
#include "monarch/planner/model_graph.h"
#include "monarch/planner/search.h"

namespace mp = monarch::planner;

namespace {

struct Case {
  std::string name;
  mp::TransformerConfig model;
  std::string cluster;
  int64_t gpus;
  int64_t global_batch;
};

mp::TransformerConfig gpt(const char* name, int64_t layers, int64_t hidden, int64_t heads) {
  mp::TransformerConfig c;
  c.name = name;
  c.layers = layers;
  c.hidden = hidden;
  c.heads = heads;
  c.seq = 2048;
  c.vocab = 51200;
  return c;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string out_path = argc > 1 ? argv[1] : "bench/results/planner.json";
  const int runs = 7;
  // Narayanan et al. 2021, Table 1: GPT-3 175B and the 1T model (128 layers, h=25600,
  // 160 heads) with the batch sizes they trained with.
  const std::vector<Case> cases = {
      {"gpt3-175b", gpt("gpt3-175b", 96, 12288, 96), "a100-80gb", 1024, 1536},
      {"gpt-1t", gpt("gpt-1t", 128, 25600, 160), "a100-80gb", 3072, 3072},
  };

  std::string json = "{\n  \"runs_per_case\": " + std::to_string(runs) + ",\n  \"planning\": [\n";
  std::printf("%-10s %6s %10s %10s %10s  %-45s %9s %7s\n", "model", "gpus", "median_s", "min_s",
              "max_s", "plan", "TFLOP/s", "MFU");
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    const mp::ModelGraph graph = mp::build_transformer(c.model);
    const mp::Cluster cluster = mp::cluster_preset(c.cluster, c.gpus);
    mp::TrainingConfig training;
    training.global_batch = c.global_batch;
    std::vector<double> seconds;
    mp::Plan plan;
    for (int r = 0; r < runs; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      plan = mp::search(graph, cluster, training);
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const double med = median(seconds);
    const double lo = *std::min_element(seconds.begin(), seconds.end());
    const double hi = *std::max_element(seconds.begin(), seconds.end());
    std::printf("%-10s %6lld %10.4f %10.4f %10.4f  %-45s %9.1f %6.1f%%\n", c.name.c_str(),
                static_cast<long long>(c.gpus), med, lo, hi, plan.summary().c_str(),
                plan.prediction.tflops_per_device, 100 * plan.prediction.mfu);
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "    {\"model\": \"%s\", \"gpus\": %lld, \"cluster\": \"%s\", \"global_batch\": %lld, "
                  "\"median_s\": %.6f, \"min_s\": %.6f, \"max_s\": %.6f, \"plan\": \"%s\", "
                  "\"tflops_per_device\": %.3f, \"mfu\": %.4f}%s\n",
                  c.name.c_str(), static_cast<long long>(c.gpus), c.cluster.c_str(),
                  static_cast<long long>(c.global_batch), med, lo, hi,
                  json_escape(plan.summary()).c_str(), plan.prediction.tflops_per_device,
                  plan.prediction.mfu, ci + 1 < cases.size() ? "," : "");
    json += buf;
  }
  json += "  ],\n";

  // Calibration: Narayanan et al. 2021, Table 2 (PTD-P vs ZeRO-3): GPT-3 175B, batch 1536,
  // 384 A100s, t=8, p=12: 153 TFLOP/s per GPU.
  const mp::ModelGraph gpt3 = mp::build_transformer(cases[0].model);
  const mp::Cluster c384 = mp::cluster_preset("a100-80gb", 384);
  mp::TrainingConfig training;
  training.global_batch = 1536;
  mp::Pins pins;
  pins.tp = 8;
  pins.pp = 12;
  pins.dp = 4;
  pins.zero_stage = 0;
  pins.micro_batch_size = 1;
  pins.schedule = mp::ScheduleKind::one_f_one_b;
  pins.recompute = mp::Recompute::full;
  pins.sequence_parallel = false;
  const mp::Plan pinned = mp::evaluate_layout(gpt3, c384, training, pins);
  const mp::Plan free_plan = mp::search(gpt3, c384, training);
  const double paper = 153.0;
  std::printf("\ncalibration: GPT-3 175B, batch 1536, 384 x a100-80gb (Narayanan et al. 2021 Table 2: %.0f TFLOP/s)\n", paper);
  std::printf("  %-8s %-55s %9s %8s %10s\n", "layout", "plan", "TFLOP/s", "vs paper", "memory GiB");
  for (const auto* p : {&pinned, &free_plan}) {
    std::printf("  %-8s %-55s %9.1f %+7.1f%% %10.1f\n", p == &pinned ? "pinned" : "searched",
                p->summary().c_str(), p->prediction.tflops_per_device,
                100 * (p->prediction.tflops_per_device / paper - 1),
                p->prediction.memory_bytes_per_device / (1024.0 * 1024 * 1024));
  }
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "  \"calibration\": {\"paper_tflops_per_device\": %.1f,\n"
                "    \"pinned\": {\"plan\": \"%s\", \"tflops_per_device\": %.3f, \"memory_bytes\": %.0f},\n"
                "    \"searched\": {\"plan\": \"%s\", \"tflops_per_device\": %.3f, \"memory_bytes\": %.0f}}\n}\n",
                paper, json_escape(pinned.summary()).c_str(), pinned.prediction.tflops_per_device,
                pinned.prediction.memory_bytes_per_device, json_escape(free_plan.summary()).c_str(),
                free_plan.prediction.tflops_per_device, free_plan.prediction.memory_bytes_per_device);
  json += buf;

  // Embedding tables: 1000 tables of power-law sizes (1k to 200M rows, dims 32 to 128,
  // pooling factors 1 to 30) on 128 A100s, batch 512 per rank.
  {
    std::vector<mp::EmbeddingTable> tables;
    for (int i = 0; i < 1000; ++i) {
      mp::EmbeddingTable t;
      t.name = "t" + std::to_string(i);
      t.rows = 1000 + static_cast<int64_t>(2e8 / ((i + 1) * (i + 1) / 4.0 + 1));
      t.dim = 32 * (1 + i % 4);
      t.features = {t.name};
      t.pooling_factor = 1 + i % 30;
      tables.push_back(t);
    }
    mp::EmbeddingOptions options;
    options.world_size = 128;
    options.batch_per_rank = 512;
    options.optimizer = mp::EmbeddingOptimizer::rowwise_adagrad;
    const mp::Cluster c128 = mp::cluster_preset("a100-80gb", 128);
    std::vector<double> times;
    mp::EmbeddingPlan plan;
    for (int r = 0; r < runs; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      plan = mp::plan_embeddings(tables, c128, options);
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const double gap = plan.max_rank_s / plan.lower_bound_s - 1;
    std::printf("\nembedding tables: 1000 on 128 x a100-80gb: planned in %.3f s (median of %d), most loaded rank "
                "%.2f ms, %.1f%% above the lower bound\n", median(times), runs, plan.max_rank_s * 1e3, 100 * gap);
    json.pop_back();  // the closing brace and newline of the object written above
    json.pop_back();
    char ebuf[512];
    std::snprintf(ebuf, sizeof ebuf,
                  ",\n  \"embeddings\": {\"tables\": 1000, \"ranks\": 128, \"median_s\": %.6f, "
                  "\"max_rank_s\": %.6f, \"lower_bound_s\": %.6f}\n}\n",
                  median(times), plan.max_rank_s, plan.lower_bound_s);
    json += ebuf;
  }
  std::ofstream f(out_path);
  if (!f) {
    std::cerr << "bench_planner: cannot write " << out_path << "\n";
    return 1;
  }
  f << json;
  std::cout << "\nwrote " << out_path << "\n";
  return 0;
}
