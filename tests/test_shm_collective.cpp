// The cross-process all-gather (runtime/publication/shm_collective.hpp) with every rank in its
// own forked process: byte-exact results over many rounds and publications, and every way a
// round can go wrong (mismatched items, a dead peer, a silent peer, an abort) ends in an error
// naming the peer, never a hang.
#include "runtime/publication/shm_collective.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace refit::publication;
using namespace std::chrono_literals;
using ::testing::HasSubstr;
using clock_type = std::chrono::steady_clock;

// What one rank does in its process; returns "" on success or what went wrong.
using rank_body = std::function<std::string(std::uint32_t rank, const std::shared_ptr<shm_endpoint>&,
                                            const std::vector<shm_peer>&)>;

void write_all(int fd, const std::string& text) {
  std::size_t done = 0;
  while (done < text.size()) {
    auto n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0)
      return;
    done += static_cast<std::size_t>(n);
  }
}

// Reads one '\n'-terminated line within `timeout` ("" on timeout or EOF).
std::string read_line(int fd, std::chrono::milliseconds timeout) {
  std::string line;
  auto until = clock_type::now() + timeout;
  char c;
  while (clock_type::now() < until) {
    pollfd p{fd, POLLIN, 0};
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - clock_type::now());
    if (::poll(&p, 1, static_cast<int>(std::max<long>(left.count(), 1))) <= 0)
      continue;
    if (::read(fd, &c, 1) != 1)
      return line;
    if (c == '\n')
      return line;
    line += c;
  }
  return line;
}

struct outcome {
  std::vector<std::string> results; // per rank: "" = ok, else its error ("<exited>" if it died)
  std::chrono::milliseconds elapsed{0};
};

// Forks `world` ranks; each creates its endpoint and reports the handle; the test process
// sends everyone the member table; then each runs `body` and reports its result.
outcome run_ranks(std::uint32_t world, const rank_body& body) {
  struct child {
    pid_t pid = -1;
    int in = -1;  // test -> child
    int out = -1; // child -> test
  };
  std::vector<child> kids(world);
  for (std::uint32_t r = 0; r < world; ++r) {
    int down[2], up[2];
    if (::pipe(down) != 0 || ::pipe(up) != 0)
      throw std::runtime_error("pipe");
    pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::close(down[1]);
      ::close(up[0]);
      std::string result;
      try {
        auto ep = std::make_shared<shm_endpoint>(r);
        write_all(up[1], std::to_string(::getpid()) + " " + ep->handle() + "\n");
        std::vector<shm_peer> members;
        std::string table = read_line(down[0], 10s);
        std::size_t pos = 0;
        for (std::uint32_t k = 0; k < world; ++k) {
          auto next = table.find(';', pos);
          auto entry = table.substr(pos, next - pos);
          pos = next + 1;
          auto space = entry.find(' ');
          members.push_back({k, std::stoi(entry.substr(0, space)), entry.substr(space + 1)});
        }
        result = body(r, ep, members);
      } catch (const std::exception& e) {
        result = std::string("exception: ") + e.what();
      }
      write_all(up[1], (result.empty() ? "OK" : "ERR " + result) + "\n");
      ::_exit(0);
    }
    ::close(down[0]);
    ::close(up[1]);
    kids[r] = {pid, down[1], up[0]};
  }
  std::string table;
  for (auto& k : kids)
    table += read_line(k.out, 10s) + ";";
  auto t0 = clock_type::now();
  for (auto& k : kids)
    write_all(k.in, table + "\n");
  outcome res;
  for (auto& k : kids) {
    auto line = read_line(k.out, 60s);
    if (line == "OK")
      res.results.push_back("");
    else if (line.rfind("ERR ", 0) == 0)
      res.results.push_back(line.substr(4));
    else
      res.results.push_back("<exited>");
  }
  res.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(clock_type::now() - t0);
  for (auto& k : kids) {
    ::kill(k.pid, SIGKILL);
    ::waitpid(k.pid, nullptr, 0);
    ::close(k.in);
    ::close(k.out);
  }
  return res;
}

std::byte pattern(std::uint32_t rank, std::size_t item, std::uint64_t round, std::uint64_t i) {
  return static_cast<std::byte>((rank * 131 + item * 17 + round * 7 + i * 3 + 1) & 0xff);
}

