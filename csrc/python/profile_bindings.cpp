// pybind11 bindings of measured profiles and the estimator seam (monarch/planner/estimator.h),
// part of torch_monarch._C.planner. Same conventions as planner_bindings.cpp. Python passes a
// MeasuredProfile by value; the estimator built from it lives for one call.
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "binding_helpers.h"
#include "monarch/planner/estimator.h"
#include "monarch/planner/search.h"

namespace py = pybind11;

namespace monarch::python {

using namespace monarch::planner;
using namespace monarch::python::binding;

void bind_profiles(py::module_& m) {
  py::class_<ProfilePoint> point(m, "ProfilePoint",
                                 "One layer's measured forward and backward seconds for one micro-batch of micro_batch samples.");
  add_kwargs_init<ProfilePoint>(point);
  add_copy<ProfilePoint>(point);
  point.def_readwrite("micro_batch", &ProfilePoint::micro_batch)
      .def_readwrite("forward_s", &ProfilePoint::forward_s)
      .def_readwrite("backward_s", &ProfilePoint::backward_s);

  py::class_<LayerProfile> layer(m, "LayerProfile", "A layer's measured times, by micro-batch size.");
  add_kwargs_init<LayerProfile>(layer);
  add_copy<LayerProfile>(layer);
  layer.def_readwrite("name", &LayerProfile::name).def_readwrite("points", &LayerProfile::points);

  py::class_<LinkProfile> link(m, "LinkProfile", "Measured all-reduce latency and bus bandwidth of one link level.");
  add_kwargs_init<LinkProfile>(link);
  add_copy<LinkProfile>(link);
  link.def_readwrite("latency_s", &LinkProfile::latency_s).def_readwrite("bytes_per_s", &LinkProfile::bytes_per_s);

  py::class_<MeasuredProfile> profile(m, "MeasuredProfile",
                                      "Per-layer times and link speeds measured on the machine (estimator.h).");
  add_kwargs_init<MeasuredProfile>(profile);
  add_copy<MeasuredProfile>(profile);
  profile.def_readwrite("source", &MeasuredProfile::source)
      .def_readwrite("layers", &MeasuredProfile::layers)
      .def_readwrite("intra_node", &MeasuredProfile::intra_node)
      .def_readwrite("inter_node", &MeasuredProfile::inter_node)
      .def_readwrite("repeatability", &MeasuredProfile::repeatability)
      .def("__repr__", [](const MeasuredProfile& p) {
        return "<MeasuredProfile " + quoted(p.source) + ", " + std::to_string(p.layers.size()) + " layers>";
      });

  m.def("validate_profile", [](const MeasuredProfile& p) { validate(p); }, py::arg("profile"));
  m.def("profile_to_json", [](const MeasuredProfile& p, int indent) { return to_json(p, indent); },
        py::arg("profile"), py::arg("indent") = 2);
  m.def("profile_from_json", &profile_from_json, py::arg("text"));
  m.def("load_profile", &load_profile, py::arg("path"));

  m.def(
      "search_with_profile",
      [](const ModelGraph& graph, const Cluster& cluster, const TrainingConfig& training, SearchOptions options,
         const MeasuredProfile& profile) {
        const ProfileEstimator estimator(profile);
        options.estimator = &estimator;
        return search(graph, cluster, training, options);
      },
      py::arg("graph"), py::arg("cluster"), py::arg("training"), py::arg("options"), py::arg("profile"),
      py::call_guard<py::gil_scoped_release>(),
      "search() with per-layer times from a measured profile (its links replace the cluster's).");
  m.def(
      "evaluate_layout_with_profile",
      [](const ModelGraph& graph, const Cluster& cluster, const TrainingConfig& training, const Pins& pins,
         bool allow_over_memory, const MeasuredProfile& profile) {
        const ProfileEstimator estimator(profile);
        return evaluate_layout(graph, cluster, training, pins, allow_over_memory, &estimator);
      },
      py::arg("graph"), py::arg("cluster"), py::arg("training"), py::arg("pins"), py::arg("allow_over_memory"),
      py::arg("profile"), py::call_guard<py::gil_scoped_release>(),
      "evaluate_layout() with per-layer times from a measured profile.");
}

}  // namespace monarch::python
