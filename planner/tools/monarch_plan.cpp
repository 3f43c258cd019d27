// monarch-plan: plan, score, show and validate parallel layouts from the command line.
// Every error is one line on stderr and a non-zero exit status.
#include <cstdlib>
#include <fstream>
#include <cstdio>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "monarch/planner/cluster.h"
#include "monarch/planner/embeddings.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/estimator.h"
#include "monarch/planner/model_graph.h"
#include "monarch/planner/plan.h"
#include "monarch/planner/measured_trace.h"
#include "monarch/planner/report.h"
#include "monarch/planner/report_html.h"
#include "monarch/planner/schedule.h"
#include "monarch/planner/search.h"

namespace mp = monarch::planner;

namespace {

const char* kUsage = R"(usage:
  monarch-plan transformer --layers L --hidden H --heads A --seq S --vocab V
                           --global-batch B --gpus N [--cluster a100-80gb] [-o plan.json]
                           [--kv-heads K] [--ffn F] [--gated-mlp] [--tied-embeddings]
                           [--dtype bf16] [--name NAME]
                           [--tp T] [--pp P] [--dp D] [--zero Z] [--micro-batch M]
                           [--schedule gpipe|1f1b|interleaved_1f1b|zb_h1|zbv] [--virtual-stages V]
                           [--recompute none|selective|full] [--sequence-parallel on|off]
                           [--attention flash|materialized] [--fused-kernels on|off] [--dropout on|off]
                           [--alternatives N] [--json]
                           [--profile profile.json] [--tie-tolerance T]
                           [--hierarchical-dp on|off] [--inter-node-compression none|bf16|int8]
                           [--head-dim D] [--attention-params N] [--cp C] [--ep E]
                           [--experts E --top-k K [--expert-ffn F] [--shared-experts S]
                            [--first-dense-layers N] [--moe-every N] [--capacity-factor C]
                            [--moe-imbalance I]]
                           [--mode training|inference --batch B --prompt-len P
                            --max-new-tokens N [--objective latency|throughput]
                            [--latency-target-ms T] [--max-batch M] [--hbm-efficiency E]]
      Plans the model (or, with --tp --pp --dp --zero --micro-batch --schedule all given,
      scores exactly that layout) and prints a summary; -o writes the plan as JSON.
      --profile: per-layer times measured on the machine (torch_monarch.profile) instead
      of the analytic model's; --tie-tolerance: layouts within this fraction of the
      fastest are tied and the simplest wins (default 0.05, 0 = always the fastest).
      --hierarchical-dp: may reduce dp in two levels where a dp group spans nodes with
      several ranks on each (default on); --inter-node-compression: the lossy compression
      its inter-node hop may use when faster (default none).
      --fused-kernels: activations as fused kernels keep them (Megatron-LM / Transformer
      Engine, the default) or as eager PyTorch ops do (off); --dropout off: a model without
      dropout (Llama-style), whose blocks keep no masks (docs/cost_model.md, "Memory").
      --mode inference: plans generation instead of training (docs/cost_model.md,
      "Inference"): tp x pp with dp replicas for the lowest per-token latency at batch B
      (--objective latency, the default without --latency-target-ms) or the most tokens/s
      (--objective throughput, the default with it; batch per replica up to --max-batch,
      default 256) with per-token latency under T ms. --seq defaults to P + N;
      --global-batch is not used; --tp / --pp pin; --tie-tolerance (default 0.03).
  monarch-plan show plan.json       print the summary of a saved plan
  monarch-plan report plan.json -o plan.html [--trace trace.json] [--trace-step K]
      one self-contained HTML page: mesh, pipeline timeline, memory per rank, step
      time and traffic, alternatives; --trace draws a run's measured step (the
      Chrome trace model.trace() writes) under the predicted one
  monarch-plan diff a.json b.json   what differs between two plans
  monarch-plan validate plan.json   check a plan; exit 0 if valid
  monarch-plan schedule --schedule 1f1b --pp P --micro-batches M [--virtual-stages V]
      print each pipeline rank's action list
  monarch-plan embeddings tables.json --gpus N --batch-per-rank B [--cluster a100-80gb]
                           [--optimizer sgd|rowwise_adagrad|adam] [--table NAME=SHARDING ...]
                           [--memory-budget-gib G] [-o embeddings.json] [--json]
      Shards embedding tables (data_parallel, table_wise, row_wise, column_wise,
      table_row_wise) over N ranks; --table pins one table (repeatable).
  monarch-plan presets              list cluster presets
)";

