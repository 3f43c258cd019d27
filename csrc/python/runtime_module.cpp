// torch_monarch._runtime: the LibTorch runtime for Python. Thin: every object here is the
// C++ engine the C++ frontend uses; Python keeps only module-tree work (hooks, wrappers).
#include <torch/extension.h>

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "monarch/runtime/checksum.h"
#include "monarch/runtime/composition.h"
#include "monarch/runtime/data_parallel.h"
#include "monarch/runtime/device_mesh.h"
#include "monarch/runtime/fully_shard.h"
#include "monarch/runtime/node_all_reduce.h"
#include "monarch/runtime/shared_memory.h"
#include "monarch/runtime/pipeline.h"
#include "monarch/runtime/replicas.h"
#include "monarch/runtime/sharded_embeddings.h"
#include "monarch/runtime/tensor_parallel.h"
#include "monarch/runtime/trace.h"
#include "monarch/runtime/world.h"

namespace py = pybind11;
using namespace monarch;

// In their own files (one per runtime concern).
namespace monarch::python {
void bind_experts(py::module_& m);
void bind_context_parallel(py::module_& m);
}  // namespace monarch::python

namespace {

InitOptions options_with_timeout(double timeout_s) {
  InitOptions o;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  return o;
}

// A mesh owns Gloo process groups, whose destructors join worker threads; those threads
// may be freeing tensors that have Python objects, which needs the GIL. Holding the GIL
// while destroying the mesh would deadlock (PyTorch avoids the same trap for its own
// ProcessGroup wrappers), so drop it for the destructor.
void destroy_without_gil(DeviceMesh* mesh) {
  if (PyGILState_Check()) {
    py::gil_scoped_release release;
    delete mesh;
  } else {
    delete mesh;
  }
}

at::ScalarType dtype_from_name(const std::string& name, const std::string& field = "compute_dtype") {
  if (name == "float32" || name == "float" || name == "Float") return at::kFloat;
  if (name == "bfloat16" || name == "BFloat16") return at::kBFloat16;
  if (name == "float16" || name == "half" || name == "Half") return at::kHalf;
  throw py::value_error(field + ": expected float32, bfloat16 or float16, got '" + name + "'");
}

// Lets Python stand in for a stage's computation (the pipeline bench's timed stages).
class PyStageWork : public StageWork {
 public:
  using StageWork::StageWork;
  std::vector<at::Tensor> forward(int64_t stage, int64_t mb, std::vector<at::Tensor> inputs) override {
    PYBIND11_OVERRIDE_PURE(std::vector<at::Tensor>, StageWork, forward, stage, mb, inputs);
  }
  std::vector<at::Tensor> backward(int64_t stage, int64_t mb, std::vector<at::Tensor> grads) override {
    PYBIND11_OVERRIDE_PURE(std::vector<at::Tensor>, StageWork, backward, stage, mb, grads);
  }
  std::vector<at::Tensor> backward_input(int64_t stage, int64_t mb, std::vector<at::Tensor> grads) override {
    PYBIND11_OVERRIDE_PURE(std::vector<at::Tensor>, StageWork, backward_input, stage, mb, grads);
  }
  void backward_weight(int64_t stage, int64_t mb) override {
    PYBIND11_OVERRIDE_PURE(void, StageWork, backward_weight, stage, mb);
  }
};

py::dict stats_to_dict(const PipelineStepStats& s) {
  py::list trace;
  for (const auto& a : s.trace) trace.append(py::make_tuple(planner::to_string(a.type), a.micro_batch, a.stage));
  py::dict d;
  d["trace"] = trace;
  d["total_s"] = s.total_s;
  d["compute_s"] = s.compute_s;
  d["wait_s"] = s.wait_s;
  return d;
}

void bind_tensor_parallel(py::module_& m) {
  using py::arg;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def(
      "deferred_linear",
      [](const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
        return deferred_linear(input, weight, bias.value_or(at::Tensor()));
      },
      arg("input"), arg("weight"), arg("bias") = py::none(),
      "y = x wᵀ + b whose weight gradient waits for the pipeline's W pass under zero-bubble schedules "
      "(torch_monarch.zero_bubble).");
  m.def("tp_copy_to_group", &tp::copy_to_group, arg("x"), arg("group"), nogil,
        "Identity forward; all-reduce of the gradient in backward (enter a tensor-parallel region).");
  m.def("tp_reduce_from_group", &tp::reduce_from_group, arg("x"), arg("group"), nogil,
        "All-reduce forward; identity backward (leave a row-parallel region).");
  m.def("tp_gather_from_group", &tp::gather_from_group, arg("x"), arg("group"), arg("dim"), nogil);
  m.def("tp_scatter_to_group", &tp::scatter_to_group, arg("x"), arg("group"), arg("dim"), nogil);
  m.def("tp_sequence_gather", &tp::sequence_gather, arg("x"), arg("group"), arg("dim"), nogil,
        "Sequence parallel: all-gather along dim; reduce-scatter of the gradient.");
  m.def("tp_sequence_reduce_scatter", &tp::sequence_reduce_scatter, arg("x"), arg("group"), arg("dim"), nogil,
        "Sequence parallel: reduce-scatter along dim; all-gather of the gradient.");
  m.def("vocab_parallel_embedding", &tp::vocab_parallel_embedding, arg("tokens"), arg("weight_shard"),
        arg("vocab_start"), arg("group"), arg("sequence_dim") = -1, arg("padding_idx") = -1, nogil);
  m.def("vocab_parallel_cross_entropy", &tp::vocab_parallel_cross_entropy, arg("logits_shard"), arg("targets"),
        arg("vocab_start"), arg("group"), arg("ignore_index") = -100, nogil);
  m.def("shard_tensor", &tp::shard_tensor, arg("full"), arg("dim"), arg("rank"), arg("size"),
        arg("fused_parts") = 1, arg("what") = "tensor");
  m.def("unshard_tensor", &tp::unshard_tensor, arg("shards"), arg("dim"), arg("fused_parts") = 1);
}

void bind_pipeline(py::module_& m) {
  using py::arg;
  py::class_<StageWork, PyStageWork>(m, "StageWork")
      .def(py::init<>())
      // Without the GIL (autograd refuses to run under it); Python callables take it back.
      .def("forward", &StageWork::forward, py::call_guard<py::gil_scoped_release>())
      .def("backward", &StageWork::backward, py::call_guard<py::gil_scoped_release>())
      .def("backward_input", &StageWork::backward_input, py::call_guard<py::gil_scoped_release>())
      .def("backward_weight", &StageWork::backward_weight, py::call_guard<py::gil_scoped_release>());

  // The callables are Python functions: pybind takes the GIL around each call.
  py::class_<AutogradStageWork, StageWork>(m, "AutogradStageWork")
      .def(py::init<int64_t, int64_t, AutogradStageWork::ForwardFn, AutogradStageWork::LossFn, double,
                    AutogradStageWork::ParametersFn, AutogradStageWork::BackwardHook>(),
           arg("num_stages"), arg("micro_batches"), arg("forward_fn"), arg("loss_fn"), arg("loss_scale"),
           arg("stage_parameters") = AutogradStageWork::ParametersFn(),
           arg("before_backward") = AutogradStageWork::BackwardHook())
      .def("losses", [](const AutogradStageWork& w) {
        std::vector<double> out;
        for (const auto& [mb, loss] : w.losses()) out.push_back(loss);
        return out;
      });

  py::class_<PipelineExecutor>(m, "PipelineExecutor")
      .def(py::init([](const planner::Schedule& schedule, std::shared_ptr<DeviceMesh> mesh) {
             py::gil_scoped_release release;
             return std::make_unique<PipelineExecutor>(schedule, mesh->group("pp"));
           }),
           arg("schedule"), arg("mesh"), py::keep_alive<1, 3>(),
           "Checks the schedule on every pp rank (refusing it everywhere before any activation moves).")
      .def_property_readonly("local_stages", &PipelineExecutor::local_stages)
      .def_property_readonly("num_stages", [](const PipelineExecutor& e) { return e.schedule().num_stages(); })
      .def("program", [](const PipelineExecutor& e) {
        py::list out;
        for (const auto& a : e.program()) out.append(py::make_tuple(planner::to_string(a.type), a.micro_batch, a.stage));
        return out;
      })
      .def("run",
           [](PipelineExecutor& e, StageWork& work, bool forward_only) {
             PipelineStepStats stats;
             {
               py::gil_scoped_release release;
               stats = e.run(work, forward_only);
             }
             return stats_to_dict(stats);
           },
           arg("work"), arg("forward_only") = false)
      .def("train_step",
           [](PipelineExecutor& e, AutogradStageWork& work) {
             PipelineStepStats stats;
             double loss;
             {
               py::gil_scoped_release release;
               loss = e.train_step(work, &stats);
             }
             return py::make_tuple(loss, stats_to_dict(stats));
           },
           arg("work"), "One training step; returns (mean loss on every pp rank, step statistics).");
  m.def("broadcast_from_root", &broadcast_from_root, arg("tensors"), arg("group"),
        py::call_guard<py::gil_scoped_release>(), "Overwrites every tensor with the group's rank 0's values.");
  m.def("sync_tied_gradients", &sync_tied_gradients, arg("params"), arg("dp"), arg("ends"),
        py::call_guard<py::gil_scoped_release>(),
        "Gradients of weights tied across pipeline ends: averaged over dp (None: skip), summed over the ends (None: skip).");
}

// The composition engine: Python's parallelize hands it its local stages (module-tree work
// stays in Python) and calls it for everything after.
void bind_composition(py::module_& m) {
  using py::arg;
  py::class_<Layout>(m, "Layout")
      .def_property_readonly("pp", [](const Layout& l) { return l.mesh.pp; })
      .def_property_readonly("dp", [](const Layout& l) { return l.mesh.dp; })
      .def_property_readonly("tp", [](const Layout& l) { return l.mesh.tp; })
      .def_property_readonly("cp", [](const Layout& l) { return l.mesh.cp; })
      .def_property_readonly("ep", [](const Layout& l) { return l.mesh.ep; })
      .def_readonly("virtual_stages", &Layout::virtual_stages)
      .def_readonly("block_stage", &Layout::block_stage)
      .def_readonly("schedule", &Layout::schedule)
      .def_readonly("micro_batches", &Layout::micro_batches)
      .def_readonly("zero_stage", &Layout::zero_stage)
      .def_readonly("sequence_parallel", &Layout::sequence_parallel)
      .def_readonly("bucket_bytes", &Layout::bucket_bytes)
      .def_readonly("recompute", &Layout::recompute)
      .def_property_readonly("dp_reduction", [](const Layout& l) { return planner::to_string(l.dp_reduction); })
      .def_property_readonly("inter_node_compression",
                             [](const Layout& l) { return planner::to_string(l.inter_node_compression); })
      .def_readonly("zero_overlap", &Layout::zero_overlap)
      .def_property_readonly("num_stages", &Layout::num_stages)
      .def("stages_of", &Layout::stages_of, arg("pp_rank"))
      .def("summary", &Layout::summary)
      .def("__repr__", [](const Layout& l) { return "Layout(" + l.summary() + ")"; });
  m.def("layout_from_plan",
        py::overload_cast<const planner::Plan&, int64_t, int64_t, const std::vector<std::string>&>(&layout_from_plan),
        arg("plan"), arg("num_blocks"), arg("world_size"), arg("block_names") = std::vector<std::string>{},
        "The plan's layout for a model with num_blocks blocks; ValueError listing every difference.");
  m.def(
      "layout_from_pins",
      [](int64_t num_blocks, int64_t world_size, int64_t pp, int64_t dp, int64_t tp, int64_t virtual_stages,
         std::vector<int64_t> block_stage, std::optional<planner::ScheduleKind> schedule, int64_t micro_batches,
         int64_t zero_stage, bool sequence_parallel, int64_t bucket_bytes, std::vector<std::string> block_names,
         planner::Recompute recompute, const std::string& dp_reduction, const std::string& inter_node_compression,
         bool zero_overlap, int64_t cp, int64_t ep) {
        LayoutPins p;
        p.cp = cp;
        p.ep = ep;
        p.zero_overlap = zero_overlap;
        p.dp_reduction = planner::dp_reduction_from_string(dp_reduction);
        p.inter_node_compression = planner::compression_from_string(inter_node_compression);
        p.pp = pp;
        p.dp = dp;
        p.tp = tp;
        p.virtual_stages = virtual_stages;
        p.block_stage = std::move(block_stage);
        p.schedule = schedule;
        p.micro_batches = micro_batches;
        p.zero_stage = zero_stage;
        p.sequence_parallel = sequence_parallel;
        p.bucket_bytes = bucket_bytes;
        p.recompute = recompute;
        return layout_from_pins(p, num_blocks, world_size, block_names);
      },
      arg("num_blocks"), arg("world_size"), arg("pp") = 1, arg("dp") = 0, arg("tp") = 1, arg("virtual_stages") = 1,
      arg("block_stage") = std::vector<int64_t>{}, arg("schedule") = py::none(), arg("micro_batches") = 1,
      arg("zero_stage") = 0, arg("sequence_parallel") = false, arg("bucket_bytes") = 25 * 1024 * 1024,
      arg("block_names") = std::vector<std::string>{}, arg("recompute") = planner::Recompute::none,
      arg("dp_reduction") = "flat", arg("inter_node_compression") = "none", arg("zero_overlap") = true,
      arg("cp") = 1, arg("ep") = 1);
  m.def("even_block_stages", &even_block_stages, arg("num_blocks"), arg("num_stages"));

  py::class_<StateEntry>(m, "StateEntry")
      .def(py::init([](std::string name, const at::Tensor& like, int64_t stage, std::optional<int64_t> tp_dim,
                       int64_t fused_parts, bool experts) {
             StateEntry e{std::move(name), like.sizes().vec(), like.scalar_type(), stage, std::nullopt};
             if (tp_dim) e.tp = TpSpec{*tp_dim, fused_parts};
             e.experts = experts;
             return e;
           }),
           arg("name"), arg("like"), arg("stage"), arg("tp_dim") = py::none(), arg("fused_parts") = 1,
           arg("experts") = false,
           "An entry of the whole model's state dict: the local shape and dtype of `like`, the first stage "
           "holding it, how tensor parallelism split it.")
      .def_readonly("name", &StateEntry::name)
      .def_readonly("shape", &StateEntry::shape)
      .def_readonly("stage", &StateEntry::stage);

  py::class_<Composition>(m, "Composition")
      .def(py::init([](const Layout& layout, std::shared_ptr<DeviceMesh> mesh, py::list stages,
                       std::vector<StateEntry> entries, std::vector<at::Tensor> tied,
                       std::vector<at::Tensor> tp_replicated) {
             std::vector<LocalStage> local;
             for (const auto& item : stages) {
               auto t = item.cast<py::tuple>();
               LocalStage s;
               s.stage = t[0].cast<int64_t>();
               s.parameters = t[1].cast<std::vector<at::Tensor>>();
               if (!t[2].is_none()) s.data_parallel = t[2].cast<DataParallelEngine*>();
               local.push_back(std::move(s));
             }
             py::gil_scoped_release release;
             return std::make_unique<Composition>(layout, std::move(mesh), std::move(local), std::move(entries),
                                                  std::move(tied), std::move(tp_replicated));
           }),
           arg("layout"), arg("mesh"), arg("stages"), arg("entries"), arg("tied") = std::vector<at::Tensor>{},
           arg("tp_replicated") = std::vector<at::Tensor>{}, py::keep_alive<1, 4>(),
           "stages: [(stage, parameters, DataParallelEngine or None)] for this rank's stages. Collective.")
      .def("set_data_parallel", &Composition::set_data_parallel, arg("stage"), arg("engine"), py::keep_alive<1, 3>())
      .def("set_fully_shard", &Composition::set_fully_shard, arg("stage"), arg("engine"), py::keep_alive<1, 3>())
      .def("add_data_parallel", &Composition::add_data_parallel, arg("stage"), arg("engine"), py::keep_alive<1, 3>())
      .def("add_fully_shard", &Composition::add_fully_shard, arg("stage"), arg("engine"), py::keep_alive<1, 3>())
      .def_property_readonly("layout", &Composition::layout, py::return_value_policy::reference_internal)
      .def_property_readonly("local_stages", &Composition::local_stages)
      .def_property_readonly("executor", &Composition::executor, py::return_value_policy::reference_internal)
      .def_property_readonly("last_stats",
                             [](const Composition& c) -> py::object {
                               if (!c.last_stats()) return py::none();
                               return stats_to_dict(*c.last_stats());
                             })
      .def(
          "train_step",
          [](Composition& c, py::function forward, py::function loss, int64_t samples) {
            // By reference, called with the GIL: the std::functions own no Python object,
            // so copying or destroying them without the GIL is safe.
            Composition::ForwardFn f = [&forward](int64_t stage, int64_t mb, const std::vector<at::Tensor>& in) {
              py::gil_scoped_acquire gil;
              return forward(stage, mb, in).cast<std::vector<at::Tensor>>();
            };
            Composition::LossFn l = [&loss](int64_t mb, const std::vector<at::Tensor>& out) {
              py::gil_scoped_acquire gil;
              return loss(mb, out).cast<at::Tensor>();
            };
            py::gil_scoped_release release;
            return c.train_step(f, l, samples);
          },
          arg("forward"), arg("loss"), arg("samples") = -1,
          "forward(stage, mb, received) -> list of tensors; loss(mb, outputs) -> tensor. Returns the global "
          "batch's mean loss on every rank; with `samples` (this rank's batch size) weighted by samples, so "
          "ranks may hold different numbers.")
      .def(
          "predict",
          [](Composition& c, py::function forward) {
            Composition::ForwardFn f = [&forward](int64_t stage, int64_t mb, const std::vector<at::Tensor>& in) {
              py::gil_scoped_acquire gil;
              return forward(stage, mb, in).cast<std::vector<at::Tensor>>();
            };
            py::gil_scoped_release release;
            c.predict(f);
          },
          arg("forward"))
      .def("local_batch", &Composition::local_batch, arg("global_batch"))
      .def("expect_all", &Composition::expect_all, py::arg("what"), py::call_guard<py::gil_scoped_release>())
      .def("full_state_dict", &Composition::full_state_dict, arg("local"),
           py::call_guard<py::gil_scoped_release>(), "[(name, tensor)] of the whole model on every rank. Collective.")
      .def("local_slices", &Composition::local_slices, arg("full"), arg("names"))
      .def("compare_keys", &Composition::compare_keys, arg("keys"), "(missing, unexpected)");
}

}  // namespace

