// pybind11 bindings of the inference planner (monarch/planner/inference.h), part of
// torch_monarch._C.planner. Same conventions as planner_bindings.cpp: value types with
// keyword constructors, enums as strings, planner errors as ValueErrors.
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "binding_helpers.h"
#include "monarch/planner/inference.h"
#include "monarch/planner/plan.h"

namespace py = pybind11;

namespace monarch::python {

using namespace monarch::planner;
using namespace monarch::python::binding;

void bind_inference(py::module_& m) {
  py::class_<InferenceConfig> config(m, "InferenceConfig",
                                     "What an inference plan serves: objective ('latency' or 'throughput'), batch "
                                     "per replica, prompt_len, max_new_tokens, latency_target_s (throughput; 0: none), "
                                     "max_batch (throughput; 0: 256), bytes per weight / KV element (0: the model's "
                                     "dtype), hbm_efficiency, host_seconds_per_op / ops_per_block / "
                                     "host_seconds_per_step / host_overlaps_device (eager host dispatch; 0: "
                                     "none).");
  add_kwargs_init<InferenceConfig>(config);
  add_copy<InferenceConfig>(config);
  config
      .def_property(
          "objective", [](const InferenceConfig& c) { return to_string(c.objective); },
          [](InferenceConfig& c, const std::string& name) { c.objective = inference_objective_from_string(name); })
      .def_readwrite("batch", &InferenceConfig::batch)
      .def_readwrite("prompt_len", &InferenceConfig::prompt_len)
      .def_readwrite("max_new_tokens", &InferenceConfig::max_new_tokens)
      .def_readwrite("latency_target_s", &InferenceConfig::latency_target_s)
      .def_readwrite("max_batch", &InferenceConfig::max_batch)
      .def_readwrite("weight_bytes", &InferenceConfig::weight_bytes)
      .def_readwrite("kv_bytes", &InferenceConfig::kv_bytes)
      .def_readwrite("hbm_efficiency", &InferenceConfig::hbm_efficiency)
      .def_readwrite("host_seconds_per_op", &InferenceConfig::host_seconds_per_op)
      .def_readwrite("ops_per_block", &InferenceConfig::ops_per_block)
      .def_readwrite("host_seconds_per_step", &InferenceConfig::host_seconds_per_step)
      .def_readwrite("host_overlaps_device", &InferenceConfig::host_overlaps_device)
      .def(py::self == py::self)
      .def("__repr__", [](const InferenceConfig& c) {
        return "<InferenceConfig " + to_string(c.objective) + " batch=" + std::to_string(c.batch) +
               " prompt_len=" + std::to_string(c.prompt_len) + " max_new_tokens=" + std::to_string(c.max_new_tokens) +
               ">";
      });

  py::class_<InferencePrediction> pred(m, "InferencePrediction",
                                       "Time to first token, per-token latency, tokens/s (all replicas), request "
                                       "time; per device: weights, KV cache, activations, memory; decode and "
                                       "prefill breakdowns (seconds).");
  add_kwargs_init<InferencePrediction>(pred);
  add_copy<InferencePrediction>(pred);
  pred.def_readwrite("ttft_s", &InferencePrediction::ttft_s)
      .def_readwrite("per_token_s", &InferencePrediction::per_token_s)
      .def_readwrite("tokens_per_s", &InferencePrediction::tokens_per_s)
      .def_readwrite("request_s", &InferencePrediction::request_s)
      .def_readwrite("weights_bytes", &InferencePrediction::weights_bytes)
      .def_readwrite("kv_cache_bytes", &InferencePrediction::kv_cache_bytes)
      .def_readwrite("activation_bytes", &InferencePrediction::activation_bytes)
      .def_readwrite("memory_bytes", &InferencePrediction::memory_bytes)
      .def_readwrite("decode_weights_s", &InferencePrediction::decode_weights_s)
      .def_readwrite("decode_kv_s", &InferencePrediction::decode_kv_s)
      .def_readwrite("decode_compute_s", &InferencePrediction::decode_compute_s)
      .def_readwrite("decode_tp_comm_s", &InferencePrediction::decode_tp_comm_s)
      .def_readwrite("decode_pp_comm_s", &InferencePrediction::decode_pp_comm_s)
      .def_readwrite("decode_host_s", &InferencePrediction::decode_host_s)
      .def_readwrite("prefill_compute_s", &InferencePrediction::prefill_compute_s)
      .def_readwrite("prefill_tp_comm_s", &InferencePrediction::prefill_tp_comm_s)
      .def_readwrite("prefill_pp_comm_s", &InferencePrediction::prefill_pp_comm_s)
      .def(py::self == py::self);

  py::class_<InferencePlan> iplan(m, "InferencePlan",
                                  "An inference plan's section (Plan.inference): config, batch per replica, "
                                  "decode micro-batches, prediction.");
  add_kwargs_init<InferencePlan>(iplan);
  add_copy<InferencePlan>(iplan);
  iplan.def_readwrite("config", &InferencePlan::config)
      .def_readwrite("batch_per_replica", &InferencePlan::batch_per_replica)
      .def_readwrite("decode_micro_batches", &InferencePlan::decode_micro_batches)
      .def_readwrite("prediction", &InferencePlan::prediction)
      .def(py::self == py::self);

  py::class_<InferenceOptions> options(m, "InferenceOptions", "Pins (tp, pp; 0 = searched) and alternatives kept.");
  add_kwargs_init<InferenceOptions>(options);
  add_copy<InferenceOptions>(options);
  options.def_readwrite("tp", &InferenceOptions::tp)
      .def_readwrite("pp", &InferenceOptions::pp)
      .def_readwrite("alternatives", &InferenceOptions::alternatives)
      .def_readwrite("tie_tolerance", &InferenceOptions::tie_tolerance);

  m.def("plan_inference", &plan_inference, py::arg("graph"), py::arg("cluster"), py::arg("config"),
        py::arg("options") = InferenceOptions{}, py::call_guard<py::gil_scoped_release>(),
        "The tp x pp layout (dp replicas fill the world) with the lowest per-token latency or the most tokens/s "
        "under the latency target; Plan.inference holds the prediction, Plan.choices why. InfeasibleError names "
        "the memory (or the target) when nothing qualifies.");
  m.def("evaluate_inference", &evaluate_inference, py::arg("graph"), py::arg("cluster"), py::arg("config"),
        py::arg("tp"), py::arg("pp"), py::arg("batch_per_replica"), py::arg("decode_micro_batches") = 1,
        py::call_guard<py::gil_scoped_release>(), "Scores one inference layout (memory not checked).");
  m.def("kv_cache_bytes_per_sequence", &kv_cache_bytes_per_sequence, py::arg("graph"), py::arg("tokens"),
        py::arg("kv_bytes"), py::arg("tp") = 1,
        "KV-cache bytes of one sequence of `tokens` on one device (kv heads split over tp).");
  m.def("validate", py::overload_cast<const InferenceConfig&>(&validate), py::arg("config"));
}

}  // namespace monarch::python