// Thrown for command-line mistakes (exit status 2).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Args {
 public:
  Args(int argc, char** argv, int start, const std::vector<std::string>& flags,
       const std::vector<std::string>& switches) {
    for (int i = start; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "-o") a = "--output";
      if (is_in(a, switches)) {
        values_[a] = "on";
      } else if (is_in(a, flags)) {
        if (i + 1 >= argc) throw UsageError(a + ": missing value");
        values_[a] = argv[++i];
      } else if (a.rfind("--", 0) == 0) {
        throw UsageError("unknown option '" + a + "'");
      } else {
        positional_.push_back(a);
      }
    }
  }
  bool has(const std::string& f) const { return values_.count(f) > 0; }
  std::string str(const std::string& f, const std::string& fallback = "") const {
    auto it = values_.find(f);
    return it == values_.end() ? fallback : it->second;
  }
  std::optional<int64_t> integer(const std::string& f) const {
    auto it = values_.find(f);
    if (it == values_.end()) return std::nullopt;
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(it->second, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != it->second.size() || it->second.empty()) {
      throw UsageError(f + ": expected an integer, got '" + it->second + "'");
    }
    return v;
  }
  int64_t required(const std::string& f) const {
    auto v = integer(f);
    if (!v) throw UsageError(f + " is required");
    return *v;
  }
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  static bool is_in(const std::string& a, const std::vector<std::string>& list) {
    for (const auto& x : list) if (x == a) return true;
    return false;
  }
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

bool on_off(const std::string& flag, const std::string& value) {
  if (value == "on" || value == "true" || value == "1") return true;
  if (value == "off" || value == "false" || value == "0") return false;
  throw UsageError(flag + ": expected on or off, got '" + value + "'");
}

template <typename Number>
int run_inference(const Args& args, const mp::ModelGraph& graph, const mp::Cluster& cluster, Number number) {
  for (const char* flag : {"--global-batch", "--dp", "--zero", "--micro-batch", "--schedule", "--virtual-stages",
                           "--recompute", "--sequence-parallel", "--profile", "--cp", "--ep",
                           "--hierarchical-dp", "--inter-node-compression"}) {
    if (args.has(flag)) throw UsageError(std::string(flag) + " is a training option (not with --mode inference)");
  }
  mp::InferenceConfig config;
  config.batch = args.required("--batch");
  config.prompt_len = args.required("--prompt-len");
  config.max_new_tokens = args.required("--max-new-tokens");
  config.latency_target_s = number("--latency-target-ms", 0.0) / 1000.0;
  config.max_batch = args.integer("--max-batch").value_or(0);
  config.hbm_efficiency = number("--hbm-efficiency", config.hbm_efficiency);
  const std::string objective =
      args.str("--objective", config.latency_target_s > 0 || args.has("--max-batch") ? "throughput" : "latency");
  config.objective = mp::inference_objective_from_string(objective, "--objective");
  if (config.objective == mp::InferenceObjective::latency && args.has("--latency-target-ms")) {
    throw UsageError("--latency-target-ms: a target bounds the throughput objective (--objective throughput)");
  }
  mp::InferenceOptions options;
  options.tp = args.integer("--tp").value_or(0);
  options.pp = args.integer("--pp").value_or(0);
  options.alternatives = args.integer("--alternatives").value_or(5);
  options.tie_tolerance = number("--tie-tolerance", options.tie_tolerance);
  const mp::Plan plan = mp::plan_inference(graph, cluster, config, options);
  if (args.has("--json")) {
    std::cout << mp::to_json(plan) << "\n";
  } else {
    std::cout << mp::format_report(plan);
  }
  if (args.has("--output")) {
    mp::save_plan(plan, args.str("--output"));
    if (!args.has("--json")) std::cout << "\nwrote " << args.str("--output") << "\n";
  }
  return 0;
}

