#include "monarch/runtime/device_mesh.h"


#include "monarch/runtime/log.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include <c10/util/Exception.h>

namespace monarch {

DeviceMesh::DeviceMesh(std::shared_ptr<World> world, const planner::Mesh& mesh)
    : world_(std::move(world)), mesh_(mesh) {
  // Every rank must ask for the same mesh before any group connects: ranks asking for
  // different ones would otherwise wait out the timeout connecting groups that never pair.
  std::ostringstream request;
  request << planner::mesh_summary(mesh) << " order=";
  for (size_t i = 0; i < mesh.order.size(); ++i) request << (i ? "," : "") << mesh.order[i];
  // Collective agreement must be on everywhere or nowhere (a fingerprint exchange would
  // otherwise pair with a real collective).
  const char* checks = std::getenv("MONARCH_CHECK_COLLECTIVES");
  request << " MONARCH_CHECK_COLLECTIVES=" << (checks != nullptr && *checks ? checks : "all");
  // So must the shared-memory all-reduce's settings (members would otherwise take different
  // paths for the same all-reduce).
  for (const char* name : {"MONARCH_SHARED_MEMORY", "MONARCH_NODE_ALL_REDUCE_BYTES"}) {
    const char* value = std::getenv(name);
    request << " " << name << "=" << (value != nullptr ? value : "");
  }
  // Ranks per node (checked when a group is split by node, node_groups).
  ranks_per_node_ = world_->size();
  if (const char* local = std::getenv("LOCAL_WORLD_SIZE"); local != nullptr && *local) {
    char* end = nullptr;
    const long value = std::strtol(local, &end, 10);
    TORCH_CHECK(*end == '\0' && value >= 1, "monarch: LOCAL_WORLD_SIZE='", local, "' is not a positive integer");
    ranks_per_node_ = static_cast<int>(value);
  }
  world_->agree("mesh", request.str());
  std::vector<std::string> sorted = mesh.order;
  std::sort(sorted.begin(), sorted.end());
  const bool cp_axis = std::find(sorted.begin(), sorted.end(), "cp") != sorted.end();
  TORCH_CHECK(sorted == std::vector<std::string>({"dp", "pp", "tp"}) ||
                  sorted == std::vector<std::string>({"cp", "dp", "pp", "tp"}),
              "monarch: mesh.order must be a permutation of pp, dp, tp (and cp)");
  TORCH_CHECK(cp_axis || mesh.cp == 1, "monarch: mesh cp=", mesh.cp, " needs cp in mesh.order");
  // The ep / edp groups (planner::expert_groups) and the cost model assume the standard order.
  TORCH_CHECK((mesh.cp == 1 && mesh.ep == 1) || mesh.order == std::vector<std::string>({"pp", "dp", "cp", "tp"}) ||
                  (mesh.cp == 1 && mesh.order == std::vector<std::string>({"pp", "dp", "tp"})),
              "monarch: a mesh with cp or ep > 1 needs the order [pp, dp, cp, tp] (or [pp, dp, tp] without cp)");
  TORCH_CHECK(mesh.pp >= 1 && mesh.dp >= 1 && mesh.tp >= 1 && mesh.cp >= 1 && mesh.ep >= 1,
              "monarch: mesh sizes must be >= 1");
  TORCH_CHECK(mesh.world_size() == world_->size(), "monarch: the plan's mesh ", planner::mesh_summary(mesh),
              " = ", mesh.world_size(), " ranks does not match the world size ", world_->size(), " (WORLD_SIZE)");
  TORCH_CHECK(mesh.token_parallel() % mesh.ep == 0, "monarch: mesh ep=", mesh.ep, " does not divide dp*cp = ",
              mesh.dp, "*", mesh.cp, " (experts are split over ranks that hold different tokens)");
  for (const auto& axis : mesh.order) {
    sizes_.push_back(static_cast<int>(axis == "pp" ? mesh.pp : axis == "dp" ? mesh.dp : axis == "cp" ? mesh.cp : mesh.tp));
  }
  // Coordinates: row-major over `order` (last axis fastest).
  coords_.assign(sizes_.size(), 0);
  int rest = world_->rank();
  for (int i = static_cast<int>(sizes_.size()) - 1; i >= 0; --i) {
    coords_[i] = rest % sizes_[i];
    rest /= sizes_[i];
  }
  // One group per axis: the ranks varying only along it. Created in a fixed axis order on
  // every rank so the store-based connects pair up.
  for (size_t a = 0; a < sizes_.size(); ++a) {
    std::vector<int> ranks;
    std::vector<int> c = coords_;
    for (int i = 0; i < sizes_[a]; ++i) {
      c[a] = i;
      ranks.push_back(rank_at(c));
    }
    std::ostringstream name;
    name << mesh.order[a] << "[";
    for (size_t i = 0; i < ranks.size(); ++i) name << (i ? "," : "") << ranks[i];
    name << "]";
    add_group(mesh.order[a], ranks);
  }
  // Groups that are not one axis: the replicas of non-expert parameters under context
  // parallelism (dp x cp), and the expert groups (planner::expert_groups: one definition for
  // planner and runtime). Every rank belongs to exactly one of each kind, so every rank
  // creates them in the same order.
  if (mesh.cp > 1) {
    std::vector<int> ranks;
    std::vector<int> c = coords_;
    const int dp_axis = axis_index("dp"), cp_axis_index = axis_index("cp");
    for (int d = 0; d < sizes_[dp_axis]; ++d) {
      for (int k = 0; k < sizes_[cp_axis_index]; ++k) {
        c[dp_axis] = d;
        c[cp_axis_index] = k;
        ranks.push_back(rank_at(c));
      }
    }
    add_group("dp_cp", ranks);
  }
  if (mesh.ep > 1) {
    const planner::ExpertGroups expert = planner::expert_groups(mesh);
    const auto mine = [this](const std::vector<std::vector<int64_t>>& all) {
      for (const auto& g : all) {
        if (std::find(g.begin(), g.end(), world_->rank()) != g.end()) return std::vector<int>(g.begin(), g.end());
      }
      TORCH_INTERNAL_ASSERT(false, "rank ", world_->rank(), " is in no expert group");
    };
    add_group("ep", mine(expert.ep));
    add_group("edp", mine(expert.edp));
  }
  // Every rank takes part in the id bookkeeping of the ends group, members or not.
  if (mesh.pp > 2) {
    const int pp_axis = axis_index("pp");
    const int pp_coord = coords_[pp_axis];
    if (pp_coord == 0 || pp_coord == sizes_[pp_axis] - 1) {
      std::vector<int> c = coords_;
      c[pp_axis] = 0;
      const int first = rank_at(c);
      c[pp_axis] = sizes_[pp_axis] - 1;
      const int last = rank_at(c);
      std::vector<int> ranks{first, last};
      const std::string name = "pp_ends[" + std::to_string(first) + "," + std::to_string(last) + "]";
      auto group = world_->new_group(ranks, name);
      ends_ = std::make_unique<Communicator>(group, ranks, world_->rank(), "pp_ends", world_->store(),
                                             "monarch/group/" + std::to_string(world_->groups_created()) + "/" + name);
    } else {
      world_->skip_group();
    }
  }
  log::info("mesh", "mesh ", planner::mesh_summary(mesh), ": groups connected; this rank at pp ", coordinate("pp"),
            ", dp ", coordinate("dp"), cp_axis ? ", cp " + std::to_string(coordinate("cp")) : std::string(), ", tp ",
            coordinate("tp"));
}

void DeviceMesh::add_group(const std::string& key, const std::vector<int>& ranks) {
  std::ostringstream name;
  name << key << "[";
  for (size_t i = 0; i < ranks.size(); ++i) name << (i ? "," : "") << ranks[i];
  name << "]";
  auto group = world_->new_group(ranks, name.str());
  groups_[key] = std::make_unique<Communicator>(group, ranks, world_->rank(), key, world_->store(),
                                                "monarch/group/" + std::to_string(world_->groups_created()) + "/" +
                                                    name.str());
  // Tensor parallelism's all-reduces are small, latency-bound and on the critical path, and
  // every member runs the same program in the same order (a synchronous collective cannot
  // wait on a member that waits on something else first): its group takes the node's
  // shared-memory path where it can. Data-parallel buckets stay asynchronous on Gloo.
  if (key == "tp") groups_[key]->set_node_local(on_one_node(ranks));
}

bool DeviceMesh::on_one_node(const std::vector<int>& ranks) const {
  // ranks_per_node_ is the world size without LOCAL_WORLD_SIZE: one node, as torchrun's
  // single-node launch; ranks that turn out not to share memory fall back to Gloo anyway.
  for (int r : ranks) {
    if (r / ranks_per_node_ != ranks.front() / ranks_per_node_) return false;
  }
  return true;
}

bool DeviceMesh::has_pipeline_ends_group() const {
  const int c = coords_[axis_index("pp")];
  return mesh_.pp > 1 && (c == 0 || c == mesh_.pp - 1);
}

Communicator& DeviceMesh::pipeline_ends_group() {
  TORCH_CHECK(has_pipeline_ends_group(), "monarch: rank ", rank(),
              " is not at either end of the pipeline (pp coordinate ", coordinate("pp"), " of ", mesh_.pp, ")");
  return mesh_.pp == 2 ? *groups_.at("pp") : *ends_;
}

int DeviceMesh::axis_index(const std::string& axis) const {
  for (size_t i = 0; i < mesh_.order.size(); ++i) {
    if (mesh_.order[i] == axis) return static_cast<int>(i);
  }
  std::string axes;
  for (const auto& a : mesh_.order) axes += (axes.empty() ? "" : ", ") + a;
  TORCH_CHECK(false, "monarch: unknown mesh axis '", axis, "' (axes: ", axes, ")");
}

int DeviceMesh::size(const std::string& axis) const {
  // cp is 1 on a mesh without the axis; the groups that are not axes have their own sizes.
  if (axis == "cp" && !has_axis("cp")) return 1;
  if (axis == "ep") return static_cast<int>(mesh_.ep);
  if (axis == "edp") return static_cast<int>(mesh_.expert_data_parallel());
  if (axis == "dp_cp") return static_cast<int>(mesh_.token_parallel());
  return sizes_[axis_index(axis)];
}
int DeviceMesh::coordinate(const std::string& axis) const {
  if (axis == "cp" && !has_axis("cp")) return 0;
  return coords_[axis_index(axis)];
}
bool DeviceMesh::has_axis(const std::string& axis) const {
  return std::find(mesh_.order.begin(), mesh_.order.end(), axis) != mesh_.order.end();
}

int DeviceMesh::rank_at(const std::vector<int>& coordinates) const {
  TORCH_CHECK(coordinates.size() == sizes_.size(), "monarch: need one coordinate per mesh axis");
  int rank = 0;
  for (size_t i = 0; i < sizes_.size(); ++i) {
    TORCH_CHECK(coordinates[i] >= 0 && coordinates[i] < sizes_[i], "monarch: coordinate ",
                coordinates[i], " out of range for axis ", mesh_.order[i]);
    rank = rank * sizes_[i] + coordinates[i];
  }
  return rank;
}

std::string DeviceMesh::canonical(const std::string& axis) const {
  const bool cp = has_axis("cp") && mesh_.cp > 1;
  if (axis == "dp_cp" && !cp) return "dp";
  if (axis == "edp" && mesh_.ep == 1) return cp ? "dp_cp" : "dp";
  return axis;
}

NodeGroups& DeviceMesh::node_groups(const std::string& requested) {
  // One split per group, whichever of its names asks (dp_cp is dp without cp).
  const std::string axis = canonical(requested);
  auto found = node_groups_.find(axis);
  if (found != node_groups_.end()) return *found->second;
  Communicator& whole = group(axis);
  // Every rank splits here (collective): agree on the node size first, so nodes of different
  // sizes, or ranks where only some asked for the split, are one clear error on every rank
  // instead of groups that never connect.
  world_->agree("split of the " + axis + " groups by node",
                "LOCAL_WORLD_SIZE=" + std::to_string(ranks_per_node_));
  TORCH_CHECK(world_->size() % ranks_per_node_ == 0, "monarch: LOCAL_WORLD_SIZE=", ranks_per_node_,
              " does not divide the world size ", world_->size(), " (every node must run as many ranks)");
  const auto node_of = [this](int r) { return r / ranks_per_node_; };
  const int my_node = node_of(rank());
  // Group members per node, in group order.
  std::map<int, std::vector<int>> by_node;
  for (int r : whole.ranks()) by_node[node_of(r)].push_back(r);
  const std::vector<int>& mine = by_node.at(my_node);
  std::ostringstream counts;
  bool even = true;
  for (const auto& [node, ranks] : by_node) {
    counts << (counts.tellp() > 0 ? ", " : "") << "node " << node << ": " << ranks.size();
    even = even && ranks.size() == mine.size();
  }
  TORCH_CHECK(even, "monarch: the ", axis, " group ", whole.name(), " has different numbers of ranks per node (",
              counts.str(), "): a hierarchical reduction needs the same number on every node");
  const int index = static_cast<int>(std::find(mine.begin(), mine.end(), rank()) - mine.begin());
  std::vector<int> across;
  for (const auto& [node, ranks] : by_node) across.push_back(ranks[index]);
  auto groups = std::make_unique<NodeGroups>();
  const auto make = [&](const std::vector<int>& ranks, const std::string& kind) {
    std::ostringstream name;
    name << axis << "." << kind << "[";
    for (size_t i = 0; i < ranks.size(); ++i) name << (i ? "," : "") << ranks[i];
    name << "]";
    auto pg = world_->new_group(ranks, name.str());
    return std::make_unique<Communicator>(pg, ranks, rank(), axis + "." + kind, world_->store(),
                                          "monarch/group/" + std::to_string(world_->groups_created()) + "/" +
                                              name.str());
  };
  groups->intra = make(mine, "intra");
  groups->inter = make(across, "inter");
  log::info("mesh", axis, " split by node: ", mine.size(), " rank(s) on this node (", groups->intra->name(), "), ",
            across.size(), " node(s) (", groups->inter->name(), ")");
  return *node_groups_.emplace(axis, std::move(groups)).first->second;
}

Communicator& DeviceMesh::group(const std::string& axis) {
  auto found = groups_.find(canonical(axis));
  if (found != groups_.end()) return *found->second;
  TORCH_CHECK(axis != "ep", "monarch: the mesh has no ep group (ep=1); ", planner::mesh_summary(mesh_));
  axis_index(axis);  // names the axes
  return *groups_.at(axis);
}

}  // namespace monarch
