#pragma once
// Human-readable summaries of a plan (what `monarch-plan` prints).
#include <string>

#include "monarch/planner/plan.h"

namespace monarch::planner {

// Multi-line summary: model, cluster, mesh, memory per rank, step-time breakdown,
// throughput, MFU, stage boundaries, alternatives.
std::string format_report(const Plan& plan);
// The inference section of an inference plan (Plan::inference): ask, time to first token,
// per-token latency, tokens/s, memory (weights, KV cache), why, alternatives.
std::string format_inference_report(const Plan& plan);
// "12.3 GiB", "1.50 TB"-style helpers.
std::string format_bytes(double bytes);
std::string format_seconds(double seconds);

}  // namespace monarch::planner
