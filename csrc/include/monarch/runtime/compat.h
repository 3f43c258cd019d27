#pragma once
// The one place where LibTorch version differences live (Debian's 1.13 here, 2.x on the GPU
// machine).
#include <torch/version.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace monarch::compat {

using Work = c10d::Work;  // c10d::ProcessGroup::Work before LibTorch 1.13
using WorkPtr = c10::intrusive_ptr<Work>;
using GlooPtr = c10::intrusive_ptr<c10d::ProcessGroupGloo>;

}  // namespace monarch::compat
