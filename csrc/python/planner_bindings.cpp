// pybind11 bindings of the planner (torch_monarch._C.planner).
//
// The bindings mirror the C++ API one to one (same names, same fields, methods stay
// methods); torch_monarch/planner.py adds the Pythonic layer on top (strings for enums,
// keyword pins, file paths). Planner exceptions become Python exceptions with the very
// same message: ValidationError / FormatError / InfeasibleError derive from ValueError,
// any other PlannerError from RuntimeError.
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl_bind.h>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "monarch/planner/cluster.h"
#include "monarch/planner/dtype.h"
#include "monarch/planner/errors.h"
#include "monarch/planner/model_graph.h"
#include "monarch/planner/plan.h"
#include "monarch/planner/measured_trace.h"
#include "monarch/planner/report.h"
#include "monarch/planner/report_html.h"
#include "monarch/planner/cost_model.h"
#include "monarch/planner/collectives.h"
#include "monarch/planner/schedule.h"
#include "monarch/planner/search.h"
#include "monarch/planner/training_config.h"
#include "monarch/planner/traffic.h"
#include "binding_helpers.h"

// Lists whose elements users edit in place (plan.layers[3].stage = 2) are bound as opaque
// list types holding the C++ vector, so item access returns a reference, not a copy.
PYBIND11_MAKE_OPAQUE(std::vector<monarch::planner::Layer>)
PYBIND11_MAKE_OPAQUE(std::vector<monarch::planner::LayerPlacement>)
PYBIND11_MAKE_OPAQUE(std::vector<monarch::planner::Alternative>)

namespace py = pybind11;

namespace monarch::python {
namespace {

using namespace monarch::planner;
using namespace monarch::python::binding;

// ---------------------------------------------------------------------------------------
// Exceptions

py::handle g_planner_error;
py::handle g_validation_error;
py::handle g_format_error;
py::handle g_infeasible_error;

py::handle new_exception(py::module_& m, const char* name, PyObject* base, const char* doc) {
  const std::string qualified = std::string(PyModule_GetName(m.ptr())) + "." + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, base, nullptr);
  if (!type) throw py::error_already_set();
  m.add_object(name, py::handle(type));  // add_object takes its own reference; ours is kept
  return py::handle(type);
}

void set_python_error(py::handle type, const char* message, const std::string* field = nullptr) {
  py::object exc = type(message);
  if (field) exc.attr("field") = *field;
  PyErr_SetObject(type.ptr(), exc.ptr());
}

void bind_exceptions(py::module_& m) {
  g_planner_error = new_exception(m, "PlannerError", PyExc_RuntimeError,
                                  "Base of the planner's errors that are not ValueErrors.");
  g_validation_error = new_exception(
      m, "ValidationError", PyExc_ValueError,
      "A value is malformed or inconsistent; `field` is its dotted path (e.g. 'mesh.tp').");
  g_format_error = new_exception(m, "FormatError", PyExc_ValueError,
                                 "Plan JSON could not be parsed or has an unknown version.");
  g_infeasible_error = new_exception(m, "InfeasibleError", PyExc_ValueError,
                                     "No layout satisfies the constraints.");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ValidationError& e) {
      set_python_error(g_validation_error, e.what(), &e.field());
    } catch (const FormatError& e) {
      set_python_error(g_format_error, e.what());
    } catch (const InfeasibleError& e) {
      set_python_error(g_infeasible_error, e.what());
    } catch (const PlannerError& e) {
      set_python_error(g_planner_error, e.what());
    }
  });
}

// ---------------------------------------------------------------------------------------
// Enums

void bind_enums(py::module_& m) {
  py::enum_<DType> dtype(m, "DType", "Numeric formats: fp32, tf32, bf16, fp16, fp8.");
  dtype.value("fp32", DType::fp32)
      .value("tf32", DType::tf32)
      .value("bf16", DType::bf16)
      .value("fp16", DType::fp16)
      .value("fp8", DType::fp8);
  finish_enum(dtype, [](const std::string& n, const std::string& f) { return dtype_from_string(n, f); },
              "dtype");

  py::enum_<LayerKind> kind(m, "LayerKind");
  kind.value("embedding", LayerKind::embedding)
      .value("attention", LayerKind::attention)
      .value("mlp", LayerKind::mlp)
      .value("norm", LayerKind::norm)
      .value("block", LayerKind::block)
      .value("head", LayerKind::head)
      .value("other", LayerKind::other);
  finish_enum(kind, [](const std::string& n, const std::string& f) { return layer_kind_from_string(n, f); },
              "kind");

  py::enum_<TpPattern> tp(m, "TpPattern", "How a layer splits over the tp axis (Megatron-LM).");
  tp.value("replicated", TpPattern::replicated)
      .value("column_row", TpPattern::column_row)
      .value("heads", TpPattern::heads)
      .value("block", TpPattern::block)
      .value("vocab", TpPattern::vocab);
  finish_enum(tp, [](const std::string& n, const std::string& f) { return tp_pattern_from_string(n, f); },
              "tp");

  py::enum_<ScheduleKind> schedule(m, "ScheduleKind", "Pipeline schedules.");
  schedule.value("none", ScheduleKind::none)
      .value("gpipe", ScheduleKind::gpipe)
      .value("one_f_one_b", ScheduleKind::one_f_one_b)
      .value("interleaved_1f1b", ScheduleKind::interleaved_1f1b)
      .value("zero_bubble_h1", ScheduleKind::zero_bubble_h1)
      .value("zero_bubble_v", ScheduleKind::zero_bubble_v);
  finish_enum(schedule, [](const std::string& n, const std::string& f) { return schedule_from_string(n, f); },
              "schedule");

  py::enum_<AttentionKernel> attention(m, "AttentionKernel",
                                       "How attention is computed: flash (no s x s scores kept) or materialized.");
  attention.value("flash", AttentionKernel::flash).value("materialized", AttentionKernel::materialized);
  finish_enum(attention,
              [](const std::string& n, const std::string& f) { return attention_kernel_from_string(n, f); },
              "attention");
  py::enum_<Recompute> recompute(m, "Recompute", "Activation recomputation (Korthikanti et al. 2022).");
  recompute.value("none", Recompute::none)
      .value("selective", Recompute::selective)
      .value("full", Recompute::full);
  finish_enum(recompute, [](const std::string& n, const std::string& f) { return recompute_from_string(n, f); },
              "recompute");

  py::enum_<ActionType> action(m, "ActionType", "What one entry of a pipeline rank's program does.");
  action.value("forward", ActionType::forward)
      .value("backward", ActionType::backward)
      .value("backward_input", ActionType::backward_input)
      .value("backward_weight", ActionType::backward_weight)
      .value("send_activation", ActionType::send_activation)
      .value("recv_activation", ActionType::recv_activation)
      .value("send_gradient", ActionType::send_gradient)
      .value("recv_gradient", ActionType::recv_gradient);
  finish_enum(action, [](const std::string& n, const std::string& f) { return action_type_from_string(n, f); },
              "type");

  m.def("bytes_of", &bytes_of, py::arg("dtype"), "Bytes per element of a tensor stored in `dtype`.");
}

