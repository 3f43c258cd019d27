#pragma once
// Where the search's per-layer times come from. The search runs in four steps with typed
// values between them (docs/cost_model.md, "Search"):
//   enumerate: meshes and Layouts the pins and the model allow;
//   estimate:  an Estimator turns a Layout into LayerCosts (time and memory per layer);
//   partition: stage boundaries under the memory limit (stage_partition.h);
//   propose:   the schedule simulation scores each candidate, ties are broken, and the
//              fastest plan is returned with the runners-up.
// The analytic estimator derives layer times from FLOPs and the cluster's peak rates. The
// profile estimator uses per-layer forward and backward times measured on the real machine
// (torch_monarch.profile), so a model whose kernels are not matmul-bound, or a machine whose
// rates the datasheet does not describe, is planned from what it actually does.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "monarch/planner/cluster.h"
#include "monarch/planner/cost_model.h"
#include "monarch/planner/model_graph.h"
#include "monarch/planner/training_config.h"

namespace monarch::planner {

class Estimator {
 public:
  virtual ~Estimator() = default;
  // "analytic", or "profile: <where it was measured>"; recorded in the plan.
  virtual std::string name() const = 0;
  // The cluster the plan is made for: a profile's measured links replace the cluster's.
  virtual Cluster cluster_for(const Cluster& cluster) const { return cluster; }
  // Time and memory of every layer of `graph` on one rank of `layout`, per micro-batch.
  virtual std::vector<LayerCost> layer_costs(const ModelGraph& graph, const Cluster& cluster,
                                             const TrainingConfig& training,
                                             const Layout& layout) const = 0;
  // Relative difference between two predictions below which this estimator cannot tell them
  // apart (0: none stated). The search treats layouts of one mesh this close as equally fast
  // and takes the simplest (search.cpp, kSameTime is the floor).
  virtual double resolution() const { return 0; }
};

// FLOPs at the cluster's achievable rate, memory-bound work at its memory bandwidth, tp
// collectives on the tp link (cost_model.h's layer_costs).
class AnalyticEstimator final : public Estimator {
 public:
  std::string name() const override { return "analytic"; }
  std::vector<LayerCost> layer_costs(const ModelGraph& graph, const Cluster& cluster,
                                     const TrainingConfig& training,
                                     const Layout& layout) const override;
};
const Estimator& analytic_estimator();

// One layer's measured times for one micro-batch at one micro-batch size, on one rank with
// tp = 1, measured while every rank of the node computes too (the cluster's rates mean the
// same: cluster.h).
struct ProfilePoint {
  int64_t micro_batch = 1;
  double forward_s = 0;
  double backward_s = 0;  // gradients for inputs and weights, no recomputation
};

struct LayerProfile {
  std::string name;                 // the graph's layer name
  std::vector<ProfilePoint> points; // ascending micro-batch sizes, at least one
};

// Measured latency and achieved bus bandwidth of one link level (all-reduce fit, as
// cluster.probe measures them).
struct LinkProfile {
  double latency_s = 0;
  double bytes_per_s = 0;
};

struct MeasuredProfile {
  std::string source;  // where and how it was measured, e.g. "cpu: 4 ranks on 2 cores"
  std::vector<LayerProfile> layers;
  std::optional<LinkProfile> intra_node, inter_node;
  // How far repeated measurements of the same layer and size differed, relative (the median
  // over the profile's points; 0: not measured). Predictions from the profile that differ by
  // less than this are within its own noise (Estimator::resolution).
  double repeatability = 0;
};

// Per-layer times from a MeasuredProfile; everything the profile does not measure (memory,
// parameters, collective volumes) from the analytic model. A layer's time at micro-batch b
// is interpolated linearly between the measured sizes (proportionally below the smallest,
// along the last two points' slope above the largest, never below the largest's time); a
// layer tp splits runs the share of it the analytic model keeps on one tp rank (its compute
// at tp over its compute at tp = 1: the GEMMs' 1/tp at their new shapes, norms only with
// sequence parallelism); recomputation costs the measured forward again (full) or the
// analytic model's share of it (selective).
class ProfileEstimator final : public Estimator {
 public:
  // Throws ValidationError("profile.layers[2].points", ...) for an unusable profile.
  explicit ProfileEstimator(MeasuredProfile profile);
  std::string name() const override { return "profile: " + profile_.source; }
  Cluster cluster_for(const Cluster& cluster) const override;
  // Throws ValidationError("profile.layers", ...) when the profile and the graph do not
  // name the same layers (a profile of another model).
  std::vector<LayerCost> layer_costs(const ModelGraph& graph, const Cluster& cluster,
                                     const TrainingConfig& training,
                                     const Layout& layout) const override;
  const MeasuredProfile& profile() const { return profile_; }
  double resolution() const override { return profile_.repeatability; }

 private:
  MeasuredProfile profile_;
};

// Checks names, sizes and times; ValidationError with the field path.
void validate(const MeasuredProfile& profile);
// JSON (docs/plan_format.md, "Measured profiles"): strict reading, field paths in errors.
std::string to_json(const MeasuredProfile& profile, int indent = 2);
MeasuredProfile profile_from_json(const std::string& text);
MeasuredProfile load_profile(const std::string& path);

}  // namespace monarch::planner