// One round: items of `sizes` shard bytes, each rank's shard filled with its pattern; checks
// every output byte. Returns "" or what differed / failed.
std::string gather_round(shm_collective& c, std::uint32_t rank, std::uint32_t world,
                         const std::vector<std::uint64_t>& sizes, std::uint64_t round,
                         clock_type::time_point deadline) {
  std::vector<std::vector<std::byte>> shards(sizes.size()), outs(sizes.size());
  std::vector<gather_item> items;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    shards[i].resize(sizes[i]);
    for (std::uint64_t b = 0; b < sizes[i]; ++b)
      shards[i][b] = pattern(rank, i, round, b);
    outs[i].assign(sizes[i] * world, std::byte{0xee});
    items.push_back({shards[i].data(), sizes[i], outs[i].data()});
  }
  auto st = c.all_gather(rank, items, deadline);
  if (!st.ok)
    return st.error;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    for (std::uint32_t src = 0; src < world; ++src)
      for (std::uint64_t b = 0; b < sizes[i]; ++b)
        if (outs[i][src * sizes[i] + b] != pattern(src, i, round, b))
          return "round " + std::to_string(round) + " item " + std::to_string(i) + ": byte "
                 + std::to_string(b) + " of rank " + std::to_string(src) + "'s slot differs";
  return "";
}

TEST(ShmCollective, ThreeProcessesGatherByteExactOverRoundsAndPublications) {
  auto res = run_ranks(3, [](std::uint32_t rank, const auto& ep, const auto& members) {
    // Sizes change every round (staging grows mid-way; a zero-size item is allowed).
    const std::vector<std::vector<std::uint64_t>> rounds = {
      {256, 4096}, {0, 64, 100000}, {1, 3 << 20}, {512}, {70000, 70000, 70000}};
    for (const std::string pub : {"pub-a", "pub-b"}) {
      shm_collective c(ep, members, pub);
      for (std::uint64_t k = 0; k < rounds.size(); ++k)
        if (auto err = gather_round(c, rank, 3, rounds[k], k, clock_type::now() + 20s); !err.empty())
          return pub + ": " + err;
    }
    return std::string();
  });
  for (std::uint32_t r = 0; r < 3; ++r)
    EXPECT_EQ(res.results[r], "") << "rank " << r;
}

TEST(ShmCollective, InPlaceShardsAreAllowed) {
  // FSDP-style: the shard already sits at its slot of the output.
  auto res = run_ranks(2, [](std::uint32_t rank, const auto& ep, const auto& members) {
    shm_collective c(ep, members, "pub-inplace");
    std::vector<std::byte> out(2 * 8192);
    for (std::uint64_t b = 0; b < 8192; ++b)
      out[rank * 8192 + b] = pattern(rank, 0, 0, b);
    std::vector<gather_item> items{{out.data() + rank * 8192, 8192, out.data()}};
    auto st = c.all_gather(rank, items, clock_type::now() + 20s);
    if (!st.ok)
      return st.error;
    for (std::uint32_t src = 0; src < 2; ++src)
      for (std::uint64_t b = 0; b < 8192; ++b)
        if (out[src * 8192 + b] != pattern(src, 0, 0, b))
          return std::string("slot of rank ") + std::to_string(src) + " differs";
    return std::string();
  });
  EXPECT_EQ(res.results, (std::vector<std::string>{"", ""}));
}

TEST(ShmCollective, VariablePieceLayoutsConcatenateInRankOrder) {
  // Registered tensors: unequal row ranges (5 rows over 3 ranks: 2, 2, 1), a tensor only rank
  // 1 holds (a fused expert's canonical tensor), and one nobody but rank 0 contributes to.
  auto res = run_ranks(3, [](std::uint32_t rank, const auto& ep, const auto& members) {
    shm_collective c(ep, members, "pub-pieces");
    const std::vector<std::vector<gather_piece>> layouts = {
      {{0, 200}, {200, 200}, {400, 100}}, {{0, 0}, {0, 4096}, {0, 0}}, {{0, 7}, {7, 0}, {7, 0}}};
    const std::vector<std::uint64_t> totals = {500, 4096, 7};
    std::vector<std::vector<std::byte>> shards(layouts.size()), outs(layouts.size());
    std::vector<gather_item> items;
    for (std::size_t i = 0; i < layouts.size(); ++i) {
      const auto& mine = layouts[i][rank];
      shards[i].resize(mine.bytes);
      for (std::uint64_t b = 0; b < mine.bytes; ++b)
        shards[i][b] = pattern(rank, i, 0, b);
      outs[i].assign(totals[i], std::byte{0xee});
      items.push_back({shards[i].data(), mine.bytes, outs[i].data(), layouts[i]});
    }
    auto st = c.all_gather(rank, items, clock_type::now() + 20s);
    if (!st.ok)
      return st.error;
    for (std::size_t i = 0; i < layouts.size(); ++i)
      for (std::uint32_t src = 0; src < 3; ++src)
        for (std::uint64_t b = 0; b < layouts[i][src].bytes; ++b)
          if (outs[i][layouts[i][src].offset + b] != pattern(src, i, 0, b))
            return "item " + std::to_string(i) + ": byte " + std::to_string(b) + " of rank "
                   + std::to_string(src) + "'s piece differs";
    return std::string();
  });
  EXPECT_EQ(res.results, (std::vector<std::string>{"", "", ""}));
}