// ---------------------------------------------------------------------------------------
// Model graph

void bind_model_graph(py::module_& m) {
  py::class_<TpDims> dims(m, "TpDims", "What tp must divide for a layer to be split (0: no constraint).");
  add_kwargs_init<TpDims>(dims);
  add_copy<TpDims>(dims);
  dims.def_readwrite("heads", &TpDims::heads)
      .def_readwrite("kv_heads", &TpDims::kv_heads)
      .def_readwrite("ffn", &TpDims::ffn)
      .def_readwrite("vocab", &TpDims::vocab)
      .def("__repr__", [](const TpDims& d) {
        return "TpDims(heads=" + std::to_string(d.heads) + ", kv_heads=" + std::to_string(d.kv_heads) +
               ", ffn=" + std::to_string(d.ffn) + ", vocab=" + std::to_string(d.vocab) + ")";
      });

  py::class_<ActivationBytes> act(m, "ActivationBytes",
                                  "Activation bytes one sample keeps for backward (Korthikanti et al. 2022).");
  add_kwargs_init<ActivationBytes>(act);
  add_copy<ActivationBytes>(act);
  act.def_readwrite("replicated", &ActivationBytes::replicated)
      .def_readwrite("tp_sharded", &ActivationBytes::tp_sharded)
      .def_readwrite("attention_scores", &ActivationBytes::attention_scores)
      .def_readwrite("layer_input", &ActivationBytes::layer_input)
      .def_readwrite("backward_transient", &ActivationBytes::backward_transient,
                     "Live only while the layer's backward runs, beyond what it keeps (not in total()).")
      .def_readwrite("read_once", &ActivationBytes::read_once,
                     "Written and read once by the forward, not kept: memory traffic, not memory.")
      .def("total", &ActivationBytes::total)
      .def("__repr__", [](const ActivationBytes& a) {
        return "ActivationBytes(replicated=" + num(a.replicated) + ", tp_sharded=" + num(a.tp_sharded) +
               ", attention_scores=" + num(a.attention_scores) + ", layer_input=" + num(a.layer_input) + ")";
      });

  py::enum_<GemmSplit>(m, "GemmSplit", "The dimension of a GEMM tensor parallelism divides.")
      .value("none", GemmSplit::none)
      .value("n", GemmSplit::n)
      .value("k", GemmSplit::k);
  py::class_<Gemm> gemm(m, "Gemm", "A layer's weight GEMM per sample: (m_per_sample x k) @ (k x n).");
  add_kwargs_init<Gemm>(gemm);
  add_copy<Gemm>(gemm);
  gemm.def_readwrite("m_per_sample", &Gemm::m_per_sample)
      .def_readwrite("n", &Gemm::n)
      .def_readwrite("k", &Gemm::k)
      .def_readwrite("split", &Gemm::split)
      .def_readwrite("experts", &Gemm::experts)
      .def("__repr__", [](const Gemm& g) {
        return "<Gemm " + num(g.m_per_sample) + " x " + std::to_string(g.k) + " @ " + std::to_string(g.k) + " x " +
               std::to_string(g.n) + ">";
      });

  py::class_<MoeDims> moe_dims(m, "MoeDims", "A Mixture-of-Experts layer's routing (experts == 0: dense).");
  add_kwargs_init<MoeDims>(moe_dims);
  add_copy<MoeDims>(moe_dims);
  moe_dims.def_readwrite("experts", &MoeDims::experts)
      .def_readwrite("top_k", &MoeDims::top_k)
      .def_readwrite("expert_params", &MoeDims::expert_params)
      .def_readwrite("routed_flops_per_sample", &MoeDims::routed_flops_per_sample)
      .def_readwrite("dispatch_bytes_per_sample", &MoeDims::dispatch_bytes_per_sample)
      .def_readwrite("capacity_factor", &MoeDims::capacity_factor)
      .def_readwrite("imbalance", &MoeDims::imbalance)
      .def("__repr__", [](const MoeDims& d) {
        return "MoeDims(experts=" + std::to_string(d.experts) + ", top_k=" + std::to_string(d.top_k) +
               ", expert_params=" + std::to_string(d.expert_params) + ")";
      });

  py::class_<Layer> layer(m, "Layer", "One layer as the planner sees it.");
  add_kwargs_init<Layer>(layer);
  add_copy<Layer>(layer);
  layer.def_readwrite("name", &Layer::name)
      .def_readwrite("kind", &Layer::kind)
      .def_readwrite("params", &Layer::params)
      .def_readwrite("param_dtype", &Layer::param_dtype)
      .def_readwrite("forward_flops_per_sample", &Layer::forward_flops_per_sample)
      .def_readwrite("attention_flops_per_sample", &Layer::attention_flops_per_sample)
      .def_readwrite("activations", &Layer::activations)
      .def_readwrite("output_bytes_per_sample", &Layer::output_bytes_per_sample)
      .def_readwrite("tp", &Layer::tp)
      .def_readwrite("tp_dims", &Layer::tp_dims)
      .def_readwrite("recomputable", &Layer::recomputable)
      .def_readwrite("gemms", &Layer::gemms)
      .def_readwrite("kv_elements_per_token", &Layer::kv_elements_per_token)
      .def_readwrite("moe", &Layer::moe)
      .def("__repr__", [](const Layer& l) {
        return "<Layer " + quoted(l.name) + " " + to_string(l.kind) + " params=" + std::to_string(l.params) +
               " tp=" + to_string(l.tp) + ">";
      });
  py::bind_vector<std::vector<Layer>>(m, "LayerList");
  py::implicitly_convertible<py::list, std::vector<Layer>>();
  py::implicitly_convertible<py::tuple, std::vector<Layer>>();

  py::class_<MoeConfig> moe_config(m, "MoeConfig",
                                   "Mixture-of-Experts layers of a transformer: MoeConfig(experts=8, top_k=2); "
                                   "capacity_factor 0 is dropless.");
  add_kwargs_init<MoeConfig>(moe_config);
  add_copy<MoeConfig>(moe_config);
  moe_config.def_readwrite("experts", &MoeConfig::experts)
      .def_readwrite("top_k", &MoeConfig::top_k)
      .def_readwrite("expert_ffn", &MoeConfig::expert_ffn)
      .def_readwrite("shared_experts", &MoeConfig::shared_experts)
      .def_readwrite("first_dense_layers", &MoeConfig::first_dense_layers)
      .def_readwrite("every", &MoeConfig::every)
      .def_readwrite("capacity_factor", &MoeConfig::capacity_factor)
      .def_readwrite("imbalance", &MoeConfig::imbalance)
      .def(py::self == py::self)
      .def("__repr__", [](const MoeConfig& c) {
        return "MoeConfig(experts=" + std::to_string(c.experts) + ", top_k=" + std::to_string(c.top_k) +
               ", expert_ffn=" + std::to_string(c.expert_ffn) + ", shared_experts=" +
               std::to_string(c.shared_experts) + ", first_dense_layers=" + std::to_string(c.first_dense_layers) +
               ", every=" + std::to_string(c.every) + ", capacity_factor=" + num(c.capacity_factor) +
               ", imbalance=" + num(c.imbalance) + ")";
      });

  py::class_<TransformerConfig> tc(m, "TransformerConfig",
                                   "Hyperparameters of a decoder-only transformer. "
                                   "TransformerConfig(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)");
  add_kwargs_init<TransformerConfig>(tc);
  add_copy<TransformerConfig>(tc);
  tc.def_readwrite("name", &TransformerConfig::name)
      .def_readwrite("layers", &TransformerConfig::layers)
      .def_readwrite("hidden", &TransformerConfig::hidden)
      .def_readwrite("heads", &TransformerConfig::heads)
      .def_readwrite("kv_heads", &TransformerConfig::kv_heads)
      .def_readwrite("ffn", &TransformerConfig::ffn)
      .def_readwrite("gated_mlp", &TransformerConfig::gated_mlp)
      .def_readwrite("seq", &TransformerConfig::seq)
      .def_readwrite("vocab", &TransformerConfig::vocab)
      .def_readwrite("tied_embeddings", &TransformerConfig::tied_embeddings)
      .def_readwrite("dtype", &TransformerConfig::dtype)
      .def_readwrite("attention", &TransformerConfig::attention)
      .def_readwrite("head_dim", &TransformerConfig::head_dim)
      .def_readwrite("attention_params", &TransformerConfig::attention_params)
      .def_readwrite("moe", &TransformerConfig::moe)
      .def_readwrite("fused_kernels", &TransformerConfig::fused_kernels,
                     "Activations as fused kernels keep them (Megatron-LM / Transformer Engine), or eager ops (False).")
      .def_readwrite("dropout", &TransformerConfig::dropout, "The model has dropout (its masks are kept).")
      .def(py::self == py::self)
      .def("__repr__", [](const TransformerConfig& c) {
        std::ostringstream os;
        os << "TransformerConfig(name=" << quoted(c.name) << ", layers=" << c.layers << ", hidden=" << c.hidden
           << ", heads=" << c.heads << ", kv_heads=" << c.kv_heads << ", ffn=" << c.ffn
           << ", gated_mlp=" << pybool(c.gated_mlp) << ", seq=" << c.seq << ", vocab=" << c.vocab
           << ", tied_embeddings=" << pybool(c.tied_embeddings) << ", dtype=" << to_string(c.dtype)
           << ", attention=" << to_string(c.attention) << ")";
        return os.str();
      });

  py::class_<ModelGraph> graph(m, "ModelGraph",
                               "A model as the planner sees it: layers in execution order, extra "
                               "data-flow edges, tied weight groups.");
  add_kwargs_init<ModelGraph>(graph);
  add_copy<ModelGraph>(graph);
  graph.def_readwrite("name", &ModelGraph::name)
      .def_readwrite("layers", &ModelGraph::layers)
      .def_readwrite("edges", &ModelGraph::edges)
      .def_readwrite("tied_groups", &ModelGraph::tied_groups)
      .def_readwrite("tied_group_params", &ModelGraph::tied_group_params)
      .def_readwrite("transformer", &ModelGraph::transformer)
      .def("total_params", &ModelGraph::total_params)
      .def("seq_len", &ModelGraph::seq_len)
      .def("can_cut_before", &ModelGraph::can_cut_before, py::arg("index"))
      .def("__len__", [](const ModelGraph& g) { return g.layers.size(); })
      .def("__repr__", [](const ModelGraph& g) {
        return "<ModelGraph " + quoted(g.name) + ": " + std::to_string(g.layers.size()) + " layers, " +
               std::to_string(g.total_params()) + " params>";
      });

  m.def(
      "restrict_cuts_to_blocks",
      [](ModelGraph& graph) {
        restrict_cuts_to_blocks(graph);
        return graph;
      },
      py::arg("graph"),
      "Sets graph.edges so pipeline cuts fall only between blocks (what the runtime can cut); returns the graph.");
  m.def("build_transformer", &build_transformer, py::arg("config"),
        "Layer list of a decoder transformer: embedding, blocks, final norm, LM head.");
}

