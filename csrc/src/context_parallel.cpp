#include "monarch/runtime/context_parallel.h"

namespace monarch::cp {}  // namespace monarch::cp
