// Runtime logging levels (csrc/src/log.cpp): MONARCH_LOG_LEVEL's grammar, the quiet default
// on ranks > 0, and one clear error for a malformed value. The lines themselves, with the
// rank in each, are checked on a launched job by test/python/test_logging.py.
#include "catch_with_torch.h"

#include "monarch/runtime/log.h"

using monarch::log::level_for;

TEST_CASE("log levels: info on rank 0, warn elsewhere, overridden per component", "[runtime][log]") {
  CHECK(level_for("", "pipeline", 0) == "info");
  CHECK(level_for("", "pipeline", 3) == "warn");
  CHECK(level_for("", "world", -1) == "info");  // rank not known yet
  CHECK(level_for("debug", "mesh", 5) == "debug");
  CHECK(level_for("warn,pipeline=debug", "pipeline", 0) == "debug");
  CHECK(level_for("warn,pipeline=debug", "mesh", 0) == "warn");
  CHECK(level_for("pipeline=trace", "mesh", 2) == "warn");
  CHECK(level_for("off", "comm", 0) == "off");
  CHECK_THROWS_WITH(level_for("loud", "mesh", 0), Catch::Contains("MONARCH_LOG_LEVEL: 'loud' is neither a level"));
  CHECK_THROWS_WITH(level_for("=debug", "mesh", 0), Catch::Contains("'=debug'"));
  CHECK_THROWS_WITH(level_for("mesh=verbose", "mesh", 0), Catch::Contains("'mesh=verbose'"));
}