// ---------------------------------------------------------------------------------------
// Cluster and training configuration

// A two-level field set from Python: with levels, the matching level (0: intra, 1: inter)
// follows, so old code that edits intra_node_* / inter_node_* keeps the cluster consistent.
void set_compat_link(Cluster& c, size_t level, const double* bytes_per_s, const double* latency_s) {
  double& bw = level == 0 ? c.intra_node_bytes_per_s : c.inter_node_bytes_per_s;
  double& lat = level == 0 ? c.intra_node_latency_s : c.inter_node_latency_s;
  if (bytes_per_s) bw = *bytes_per_s;
  if (latency_s) lat = *latency_s;
  if (c.levels.size() > level) {
    if (bytes_per_s) c.levels[level].bytes_per_s = *bytes_per_s;
    if (latency_s) c.levels[level].latency_s = *latency_s;
  }
}

void bind_cluster_training(py::module_& m) {
  py::class_<LinkLevel> level(m, "LinkLevel",
                              "One tier of the network, innermost first (docs/cost_model.md, \"Link levels\"): name, "
                              "devices per unit (cumulative; 0 on the outermost), bytes_per_s per device, latency_s, "
                              "oversubscription (>= 1: bytes_per_s is divided by it for groups that reach this level).");
  add_kwargs_init<LinkLevel>(level);
  add_copy<LinkLevel>(level);
  level.def_readwrite("name", &LinkLevel::name)
      .def_readwrite("devices", &LinkLevel::devices)
      .def_readwrite("bytes_per_s", &LinkLevel::bytes_per_s)
      .def_readwrite("latency_s", &LinkLevel::latency_s)
      .def_readwrite("oversubscription", &LinkLevel::oversubscription)
      .def(py::self == py::self)
      .def("__repr__", [](const LinkLevel& l) {
        return "LinkLevel(name=" + quoted(l.name) + ", devices=" + std::to_string(l.devices) + ", bytes_per_s=" +
               num(l.bytes_per_s) + ", latency_s=" + num(l.latency_s) + ", oversubscription=" +
               num(l.oversubscription) + ")";
      });

  py::class_<Cluster> cluster(m, "Cluster",
                              "Identical nodes of identical devices on link levels (two by default: intra-node, "
                              "inter-node; `levels` for more).");
  add_kwargs_init<Cluster>(cluster);
  add_copy<Cluster>(cluster);
  cluster.def_readwrite("name", &Cluster::name)
      .def_readwrite("nodes", &Cluster::nodes)
      .def_readwrite("devices_per_node", &Cluster::devices_per_node)
      .def_readwrite("device_memory_bytes", &Cluster::device_memory_bytes)
      .def_readwrite("memory_reserved_bytes", &Cluster::memory_reserved_bytes)
      .def_readwrite("peak_flops_fp32", &Cluster::peak_flops_fp32)
      .def_readwrite("peak_flops_tf32", &Cluster::peak_flops_tf32)
      .def_readwrite("peak_flops_bf16", &Cluster::peak_flops_bf16)
      .def_readwrite("peak_flops_fp8", &Cluster::peak_flops_fp8)
      .def_readwrite("matmul_efficiency", &Cluster::matmul_efficiency)
      .def_readwrite("backward_forward_ratio", &Cluster::backward_forward_ratio)
      .def_readwrite("overlap_contention", &Cluster::overlap_contention)
      .def_readwrite("cores_per_node", &Cluster::cores_per_node)
      .def_readwrite("straggler_spread", &Cluster::straggler_spread)
      .def_readwrite("sm_count", &Cluster::sm_count)
      .def_readwrite("hbm_bytes_per_s", &Cluster::hbm_bytes_per_s)
      // The two-level fields: with levels given they are levels[0] (intra) and levels[1]
      // (inter), and setting one sets that level too.
      .def_property(
          "intra_node_bytes_per_s", [](const Cluster& c) { return c.intra_node_bytes_per_s; },
          [](Cluster& c, double v) { set_compat_link(c, 0, &v, nullptr); })
      .def_property(
          "intra_node_latency_s", [](const Cluster& c) { return c.intra_node_latency_s; },
          [](Cluster& c, double v) { set_compat_link(c, 0, nullptr, &v); })
      .def_property(
          "inter_node_bytes_per_s", [](const Cluster& c) { return c.inter_node_bytes_per_s; },
          [](Cluster& c, double v) { set_compat_link(c, 1, &v, nullptr); })
      .def_property(
          "inter_node_latency_s", [](const Cluster& c) { return c.inter_node_latency_s; },
          [](Cluster& c, double v) { set_compat_link(c, 1, nullptr, &v); })
      .def_property(
          "levels", [](const Cluster& c) { return c.levels; },
          [](Cluster& c, std::vector<LinkLevel> levels) { set_levels(c, std::move(levels)); },
          "The network as LinkLevels, innermost first ([]: the two-level fields). Setting it sets "
          "intra_node_* from levels[0] and inter_node_* from levels[1]. A list: assign a new one to change it.")
      .def("link_levels", [](const Cluster& c) { return link_levels(c); },
           "levels, or the two default ones (node, network) built from the two-level fields.")
      .def("world_size", &Cluster::world_size)
      .def("peak_flops", &Cluster::peak_flops, py::arg("dtype"))
      .def("usable_memory_bytes", &Cluster::usable_memory_bytes)
      .def(py::self == py::self)
      .def("__repr__", [](const Cluster& c) {
        return "<Cluster " + quoted(c.name) + ": " + std::to_string(c.nodes) + " nodes x " +
               std::to_string(c.devices_per_node) + " devices, " + format_bytes(c.device_memory_bytes) +
               " per device>";
      });

  m.def("zero_overlap_pays", &zero_overlap_pays, py::arg("cluster"),
        "Whether overlapping the ZeRO engine's collectives with computation can save time (overlap_contention < 1).");
  m.def("cluster_preset", &cluster_preset, py::arg("name"), py::arg("devices"),
        "A known cluster (see cluster_preset_names()) with `devices` devices in total.");
  m.def("cluster_preset_names", &cluster_preset_names);

  py::class_<TrainingConfig> training(m, "TrainingConfig",
                                      "What is trained and which techniques the search may use.");
  add_kwargs_init<TrainingConfig>(training);
  add_copy<TrainingConfig>(training);
  training.def_readwrite("global_batch", &TrainingConfig::global_batch)
      .def_readwrite("compute_dtype", &TrainingConfig::compute_dtype)
      .def_readwrite("param_bytes", &TrainingConfig::param_bytes)
      .def_readwrite("grad_bytes", &TrainingConfig::grad_bytes)
      .def_readwrite("zero_grad_bytes", &TrainingConfig::zero_grad_bytes)
      .def_readwrite("master_grad_bytes", &TrainingConfig::master_grad_bytes)
      .def_readwrite("optimizer_bytes", &TrainingConfig::optimizer_bytes)
      .def_readwrite("activation_bytes", &TrainingConfig::activation_bytes)
      .def_readwrite("allow_tensor_parallel", &TrainingConfig::allow_tensor_parallel)
      .def_readwrite("allow_pipeline_parallel", &TrainingConfig::allow_pipeline_parallel)
      .def_readwrite("allow_zero", &TrainingConfig::allow_zero)
      .def_readwrite("allow_recompute", &TrainingConfig::allow_recompute)
      .def_readwrite("recompute_modes", &TrainingConfig::recompute_modes,
                     "Recompute modes the search may use when allow_recompute (none is always one).")
      .def_readwrite("allow_sequence_parallel", &TrainingConfig::allow_sequence_parallel)
      .def_readwrite("schedules", &TrainingConfig::schedules,
                     "A copy: assign a new list to change it (appending to the copy has no effect).")
      .def_readwrite("max_micro_batch_size", &TrainingConfig::max_micro_batch_size)
      .def_readwrite("dp_bucket_bytes", &TrainingConfig::dp_bucket_bytes)
      .def_readwrite("allow_hierarchical_dp", &TrainingConfig::allow_hierarchical_dp,
                     "The search may reduce dp gradients hierarchically across nodes (ZeRO 0).")
      .def_property(
          "inter_node_compression",
          [](const TrainingConfig& t) { return to_string(t.inter_node_compression); },
          [](TrainingConfig& t, const std::string& name) {
            t.inter_node_compression = compression_from_string(name, "training.inter_node_compression");
          },
          "Lossy compression the search may put on the inter-node hop: 'none', 'bf16' or 'int8'.")
      .def_readwrite("pipeline_sends_kept", &TrainingConfig::pipeline_sends_kept,
                     "Pipeline stages keep what they send until the step ends (torch_monarch's runtime), "
                     "instead of freeing it once sent (Megatron-LM).")
      .def_readwrite("weights_cast_per_forward", &TrainingConfig::weights_cast_per_forward,
                     "Each forward casts the weights to the compute dtype and keeps the copies until its backward "
                     "(torch_monarch's mixed precision below ZeRO-3).")
      .def(py::self == py::self)
      .def("__repr__", [](const TrainingConfig& t) {
        return "<TrainingConfig global_batch=" + std::to_string(t.global_batch) +
               " compute_dtype=" + to_string(t.compute_dtype) + ">";
      });

  py::class_<Pins> pins(m, "Pins", "Choices a user fixes; None means searched.");
  add_kwargs_init<Pins>(pins);
  add_copy<Pins>(pins);
  pins.def_readwrite("tp", &Pins::tp)
      .def_readwrite("pp", &Pins::pp)
      .def_readwrite("dp", &Pins::dp)
      .def_readwrite("zero_stage", &Pins::zero_stage)
      .def_readwrite("micro_batch_size", &Pins::micro_batch_size)
      .def_readwrite("virtual_stages", &Pins::virtual_stages)
      .def_readwrite("schedule", &Pins::schedule)
      .def_readwrite("recompute", &Pins::recompute)
      .def_readwrite("sequence_parallel", &Pins::sequence_parallel)
      .def_readwrite("zero_overlap", &Pins::zero_overlap)
      .def_readwrite("cp", &Pins::cp)
      .def_readwrite("ep", &Pins::ep)
      .def("all_layout_pinned", &Pins::all_layout_pinned)
      .def("__repr__", [](const Pins& p) {
        return "Pins(tp=" + opt(p.tp) + ", pp=" + opt(p.pp) + ", dp=" + opt(p.dp) +
               ", zero_stage=" + opt(p.zero_stage) + ", micro_batch_size=" + opt(p.micro_batch_size) +
               ", virtual_stages=" + opt(p.virtual_stages) + ", schedule=" + opt(p.schedule) +
               ", recompute=" + opt(p.recompute) + ", sequence_parallel=" + opt(p.sequence_parallel) + ")";
      });

  m.def("validate", py::overload_cast<const Cluster&>(&validate), py::arg("cluster"));
  m.def("validate", py::overload_cast<const TrainingConfig&>(&validate), py::arg("training"));
  m.def("validate", py::overload_cast<const ModelGraph&>(&validate), py::arg("graph"),
        "Checks a model graph can be planned (counts finite and >= 0, edges and tied groups in range).");
}

