#pragma once
// A plan as one self-contained HTML page (inline SVG and CSS, no script, no network): the
// mesh, the pipeline timeline of one step, memory per pipeline rank against the device
// limit, the step-time breakdown and traffic per link level, the alternatives and, for a
// plan that does not fit, what would make it fit; with a measured trace, the measured step
// under the predicted one. docs/report.md describes every part.
#include <optional>
#include <string>

#include "monarch/planner/measured_trace.h"
#include "monarch/planner/plan.h"

namespace monarch::planner {

struct HtmlReportOptions {
  std::optional<MeasuredTrace> trace;  // the run's measured trace (measured_trace.h)
  int64_t trace_step = -1;             // which pipeline step of it; -1: the last complete one
  std::string title;                   // default: the model's name
};

std::string html_report(const Plan& plan, const HtmlReportOptions& options = {});
// Writes html_report to `path` (FormatError when the file cannot be written).
void save_html_report(const Plan& plan, const std::string& path, const HtmlReportOptions& options = {});

// What differs between two plans: layout fields, per-layer placement (stage, tp pattern,
// sharding unit), predicted time, memory and per-rank memory. Plain text for a terminal
// or a code review; "plans are identical" when nothing differs.
std::string diff_plans(const Plan& a, const Plan& b);

}  // namespace monarch::planner
