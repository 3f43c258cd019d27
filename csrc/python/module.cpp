// torch_monarch._C: the compiled half of torch_monarch.
// Submodules: `planner` (pure C++ planner, no torch). The LibTorch runtime joins later.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace monarch::python {
void bind_planner(py::module_& m);
}  // namespace monarch::python

#ifndef MONARCH_VERSION_INFO
#define MONARCH_VERSION_INFO "0.1.0"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_monarch native extension";
  m.attr("__version__") = MONARCH_VERSION_INFO;
  py::module_ planner = m.def_submodule(
      "planner", "Cost-model planner: model graphs, clusters, search, plans, schedules");
  monarch::python::bind_planner(planner);
}
