// MeasuredProfile <-> JSON (docs/plan_format.md, "Measured profiles"). Strict reading like
// the plan's: every field typed, unknown keys refused, errors naming the field path.
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "json_fields.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/estimator.h"

namespace monarch::planner {
namespace {

using json_detail::Fields;
using json_detail::Json;

constexpr const char* kFormat = "monarch-profile";
constexpr int64_t kVersion = 1;

Json link_to_json(const LinkProfile& l) {
  Json j;
  j["latency_s"] = l.latency_s;
  j["bytes_per_s"] = l.bytes_per_s;
  return j;
}

LinkProfile link_from_fields(const Fields& f) {
  LinkProfile l;
  l.latency_s = f.number("latency_s");
  l.bytes_per_s = f.number("bytes_per_s");
  return l;
}

}  // namespace

std::string to_json(const MeasuredProfile& profile, int indent) {
  Json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["source"] = profile.source;
  if (profile.repeatability > 0) j["repeatability"] = profile.repeatability;
  Json layers = Json::array();
  for (const auto& l : profile.layers) {
    Json x;
    x["name"] = l.name;
    Json points = Json::array();
    for (const auto& p : l.points) {
      Json y;
      y["micro_batch"] = p.micro_batch;
      y["forward_s"] = p.forward_s;
      y["backward_s"] = p.backward_s;
      points.push_back(y);
    }
    x["points"] = points;
    layers.push_back(x);
  }
  j["layers"] = layers;
  if (profile.intra_node || profile.inter_node) {
    Json links = Json::object();
    if (profile.intra_node) links["intra_node"] = link_to_json(*profile.intra_node);
    if (profile.inter_node) links["inter_node"] = link_to_json(*profile.inter_node);
    j["links"] = links;
  }
  return j.dump(indent);
}

MeasuredProfile profile_from_json(const std::string& text) {
  Json root;
  try {
    root = Json::parse(text);
  } catch (const Json::exception& e) {
    throw FormatError(std::string("profile JSON: ") + e.what());
  }
  if (!root.is_object()) throw FormatError("profile JSON: expected an object at the top level");
  const Fields f(root, "profile", {"format", "version", "source", "layers", "links", "repeatability"});
  if (f.string("format") != kFormat) {
    throw FormatError("profile JSON: format '" + f.string("format") + "' is not '" + kFormat + "'");
  }
  if (f.integer("version") != kVersion) {
    throw FormatError("profile JSON: version " + std::to_string(f.integer("version")) +
                      " is not supported (this build reads version 1)");
  }
  MeasuredProfile p;
  p.source = f.string("source");
  if (f.has("repeatability")) p.repeatability = f.number("repeatability");
  const Json& layers = f.array("layers");
  for (size_t i = 0; i < layers.size(); ++i) {
    const Fields x(layers[i], json_detail::element("profile.layers", i), {"name", "points"});
    LayerProfile l;
    l.name = x.string("name");
    const Json& points = x.array("points");
    for (size_t k = 0; k < points.size(); ++k) {
      const Fields y(points[k], json_detail::element(x.path("points"), k), {"micro_batch", "forward_s", "backward_s"});
      l.points.push_back({y.integer("micro_batch"), y.number("forward_s"), y.number("backward_s")});
    }
    p.layers.push_back(std::move(l));
  }
  if (f.has("links")) {
    const Fields links = f.object("links", {"intra_node", "inter_node"});
    if (links.has("intra_node")) p.intra_node = link_from_fields(links.object("intra_node", {"latency_s", "bytes_per_s"}));
    if (links.has("inter_node")) p.inter_node = link_from_fields(links.object("inter_node", {"latency_s", "bytes_per_s"}));
  }
  validate(p);
  return p;
}

MeasuredProfile load_profile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FormatError("cannot read profile file '" + path + "': " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw FormatError("cannot read profile file '" + path + "'");
  try {
    return profile_from_json(text.str());
  } catch (const FormatError& e) {
    throw FormatError(path + ": " + e.what());
  }
}

}  // namespace monarch::planner
