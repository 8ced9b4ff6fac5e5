// The fault matrix (CTest label `faults`): every runtime command of a publication x every
// fault kind, injected into the first runtime incarnation, with the real refit-runtime child.
#include "publication_fixture.hpp"

#include "runtime/publication/direct_backend.hpp"

using namespace refit;
using namespace refit::testing;

namespace {

// The fault matrix (label `faults`): every runtime command of a publication x every fault
// kind, injected into the first runtime incarnation. Each must end Poisoned with nothing
// committed, the runtime's whole process group killed and reaped, a fresh runtime attached,
// and no memfd mapping, /dev/shm segment or fd left behind.
struct matrix_case {
  const char* command;
  const char* kind;
  std::uint32_t after;
  const char* mode = "packed"; // publication.mode
};

class PublicationFaultMatrix : public Publication,
                               public ::testing::WithParamInterface<matrix_case> {};

TEST_P(PublicationFaultMatrix, FailStopLeavesNothingBehind) {
  auto c = GetParam();
  cfg.runtime.timeouts_ms.init_weight_transfer = 400;
  cfg.runtime.timeouts_ms.start_weight_update = 400;
  cfg.runtime.timeouts_ms.update_weights = 400;
  cfg.runtime.timeouts_ms.finish_weight_update = 400;
  cfg.runtime.timeouts_ms.release_ipc = 400;
  cfg.runtime.faults = {{c.command, c.kind, c.after, 1}};
  cfg.publication.mode = c.mode;
  auto shm_before = shm_entries();
  start();
  auto fds_before = fd_count();
  auto pid = runtime_pid();
  auto res = publish(1);
  ASSERT_FALSE(res) << c.command << ":" << c.kind << " committed";
  EXPECT_EQ(engine().committed_version, 0u) << render(res.error());
  ASSERT_TRUE(wait_incarnation(2)) << render(res.error());
  EXPECT_TRUE(proc::processes_in_group(pid).empty());
  EXPECT_EQ(::kill(pid, 0), -1) << "reaped";
  EXPECT_TRUE(engine().needs_publication);
  // Direct mode: every rank closed its mappings of the dead runtime's resident arenas.
  EXPECT_EQ(open_targets_after_release(), 0u);
  for (const auto& r : pub.ranks)
    EXPECT_LE(ask<rank_info>(r, describe_atom::value)->peak_materialized_bytes,
              cfg.publication.buffer_count * cfg.publication.buffer_bytes);
  // The fresh runtime takes the same weights: the next publication commits.
  auto again = publish(2);
  ASSERT_TRUE(again) << render(again.error());
  EXPECT_EQ(engine().committed_version, 2u);
  EXPECT_EQ(shm_entries(), shm_before);
  // Threads may hold a transient fd (a /proc read) at any moment: a leak is a count that stays
  // above the baseline.
  auto until = std::chrono::steady_clock::now() + 2s;
  while (fd_count() > fds_before && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(10ms);
  EXPECT_LE(fd_count(), fds_before) << "no fd outlives a failed publication";
}

std::vector<matrix_case> matrix() {
  std::vector<matrix_case> out;
  for (const char* kind : {"error", "stall", "exit", "sigkill", "bad_frame", "wrong_id",
                           "wrong_result"}) {
    out.push_back({"init_weight_transfer", kind, 0});
    out.push_back({"start_weight_update", kind, 0});
    out.push_back({"update_weights", kind, 0});
    out.push_back({"update_weights", kind, 2});
    out.push_back({"finish_weight_update", kind, 0});
    out.push_back({"release_ipc", kind, 0});
  }
  // Direct mode: the runtime fails or dies while the ranks write its exported arenas (the 1st
  // and 3rd update_weights answer chunks the ranks already wrote, while the next is written).
  for (const char* kind : {"error", "exit", "sigkill", "wrong_result"}) {
    out.push_back({"init_weight_transfer", kind, 0, "direct"});
    out.push_back({"start_weight_update", kind, 0, "direct"});
    out.push_back({"update_weights", kind, 0, "direct"});
    out.push_back({"update_weights", kind, 2, "direct"});
    out.push_back({"finish_weight_update", kind, 0, "direct"});
    out.push_back({"release_ipc", kind, 0, "direct"});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Matrix, PublicationFaultMatrix, ::testing::ValuesIn(matrix()),
                         [](const auto& info) {
                           return std::string(info.param.command) + "_" + info.param.kind + "_"
                                  + std::to_string(info.param.after)
                                  + (std::string(info.param.mode) == "direct" ? "_direct" : "");
                         });

} // namespace
