#pragma once
// The ranks laid out as the Plan's mesh says: named axes (pp, dp, cp, tp), one process group
// per axis slice, and this rank's coordinates. Besides the axes: "dp_cp" (dp x cp, the
// replicas of parameters under context parallelism), "ep" (a MoE layer's experts split over
// them) and "edp" (the replicas of one expert: dp x cp / ep), as planner::expert_groups says.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "monarch/planner/plan.h"
#include "monarch/runtime/communicator.h"
#include "monarch/runtime/hierarchical.h"
#include "monarch/runtime/world.h"

namespace monarch {

class DeviceMesh {
 public:
  // `mesh.order` lists the axes outermost first; the last varies fastest. Refuses a mesh
  // whose size differs from the world's. Every rank of the world must construct the mesh
  // (it creates one group per axis slice this rank belongs to).
  DeviceMesh(std::shared_ptr<World> world, const planner::Mesh& mesh);

  const planner::Mesh& shape() const { return mesh_; }
  int rank() const { return world_->rank(); }
  int size() const { return world_->size(); }
  // Sizes and coordinates of axes (cp is size 1, coordinate 0 on a mesh without it); size()
  // also answers for "dp_cp", "ep" and "edp".
  int size(const std::string& axis) const;
  int coordinate(const std::string& axis) const;
  bool has_axis(const std::string& axis) const;
  // The global rank at the given coordinates (one per axis, in `shape().order`).
  int rank_at(const std::vector<int>& coordinates) const;
  // This rank's group along `axis` (the ranks that differ from it only in that coordinate),
  // or "dp_cp", "ep", "edp" (see above; dp_cp is dp when cp == 1, edp is dp_cp when ep == 1).
  Communicator& group(const std::string& axis);
  // Pipeline ends: this rank and its peer at the other end of the `pp` axis (first and
  // last stage, same dp / tp coordinates), for weights tied between the embedding and the
  // output head. Only ranks at pp coordinate 0 or pp-1 belong; with pp == 2 it is the pp group.
  bool has_pipeline_ends_group() const;
  Communicator& pipeline_ends_group();
  const std::shared_ptr<World>& world() const { return world_; }
  // The ranks on one node: LOCAL_WORLD_SIZE (torchrun numbers the ranks of a node
  // consecutively; node_groups checks it is equal on every rank); the world size when it is
  // not set.
  int ranks_per_node() const { return ranks_per_node_; }
  // `axis`'s group split by node (hierarchical.h). Collective on the whole world the first
  // time (the ranks agree on LOCAL_WORLD_SIZE, then every rank creates its two groups);
  // refuses a group whose nodes hold different numbers of its ranks.
  NodeGroups& node_groups(const std::string& axis);

 private:
  int axis_index(const std::string& axis) const;
  void add_group(const std::string& key, const std::vector<int>& ranks);
  // Whether all of `ranks` run on one node (global rank / LOCAL_WORLD_SIZE).
  bool on_one_node(const std::vector<int>& ranks) const;
  // The name a group is kept under: dp_cp is dp without cp, edp is dp_cp when ep == 1.
  std::string canonical(const std::string& axis) const;
  std::shared_ptr<World> world_;
  planner::Mesh mesh_;
  std::vector<int> sizes_;   // in mesh_.order
  std::vector<int> coords_;  // in mesh_.order
  std::map<std::string, std::unique_ptr<Communicator>> groups_;
  std::unique_ptr<Communicator> ends_;
  int ranks_per_node_ = 1;
  std::map<std::string, std::unique_ptr<NodeGroups>> node_groups_;
};

}  // namespace monarch