void bind_embeddings(py::module_& m) {
  using planner::EmbeddingOptimizer;
  py::class_<ShardedEmbeddingTables>(m, "ShardedEmbeddingTables")
      .def(py::init([](planner::EmbeddingPlan plan, Communicator& group, const std::string& optimizer, double lr,
                       double eps, double beta1, double beta2) {
             EmbeddingOptimizerConfig config;
             config.kind = planner::embedding_optimizer_from_string(optimizer, "optimizer");
             config.lr = lr;
             config.eps = eps;
             config.beta1 = beta1;
             config.beta2 = beta2;
             py::gil_scoped_release release;
             return std::make_unique<ShardedEmbeddingTables>(std::move(plan), group, config);
           }),
           py::arg("plan"), py::arg("group"), py::arg("optimizer"), py::arg("lr"), py::arg("eps") = 1e-8,
           py::arg("beta1") = 0.9, py::arg("beta2") = 0.999, py::keep_alive<1, 3>())
      .def(
          "forward",
          [](ShardedEmbeddingTables& self, std::vector<std::string> keys, at::Tensor values, at::Tensor lengths,
             std::optional<at::Tensor> weights) {
            JaggedBatch batch{std::move(keys), std::move(values), std::move(lengths), weights ? *weights : at::Tensor()};
            py::gil_scoped_release release;
            return self.forward(batch);
          },
          py::arg("keys"), py::arg("values"), py::arg("lengths"), py::arg("weights") = py::none())
      .def(
          "forward_all",
          [](ShardedEmbeddingTables& self, std::vector<std::string> keys, at::Tensor values, at::Tensor lengths,
             std::optional<at::Tensor> weights) {
            JaggedBatch batch{std::move(keys), std::move(values), std::move(lengths), weights ? *weights : at::Tensor()};
            EmbeddingLookup out;
            {
              py::gil_scoped_release release;
              out = self.forward_all(batch);
            }
            return py::make_tuple(out.pooled, out.sequences);
          },
          py::arg("keys"), py::arg("values"), py::arg("lengths"), py::arg("weights") = py::none(),
          "(pooled [B, width], [rows of each sequence feature])")
      .def_property_readonly("output_keys", &ShardedEmbeddingTables::output_keys)
      .def_property_readonly("output_dims", &ShardedEmbeddingTables::output_dims)
      .def_property_readonly("sequence_keys", &ShardedEmbeddingTables::sequence_keys)
      .def("load_table", &ShardedEmbeddingTables::load_table, py::arg("table"), py::arg("full"))
      .def("init_uniform", &ShardedEmbeddingTables::init_uniform, py::arg("bound"), py::arg("seed"))
      .def("full_table", &ShardedEmbeddingTables::full_table, py::arg("table"), py::call_guard<py::gil_scoped_release>())
      .def("local_shards", &ShardedEmbeddingTables::local_shards)
      .def(
          "shard_views",
          [](ShardedEmbeddingTables& self) {
            py::list out;
            for (const auto& v : self.shard_views()) {
              out.append(py::make_tuple(v.table, v.where.row_offset, v.where.rows, v.where.col_offset, v.where.cols,
                                        v.weight, v.state.defined() ? py::cast(v.state) : py::none()));
            }
            return out;
          },
          "This rank's shards: (table, row_offset, rows, col_offset, cols, weight, state or None), the engine's "
          "own tensors.")
      .def_property("adam_step", &ShardedEmbeddingTables::adam_step, &ShardedEmbeddingTables::set_adam_step)
      .def_property_readonly("local_bytes", &ShardedEmbeddingTables::local_bytes)
      .def_property_readonly("plan", &ShardedEmbeddingTables::plan);
}

