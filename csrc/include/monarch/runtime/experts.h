#pragma once
// Expert parallelism: a Mixture-of-Experts layer's experts split over the mesh's ep ranks,
// tokens sent to them and back by all-to-all. See experts.cpp.

namespace monarch::experts {}  // namespace monarch::experts
