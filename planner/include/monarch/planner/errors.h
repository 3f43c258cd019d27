#pragma once
// Exception types thrown by the planner. Every message names the offending field path or
// constraint, e.g. "mesh.tp: 3 does not divide heads=32".
#include <stdexcept>
#include <string>

namespace monarch::planner {

// Base of every planner error.
class PlannerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A value (CLI flag, JSON field, builder argument) is malformed or inconsistent.
// `field` is the dotted path of the offending value ("mesh.tp", "layers[3].stage").
class ValidationError : public PlannerError {
 public:
  ValidationError(std::string field, const std::string& message)
      : PlannerError(field + ": " + message), field_(std::move(field)) {}
  const std::string& field() const { return field_; }

 private:
  std::string field_;
};

// JSON text could not be parsed, or its version is unknown.
class FormatError : public PlannerError {
 public:
  using PlannerError::PlannerError;
};

// No layout satisfies the constraints (memory, divisibility, pins).
class InfeasibleError : public PlannerError {
 public:
  using PlannerError::PlannerError;
};

}  // namespace monarch::planner
