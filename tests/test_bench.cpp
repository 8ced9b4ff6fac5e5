// refit-bench smoke tests: the JSON report of a tiny publication benchmark is complete and
// self-consistent (no timing assertions), failures are one line and a non-zero exit, and the
// streaming bulk copies the publication path uses are byte-identical to memcpy.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <sys/wait.h>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "run_command.hpp"
#include "runtime/publication/host_buffer.hpp"

namespace {

using json = nlohmann::json;

std::string bench_exe() {
  std::string runtime = REFIT_RUNTIME_EXE;
  return runtime.substr(0, runtime.rfind('/') + 1) + "refit-bench";
}

using run_result = refit::testing::command_result;

run_result run(const std::string& args) {
  return refit::testing::run_command(bench_exe() + " " + args);
}

std::string tiny_config() { return std::string(REFIT_SOURCE_DIR) + "/configs/tiny-synthetic.yaml"; }

TEST(Bench, PublishReportIsCompleteAndConsistent) {
  auto r = run("publish --config " + tiny_config()
               + " --iterations 3 --verify --json --bound-reps 3 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  json j = json::parse(r.out);
  for (const char* key :
       {"tensors", "bytes", "chunks", "trainer_ranks", "tp", "seconds", "gbps", "bound_gbps",
        "ratio", "peak_extra_bytes", "verified", "iterations", "seconds_all", "config",
        "buffer_bytes", "buffer_count", "bound_method"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["iterations"], 3);
  ASSERT_EQ(j["seconds_all"].size(), 3u);
  EXPECT_EQ(j["trainer_ranks"], 2);
  EXPECT_EQ(j["tp"], 2);
  EXPECT_GT(j["tensors"].get<std::uint64_t>(), 0u);
  EXPECT_GT(j["chunks"].get<std::uint32_t>(), 1u);
  EXPECT_EQ(j["buffer_bytes"], 65536);
  EXPECT_EQ(j["buffer_count"], 2);
  EXPECT_EQ(j["config"], tiny_config());
  EXPECT_TRUE(j["verified"].get<bool>());

  const double bytes = j["bytes"].get<double>();
  const double seconds = j["seconds"].get<double>();
  const double gbps = j["gbps"].get<double>();
  const double bound = j["bound_gbps"].get<double>();
  ASSERT_GT(seconds, 0.0);
  ASSERT_GT(bound, 0.0);
  EXPECT_NEAR(gbps, bytes / seconds / 1e9, 1e-9 * gbps);
  EXPECT_NEAR(j["ratio"].get<double>(), gbps / bound, 1e-9 * gbps / bound);
  // seconds is the median of seconds_all.
  std::vector<double> all = j["seconds_all"].get<std::vector<double>>();
  std::sort(all.begin(), all.end());
  EXPECT_DOUBLE_EQ(seconds, all[1]);
  EXPECT_NE(j["bound_method"].get<std::string>().find("memcpy"), std::string::npos);
}

TEST(Bench, RegisteredSourcePublishesTheSameBytesVerified) {
  auto synth = run("publish --config " + tiny_config() + " --iterations 1 --json 2>/dev/null");
  auto reg = run("publish --config " + tiny_config()
                 + " --iterations 2 --verify --json --source registered 2>/dev/null");
  ASSERT_EQ(synth.exit_code, 0) << synth.out;
  ASSERT_EQ(reg.exit_code, 0) << reg.out;
  json a = json::parse(synth.out), b = json::parse(reg.out);
  EXPECT_EQ(a["source"], "synthetic");
  EXPECT_EQ(b["source"], "registered");
  EXPECT_EQ(a["bytes"], b["bytes"]);
  EXPECT_EQ(a["tensors"], b["tensors"]);
  EXPECT_EQ(a["chunks"], b["chunks"]);
  EXPECT_TRUE(b["verified"].get<bool>()) << "digest terms of the registered memory == receipts";
  auto bad = run("publish --config " + tiny_config() + " --source torch 2>&1");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("--source"), std::string::npos) << bad.out;
}

TEST(Bench, MissingConfigIsOneErrorLineAndNonZeroExit) {
  auto r = run("publish --config /nonexistent/bench.yaml --json 2>&1");
  EXPECT_NE(r.exit_code, 0);
  ASSERT_FALSE(r.out.empty());
  EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << r.out;
  EXPECT_NE(r.out.find("/nonexistent/bench.yaml"), std::string::npos) << r.out;
}

TEST(Bench, BadConfigValueNamesTheKey) {
  char path[] = "/tmp/refit-bench-test-XXXXXX";
  int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  ::close(fd);
  {
    std::ifstream in(tiny_config());
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto at = text.find("buffer_count: 2");
    ASSERT_NE(at, std::string::npos);
    text.replace(at, 15, "buffer_count: -3");
    std::ofstream(path) << text;
  }
  auto r = run(std::string("publish --config ") + path + " 2>&1");
  ::unlink(path);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << r.out;
  EXPECT_NE(r.out.find("publication.buffer_count"), std::string::npos) << r.out;
}

TEST(Bench, HelpExplainsEveryOption) {
  auto r = run("publish --help 2>&1");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* opt : {"--config", "--iterations", "--verify", "--json", "--bound-reps"})
    EXPECT_NE(r.out.find(opt), std::string::npos) << opt;
}

// The streaming copies must equal memcpy for every alignment and size around the thresholds.
TEST(BulkCopy, MatchesMemcpyForAnyAlignmentAndSize) {
  using refit::publication::bulk_copy;
  using refit::publication::bulk_copy_rows;
  const std::size_t max = refit::publication::streaming_copy_min_bytes * 3;
  std::vector<std::byte> src(max + 256), dst(max + 256), want(max + 256);
  for (std::size_t i = 0; i < src.size(); ++i)
    src[i] = static_cast<std::byte>((i * 131 + 7) & 0xff);
  const std::size_t min = refit::publication::streaming_copy_min_bytes;
  for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{100}, min - 1, min,
                            min + 1, min + 63, 2 * min + 129, max}) {
    for (std::size_t doff : {0, 1, 17, 63, 64}) {
      for (std::size_t soff : {0, 3, 64}) {
        std::fill(dst.begin(), dst.end(), std::byte{0xAA});
        want = dst;
        std::memcpy(want.data() + doff, src.data() + soff, bytes);
        bulk_copy(dst.data() + doff, src.data() + soff, bytes);
        ASSERT_EQ(dst, want) << "bytes " << bytes << " dst+" << doff << " src+" << soff;
      }
    }
  }
  // One source to several destinations (the all-gather's push), with equal and with mixed
  // cache-line offsets.
  using refit::publication::bulk_copy_to_all;
  for (std::size_t bytes : {std::size_t{100}, min, 2 * min + 129}) {
    for (std::vector<std::size_t> offs :
         {std::vector<std::size_t>{0}, {0, 64 * 40}, {17, 17 + 64 * 50, 17 + 64 * 100},
          {0, 3 + 64 * 40}}) {
      std::vector<std::byte> out(offs.size() * (bytes + 192) + 64, std::byte{0x11});
      auto expect = out;
      std::vector<std::byte*> dsts;
      for (std::size_t off : offs) {
        off = off % 64 + (dsts.size() * (bytes + 128) / 64) * 64; // disjoint, keeps off % 64
        dsts.push_back(out.data() + off);
        std::memcpy(expect.data() + off, src.data() + 5, bytes);
      }
      bulk_copy_to_all(dsts.data(), dsts.size(), src.data() + 5, bytes);
      ASSERT_EQ(out, expect) << "bytes " << bytes << " destinations " << dsts.size();
    }
  }
  // Strided rows (a TP column slice): 512-byte rows out of 1024-byte rows, and short rows.
  for (std::size_t row : {std::size_t{40}, std::size_t{512}, std::size_t{777}}) {
    const std::size_t rows = max / (2 * row + 64);
    std::fill(dst.begin(), dst.end(), std::byte{0x55});
    want = dst;
    for (std::size_t r = 0; r < rows; ++r)
      std::memcpy(want.data() + 5 + r * (row + 3), src.data() + 1 + r * 2 * row, row);
    bulk_copy_rows(dst.data() + 5, row + 3, src.data() + 1, 2 * row, row, rows);
    ASSERT_EQ(dst, want) << "row " << row;
  }
}

} // namespace
