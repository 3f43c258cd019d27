#pragma once
// LibTorch pulls in glog, whose CHECK macro collides with Catch2's: include torch first,
// drop glog's CHECK, then Catch2.
#include <torch/torch.h>
#undef CHECK
#include "catch_compat.h"
