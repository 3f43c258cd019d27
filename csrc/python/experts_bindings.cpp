// torch_monarch._runtime: bindings of monarch/runtime/experts.h.
#include <torch/extension.h>

#include "monarch/runtime/experts.h"

namespace py = pybind11;

namespace monarch::python {

void bind_experts(py::module_& m) { (void)m; }

}  // namespace monarch::python