int cmd_transformer(int argc, char** argv) {
  const Args args(argc, argv, 2,
                  {"--layers", "--hidden", "--heads", "--kv-heads", "--ffn", "--seq", "--vocab",
                   "--dtype", "--name", "--global-batch", "--gpus", "--cluster", "--output",
                   "--tp", "--pp", "--dp", "--zero", "--micro-batch", "--schedule",
                   "--virtual-stages", "--recompute", "--sequence-parallel", "--alternatives", "--attention",
                   "--profile", "--tie-tolerance", "--hierarchical-dp", "--inter-node-compression",
                   "--head-dim", "--attention-params", "--cp", "--ep", "--experts", "--top-k", "--expert-ffn",
                   "--shared-experts", "--first-dense-layers", "--moe-every", "--capacity-factor",
                   "--moe-imbalance", "--mode", "--batch", "--prompt-len", "--max-new-tokens",
                   "--objective", "--latency-target-ms", "--max-batch", "--hbm-efficiency", "--fused-kernels",
                   "--dropout"},
                  {"--gated-mlp", "--tied-embeddings", "--json"});
  if (!args.positional().empty()) throw UsageError("unexpected argument '" + args.positional()[0] + "'");
  mp::TransformerConfig tc;
  tc.layers = args.required("--layers");
  tc.hidden = args.required("--hidden");
  tc.heads = args.required("--heads");
  tc.kv_heads = args.integer("--kv-heads").value_or(0);
  tc.ffn = args.integer("--ffn").value_or(0);
  const std::string mode = args.str("--mode", "training");
  if (mode != "training" && mode != "inference") {
    throw UsageError("--mode: expected training or inference, got '" + mode + "'");
  }
  const bool inference = mode == "inference";
  if (inference) {
    if (!args.has("--seq")) {
      tc.seq = args.required("--prompt-len") + args.required("--max-new-tokens");
    } else {
      tc.seq = args.required("--seq");
    }
  } else {
    for (const char* flag : {"--batch", "--prompt-len", "--max-new-tokens", "--objective", "--latency-target-ms",
                             "--max-batch", "--hbm-efficiency"}) {
      if (args.has(flag)) throw UsageError(std::string(flag) + " needs --mode inference");
    }
    tc.seq = args.required("--seq");
  }
  tc.vocab = args.required("--vocab");
  tc.gated_mlp = args.has("--gated-mlp");
  tc.tied_embeddings = args.has("--tied-embeddings");
  tc.dtype = mp::dtype_from_string(args.str("--dtype", "bf16"), "--dtype");
  tc.attention = mp::attention_kernel_from_string(args.str("--attention", "flash"), "--attention");
  if (args.has("--fused-kernels")) tc.fused_kernels = on_off("--fused-kernels", args.str("--fused-kernels"));
  if (args.has("--dropout")) tc.dropout = on_off("--dropout", args.str("--dropout"));
  tc.name = args.str("--name", "transformer");
  tc.head_dim = args.integer("--head-dim").value_or(0);
  tc.attention_params = args.integer("--attention-params").value_or(0);
  tc.moe.experts = args.integer("--experts").value_or(0);
  tc.moe.top_k = args.integer("--top-k").value_or(0);
  tc.moe.expert_ffn = args.integer("--expert-ffn").value_or(0);
  tc.moe.shared_experts = args.integer("--shared-experts").value_or(0);
  tc.moe.first_dense_layers = args.integer("--first-dense-layers").value_or(0);
  tc.moe.every = args.integer("--moe-every").value_or(1);
  auto number = [&](const char* flag, double fallback) {
    if (!args.has(flag)) return fallback;
    const std::string text = args.str(flag);
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0') throw UsageError(std::string(flag) + ": expected a number, got '" + text + "'");
    return v;
  };
  tc.moe.capacity_factor = number("--capacity-factor", 0.0);
  tc.moe.imbalance = number("--moe-imbalance", 1.0);
  const mp::ModelGraph graph = mp::build_transformer(tc);

  const mp::Cluster cluster = mp::cluster_preset(args.str("--cluster", "a100-80gb"), args.required("--gpus"));
  if (inference) return run_inference(args, graph, cluster, number);
  mp::TrainingConfig training;
  training.global_batch = args.required("--global-batch");
  training.compute_dtype = tc.dtype;
  if (args.has("--hierarchical-dp")) {
    training.allow_hierarchical_dp = on_off("--hierarchical-dp", args.str("--hierarchical-dp"));
  }
  if (args.has("--inter-node-compression")) {
    training.inter_node_compression =
        mp::compression_from_string(args.str("--inter-node-compression"), "--inter-node-compression");
  }

  mp::Pins pins;
  pins.tp = args.integer("--tp");
  pins.pp = args.integer("--pp");
  pins.dp = args.integer("--dp");
  pins.cp = args.integer("--cp");
  pins.ep = args.integer("--ep");
  pins.zero_stage = args.integer("--zero");
  pins.micro_batch_size = args.integer("--micro-batch");
  pins.virtual_stages = args.integer("--virtual-stages");
  if (args.has("--schedule")) pins.schedule = mp::schedule_from_string(args.str("--schedule"), "--schedule");
  if (args.has("--recompute")) pins.recompute = mp::recompute_from_string(args.str("--recompute"), "--recompute");
  if (args.has("--sequence-parallel")) {
    pins.sequence_parallel = on_off("--sequence-parallel", args.str("--sequence-parallel"));
  }

  std::optional<mp::ProfileEstimator> profile;
  if (args.has("--profile")) profile.emplace(mp::load_profile(args.str("--profile")));
  const mp::Estimator* estimator = profile ? &*profile : nullptr;

  mp::Plan plan;
  mp::SearchStats stats;
  const bool scoring = pins.all_layout_pinned();
  if (scoring) {
    plan = mp::evaluate_layout(graph, cluster, training, pins, /*allow_over_memory=*/true, estimator);
  } else {
    mp::SearchOptions options;
    options.pins = pins;
    options.alternatives = args.integer("--alternatives").value_or(5);
    options.stats = &stats;
    options.estimator = estimator;
    if (args.has("--tie-tolerance")) {
      const std::string text = args.str("--tie-tolerance");
      char* end = nullptr;
      options.tie_tolerance = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0') throw UsageError("--tie-tolerance: expected a number, got '" + text + "'");
    }
    plan = mp::search(graph, cluster, training, options);
  }
  if (args.has("--json")) {
    std::cout << mp::to_json(plan) << "\n";
  } else {
    std::cout << (scoring ? "scoring the pinned layout\n\n" : "") << mp::format_report(plan);
    if (!scoring) {
      std::cout << "\nsearched " << stats.considered << " layouts: " << stats.pruned
                << " cut by the step-time bound, " << stats.over_memory << " over memory, "
                << stats.scored << " scored by simulating their schedule\n";
    }
  }
  if (args.has("--output")) {
    mp::save_plan(plan, args.str("--output"));
    if (!args.has("--json")) std::cout << "\nwrote " << args.str("--output") << "\n";
  }
  if (plan.prediction.memory_bytes_per_device > cluster.usable_memory_bytes()) {
    std::cerr << "monarch-plan: error: the pinned layout needs "
              << mp::format_bytes(plan.prediction.memory_bytes_per_device) << " per device, "
              << mp::format_bytes(cluster.usable_memory_bytes()) << " usable\n";
    return 1;
  }
  return 0;
}

