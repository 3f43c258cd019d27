// torch_monarch._runtime: bindings of monarch/runtime/experts.h (expert parallelism).
#include <torch/extension.h>

#include "monarch/runtime/experts.h"

namespace py = pybind11;

namespace monarch::python {

void bind_experts(py::module_& m) {
  using namespace monarch::experts;
  py::class_<Dispatch, std::shared_ptr<Dispatch>>(m, "ExpertDispatch",
                                                  "Where one forward's token slots go (plan_expert_dispatch).")
      .def_readonly("tokens", &Dispatch::tokens)
      .def_readonly("top_k", &Dispatch::top_k)
      .def_readonly("num_experts", &Dispatch::num_experts)
      .def_readonly("local_experts", &Dispatch::local_experts)
      .def_readonly("send_rows", &Dispatch::send_rows)
      .def_readonly("recv_rows", &Dispatch::recv_rows)
      .def_readonly("rows_per_local_expert", &Dispatch::rows_per_local_expert)
      .def_readonly("dropped_slots", &Dispatch::dropped_slots)
      .def_readonly("capacity", &Dispatch::capacity);
  m.def(
      "plan_expert_dispatch",
      [](const at::Tensor& top_k_index, int64_t num_experts, double capacity_factor, Communicator& ep_group,
         Communicator* token_group) {
        DispatchOptions options;
        options.num_experts = num_experts;
        options.capacity_factor = capacity_factor;
        return std::make_shared<Dispatch>(plan_dispatch(top_k_index, options, ep_group, token_group));
      },
      py::arg("top_k_index"), py::arg("num_experts"), py::arg("capacity_factor"), py::arg("ep_group"),
      py::arg("token_group") = nullptr, py::call_guard<py::gil_scoped_release>(),
      // The groups belong to the mesh, which must outlive the route (keep_alive on the route).
      py::keep_alive<0, 4>());
  m.def(
      "expert_dispatch", [](const at::Tensor& x, const std::shared_ptr<Dispatch>& route) { return dispatch(x, *route); },
      py::arg("x"), py::arg("route"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "expert_combine",
      [](const at::Tensor& out, const at::Tensor& weights, const std::shared_ptr<Dispatch>& route) {
        return combine(out, weights, *route);
      },
      py::arg("expert_out"), py::arg("top_k_weights"), py::arg("route"), py::call_guard<py::gil_scoped_release>());
  m.def("grouped_mlp", &grouped_mlp, py::arg("x"), py::arg("rows_per_expert"), py::arg("gate_up"), py::arg("down"),
        py::arg("activation"), py::call_guard<py::gil_scoped_release>());
  m.def("known_expert_activation", &known_activation, py::arg("activation"));
  m.def("load_balancing_loss", &load_balancing_loss, py::arg("router_probs"), py::arg("top_k_index"),
        py::arg("num_experts"), py::arg("token_group") = nullptr, py::call_guard<py::gil_scoped_release>());
}

}  // namespace monarch::python