// ---------------------------------------------------------------------------------------
// Plan

void bind_plan(py::module_& m) {
  m.attr("PLAN_FORMAT_VERSION") = kPlanFormatVersion;

  py::class_<Mesh> mesh(m, "Mesh",
                        "Device mesh: pp x dp x cp x tp, axis order outermost first; ep (experts) divides dp x cp.");
  add_kwargs_init<Mesh>(mesh);
  add_copy<Mesh>(mesh);
  mesh.def_readwrite("pp", &Mesh::pp)
      .def_readwrite("dp", &Mesh::dp)
      .def_readwrite("tp", &Mesh::tp)
      .def_readwrite("cp", &Mesh::cp)
      .def_readwrite("ep", &Mesh::ep)
      .def_readwrite("order", &Mesh::order)
      .def("world_size", &Mesh::world_size)
      .def("expert_data_parallel", &Mesh::expert_data_parallel)
      .def(py::self == py::self)
      .def("__repr__", [](const Mesh& x) {
        std::string s = "Mesh(pp=" + std::to_string(x.pp) + ", dp=" + std::to_string(x.dp);
        if (x.cp != 1) s += ", cp=" + std::to_string(x.cp);
        s += ", tp=" + std::to_string(x.tp);
        if (x.ep != 1) s += ", ep=" + std::to_string(x.ep);
        return s + ")";
      });

  py::class_<LayerPlacement> lp(m, "LayerPlacement", "Where one layer goes: stage, tp split, sharding unit.");
  add_kwargs_init<LayerPlacement>(lp);
  add_copy<LayerPlacement>(lp);
  lp.def_readwrite("name", &LayerPlacement::name)
      .def_readwrite("kind", &LayerPlacement::kind)
      .def_readwrite("params", &LayerPlacement::params)
      .def_readwrite("stage", &LayerPlacement::stage)
      .def_readwrite("tp", &LayerPlacement::tp)
      .def_readwrite("tp_dims", &LayerPlacement::tp_dims)
      .def_readwrite("sharding_unit", &LayerPlacement::sharding_unit)
      .def(py::self == py::self)
      .def("__repr__", [](const LayerPlacement& l) {
        return "<LayerPlacement " + quoted(l.name) + " stage=" + std::to_string(l.stage) +
               " tp=" + to_string(l.tp) + (l.sharding_unit ? " sharding_unit" : "") + ">";
      });
  py::bind_vector<std::vector<LayerPlacement>>(m, "LayerPlacementList");
  py::implicitly_convertible<py::list, std::vector<LayerPlacement>>();
  py::implicitly_convertible<py::tuple, std::vector<LayerPlacement>>();

  py::class_<MemoryBreakdown> mem(m, "MemoryBreakdown", "Bytes on the most loaded rank.");
  add_kwargs_init<MemoryBreakdown>(mem);
  add_copy<MemoryBreakdown>(mem);
  mem.def_readwrite("params", &MemoryBreakdown::params)
      .def_readwrite("grads", &MemoryBreakdown::grads)
      .def_readwrite("optimizer", &MemoryBreakdown::optimizer)
      .def_readwrite("activations", &MemoryBreakdown::activations)
      .def_readwrite("buffers", &MemoryBreakdown::buffers)
      .def("total", &MemoryBreakdown::total)
      .def(py::self == py::self)
      .def("__repr__", [](const MemoryBreakdown& b) {
        return "MemoryBreakdown(params=" + num(b.params) + ", grads=" + num(b.grads) +
               ", optimizer=" + num(b.optimizer) + ", activations=" + num(b.activations) +
               ", buffers=" + num(b.buffers) + ")";
      });

  py::class_<TimeBreakdown> time(m, "TimeBreakdown", "Seconds per optimizer step.");
  add_kwargs_init<TimeBreakdown>(time);
  add_copy<TimeBreakdown>(time);
  time.def_readwrite("compute", &TimeBreakdown::compute)
      .def_readwrite("recompute", &TimeBreakdown::recompute)
      .def_readwrite("tp_comm", &TimeBreakdown::tp_comm)
      .def_readwrite("dp_comm", &TimeBreakdown::dp_comm)
      .def_readwrite("pp_comm", &TimeBreakdown::pp_comm)
      .def_readwrite("bubble", &TimeBreakdown::bubble)
      .def_readwrite("optimizer", &TimeBreakdown::optimizer)
      .def_readwrite("stragglers", &TimeBreakdown::stragglers)
      .def_readwrite("total", &TimeBreakdown::total)
      .def_readwrite("ep_comm", &TimeBreakdown::ep_comm)
      .def_readwrite("cp_comm", &TimeBreakdown::cp_comm)
      .def(py::self == py::self)
      .def("__repr__", [](const TimeBreakdown& t) {
        return "TimeBreakdown(compute=" + num(t.compute) + ", recompute=" + num(t.recompute) +
               ", tp_comm=" + num(t.tp_comm) + ", dp_comm=" + num(t.dp_comm) + ", pp_comm=" + num(t.pp_comm) +
               ", bubble=" + num(t.bubble) + ", optimizer=" + num(t.optimizer) + ", total=" + num(t.total) + ")";
      });

  py::class_<RankPrediction> rank_pred(m, "RankPrediction",
                                       "One pipeline rank as predicted: memory, busy and idle time, bytes sent per axis.");
  add_kwargs_init<RankPrediction>(rank_pred);
  add_copy<RankPrediction>(rank_pred);
  rank_pred.def_readwrite("memory", &RankPrediction::memory)
      .def_readwrite("busy_s", &RankPrediction::busy_s)
      .def_readwrite("idle_s", &RankPrediction::idle_s)
      .def_readwrite("dp_bytes", &RankPrediction::dp_bytes)
      .def_readwrite("tp_bytes", &RankPrediction::tp_bytes)
      .def_readwrite("pp_bytes", &RankPrediction::pp_bytes)
      .def_readwrite("ends_bytes", &RankPrediction::ends_bytes)
      .def_readwrite("dp_inter_node_bytes", &RankPrediction::dp_inter_node_bytes)
      .def(py::self == py::self)
      .def("__repr__", [](const RankPrediction& r) {
        return "<RankPrediction " + format_bytes(r.memory.total()) + ", busy " + format_seconds(r.busy_s) + ">";
      });

  py::class_<Prediction> pred(m, "Prediction", "What the cost model expects of a layout.");
  add_kwargs_init<Prediction>(pred);
  add_copy<Prediction>(pred);
  pred.def_readwrite("step_time_s", &Prediction::step_time_s)
      .def_readwrite("time", &Prediction::time)
      .def_readwrite("memory", &Prediction::memory)
      .def_readwrite("memory_bytes_per_device", &Prediction::memory_bytes_per_device)
      .def_readwrite("tokens_per_s", &Prediction::tokens_per_s)
      .def_readwrite("tflops_per_device", &Prediction::tflops_per_device)
      .def_readwrite("mfu", &Prediction::mfu)
      .def_readwrite("bubble_fraction", &Prediction::bubble_fraction)
      .def_readwrite("estimator", &Prediction::estimator)
      .def_readwrite("stages", &Prediction::stages, "Per virtual stage, one micro-batch's StageCosts (a copy).")
      .def_readwrite("ranks", &Prediction::ranks, "Per pipeline rank, a RankPrediction (a copy).")
      .def(py::self == py::self)
      .def("__repr__", [](const Prediction& p) {
        return "<Prediction step=" + format_seconds(p.step_time_s) + ", " + num(p.tflops_per_device) +
               " TFLOP/s per device, mfu=" + num(p.mfu) + ", " + format_bytes(p.memory_bytes_per_device) +
               " per device>";
      });

  py::class_<Alternative> alt(m, "Alternative", "A layout the search considered and did not pick, and why.");
  add_kwargs_init<Alternative>(alt);
  add_copy<Alternative>(alt);
  alt.def_readwrite("summary", &Alternative::summary)
      .def_readwrite("step_time_s", &Alternative::step_time_s)
      .def_readwrite("memory_bytes_per_device", &Alternative::memory_bytes_per_device)
      .def_readwrite("reason", &Alternative::reason)
      .def(py::self == py::self)
      .def("__repr__", [](const Alternative& a) { return "<Alternative " + a.summary + ": " + a.reason + ">"; });
  py::bind_vector<std::vector<Alternative>>(m, "AlternativeList");
  py::implicitly_convertible<py::list, std::vector<Alternative>>();
  py::implicitly_convertible<py::tuple, std::vector<Alternative>>();

  py::class_<Plan> plan(m, "Plan",
                        "The contract between planner and runtime: mesh, sharding, stages, micro-batches, "
                        "schedule, recompute, buckets, and the cost model's prediction.");
  add_kwargs_init<Plan>(plan);
  add_copy<Plan>(plan);
  plan.def_readwrite("version", &Plan::version)
      .def_readwrite("model_name", &Plan::model_name)
      .def_readwrite("model_params", &Plan::model_params)
      .def_readwrite("transformer", &Plan::transformer)
      .def_readwrite("cluster", &Plan::cluster)
      .def_readwrite("training", &Plan::training)
      .def_readwrite("mesh", &Plan::mesh)
      .def_readwrite("zero_stage", &Plan::zero_stage)
      .def_readwrite("micro_batch_size", &Plan::micro_batch_size)
      .def_readwrite("num_micro_batches", &Plan::num_micro_batches)
      .def_readwrite("schedule", &Plan::schedule)
      .def_readwrite("virtual_stages", &Plan::virtual_stages)
      .def_readwrite("recompute", &Plan::recompute)
      .def_readwrite("sequence_parallel", &Plan::sequence_parallel)
      .def_readwrite("dp_bucket_bytes", &Plan::dp_bucket_bytes)
      .def_property(
          "dp_reduction", [](const Plan& p) { return to_string(p.dp_reduction); },
          [](Plan& p, const std::string& name) { p.dp_reduction = dp_reduction_from_string(name); },
          "'flat' or 'hierarchical' (reduce inside the node, across nodes, gather inside).")
      .def_property(
          "inter_node_compression", [](const Plan& p) { return to_string(p.inter_node_compression); },
          [](Plan& p, const std::string& name) { p.inter_node_compression = compression_from_string(name); },
          "'none', 'bf16' or 'int8': the inter-node hop of a hierarchical reduction.")
      .def_readwrite("zero_overlap", &Plan::zero_overlap,
                     "ZeRO 1-3: a unit's gradient reduce-scatter in flight during the next unit's backward, or each waited for.")
      .def_readwrite("layers", &Plan::layers)
      .def_readwrite("embeddings", &Plan::embeddings)
      .def_readwrite("prediction", &Plan::prediction)
      .def_readwrite("alternatives", &Plan::alternatives)
      .def_readwrite("tie_break", &Plan::tie_break)
      .def_readwrite("choices", &Plan::choices)
      .def_readwrite("inference", &Plan::inference, "InferencePlan of an inference plan; None for training plans.")
      .def("num_stages", &Plan::num_stages)
      .def("summary", &Plan::summary, "One line: mesh, zero, micro-batch size, schedule, recompute.")
      .def(
          "to_json", [](const Plan& p, int indent) { return to_json(p, indent); }, py::arg("indent") = 2,
          "Versioned JSON; parses back to an equal Plan and re-serializes to identical text.")
      .def_static("from_json", &plan_from_json, py::arg("text"),
                  "Parses plan JSON. FormatError (a ValueError) for unparsable text or an unknown version.")
      .def(
          "save_html_report",
          [](const Plan& p, const std::string& path, std::optional<std::string> trace, int64_t trace_step) {
            HtmlReportOptions options;
            if (trace) options.trace = load_measured_trace(*trace);
            options.trace_step = trace_step;
            save_html_report(p, path, options);
          },
          py::arg("path"), py::arg("trace") = py::none(), py::arg("trace_step") = -1,
          "Writes the plan as one self-contained HTML page (monarch-plan report); `trace`: a run's measured "
          "trace (model.trace()) drawn under the predicted timeline.")
      .def("diff", &diff_plans, py::arg("other"), "What differs between this plan and `other` (monarch-plan diff).")
      .def(py::self == py::self)
      .def("__repr__", [](const Plan& p) { return "<Plan " + quoted(p.model_name) + ": " + p.summary() + ">"; })
      .def(py::pickle([](const Plan& p) { return to_json(p, 2); },
                      [](const std::string& text) { return plan_from_json(text); }));

  m.def(
      "dp_reduction_seconds",
      [](const Cluster& cluster, int64_t dp, double bytes, bool hierarchical, const std::string& compression,
         double element_bytes) {
        return dp_group(cluster, 1, dp, 1, hierarchical ? DpReduction::hierarchical : DpReduction::flat,
                        compression_from_string(compression))
            .seconds(Collective::all_reduce, bytes, element_bytes);
      },
      py::arg("cluster"), py::arg("dp"), py::arg("bytes"), py::arg("hierarchical"), py::arg("compression") = "none",
      py::arg("element_bytes") = 4.0,
      "The cost model's time for a data-parallel gradient all-reduce of `bytes` over dp ranks (pp = tp = 1) on "
      "`cluster`'s links: flat ring, or hierarchical with the inter-node hop compressed (collectives.h).");
  m.def("diff_plans", &diff_plans, py::arg("a"), py::arg("b"));
  m.def("to_json", &to_json, py::arg("plan"), py::arg("indent") = 2);
  m.def("plan_from_json", &plan_from_json, py::arg("text"));
  m.def("load_plan", &load_plan, py::arg("path"));
  m.def("save_plan", &save_plan, py::arg("plan"), py::arg("path"));
  m.def("validate", py::overload_cast<const Plan&>(&validate), py::arg("plan"),
        "Checks a plan on its own; ValidationError names the offending field.");
  m.def("validate", py::overload_cast<const Plan&, const ModelGraph&>(&validate), py::arg("plan"),
        py::arg("graph"), "Also checks the plan was made for `graph`.");

  m.def("format_report", &format_report, py::arg("plan"), "Multi-line human-readable summary of a plan.");
  m.def("format_bytes", &format_bytes, py::arg("bytes"));
  m.def("format_seconds", &format_seconds, py::arg("seconds"));
}