std::string single_path(int argc, char** argv, const char* what) {
  const Args args(argc, argv, 2, {}, {});
  if (args.positional().size() != 1) throw UsageError(std::string(what) + " needs exactly one plan file");
  return args.positional()[0];
}

int cmd_show(int argc, char** argv) {
  std::cout << mp::format_report(mp::load_plan(single_path(argc, argv, "show")));
  return 0;
}

int cmd_report(int argc, char** argv) {
  const Args args(argc, argv, 2, {"--output", "--trace", "--trace-step", "--title"}, {});
  if (args.positional().size() != 1) throw UsageError("report needs exactly one plan file");
  if (!args.has("--output")) throw UsageError("report needs -o FILE.html");
  const mp::Plan plan = mp::load_plan(args.positional()[0]);
  mp::HtmlReportOptions options;
  if (args.has("--trace")) options.trace = mp::load_measured_trace(args.str("--trace"));
  options.trace_step = args.integer("--trace-step").value_or(-1);
  options.title = args.str("--title");
  mp::save_html_report(plan, args.str("--output"), options);
  std::cout << "wrote " << args.str("--output") << "\n";
  return 0;
}

int cmd_diff(int argc, char** argv) {
  const Args args(argc, argv, 2, {}, {});
  if (args.positional().size() != 2) throw UsageError("diff needs exactly two plan files");
  std::cout << "--- " << args.positional()[0] << "\n+++ " << args.positional()[1] << "\n"
            << mp::diff_plans(mp::load_plan(args.positional()[0]), mp::load_plan(args.positional()[1]));
  return 0;
}

