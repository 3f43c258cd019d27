// The Catch2 driver of the planner and kernel test binaries.
#define MONARCH_CATCH_RUNNER
#include "catch_compat.h"

int main(int argc, char* argv[]) { return Catch::Session().run(argc, argv); }
