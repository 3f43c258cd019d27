// Names of the planner's enums, as they appear in plan JSON and on the command line.
#include <string>
#include <utility>
#include <vector>

#include "monarch/planner/errors.h"
#include "monarch/planner/model_graph.h"
#include "monarch/planner/training_config.h"

namespace monarch::planner {
namespace {

template <typename E>
using NameTable = std::vector<std::pair<E, const char*>>;

const NameTable<LayerKind>& layer_kind_names() {
  static const NameTable<LayerKind> t = {
      {LayerKind::embedding, "embedding"}, {LayerKind::attention, "attention"},
      {LayerKind::mlp, "mlp"},             {LayerKind::norm, "norm"},
      {LayerKind::block, "block"},         {LayerKind::head, "head"},
      {LayerKind::other, "other"}};
  return t;
}

const NameTable<TpPattern>& tp_pattern_names() {
  static const NameTable<TpPattern> t = {{TpPattern::replicated, "replicated"},
                                         {TpPattern::column_row, "column_row"},
                                         {TpPattern::heads, "heads"},
                                         {TpPattern::block, "block"},
                                         {TpPattern::vocab, "vocab"}};
  return t;
}

const NameTable<ScheduleKind>& schedule_names() {
  static const NameTable<ScheduleKind> t = {{ScheduleKind::none, "none"},
                                            {ScheduleKind::gpipe, "gpipe"},
                                            {ScheduleKind::one_f_one_b, "1f1b"},
                                            {ScheduleKind::interleaved_1f1b, "interleaved_1f1b"},
                                            {ScheduleKind::zero_bubble_h1, "zb_h1"},
                                            {ScheduleKind::zero_bubble_v, "zbv"}};
  return t;
}

// Accepted on input only; never written.
const NameTable<ScheduleKind>& schedule_aliases() {
  static const NameTable<ScheduleKind> t = {{ScheduleKind::interleaved_1f1b, "interleaved"},
                                            {ScheduleKind::zero_bubble_h1, "zb-h1"},
                                            {ScheduleKind::zero_bubble_h1, "zbh1"},
                                            {ScheduleKind::zero_bubble_v, "zb-v"},
                                            {ScheduleKind::zero_bubble_v, "zb_v"}};
  return t;
}

const NameTable<Recompute>& recompute_names() {
  static const NameTable<Recompute> t = {
      {Recompute::none, "none"}, {Recompute::selective, "selective"}, {Recompute::full, "full"}};
  return t;
}

const NameTable<DpReduction>& dp_reduction_names() {
  static const NameTable<DpReduction> t = {{DpReduction::flat, "flat"},
                                           {DpReduction::hierarchical, "hierarchical"}};
  return t;
}

const NameTable<Compression>& compression_names() {
  static const NameTable<Compression> t = {
      {Compression::none, "none"}, {Compression::bf16, "bf16"}, {Compression::int8, "int8"}};
  return t;
}

template <typename E>
std::string name_of(const NameTable<E>& table, E value) {
  for (const auto& [v, name] : table) {
    if (v == value) return name;
  }
  return "unknown";
}

template <typename E>
const E* find_name(const NameTable<E>& table, const std::string& name) {
  for (const auto& entry : table) {
    if (name == entry.second) return &entry.first;
  }
  return nullptr;
}

// ValidationError(field, "unknown <what> 'x' (expected one of a, b, c)").
template <typename E>
[[noreturn]] void throw_unknown(const NameTable<E>& table, const char* what,
                                const std::string& name, const std::string& field) {
  std::string expected;
  for (const auto& entry : table) {
    expected += (expected.empty() ? "" : ", ") + std::string(entry.second);
  }
  throw ValidationError(field, std::string("unknown ") + what + " '" + name +
                                   "' (expected one of " + expected + ")");
}

template <typename E>
E parse_name(const NameTable<E>& table, const char* what, const std::string& name,
             const std::string& field) {
  if (const E* v = find_name(table, name)) return *v;
  throw_unknown(table, what, name, field);
}

}  // namespace

std::string to_string(LayerKind kind) { return name_of(layer_kind_names(), kind); }
LayerKind layer_kind_from_string(const std::string& name, const std::string& field) {
  return parse_name(layer_kind_names(), "layer kind", name, field);
}

std::string to_string(TpPattern pattern) { return name_of(tp_pattern_names(), pattern); }
TpPattern tp_pattern_from_string(const std::string& name, const std::string& field) {
  return parse_name(tp_pattern_names(), "tp pattern", name, field);
}

std::string to_string(ScheduleKind kind) { return name_of(schedule_names(), kind); }
ScheduleKind schedule_from_string(const std::string& name, const std::string& field) {
  if (const ScheduleKind* v = find_name(schedule_aliases(), name)) return *v;
  return parse_name(schedule_names(), "schedule", name, field);
}

const NameTable<AttentionKernel>& attention_names() {
  static const NameTable<AttentionKernel> t = {{AttentionKernel::flash, "flash"},
                                               {AttentionKernel::materialized, "materialized"}};
  return t;
}

std::string to_string(AttentionKernel k) { return name_of(attention_names(), k); }
AttentionKernel attention_kernel_from_string(const std::string& name, const std::string& field) {
  return parse_name(attention_names(), "attention kernel", name, field);
}

std::string to_string(Recompute r) { return name_of(recompute_names(), r); }
Recompute recompute_from_string(const std::string& name, const std::string& field) {
  return parse_name(recompute_names(), "recompute mode", name, field);
}

std::string to_string(DpReduction r) { return name_of(dp_reduction_names(), r); }
DpReduction dp_reduction_from_string(const std::string& name, const std::string& field) {
  return parse_name(dp_reduction_names(), "dp reduction", name, field);
}

std::string to_string(Compression c) { return name_of(compression_names(), c); }
Compression compression_from_string(const std::string& name, const std::string& field) {
  return parse_name(compression_names(), "compression", name, field);
}

}  // namespace monarch::planner
