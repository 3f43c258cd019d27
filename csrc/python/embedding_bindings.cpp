// pybind11 bindings of the embedding-table planner (monarch/planner/embeddings.h), part of
// torch_monarch._C.planner. Same conventions as planner_bindings.cpp.
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "binding_helpers.h"
#include "monarch/planner/embeddings.h"

namespace py = pybind11;

namespace monarch::python {

using namespace monarch::planner;
using namespace monarch::python::binding;

void bind_embeddings(py::module_& m) {
  py::enum_<EmbeddingSharding> sharding(m, "EmbeddingSharding", "How one embedding table is split over the ranks.");
  sharding.value("data_parallel", EmbeddingSharding::data_parallel)
      .value("table_wise", EmbeddingSharding::table_wise)
      .value("row_wise", EmbeddingSharding::row_wise)
      .value("column_wise", EmbeddingSharding::column_wise)
      .value("table_row_wise", EmbeddingSharding::table_row_wise);
  finish_enum(sharding, [](const std::string& n, const std::string& f) { return embedding_sharding_from_string(n, f); },
              "sharding");
  py::enum_<EmbeddingOptimizer> optimizer(m, "EmbeddingOptimizer", "Fused sparse optimizers of the tables.");
  optimizer.value("sgd", EmbeddingOptimizer::sgd)
      .value("rowwise_adagrad", EmbeddingOptimizer::rowwise_adagrad)
      .value("adam", EmbeddingOptimizer::adam);
  finish_enum(optimizer, [](const std::string& n, const std::string& f) { return embedding_optimizer_from_string(n, f); },
              "optimizer");
  py::enum_<EmbeddingPooling> pooling(m, "EmbeddingPooling", "sum / mean (nn.EmbeddingBag) or none (nn.Embedding).");
  pooling.value("sum", EmbeddingPooling::sum).value("mean", EmbeddingPooling::mean).value("none", EmbeddingPooling::none);
  finish_enum(pooling, [](const std::string& n, const std::string& f) { return embedding_pooling_from_string(n, f); },
              "pooling");

  py::class_<EmbeddingTable> table(m, "EmbeddingTable", "One table: rows x dim, the features that look it up.");
  add_kwargs_init<EmbeddingTable>(table);
  add_copy<EmbeddingTable>(table);
  table.def_readwrite("name", &EmbeddingTable::name)
      .def_readwrite("rows", &EmbeddingTable::rows)
      .def_readwrite("dim", &EmbeddingTable::dim)
      .def_readwrite("bytes_per_element", &EmbeddingTable::bytes_per_element)
      .def_readwrite("features", &EmbeddingTable::features)
      .def_readwrite("pooling_factor", &EmbeddingTable::pooling_factor)
      .def_readwrite("pooling", &EmbeddingTable::pooling)
      .def(py::self == py::self)
      .def("__repr__", [](const EmbeddingTable& t) {
        return "<EmbeddingTable " + quoted(t.name) + " " + std::to_string(t.rows) + " x " + std::to_string(t.dim) + ">";
      });

  py::class_<EmbeddingShard> shard(m, "EmbeddingShard", "Rows [row_offset, +rows) x columns [col_offset, +cols) on rank.");
  add_kwargs_init<EmbeddingShard>(shard);
  add_copy<EmbeddingShard>(shard);
  shard.def_readwrite("rank", &EmbeddingShard::rank)
      .def_readwrite("row_offset", &EmbeddingShard::row_offset)
      .def_readwrite("rows", &EmbeddingShard::rows)
      .def_readwrite("col_offset", &EmbeddingShard::col_offset)
      .def_readwrite("cols", &EmbeddingShard::cols)
      .def(py::self == py::self)
      .def("__repr__", [](const EmbeddingShard& s) {
        return "<EmbeddingShard rank " + std::to_string(s.rank) + " rows " + std::to_string(s.row_offset) + "+" +
               std::to_string(s.rows) + " cols " + std::to_string(s.col_offset) + "+" + std::to_string(s.cols) + ">";
      });

  py::class_<EmbeddingPlacement> placement(m, "EmbeddingPlacement", "One table's sharding and shards.");
  add_kwargs_init<EmbeddingPlacement>(placement);
  add_copy<EmbeddingPlacement>(placement);
  placement.def_readwrite("table", &EmbeddingPlacement::table)
      .def_readwrite("sharding", &EmbeddingPlacement::sharding)
      .def_readwrite("shards", &EmbeddingPlacement::shards)
      .def(py::self == py::self);

  py::class_<EmbeddingRankLoad> load(m, "EmbeddingRankLoad", "What the tables put on one rank per step.");
  add_copy<EmbeddingRankLoad>(load);
  load.def(py::init<>())
      .def_readwrite("storage_bytes", &EmbeddingRankLoad::storage_bytes)
      .def_readwrite("lookup_s", &EmbeddingRankLoad::lookup_s)
      .def_readwrite("comm_s", &EmbeddingRankLoad::comm_s)
      .def_readwrite("sent_bytes", &EmbeddingRankLoad::sent_bytes)
      .def_readwrite("received_bytes", &EmbeddingRankLoad::received_bytes)
      .def_property_readonly("total_s", &EmbeddingRankLoad::total_s)
      .def(py::self == py::self);

  py::class_<EmbeddingOptions> options(m, "EmbeddingOptions", "What plan_embeddings plans for.");
  add_kwargs_init<EmbeddingOptions>(options);
  options.def_readwrite("world_size", &EmbeddingOptions::world_size)
      .def_readwrite("batch_per_rank", &EmbeddingOptions::batch_per_rank)
      .def_readwrite("optimizer", &EmbeddingOptions::optimizer)
      .def_readwrite("memory_budget_bytes", &EmbeddingOptions::memory_budget_bytes)
      .def_readwrite("column_chunk", &EmbeddingOptions::column_chunk)
      .def_readwrite("pins", &EmbeddingOptions::pins);

  py::class_<EmbeddingPlan> plan(m, "EmbeddingPlan", "Every table's sharding and shards, and the load per rank.");
  add_kwargs_init<EmbeddingPlan>(plan);
  add_copy<EmbeddingPlan>(plan);
  plan.def_readwrite("optimizer", &EmbeddingPlan::optimizer)
      .def_readwrite("world_size", &EmbeddingPlan::world_size)
      .def_readwrite("batch_per_rank", &EmbeddingPlan::batch_per_rank)
      .def_readwrite("tables", &EmbeddingPlan::tables)
      .def_readwrite("placements", &EmbeddingPlan::placements)
      .def_readwrite("ranks", &EmbeddingPlan::ranks)
      .def_readwrite("max_rank_s", &EmbeddingPlan::max_rank_s)
      .def_readwrite("lower_bound_s", &EmbeddingPlan::lower_bound_s)
      .def(
          "to_json", [](const EmbeddingPlan& p, int indent) { return embeddings_to_json(p, indent); },
          py::arg("indent") = 2)
      .def_static("from_json", &embeddings_from_json, py::arg("text"))
      .def(py::self == py::self)
      .def("__repr__", [](const EmbeddingPlan& p) {
        return "<EmbeddingPlan " + std::to_string(p.tables.size()) + " tables on " + std::to_string(p.world_size) +
               " ranks>";
      })
      .def(py::pickle([](const EmbeddingPlan& p) { return embeddings_to_json(p, 2); },
                      [](const std::string& text) { return embeddings_from_json(text); }));

  m.def("plan_embeddings", &plan_embeddings, py::arg("tables"), py::arg("cluster"), py::arg("options"),
        py::call_guard<py::gil_scoped_release>(),
        "Chooses each table's sharding and places the shards under every rank's memory budget.");
  m.def("evaluate_embeddings", &evaluate_embeddings, py::arg("plan"), py::arg("cluster"),
        py::arg("memory_budget_bytes") = 0.0, "Checks and re-scores an embedding plan.");
  m.def("embedding_placement_loads", &embedding_placement_loads, py::arg("table"), py::arg("placement"),
        py::arg("cluster"), py::arg("options"));
  m.def("format_embedding_report", &format_embedding_report, py::arg("plan"));
}

}  // namespace monarch::python
