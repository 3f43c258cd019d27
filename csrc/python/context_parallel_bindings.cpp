// torch_monarch._runtime: bindings of monarch/runtime/context_parallel.h.
#include <torch/extension.h>

#include <optional>
#include <string>

#include "monarch/runtime/context_parallel.h"

namespace py = pybind11;

namespace monarch::python {

namespace {

at::ScalarType dtype_named(const std::string& name) {
  if (name == "float32" || name == "float") return at::kFloat;
  if (name == "float64" || name == "double") return at::kDouble;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16" || name == "half") return at::kHalf;
  TORCH_CHECK(false, "monarch: cp_ring_attention_bytes: dtype '", name,
              "' is not one of float32, float64, bfloat16, float16");
}

cp::RingAttentionOptions options_of(bool causal, std::optional<double> scale, int64_t block_rows = 0) {
  cp::RingAttentionOptions o;
  o.causal = causal;
  o.scale = scale;
  o.block_rows = block_rows;
  return o;
}

}  // namespace

void bind_context_parallel(py::module_& m) {
  using py::arg;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def(
      "cp_ring_attention",
      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Communicator& group, bool causal,
         std::optional<double> scale, int64_t block_rows) {
        return cp::ring_attention(q, k, v, group, options_of(causal, scale, block_rows));
      },
      arg("q"), arg("k"), arg("v"), arg("group"), arg("causal") = true, arg("scale") = py::none(),
      arg("block_rows") = 0, nogil,
      "Ring attention over the cp group: q [b, heads, s_local, d], k / v [b, kv_heads, s_local, d]; this rank's "
      "chunks under the load-balanced layout (cp_shard_sequence). Differentiable.");
  m.def("cp_shard_sequence", &cp::shard_sequence, arg("x"), arg("dim"), arg("rank"), arg("size"),
        "Chunks rank and 2*size-1-rank of 2*size equal chunks of x along dim (differentiable).");
  m.def("cp_sequence_positions", &cp::sequence_positions, arg("seq_len"), arg("rank"), arg("size"));
  m.def("cp_local_sequence_positions", &cp::local_sequence_positions, arg("local_len"), arg("rank"), arg("size"));
  m.def("cp_unshard_sequence", &cp::unshard_sequence, arg("shards"), arg("dim"));
  m.def("cp_gather_sequence", &cp::gather_sequence, arg("x"), arg("group"), arg("dim"), nogil,
        "All-gather of every cp rank's part in sequence order; backward keeps this rank's chunks.");
  m.def(
      "cp_simulate_ring_attention",
      [](const std::vector<at::Tensor>& qs, const std::vector<at::Tensor>& ks, const std::vector<at::Tensor>& vs,
         const std::vector<at::Tensor>& douts, bool causal, std::optional<double> scale, int64_t block_rows) {
        auto r = cp::simulate_ring_attention(qs, ks, vs, douts, options_of(causal, scale, block_rows));
        py::dict d;
        d["out"] = r.out;
        d["dq"] = r.dq;
        d["dk"] = r.dk;
        d["dv"] = r.dv;
        return d;
      },
      arg("qs"), arg("ks"), arg("vs"), arg("douts") = std::vector<at::Tensor>{}, arg("causal") = true,
      arg("scale") = py::none(), arg("block_rows") = 0);
  m.def(
      "cp_ring_attention_bytes",
      [](int64_t batch, int64_t local_len, int64_t kv_heads, int64_t head_dim, int64_t v_head_dim, int64_t cp,
         const std::string& dtype) {
        auto b = cp::ring_attention_bytes(batch, local_len, kv_heads, head_dim, v_head_dim, cp, dtype_named(dtype));
        return std::make_pair(b.forward, b.backward);
      },
      arg("batch"), arg("local_len"), arg("kv_heads"), arg("head_dim"), arg("v_head_dim"), arg("cp"),
      arg("dtype") = "float32", "(forward, backward) bytes one rank sends per ring_attention call.");
}

}  // namespace monarch::python
