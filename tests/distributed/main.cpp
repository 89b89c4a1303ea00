// dtk_distributed_tests: GoogleTest, or — with DTK_TEST_WORKER set — one rank of a
// multi-process collective check (the tests spawn this binary once per rank).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

int collectives_worker(int argc, char** argv);

int main(int argc, char** argv) {
  if (const char* w = std::getenv("DTK_TEST_WORKER"); w && !std::strcmp(w, "collectives"))
    return collectives_worker(argc, argv);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
