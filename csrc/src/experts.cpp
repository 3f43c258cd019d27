#include "monarch/runtime/experts.h"

namespace monarch::experts {}  // namespace monarch::experts