TEST(ShmCollective, RanksDisagreeingOnAPieceLayoutFailEveryRank) {
  auto res = run_ranks(2, [](std::uint32_t rank, const auto& ep, const auto& members) {
    shm_collective c(ep, members, "pub-pieces-mismatch");
    std::vector<std::byte> shard(16), out(32);
    // Rank 1 thinks its piece is twice as large as rank 0 thinks it is.
    std::vector<gather_piece> layout = rank == 0 ? std::vector<gather_piece>{{0, 8}, {8, 8}}
                                                 : std::vector<gather_piece>{{0, 8}, {8, 16}};
    std::vector<gather_item> items{{shard.data(), layout[rank].bytes, out.data(), layout}};
    auto st = c.all_gather(rank, items, clock_type::now() + 20s);
    return st.ok ? std::string("gathered") : st.error;
  });
  for (const auto& r : res.results)
    EXPECT_THAT(r, HasSubstr("ranks disagree on the items of round 0"));
}

TEST(ShmCollective, MismatchedItemsFailEveryRankWithTheSameCause) {
  auto res = run_ranks(2, [](std::uint32_t rank, const auto& ep, const auto& members) {
    shm_collective c(ep, members, "pub-mismatch");
    std::vector<std::uint64_t> sizes = rank == 0 ? std::vector<std::uint64_t>{64, 64}
                                                 : std::vector<std::uint64_t>{64};
    return gather_round(c, rank, 2, sizes, 0, clock_type::now() + 20s);
  });
  for (const auto& r : res.results)
    EXPECT_THAT(r, HasSubstr("ranks disagree on the items of round 0"));
}

TEST(ShmCollective, DeadPeerIsAnErrorNamingItNotAHang) {
  auto res = run_ranks(2, [](std::uint32_t rank, const auto& ep, const auto& members) {
    if (rank == 1) {
      std::this_thread::sleep_for(200ms);
      ::_exit(7); // dies without entering the round
    }
    shm_collective c(ep, members, "pub-dead");
    return gather_round(c, rank, 2, {4096}, 0, clock_type::now() + 60s);
  });
  EXPECT_THAT(res.results[0], HasSubstr("rank 1 (pid "));
  EXPECT_THAT(res.results[0], HasSubstr("exited while this rank waited for it to stage its shards of round 0"));
  EXPECT_EQ(res.results[1], "<exited>");
  EXPECT_LT(res.elapsed, 10s) << "detected through the pidfd, long before the 60 s deadline";
}

TEST(ShmCollective, PeerThatDiesAfterSomeRoundsIsDetected) {
  auto res = run_ranks(2, [](std::uint32_t rank, const auto& ep, const auto& members) {
    shm_collective c(ep, members, "pub-dies-later");
    for (std::uint64_t k = 0; k < 3; ++k)
      if (auto err = gather_round(c, rank, 2, {1024}, k, clock_type::now() + 60s); !err.empty())
        return err;
    if (rank == 1)
      ::kill(::getpid(), SIGKILL);
    return gather_round(c, rank, 2, {1024}, 3, clock_type::now() + 60s);
  });
  EXPECT_THAT(res.results[0], HasSubstr("rank 1 (pid "));
  EXPECT_THAT(res.results[0], HasSubstr("exited"));
  EXPECT_LT(res.elapsed, 10s);
}

TEST(ShmCollective, SilentPeerHitsTheDeadline) {
  auto res = run_ranks(2, [](std::uint32_t rank, const auto& ep, const auto& members) {
    if (rank == 1) {
      std::this_thread::sleep_for(3s); // alive but never arrives in time
      return std::string();
    }
    shm_collective c(ep, members, "pub-silent");
    return gather_round(c, rank, 2, {4096}, 0, clock_type::now() + 300ms);
  });
  EXPECT_THAT(res.results[0], HasSubstr("rank 1 did not stage its shards of round 0 within the deadline"));
  EXPECT_THAT(res.results[0], HasSubstr("still running"));
}