// ---------------------------------------------------------------------------------------
// Search

void bind_search(py::module_& m) {
  py::class_<SearchOptions> options(m, "SearchOptions");
  add_kwargs_init<SearchOptions>(options);
  add_copy<SearchOptions>(options);
  options.def_readwrite("pins", &SearchOptions::pins)
      .def_readwrite("alternatives", &SearchOptions::alternatives)
      .def_readwrite("tie_tolerance", &SearchOptions::tie_tolerance)
      .def("__repr__", [](const SearchOptions& o) {
        return "<SearchOptions alternatives=" + std::to_string(o.alternatives) + ">";
      });

  m.def("search", &search, py::arg("graph"), py::arg("cluster"), py::arg("training"),
        py::arg("options") = SearchOptions{}, py::call_guard<py::gil_scoped_release>(),
        "The fastest layout that fits memory. InfeasibleError when nothing fits, "
        "ValidationError when a pin is impossible (both ValueErrors).");
  m.def("evaluate_layout",
        [](const ModelGraph& graph, const Cluster& cluster, const TrainingConfig& training, const Pins& pins,
           bool allow_over_memory) { return evaluate_layout(graph, cluster, training, pins, allow_over_memory); },
        py::arg("graph"), py::arg("cluster"), py::arg("training"),
        py::arg("pins"), py::arg("allow_over_memory") = false, py::call_guard<py::gil_scoped_release>(),
        "Scores one fully pinned layout.");
  m.def(
      "tp_bytes_per_step",
      [](const ModelGraph& graph, const TrainingConfig& training, int64_t tp, int64_t micro_batch_size,
         int64_t num_micro_batches, bool sequence_parallel, Recompute recompute) {
        Layout l;
        l.tp = tp;
        l.micro_batch_size = micro_batch_size;
        l.num_micro_batches = num_micro_batches;
        l.sequence_parallel = sequence_parallel;
        l.recompute = recompute;
        return tp_bytes_per_step(graph, training, l);
      },
      py::arg("graph"), py::arg("training"), py::arg("tp"), py::arg("micro_batch_size"),
      py::arg("num_micro_batches") = 1, py::arg("sequence_parallel") = false, py::arg("recompute") = Recompute::none,
      "Bytes one tp rank sends in tensor-parallel collectives per step, over all layers (ring volumes).");
  m.def(
      "bytes_per_step",
      [](const ModelGraph& graph, const Plan& plan) {
        std::vector<std::map<std::string, double>> out;
        for (const auto& b : bytes_per_step(graph, plan)) {
          std::map<std::string, double> row{{"dp", b.dp}, {"tp", b.tp}, {"pp", b.pp}, {"ends", b.ends},
                                            {"total", b.total()}};
          // Only where used, so dense plans' rows read as before.
          if (plan.mesh.ep > 1) row["ep"] = b.ep;
          if (plan.mesh.cp > 1) row["cp"] = b.cp;
          out.push_back(row);
        }
        return out;
      },
      py::arg("graph"), py::arg("plan"),
      "Bytes one rank sends per optimizer step on each mesh axis, per pipeline rank, as the runtime's "
      "communicator counts them: [{'dp', 'tp', 'pp', 'ends', 'total'}].");
}

