// emulated_test.hpp — the fixture every emulated test runs in: it starts each test with the
// emulation's state as a fresh process has it (no faults, no pending error, an H100, no kernel's
// shared-memory opt-in, no launch recorded, copies landing late), so that what one test left
// behind, a failure's count or another GPU's limits, does not reach the next; and fails a test
// whose kernels showed a fault it did not check itself.
#pragma once

#include <gtest/gtest.h>

#include "simt.hpp"

class Emulated : public ::testing::Test {
 protected:
  void SetUp() override {
    simt::faults = 0;
    last_error = cudaSuccess;
    simt::device = {};
    simt::shared_allowed.clear();
    simt::launched.clear();
    dtk::cuda::warp::copies_land_at_once = false;
  }
  void TearDown() override {
    EXPECT_EQ(simt::faults.exchange(0), 0) << "copies never waited for, misaligned ldmatrix rows, shared memory "
                                              "written past the launch's, or a launch a GPU refuses";
  }
};