PYBIND11_MODULE(_runtime, m) {
  m.doc() = "torch_monarch runtime: world, mesh, collectives, data-parallel, sharded, tensor- and pipeline-parallel engines";
  // The planner's types (Schedule) are registered by torch_monarch._C.
  py::module_::import("torch_monarch._C");
#ifdef MONARCH_WITH_NCCL
  m.attr("built_with_nccl") = true;  // CUDA tensors in a collective go over NCCL
#else
  m.attr("built_with_nccl") = false;  // a CUDA tensor in a collective is an error
#endif

  py::class_<World, std::shared_ptr<World>>(m, "World")
      .def_static("init", [](double timeout_s) { return World::init(options_with_timeout(timeout_s)); },
                  py::arg("timeout_s") = 300.0, py::call_guard<py::gil_scoped_release>(),
                  "Rendezvous from torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).")
      .def_static("from_store",
                  [](c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, double timeout_s) {
                    return World::from_store(std::move(store), rank, world_size, options_with_timeout(timeout_s));
                  },
                  py::arg("store"), py::arg("rank"), py::arg("world_size"), py::arg("timeout_s") = 300.0,
                  "Join an existing c10d store (torch.distributed's default store): no second port.")
      .def_property_readonly("rank", &World::rank)
      .def_property_readonly("size", &World::size);

  py::enum_<CollectiveKind>(m, "CollectiveKind")
      .value("all_reduce", CollectiveKind::all_reduce)
      .value("reduce_scatter", CollectiveKind::reduce_scatter)
      .value("all_gather", CollectiveKind::all_gather)
      .value("broadcast", CollectiveKind::broadcast)
      .value("send", CollectiveKind::send)
      .value("recv", CollectiveKind::recv)
      .value("all_to_all", CollectiveKind::all_to_all);

  py::class_<Handle>(m, "Handle")
      .def("wait", &Handle::wait, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("done", &Handle::done);

  m.def(
      "node_all_reduce_bytes",
      [] { return NodeSharedBuffer::enabled() ? NodeAllReduce::limit_bytes() : int64_t{0}; },
      "The largest all-reduce a node-local group runs through shared memory (MONARCH_NODE_ALL_REDUCE_BYTES; 0: "
      "the path is off, by that variable or MONARCH_SHARED_MEMORY=off)");
  py::class_<Communicator>(m, "Communicator")
      .def_property_readonly("name", &Communicator::name)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("rank", &Communicator::group_rank)
      .def_property_readonly("ranks", &Communicator::ranks)
      .def("all_reduce", &Communicator::all_reduce, py::arg("buffer"), py::arg("average") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("all_reduce_max", &Communicator::all_reduce_max, py::arg("buffer"), py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter", &Communicator::reduce_scatter, py::arg("output"), py::arg("input"),
           py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &Communicator::all_gather, py::arg("output"), py::arg("input"),
           py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &Communicator::broadcast, py::arg("buffer"), py::arg("root"),
           py::call_guard<py::gil_scoped_release>())
      .def("send", &Communicator::send, py::arg("buffer"), py::arg("peer"), py::arg("tag") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("recv", &Communicator::recv, py::arg("buffer"), py::arg("peer"), py::arg("tag") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("all_to_all", &Communicator::all_to_all, py::arg("output"), py::arg("input"),
           py::call_guard<py::gil_scoped_release>())
      .def("barrier", &Communicator::barrier, py::call_guard<py::gil_scoped_release>())
      .def("bytes_sent", [](const Communicator& c, CollectiveKind k) { return c.counters().bytes(k); })
      .def("total_bytes_sent", [](const Communicator& c) { return c.counters().total(); })
      .def("reset_counters", [](Communicator& c) { c.counters().reset(); })
      .def_property_readonly("step", &Communicator::step)
      .def_property_readonly("collectives_checked", &Communicator::collectives_checked)
      .def_property("checks_collectives", &Communicator::checks_collectives, &Communicator::set_checks_collectives)
      .def_property_readonly("node_local", &Communicator::node_local)
      .def_property_readonly("node_all_reduces", &Communicator::node_all_reduces)
      .def("expect_all", [](Communicator& c, const std::string& what) { c.expect_all(what); }, py::arg("what"),
           py::call_guard<py::gil_scoped_release>());

  py::class_<DeviceMesh, std::shared_ptr<DeviceMesh>>(m, "DeviceMesh")
      .def(py::init([](std::shared_ptr<World> world, int64_t pp, int64_t dp, int64_t tp, int64_t cp, int64_t ep) {
             planner::Mesh shape;
             shape.pp = pp;
             shape.dp = dp;
             shape.tp = tp;
             shape.cp = cp;
             shape.ep = ep;
             if (cp > 1) shape.order = {"pp", "dp", "cp", "tp"};
             py::gil_scoped_release release;
             return std::shared_ptr<DeviceMesh>(new DeviceMesh(std::move(world), shape), destroy_without_gil);
           }),
           py::arg("world"), py::arg("pp") = 1, py::arg("dp") = 1, py::arg("tp") = 1, py::arg("cp") = 1,
           py::arg("ep") = 1)
      .def_property_readonly("shape", [](const DeviceMesh& d) { return d.shape(); })
      .def("has_axis", &DeviceMesh::has_axis)
      .def_property_readonly("rank", [](const DeviceMesh& d) { return d.rank(); })
      .def_property_readonly("size", [](const DeviceMesh& d) { return d.size(); })
      .def("axis_size", py::overload_cast<const std::string&>(&DeviceMesh::size, py::const_))
      .def("coordinate", &DeviceMesh::coordinate)
      .def("group", &DeviceMesh::group, py::return_value_policy::reference_internal)
      .def_property_readonly("has_pipeline_ends_group", &DeviceMesh::has_pipeline_ends_group)
      .def("pipeline_ends_group", &DeviceMesh::pipeline_ends_group, py::return_value_policy::reference_internal)
      .def_property_readonly("ranks_per_node", &DeviceMesh::ranks_per_node)
      .def(
          "node_groups",
          [](DeviceMesh& d, const std::string& axis) {
            py::gil_scoped_release release;
            NodeGroups& g = d.node_groups(axis);
            return std::make_pair(g.intra.get(), g.inter.get());
          },
          py::arg("axis"), py::return_value_policy::reference_internal,
          "(intra, inter): the axis's group split by node (collective the first time)");

  m.def(
      "crc32c",
      [](py::buffer data, uint32_t crc) {
        py::buffer_info info = data.request();
        const size_t bytes = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
        py::gil_scoped_release release;
        return crc32c(info.ptr, bytes, crc);
      },
      py::arg("data"), py::arg("crc") = 0,
      "CRC-32C (Castagnoli) of a contiguous buffer (bytes, memoryview, numpy array), continuing from `crc`.");

  // The measured timeline (monarch/runtime/trace.h).
  m.def("save_trace", &trace::save, py::arg("path"), py::arg("mesh"), py::call_guard<py::gil_scoped_release>(),
        "Collective: every rank's recorded events into one Chrome trace JSON file, written by rank 0.");
  m.def("clear_trace", [] { trace::Recorder::instance().clear(); }, "Forget the events recorded so far.");
  m.def("set_trace_enabled", [](bool on) { trace::Recorder::instance().set_enabled(on); }, py::arg("on"));
  m.def("trace_enabled", [] { return trace::Recorder::instance().enabled(); });
  m.def("set_trace_capacity", [](size_t n) { trace::Recorder::instance().set_capacity(n); }, py::arg("events"));
  m.def("trace_event_count", [] { return trace::Recorder::instance().snapshot().size(); });

  py::class_<DataParallelOptions>(m, "DataParallelOptions")
      .def(py::init<>())
      .def_readwrite("bucket_bytes", &DataParallelOptions::bucket_bytes)
      .def_readwrite("broadcast_from_root", &DataParallelOptions::broadcast_from_root)
      .def_readwrite("bf16_compression", &DataParallelOptions::bf16_compression)
      .def_readwrite("hierarchical", &DataParallelOptions::hierarchical)
      .def_property(
          "reduce_dtype",
          [](const DataParallelOptions& o) -> py::object {
            if (!o.reduce_dtype) return py::none();
            return py::str(std::string(c10::toString(*o.reduce_dtype)));
          },
          [](DataParallelOptions& o, const py::object& name) {
            if (name.is_none()) {
              o.reduce_dtype.reset();
            } else {
              o.reduce_dtype = dtype_from_name(name.cast<std::string>(), "reduce_dtype");
            }
          },
          "None (the parameters' dtype) or 'bfloat16' / 'float16' / 'float32': what the buckets hold and move")
      .def_property(
          "inter_node_compression",
          [](const DataParallelOptions& o) { return planner::to_string(o.inter_node_compression); },
          [](DataParallelOptions& o, const std::string& name) {
            o.inter_node_compression = planner::compression_from_string(name, "inter_node_compression");
          },
          "'none', 'bf16' or 'int8' (the slow hop of a hierarchical reduction)");

  // The engine keeps a reference to the mesh's group: keep_alive ties the mesh's lifetime
  // to the engine's.
  py::class_<DataParallelEngine>(m, "DataParallelEngine")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<at::Tensor> buffers,
                       std::shared_ptr<DeviceMesh> mesh, const std::string& axis,
                       DataParallelOptions options) {
             py::gil_scoped_release release;
             NodeGroups* nodes = options.hierarchical ? &mesh->node_groups(axis) : nullptr;
             return std::make_unique<DataParallelEngine>(std::move(params), std::move(buffers),
                                                         mesh->group(axis), options, nodes);
           }),
           py::arg("params"), py::arg("buffers"), py::arg("mesh"), py::arg("axis") = "dp",
           py::arg("options") = DataParallelOptions(), py::keep_alive<1, 4>())
      .def("set_sync", &DataParallelEngine::set_sync)
      .def("before_forward", &DataParallelEngine::before_forward)
      .def_property_readonly("sync", &DataParallelEngine::sync)
      .def_property_readonly("num_buckets", &DataParallelEngine::num_buckets)
      .def("bucket_sizes_bytes", &DataParallelEngine::bucket_sizes_bytes);

  py::class_<FullyShardOptions>(m, "FullyShardOptions")
      .def(py::init<>())
      .def_readwrite("zero_stage", &FullyShardOptions::zero_stage)
      .def_readwrite("reshard_after_forward", &FullyShardOptions::reshard_after_forward)
      .def_property(
          "compute_dtype",
          [](const FullyShardOptions& o) { return std::string(c10::toString(o.compute_dtype)); },
          [](FullyShardOptions& o, const std::string& name) { o.compute_dtype = dtype_from_name(name); },
          "'float32', 'bfloat16' or 'float16'")
      .def_property(
          "reduce_dtype",
          [](const FullyShardOptions& o) { return std::string(c10::toString(o.effective_reduce_dtype())); },
          [](FullyShardOptions& o, const std::string& name) { o.reduce_dtype = dtype_from_name(name, "reduce_dtype"); },
          "'float32', 'bfloat16' or 'float16' (default: the compute dtype)")
      .def_readwrite("broadcast_from_root", &FullyShardOptions::broadcast_from_root)
      .def_readwrite("overlap", &FullyShardOptions::overlap,
                     "a unit's gradient reduce-scatter in flight during the next unit's backward; False: each waited for")
      .def_readwrite("hierarchical", &FullyShardOptions::hierarchical,
                     "ZeRO++: gathers and reduce-scatters in two hops over the group's nodes (stage 3)")
      .def_property(
          "inter_node_compression",
          [](const FullyShardOptions& o) { return planner::to_string(o.inter_node_compression); },
          [](FullyShardOptions& o, const std::string& name) {
            o.inter_node_compression = planner::compression_from_string(name, "inter_node_compression");
          },
          "'none', 'bf16' or 'int8' (the hop between nodes of the hierarchical layout)");

  py::class_<FullyShardEngine>(m, "FullyShardEngine")
      .def(py::init([](std::vector<std::vector<at::Tensor>> units, std::shared_ptr<DeviceMesh> mesh,
                       const std::string& axis, FullyShardOptions options, py::object materialize) {
             FullyShardEngine::Materialize fn;
             if (!materialize.is_none()) {
               // By reference: the std::function is destroyed inside the engine's
               // constructor, without the GIL, so it must own no Python object.
               fn = [&materialize](int64_t unit) {
                 py::gil_scoped_acquire gil;
                 return materialize(unit).cast<std::vector<at::Tensor>>();
               };
             }
             py::gil_scoped_release release;
             NodeGroups* nodes = options.hierarchical ? &mesh->node_groups(axis) : nullptr;
             return std::make_unique<FullyShardEngine>(std::move(units), mesh->group(axis), options, fn, nodes);
           }),
           py::arg("units"), py::arg("mesh"), py::arg("axis") = "dp",
           py::arg("options") = FullyShardOptions(), py::arg("materialize") = py::none(), py::keep_alive<1, 3>())
      .def("shards", &FullyShardEngine::shards)
      .def("before_forward", &FullyShardEngine::before_forward, py::call_guard<py::gil_scoped_release>())
      .def("after_forward", &FullyShardEngine::after_forward)
      .def("sync_parameters", &FullyShardEngine::sync_parameters, py::call_guard<py::gil_scoped_release>())
      .def("set_sync", &FullyShardEngine::set_sync, py::arg("sync"))
      .def("full_parameters", &FullyShardEngine::full_parameters, py::call_guard<py::gil_scoped_release>())
      .def(
          "load_full_parameters",
          [](FullyShardEngine& e, const std::vector<std::optional<at::Tensor>>& values) {
            std::vector<at::Tensor> v;
            for (const auto& t : values) v.push_back(t ? *t : at::Tensor());
            e.load_full_parameters(v);
          },
          py::arg("values"),
           "Every parameter whole, in full_parameters()' order (None keeps one): this rank keeps its slice.")
      .def_property_readonly("num_units", &FullyShardEngine::num_units)
      .def_property_readonly("zero_stage", [](const FullyShardEngine& e) { return e.options().zero_stage; })
      .def_property_readonly("overlap", [](const FullyShardEngine& e) { return e.options().overlap; });

  bind_tensor_parallel(m);
  bind_pipeline(m);
  bind_composition(m);
  bind_embeddings(m);
  monarch::python::bind_experts(m);
  monarch::python::bind_context_parallel(m);
}
