// The disk tier's asynchronous file I/O (plugins/strategies/zero/aio.cpp) on its own: transfers
// of several blocks under two tags round-trip through a swap file, the file goes with the object,
// and a full disk is an error naming the file and the reason; each with io_uring and with the I/O
// thread that stands in where io_uring is unavailable.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <vector>

#include "../common/run_dtk.hpp"
#include "aio.hpp"

namespace fs = std::filesystem;
using dtk::zero::AsyncFile;

namespace {

struct Aligned {
  explicit Aligned(size_t bytes) {
    if (posix_memalign(&p, AsyncFile::kAlign, bytes) != 0) p = nullptr;
  }
  ~Aligned() { std::free(p); }
  void* p = nullptr;
};

TEST(ZeroAio, TransfersOfSeveralBlocksUnderTwoTagsRoundTrip) {
  for (const bool ring : {true, false}) {
    SCOPED_TRACE(ring ? "io_uring" : "I/O thread");
    const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, ring ? "aio" : "aio-thread");
    const std::string path = dir + "/state.swap";
    const int64_t half = 9 * (1 << 20) + 3 * AsyncFile::kAlign;  // several 4 MiB blocks and a tail
    Aligned out(2 * half), in(2 * half);
    ASSERT_TRUE(out.p && in.p);
    auto* o = static_cast<uint32_t*>(out.p);
    for (int64_t i = 0; i < 2 * half / 4; ++i) o[i] = static_cast<uint32_t>(i * 2654435761u);
    {
      AsyncFile f(path, 2 * half, ring);
      EXPECT_EQ(f.engine().rfind(ring ? "io_uring" : "an I/O thread (io_uring: not asked for)", 0), 0u) << f.engine();
      EXPECT_TRUE(fs::is_regular_file(path));
      EXPECT_EQ(fs::file_size(path), static_cast<uintmax_t>(2 * half)) << "reserved at creation";
      f.write(0, out.p, 0, half);
      f.write(1, static_cast<char*>(out.p) + half, half, half);
      f.wait(1);
      f.wait(0);
      std::memset(in.p, 0, 2 * half);
      f.read(1, static_cast<char*>(in.p) + half, half, half);
      f.read(0, in.p, 0, half);
      f.wait_all();
      EXPECT_EQ(std::memcmp(in.p, out.p, 2 * half), 0);
      std::printf("direct I/O in %s: %s\n", dir.c_str(), f.direct() ? "yes" : "no (buffered)");
    }
    EXPECT_FALSE(fs::exists(path)) << "the swap file outlived its AsyncFile";
  }
}

// /dev/full answers every write with ENOSPC; a link to it stands for a swap file on a full disk
// (the link, not the device, is what the AsyncFile removes).
TEST(ZeroAio, AFullDiskIsAnErrorNamingTheFile) {
  for (const bool ring : {true, false}) {
    SCOPED_TRACE(ring ? "io_uring" : "I/O thread");
    const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, ring ? "aio-full" : "aio-full-thread");
    const std::string path = dir + "/full.swap";
    fs::create_symlink("/dev/full", path);
    Aligned buf(1 << 20);
    ASSERT_TRUE(buf.p);
    std::memset(buf.p, 1, 1 << 20);
    std::string message;
    {
      AsyncFile f(path, 0, ring);
      f.write(3, buf.p, 0, 1 << 20);
      try {
        f.wait(3);
      } catch (const std::runtime_error& e) {
        message = e.what();
      }
    }
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(std::strerror(ENOSPC)), std::string::npos) << message;
    EXPECT_NE(message.find("writing"), std::string::npos) << message;
    EXPECT_TRUE(fs::exists("/dev/full"));
  }
}

TEST(ZeroAio, AFileThatCannotBeCreatedIsNamed) {
  try {
    AsyncFile f("/proc/no-such-dir/x.swap", 4096);
    FAIL() << "created";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot create swap file /proc/no-such-dir/x.swap: "), std::string::npos)
        << e.what();
  }
}

}  // namespace
