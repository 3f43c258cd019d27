#pragma once
// Context parallelism: causal attention with the sequence split over the mesh's cp ranks
// (ring exchange of keys and values, online-softmax accumulation). See context_parallel.cpp.

namespace monarch::cp {}  // namespace monarch::cp
