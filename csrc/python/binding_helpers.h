#pragma once
// Helpers shared by the planner's pybind11 bindings (planner_bindings.cpp,
// embedding_bindings.cpp).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>

#include "monarch/planner/errors.h"

namespace monarch::python::binding {

namespace py = pybind11;
using monarch::planner::ValidationError;

// ---------------------------------------------------------------------------------------
// Small helpers

inline std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

inline std::string quoted(const std::string& s) { return "'" + s + "'"; }

template <class T>
std::string opt(const std::optional<T>& v) {
  if (!v) return "None";
  std::ostringstream os;
  if constexpr (std::is_same_v<T, bool>) {
    os << (*v ? "True" : "False");
  } else if constexpr (std::is_enum_v<T>) {
    os << to_string(*v);
  } else {
    os << *v;
  }
  return os.str();
}

inline const char* pybool(bool b) { return b ? "True" : "False"; }

// `value` as int32, or ValidationError (a ValueError) naming the argument.
inline int32_t to_int32(int64_t value, const char* name) {
  if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max()) {
    throw ValidationError(name, std::to_string(value) + " is out of range for a 32-bit index");
  }
  return static_cast<int32_t>(value);
}

// T(**kwargs): default-construct, then assign each keyword as an attribute, so unknown
// names raise AttributeError and values go through the normal field setters.
template <class T, class Cls>
void add_kwargs_init(Cls& cls) {
  cls.def(py::init([](const py::kwargs& kwargs) {
            py::object obj = py::cast(T{});
            for (const auto& item : kwargs) py::setattr(obj, item.first, item.second);
            return obj.cast<T>();
          }),
          "Default values, overridden by keyword arguments naming fields.");
}

template <class T, class Cls>
void add_copy(Cls& cls) {
  cls.def("__copy__", [](const T& self) { return T(self); });
  cls.def("__deepcopy__", [](const T& self, const py::object&) { return T(self); }, py::arg("memo"));
}

// str(enum) gives the name used in JSON and on the command line ("1f1b", "bf16"), and
// Enum.from_string(name, field) parses it, raising ValueError that names `field`.
template <class E, class FromString>
void finish_enum(py::enum_<E>& e, FromString from_string, const char* default_field) {
  e.attr("__str__") = py::cpp_function([](E v) { return to_string(v); }, py::name("__str__"),
                                       py::is_method(e));
  e.def_static(
      "from_string",
      [from_string](const std::string& name, const std::string& field) {
        return from_string(name, field);
      },
      py::arg("name"), py::arg("field") = default_field,
      "Parses the name used in JSON and on the command line.");
}

}  // namespace monarch::python::binding
