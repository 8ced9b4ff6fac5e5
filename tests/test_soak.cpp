// refit-bench soak (label `faults`): six publish/fault/restart cycles with seeded random
// runtime faults in one process; every cycle must commit after exactly one recovered fault,
// no generation may be stale, and no process, /dev/shm entry or fd may be left behind.
#include <cstdio>
#include <string>
#include <sys/wait.h>

#include "run_command.hpp"
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace {

using json = nlohmann::json;

using run_result = refit::testing::command_result;

run_result run(const std::string& args) {
  return refit::testing::run_command(std::string(REFIT_BENCH_EXE) + " " + args);
}

TEST(Soak, SixFaultedCyclesCommitWithoutStaleGenerationsOrLeaks) {
  auto r = run("soak --config " + std::string(REFIT_SOURCE_DIR)
               + "/configs/tiny-cpu.yaml --cycles 6 --seed 7 --json");
  json j = json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << "not JSON (exit " << r.exit_code << "): " << r.out;
  EXPECT_EQ(r.exit_code, 0) << j.dump(2);
  for (const char* key : {"cycles", "faults", "restarts", "commits", "stale_generations",
                          "leaked_processes", "leaked_shm", "leaked_fds", "seconds", "seed",
                          "per_cycle"})
    ASSERT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["cycles"], 6);
  EXPECT_EQ(j["seed"], 7);
  EXPECT_GE(j["commits"].get<int>(), 6) << j.dump(2);
  EXPECT_EQ(j["faults"], 6) << j.dump(2);
  EXPECT_GE(j["restarts"].get<int>(), 6) << j.dump(2);
  EXPECT_EQ(j["stale_generations"], 0) << j.dump(2);
  EXPECT_EQ(j["leaked_processes"], 0);
  EXPECT_EQ(j["leaked_shm"], 0);
  EXPECT_EQ(j["leaked_fds"], 0);
  ASSERT_EQ(j["per_cycle"].size(), 6u);
  for (const auto& c : j["per_cycle"]) {
    EXPECT_EQ(c["attempts"], 2) << c.dump();
    EXPECT_EQ(c["committed_version"], c["version"]) << c.dump();
    EXPECT_EQ(c["fault"]["incarnation"], c["cycle"]) << c.dump();
  }
}

} // namespace
