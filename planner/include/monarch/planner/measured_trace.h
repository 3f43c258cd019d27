#pragma once
// A run's measured timeline, as the runtime writes it (monarch::trace, docs/report.md): a
// Chrome trace-event JSON file that Perfetto and chrome://tracing open, with one process per
// rank and the mesh coordinates of each rank in "otherData". Read here, torch-free, so the
// report can draw the measured pipeline step under the predicted one.
#include <cstdint>
#include <string>
#include <vector>

#include "monarch/planner/schedule.h"

namespace monarch::planner {

struct MeasuredEvent {
  std::string name;      // an ActionType name ("forward", ...), "step", or a collective's
  std::string category;  // "pipeline" or "collective"
  double start_s = 0;    // seconds from the trace's time origin (clocks aligned across ranks)
  double end_s = 0;
  int64_t step = -1;         // pipeline step index on this rank (-1: not a pipeline event)
  int64_t micro_batch = -1;  // -1 when the event has none
  int64_t stage = -1;
  double bytes = 0;      // collectives: bytes this rank sent
  std::string group;     // collectives: "dp", "tp", "pp", "world", ...
};

struct MeasuredRank {
  int64_t rank = 0;
  int64_t pp = 0, dp = 0, tp = 0;  // mesh coordinates
  std::vector<MeasuredEvent> events;  // in start order
};

struct MeasuredTrace {
  std::vector<MeasuredRank> ranks;  // by rank
  int64_t dropped = 0;  // events the ring buffers overwrote before the trace was saved
  int64_t pp = 0, dp = 0, tp = 0;  // the run's mesh (otherData.mesh; 0 when absent)
};

// Reads the trace JSON text / file. Throws FormatError for text that is not JSON and
// ValidationError naming the field for a trace that is not a monarch trace (no
// otherData.format == "monarch-trace") or holds malformed events.
MeasuredTrace measured_trace_from_json(const std::string& text);
MeasuredTrace load_measured_trace(const std::string& path);

// One pipeline step as measured on each pipeline rank (the rank with dp = tp = 0 at each
// pipeline position), in the simulator's terms so it draws beside the prediction.
struct MeasuredStep {
  int64_t step = -1;                              // the step index chosen
  std::vector<std::vector<TimelineEvent>> timeline;  // per pipeline rank, times from the step start
  std::vector<double> busy_s;                     // compute (F, B, Bi, W) per pipeline rank
  double makespan_s = 0;                          // first start to last end over the ranks
  double bubble_fraction = 0;                     // mean over ranks of (makespan - busy) / makespan
};

// The last training step every pipeline rank completed (or `step` when >= 0; forward-only
// runs are not steps). Throws ValidationError when the trace's mesh has another pipeline
// depth than `pp`, when it has no such step, or lacks a rank for a pipeline position. Jobs
// without a pipeline (pp = 1) run no pipeline executor and record no steps.
MeasuredStep measured_pipeline_step(const MeasuredTrace& trace, int64_t pp, int64_t step = -1);

}  // namespace monarch::planner