// ---------------------------------------------------------------------------------------
// Schedules

void bind_schedule(py::module_& m) {
  py::class_<Action> action(m, "Action", "One entry of a pipeline rank's program.");
  action.def(py::init([](ActionType type, int64_t micro_batch, int64_t stage, int64_t peer) {
                 // Action stores 32-bit indices: refuse what would silently wrap around.
                 return Action{type, to_int32(micro_batch, "micro_batch"), to_int32(stage, "stage"),
                               to_int32(peer, "peer")};
               }),
               py::arg("type"), py::arg("micro_batch"), py::arg("stage"), py::arg("peer") = -1);
  add_copy<Action>(action);
  action.def_readwrite("type", &Action::type)
      .def_readwrite("micro_batch", &Action::micro_batch)
      .def_readwrite("stage", &Action::stage)
      .def_readwrite("peer", &Action::peer)
      .def(py::self == py::self)
      .def("__repr__", [](const Action& a) {
        return "Action(" + to_string(a.type) + ", micro_batch=" + std::to_string(a.micro_batch) +
               ", stage=" + std::to_string(a.stage) + ", peer=" + std::to_string(a.peer) + ")";
      });

  py::class_<Schedule> schedule(m, "Schedule", "Per-rank ordered action lists of a pipeline schedule.");
  add_kwargs_init<Schedule>(schedule);
  add_copy<Schedule>(schedule);
  schedule.def_readwrite("kind", &Schedule::kind)
      .def_readwrite("ranks", &Schedule::ranks)
      .def_readwrite("virtual_stages", &Schedule::virtual_stages)
      .def_readwrite("micro_batches", &Schedule::micro_batches)
      .def_readwrite("per_rank", &Schedule::per_rank,
                     "A copy: assign a new list of lists to change it.")
      .def("num_stages", &Schedule::num_stages)
      .def("rank_of_stage", &Schedule::rank_of_stage, py::arg("stage"))
      .def("__repr__", [](const Schedule& s) {
        return "<Schedule " + to_string(s.kind) + " ranks=" + std::to_string(s.ranks) +
               " virtual_stages=" + std::to_string(s.virtual_stages) +
               " micro_batches=" + std::to_string(s.micro_batches) + ">";
      });

  py::class_<StageCosts> costs(m, "StageCosts", "Durations of one micro-batch's work on one virtual stage.");
  costs.def(py::init([](double forward_s, double backward_input_s, double backward_weight_s, double p2p_s) {
              return StageCosts{forward_s, backward_input_s, backward_weight_s, p2p_s};
            }),
            py::arg("forward_s") = 1.0, py::arg("backward_input_s") = 1.0, py::arg("backward_weight_s") = 1.0,
            py::arg("p2p_s") = 0.0);
  add_copy<StageCosts>(costs);
  costs.def_readwrite("forward_s", &StageCosts::forward_s)
      .def_readwrite("backward_input_s", &StageCosts::backward_input_s)
      .def_readwrite("backward_weight_s", &StageCosts::backward_weight_s)
      .def_readwrite("p2p_s", &StageCosts::p2p_s)
      .def("__repr__", [](const StageCosts& c) {
        return "StageCosts(forward_s=" + num(c.forward_s) + ", backward_input_s=" + num(c.backward_input_s) +
               ", backward_weight_s=" + num(c.backward_weight_s) + ", p2p_s=" + num(c.p2p_s) + ")";
      });

  py::class_<TimelineEvent>(m, "TimelineEvent", "One interval of a simulated rank's timeline.")
      .def_readonly("type", &TimelineEvent::type)
      .def_readonly("micro_batch", &TimelineEvent::micro_batch)
      .def_readonly("stage", &TimelineEvent::stage)
      .def_readonly("start_s", &TimelineEvent::start_s)
      .def_readonly("end_s", &TimelineEvent::end_s)
      .def("__repr__", [](const TimelineEvent& e) {
        return "TimelineEvent(" + to_string(e.type) + " mb=" + std::to_string(e.micro_batch) +
               " stage=" + std::to_string(e.stage) + " " + num(e.start_s) + ".." + num(e.end_s) + ")";
      });

  py::class_<SimulationResult> sim(m, "SimulationResult", "Timeline of a simulated schedule.");
  add_kwargs_init<SimulationResult>(sim);
  add_copy<SimulationResult>(sim);
  sim.def_readwrite("makespan_s", &SimulationResult::makespan_s)
      .def_readwrite("busy_s", &SimulationResult::busy_s)
      .def_readwrite("idle_s", &SimulationResult::idle_s)
      .def_readwrite("bubble_fraction", &SimulationResult::bubble_fraction)
      .def_readwrite("peak_in_flight", &SimulationResult::peak_in_flight)
      .def_readonly("timeline", &SimulationResult::timeline, "Per rank, the TimelineEvents (when recorded).")
      .def("__repr__", [](const SimulationResult& r) {
        return "<SimulationResult makespan_s=" + num(r.makespan_s) + " bubble_fraction=" + num(r.bubble_fraction) +
               ">";
      });

  m.def("make_schedule", &make_schedule, py::arg("kind"), py::arg("ranks"), py::arg("micro_batches"),
        py::arg("virtual_stages") = 1, "Builds the per-rank action lists of a pipeline schedule.");
  m.def("check_schedule", &check_schedule, py::arg("schedule"),
        "Checks a schedule without running it; ValidationError names the first broken action.");
  m.def("simulate", &simulate, py::arg("schedule"), py::arg("costs"), py::arg("record_timeline") = false,
        py::call_guard<py::gil_scoped_release>(),
        "Runs the action lists on a timeline; `costs` has one StageCosts per virtual stage (or one for all); "
        "`record_timeline` keeps every interval per rank in `.timeline`.");
  m.def(
      "simulate",
      [](const Schedule& schedule, const StageCosts& costs, bool record) {
        return simulate(schedule, {costs}, record);
      },
      py::arg("schedule"), py::arg("costs"), py::arg("record_timeline") = false,
      py::call_guard<py::gil_scoped_release>());
  m.def("closed_form_bubble_fraction", &closed_form_bubble_fraction, py::arg("kind"), py::arg("ranks"),
        py::arg("micro_batches"), py::arg("virtual_stages") = 1);
}

}  // namespace

void bind_embeddings(py::module_& m);  // embedding_bindings.cpp
void bind_profiles(py::module_& m);    // profile_bindings.cpp
void bind_inference(py::module_& m);   // inference_bindings.cpp

void bind_planner(py::module_& m) {
  bind_exceptions(m);
  bind_enums(m);
  bind_model_graph(m);
  bind_cluster_training(m);
  bind_plan(m);
  bind_search(m);
  bind_schedule(m);
  bind_embeddings(m);
  bind_profiles(m);
  bind_inference(m);
}

}  // namespace monarch::python