TEST(ShmCollective, AbortWakesTheWaiterAndThePeerLearnsWhy) {
  auto res = run_ranks(2, [](std::uint32_t rank, const auto& ep, const auto& members) {
    shm_collective c(ep, members, "pub-abort");
    if (rank == 1) {
      std::this_thread::sleep_for(800ms); // rank 0 aborts meanwhile
      return gather_round(c, rank, 2, {4096}, 0, clock_type::now() + 20s);
    }
    std::thread aborter([&] {
      std::this_thread::sleep_for(200ms);
      c.abort("the gate failed the phase");
    });
    auto t0 = clock_type::now();
    auto err = gather_round(c, rank, 2, {4096}, 0, clock_type::now() + 20s);
    aborter.join();
    if (clock_type::now() - t0 > 5s)
      return std::string("abort did not wake the waiter");
    std::this_thread::sleep_for(1500ms); // stay alive: rank 1 reads why from the endpoint
    return err;
  });
  EXPECT_THAT(res.results[0], HasSubstr("collective aborted: the gate failed the phase"));
  EXPECT_THAT(res.results[1], HasSubstr("rank 0 gave up (rank 0 aborted: the gate failed the phase)"));
}

TEST(ShmCollective, BadMemberTablesAreRefused) {
  auto res = run_ranks(2, [](std::uint32_t rank, const auto& ep, auto members) {
    if (rank == 1)
      return std::string();
    members[1].pid += 100000; // the handle names another pid than the member
    shm_collective c(ep, members, "pub-bad-table");
    return gather_round(c, rank, 2, {64}, 0, clock_type::now() + 2s);
  });
  EXPECT_THAT(res.results[0], HasSubstr("belongs to pid"));
}

TEST(ShmGroup, WithoutACompleteMembershipEveryCallFails) {
  shm_group group(std::make_shared<shm_endpoint>(0));
  auto c = group.for_publication("pub-x");
  std::vector<std::byte> shard(64), out(128);
  auto st = c->all_gather(0, {{shard.data(), 64, out.data()}}, clock_type::now() + 1s);
  EXPECT_FALSE(st.ok);
  EXPECT_THAT(st.error, HasSubstr("not every trainer rank has joined"));
}

TEST(ShmGroup, LosingTheMembershipAbortsALiveCollective) {
  auto self = std::make_shared<shm_endpoint>(0);
  auto peer = std::make_shared<shm_endpoint>(1); // same process: it never arrives
  shm_group group(self);
  group.set_members({{0, ::getpid(), self->handle()}, {1, ::getpid(), peer->handle()}});
  auto c = group.for_publication("pub-y");
  std::vector<std::byte> shard(64), out(128);
  std::thread loser([&] {
    std::this_thread::sleep_for(200ms);
    group.clear_members("rank 1 left: its process exited");
  });
  auto t0 = clock_type::now();
  auto st = c->all_gather(0, {{shard.data(), 64, out.data()}}, clock_type::now() + 30s);
  loser.join();
  EXPECT_FALSE(st.ok);
  EXPECT_THAT(st.error, HasSubstr("rank 1 left: its process exited"));
  EXPECT_LT(clock_type::now() - t0, 5s);
  auto later = group.for_publication("pub-z")->all_gather(0, {{shard.data(), 64, out.data()}},
                                                         clock_type::now() + 1s);
  EXPECT_THAT(later.error, HasSubstr("no complete membership: rank 1 left"));
}

// Endpoints are sealed against shrinking (a peer's mapping never loses its pages), and a member
// table naming an unsealed memfd or a plain file as an endpoint fails the collective with a
// message, before anything of it is mapped.
TEST(ShmCollective, EndpointsAreSealedAndUnsealedOrPlainFilesAreRefused) {
  auto self = std::make_shared<shm_endpoint>(0);
  const auto h = self->handle();
  const int own = std::stoi(h.substr(h.rfind(':') + 1));
  EXPECT_TRUE(::fcntl(own, F_GET_SEALS) & F_SEAL_SHRINK);
  EXPECT_NE(::ftruncate(own, 0), 0) << "the endpoint cannot be shrunk";
  auto refused = [&](int fd) {
    shm_group group(self);
    group.set_members({{0, ::getpid(), h},
                       {1, ::getpid(), "memfd:" + std::to_string(::getpid()) + ":" + std::to_string(fd)}});
    std::vector<std::byte> shard(64), out(128);
    return group.for_publication("pub-sealed")
      ->all_gather(0, {{shard.data(), 64, out.data()}}, clock_type::now() + 2s);
  };
  const int unsealed = ::memfd_create("hostile-endpoint", MFD_CLOEXEC);
  ASSERT_EQ(::ftruncate(unsealed, 1 << 20), 0);
  auto st = refused(unsealed);
  ::close(unsealed);
  EXPECT_FALSE(st.ok);
  EXPECT_THAT(st.error, HasSubstr("without the required seals"));
  const std::string path = ::testing::TempDir() + "refit-plain-endpoint-" + std::to_string(::getpid());
  { std::ofstream(path) << std::string(1 << 16, 'x'); }
  const int plain = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ::unlink(path.c_str());
  st = refused(plain);
  ::close(plain);
  EXPECT_FALSE(st.ok);
  EXPECT_THAT(st.error, HasSubstr("is not a memfd"));
}

} // namespace