int cmd_validate(int argc, char** argv) {
  const std::string path = single_path(argc, argv, "validate");
  const mp::Plan plan = mp::load_plan(path);  // parses and validates
  std::cout << path << ": valid plan (" << plan.summary() << ")\n";
  return 0;
}

int cmd_schedule(int argc, char** argv) {
  const Args args(argc, argv, 2, {"--schedule", "--pp", "--micro-batches", "--virtual-stages"}, {});
  const auto kind = mp::schedule_from_string(args.str("--schedule", "1f1b"), "--schedule");
  const mp::Schedule s = mp::make_schedule(kind, args.required("--pp"), args.required("--micro-batches"),
                                           args.integer("--virtual-stages").value_or(
                                               kind == mp::ScheduleKind::zero_bubble_v ? 2 : 1));
  mp::check_schedule(s);
  const auto sim = mp::simulate(s, {mp::StageCosts{}});
  for (size_t r = 0; r < s.per_rank.size(); ++r) {
    std::cout << "rank " << r << ":";
    for (const auto& a : s.per_rank[r]) {
      if (a.type == mp::ActionType::forward) std::cout << " F" << a.micro_batch << "." << a.stage;
      if (a.type == mp::ActionType::backward) std::cout << " B" << a.micro_batch << "." << a.stage;
      if (a.type == mp::ActionType::backward_input) std::cout << " Bi" << a.micro_batch << "." << a.stage;
      if (a.type == mp::ActionType::backward_weight) std::cout << " W" << a.micro_batch << "." << a.stage;
    }
    std::cout << "\n";
  }
  std::cout << "bubble fraction (F = Bi = W = 1): " << sim.bubble_fraction << "\n";
  return 0;
}

