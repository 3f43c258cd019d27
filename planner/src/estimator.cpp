// Estimators: the analytic model and measured per-layer profiles (estimator.h).
#include "monarch/planner/estimator.h"

#include <cmath>
#include <map>
#include <set>

#include "monarch/planner/errors.h"

namespace monarch::planner {
namespace {

bool is_split_layer(const Layer& layer, int64_t tp) { return tp > 1 && layer.tp != TpPattern::replicated; }

// Time of one micro-batch of size b from the measured points (ascending sizes).
double interpolate(const std::vector<ProfilePoint>& points, double ProfilePoint::*field, double b) {
  const ProfilePoint& lo = points.front();
  if (points.size() == 1 || b <= static_cast<double>(lo.micro_batch)) {
    return lo.*field * b / static_cast<double>(lo.micro_batch);
  }
  for (size_t i = 1; i < points.size(); ++i) {
    const ProfilePoint& a = points[i - 1];
    const ProfilePoint& c = points[i];
    if (b <= static_cast<double>(c.micro_batch) || i + 1 == points.size()) {
      const double slope = (c.*field - a.*field) / static_cast<double>(c.micro_batch - a.micro_batch);
      const double t = a.*field + slope * (b - static_cast<double>(a.micro_batch));
      // Beyond the largest size a larger micro-batch never takes less than the largest
      // measured one (a noisy last segment sloping down would otherwise run towards zero).
      return b > static_cast<double>(c.micro_batch) ? std::max(t, c.*field) : std::max(0.0, t);
    }
  }
  return points.back().*field;  // unreachable
}

}  // namespace

std::vector<LayerCost> AnalyticEstimator::layer_costs(const ModelGraph& graph, const Cluster& cluster,
                                                      const TrainingConfig& training,
                                                      const Layout& layout) const {
  return monarch::planner::layer_costs(graph, cluster, training, layout);
}

const Estimator& analytic_estimator() {
  static const AnalyticEstimator instance;
  return instance;
}

void validate(const MeasuredProfile& profile) {
  if (profile.layers.empty()) throw ValidationError("profile.layers", "no layers measured");
  if (!(std::isfinite(profile.repeatability) && profile.repeatability >= 0 && profile.repeatability < 0.5)) {
    throw ValidationError("profile.repeatability", "must be in [0, 0.5), got " + std::to_string(profile.repeatability));
  }
  std::set<std::string> names;
  for (size_t i = 0; i < profile.layers.size(); ++i) {
    const LayerProfile& l = profile.layers[i];
    const std::string path = "profile.layers[" + std::to_string(i) + "]";
    if (l.name.empty()) throw ValidationError(path + ".name", "must not be empty");
    if (!names.insert(l.name).second) throw ValidationError(path + ".name", "'" + l.name + "' appears twice");
    if (l.points.empty()) throw ValidationError(path + ".points", "no measurement for layer '" + l.name + "'");
    for (size_t k = 0; k < l.points.size(); ++k) {
      const ProfilePoint& p = l.points[k];
      const std::string pp = path + ".points[" + std::to_string(k) + "]";
      if (p.micro_batch < 1) throw ValidationError(pp + ".micro_batch", "must be >= 1");
      if (k > 0 && p.micro_batch <= l.points[k - 1].micro_batch) {
        throw ValidationError(pp + ".micro_batch", "sizes must be ascending without repeats");
      }
      if (!(std::isfinite(p.forward_s) && p.forward_s >= 0)) throw ValidationError(pp + ".forward_s", "must be finite and >= 0");
      if (!(std::isfinite(p.backward_s) && p.backward_s >= 0)) throw ValidationError(pp + ".backward_s", "must be finite and >= 0");
    }
  }
  const std::pair<const char*, const std::optional<LinkProfile>*> links[] = {
      {"profile.links.intra_node", &profile.intra_node}, {"profile.links.inter_node", &profile.inter_node}};
  for (const auto& [path, link] : links) {
    if (!*link) continue;
    if (!((*link)->bytes_per_s > 0 && std::isfinite((*link)->bytes_per_s))) {
      throw ValidationError(std::string(path) + ".bytes_per_s", "must be finite and > 0");
    }
    if (!((*link)->latency_s >= 0 && std::isfinite((*link)->latency_s))) {
      throw ValidationError(std::string(path) + ".latency_s", "must be finite and >= 0");
    }
  }
}

ProfileEstimator::ProfileEstimator(MeasuredProfile profile) : profile_(std::move(profile)) { validate(profile_); }

Cluster ProfileEstimator::cluster_for(const Cluster& cluster) const {
  Cluster c = cluster;
  if (profile_.intra_node) {
    c.intra_node_latency_s = profile_.intra_node->latency_s;
    c.intra_node_bytes_per_s = profile_.intra_node->bytes_per_s;
  }
  if (profile_.inter_node) {
    c.inter_node_latency_s = profile_.inter_node->latency_s;
    c.inter_node_bytes_per_s = profile_.inter_node->bytes_per_s;
  }
  // A cluster with levels: the measured links are its first two levels (the outer ones keep
  // their figures).
  if (!c.levels.empty()) {
    std::vector<LinkLevel> levels = c.levels;
    levels[0].bytes_per_s = c.intra_node_bytes_per_s;
    levels[0].latency_s = c.intra_node_latency_s;
    levels[1].bytes_per_s = c.inter_node_bytes_per_s;
    levels[1].latency_s = c.inter_node_latency_s;
    set_levels(c, std::move(levels));
  }
  return c;
}

std::vector<LayerCost> ProfileEstimator::layer_costs(const ModelGraph& graph, const Cluster& cluster,
                                                     const TrainingConfig& training,
                                                     const Layout& layout) const {
  std::map<std::string, const LayerProfile*> by_name;
  for (const auto& l : profile_.layers) by_name[l.name] = &l;
  std::vector<std::string> missing;
  for (const auto& layer : graph.layers) {
    if (!by_name.count(layer.name)) missing.push_back(layer.name);
  }
  if (!missing.empty() || by_name.size() != graph.layers.size()) {
    std::string what = missing.empty() ? "" : "no measurement for layer '" + missing.front() + "'" +
                                                 (missing.size() > 1 ? " (and " + std::to_string(missing.size() - 1) + " more)" : "");
    if (missing.empty()) {
      std::set<std::string> graph_names;
      for (const auto& layer : graph.layers) graph_names.insert(layer.name);
      for (const auto& l : profile_.layers) {
        if (!graph_names.count(l.name)) {
          what = "layer '" + l.name + "' is not in model '" + graph.name + "'";
          break;
        }
      }
    }
    throw ValidationError("profile.layers", what + ": the profile was measured on another model");
  }

  // Memory, parameters and collectives as the analytic model has them; compute replaced.
  std::vector<LayerCost> costs = monarch::planner::layer_costs(graph, cluster, training, layout);
  // What tp does to a layer's compute, from the analytic model: the share it splits (GEMMs;
  // norms and dropout only with sequence parallelism) and the GEMM shapes it leaves.
  std::vector<LayerCost> whole;
  if (layout.tp > 1) {
    Layout one = layout;
    one.tp = 1;
    one.sequence_parallel = false;
    whole = monarch::planner::layer_costs(graph, cluster, training, one);
  }
  const double b = static_cast<double>(layout.micro_batch_size);
  for (size_t i = 0; i < graph.layers.size(); ++i) {
    const Layer& layer = graph.layers[i];
    const LayerProfile& measured = *by_name.at(layer.name);
    double forward_share = 1.0, backward_share = 1.0;
    if (layout.tp > 1 && is_split_layer(layer, layout.tp)) {
      const double f1 = whole[i].forward_s - whole[i].forward_tp_s, b1 = whole[i].backward_compute_s;
      forward_share = f1 > 0 ? (costs[i].forward_s - costs[i].forward_tp_s) / f1 : 1.0 / layout.tp;
      backward_share = b1 > 0 ? costs[i].backward_compute_s / b1 : 1.0 / layout.tp;
    }
    const double forward = interpolate(measured.points, &ProfilePoint::forward_s, b) * forward_share;
    const double backward = interpolate(measured.points, &ProfilePoint::backward_s, b) * backward_share;
    LayerCost& c = costs[i];
    const double analytic_forward = c.forward_s - c.forward_tp_s;
    const double backward_comm = c.backward_s - c.backward_compute_s - c.recompute_s;
    // Full recompute runs the forward again; selective the analytic model's share of it.
    const double recompute = analytic_forward > 0 ? c.recompute_s * forward / analytic_forward : 0.0;
    c.forward_s = forward + c.forward_tp_s;
    c.recompute_s = recompute;
    c.backward_compute_s = backward;
    c.backward_s = backward + recompute + backward_comm;
  }
  return costs;
}

}  // namespace monarch::planner
