// torch_monarch._runtime: bindings of monarch/runtime/context_parallel.h.
#include <torch/extension.h>

#include "monarch/runtime/context_parallel.h"

namespace py = pybind11;

namespace monarch::python {

void bind_context_parallel(py::module_& m) { (void)m; }

}  // namespace monarch::python