int cmd_embeddings(int argc, char** argv) {
  // --table may repeat: collected first, the rest parsed as usual.
  std::map<std::string, mp::EmbeddingSharding> pins;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::string(argv[i]) == "--table") {
      if (i + 1 >= argc) throw UsageError("--table: missing value");
      const std::string pin = argv[++i];
      const auto eq = pin.find('=');
      if (eq == std::string::npos || eq == 0) throw UsageError("--table: expected NAME=SHARDING, got '" + pin + "'");
      pins[pin.substr(0, eq)] = mp::embedding_sharding_from_string(pin.substr(eq + 1), "--table " + pin.substr(0, eq));
      continue;
    }
    rest.push_back(argv[i]);
  }
  const Args args(static_cast<int>(rest.size()), rest.data(), 2,
                  {"--gpus", "--batch-per-rank", "--cluster", "--optimizer", "--memory-budget-gib", "--output"},
                  {"--json"});
  if (args.positional().size() != 1) throw UsageError("embeddings needs exactly one tables file");
  std::ifstream in(args.positional()[0]);
  if (!in) throw UsageError("cannot read '" + args.positional()[0] + "'");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto tables = mp::embedding_tables_from_json(text);
  const int64_t gpus = args.required("--gpus");
  const mp::Cluster cluster = mp::cluster_preset(args.str("--cluster", "a100-80gb"), gpus);
  mp::EmbeddingOptions options;
  options.world_size = gpus;
  options.batch_per_rank = args.required("--batch-per-rank");
  options.optimizer = mp::embedding_optimizer_from_string(args.str("--optimizer", "sgd"), "--optimizer");
  if (args.has("--memory-budget-gib")) {
    try {
      options.memory_budget_bytes = std::stod(args.str("--memory-budget-gib")) * 1024.0 * 1024 * 1024;
    } catch (const std::exception&) {
      throw UsageError("--memory-budget-gib: expected a number, got '" + args.str("--memory-budget-gib") + "'");
    }
  }
  options.pins = pins;
  const mp::EmbeddingPlan plan = mp::plan_embeddings(tables, cluster, options);
  if (args.has("--json")) {
    std::cout << mp::embeddings_to_json(plan) << "\n";
  } else {
    std::cout << mp::format_embedding_report(plan);
  }
  if (args.has("--output")) {
    std::ofstream out(args.str("--output"));
    if (!out) throw std::runtime_error("cannot write '" + args.str("--output") + "'");
    out << mp::embeddings_to_json(plan) << "\n";
    if (!args.has("--json")) std::cout << "\nwrote " << args.str("--output") << "\n";
  }
  return 0;
}

int run(int argc, char** argv) {
  if (argc < 2) throw UsageError("missing command");
  const std::string cmd = argv[1];
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    std::cout << kUsage;
    return 0;
  }
  if (cmd == "transformer") return cmd_transformer(argc, argv);
  if (cmd == "show") return cmd_show(argc, argv);
  if (cmd == "validate") return cmd_validate(argc, argv);
  if (cmd == "report") return cmd_report(argc, argv);
  if (cmd == "diff") return cmd_diff(argc, argv);
  if (cmd == "schedule") return cmd_schedule(argc, argv);
  if (cmd == "embeddings") return cmd_embeddings(argc, argv);
  if (cmd == "presets") {
    // One line per preset: who rents it, its GPUs per node and per NVLink domain, per-GPU
    // memory, NVLink (bidirectional, per GPU) and the node's GPU network (docs/clusters.md:
    // every number's source); then the link levels of the presets that have more than two.
    char line[256];
    std::snprintf(line, sizeof(line), "%-18s %-7s %-13s %5s %5s %8s %12s %10s  %s\n", "preset", "kind", "gpu", "gpus",
                  "nvl", "mem GB", "NVLink GB/s", "net Gb/s", "network");
    std::cout << line;
    std::string levels;
    for (const auto& i : mp::cluster_preset_infos()) {
      std::snprintf(line, sizeof(line), "%-18s %-7s %-13s %5lld %5lld %8.0f %12.0f %10.0f  %s\n", i.name.c_str(),
                    i.kind.c_str(), i.gpu.c_str(), static_cast<long long>(i.devices_per_node),
                    static_cast<long long>(i.nvlink_domain), i.memory_gb, i.nvlink_gb_per_s, i.network_gbit_per_s,
                    i.network.c_str());
      std::cout << line;
      if (!i.levels.empty()) {
        std::snprintf(line, sizeof(line), "  %-18s %s\n", i.name.c_str(), i.levels.c_str());
        levels += line;
      }
    }
    std::cout << "cpu                (this machine's ranks over loopback: Gloo)\n";
    std::cout << "\ngpus: per node (host); nvl: per NVLink domain\n"
                 "link levels, innermost first (GPUs per unit); the other presets: node, then network\n"
              << levels;
    return 0;
  }
  throw UsageError("unknown command '" + cmd + "'");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const UsageError& e) {
    std::cerr << "monarch-plan: error: " << e.what() << " (see monarch-plan --help)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "monarch-plan: error: " << e.what() << "\n";
    return 1;
  }
}
