// The serve port against hostile local peers (issue: hardening), on loopback with bounded
// clients: an unauthenticated BASP header costs the coordinator nothing, an impostor listener
// learns nothing about the shared secret, and 1,000 unauthenticated connections held open for
// the handshake timeout keep the coordinator's peak memory bounded while two real trainers
// still join and publish.
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>

#include <cstring>

#include "multiprocess_fixture.hpp"
#include "runtime/auth/handshake.hpp"

namespace {

// VmHWM (peak resident set) of `pid` in bytes, from /proc.
std::uint64_t peak_rss(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0)
      return std::stoull(line.substr(6)) * 1024;
  ADD_FAILURE() << "no VmHWM for pid " << pid;
  return 0;
}

int tcp_to(std::uint16_t port, bool nonblocking) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 && errno != EINPROGRESS) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Reads until EOF or `timeout`; returns the bytes and whether the peer closed.
std::pair<std::string, bool> read_until_closed(int fd, std::chrono::milliseconds timeout) {
  std::string got;
  auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0)
      return {got, false};
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0)
      continue;
    char buf[4096];
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0)
      return {got, true};
    got.append(buf, static_cast<std::size_t>(n));
  }
}

// The 32-byte BASP header of the report: payload_len 0xFFFFFFFF (">BBBBIQQQ").
std::string basp_header_asking_4gib() {
  std::string h(32, '\0');
  h[0] = 1;
  h[4] = h[5] = h[6] = h[7] = static_cast<char>(0xFF);
  return h;
}

class ServeHostile : public MultiProcess {};

TEST_F(ServeHostile, AnUnauthenticatedBaspHeaderAskingFor4GiBIsDroppedAtOnce) {
  auto recipe = write_recipe("recipe.yaml", {});
  start_coordinator(recipe);
  const auto before = peak_rss(coordinator->pid());
  int fd = tcp_to(port, false);
  ASSERT_GE(fd, 0);
  // The listener speaks first to nobody: nothing arrives before the client's hello.
  auto greeting = read_until_closed(fd, 300ms);
  EXPECT_TRUE(greeting.first.empty()) << "no BASP server handshake before authentication";
  auto h = basp_header_asking_4gib();
  ASSERT_EQ(::send(fd, h.data(), h.size(), MSG_NOSIGNAL), static_cast<ssize_t>(h.size()));
  auto [answer, closed] = read_until_closed(fd, 10s);
  ::close(fd);
  EXPECT_TRUE(closed) << "a non-handshake first packet closes the connection";
  EXPECT_TRUE(answer.empty());
  const auto after = peak_rss(coordinator->pid());
  std::printf("[ measured ] coordinator VmHWM %.1f MiB before, %.1f MiB after the 4 GiB header\n",
              before / 1048576.0, after / 1048576.0);
  EXPECT_LT(after, before + (16u << 20)) << "the payload length was never believed";
  EXPECT_THAT(coordinator->stderr_text(), HasSubstr("not a refit serve handshake"));
  // Still serving.
  auto [t0, t1] = trainers(recipe);
  expect_byte_exact(publish_all({t0.get(), t1.get()}, 1)[0], 1, 0);
  quit_and_stop(t0, t1);
}

TEST_F(ServeHostile, AnImpostorListenerNeverReceivesTheSecret) {
  // A local user holds the port first and answers like a server would, with bytes of its own.
  int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(lfd, 4), 0);
  socklen_t len = sizeof(a);
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
  port = ntohs(a.sin_port);
  std::string captured;
  bool reflected = false;
  std::thread impostor([&] {
    int c = ::accept(lfd, nullptr, nullptr);
    if (c < 0)
      return;
    // Read the hello, then answer with its own nonce reflected back and a garbage "proof".
    std::string hello;
    auto until = std::chrono::steady_clock::now() + 10s;
    while (hello.size() < refit::auth::client_hello_bytes && std::chrono::steady_clock::now() < until) {
      char buf[64];
      pollfd p{c, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0)
        continue;
      ssize_t n = ::recv(c, buf, sizeof(buf), 0);
      if (n <= 0)
        break;
      hello.append(buf, static_cast<std::size_t>(n));
    }
    if (hello.size() >= refit::auth::client_hello_bytes) {
      std::string reply = hello.substr(4, 32) + hello.substr(4, 32);
      reflected = ::send(c, reply.data(), reply.size(), MSG_NOSIGNAL) == 64;
    }
    auto rest = read_until_closed(c, 15s);
    captured = hello + rest.first;
    ::close(c);
  });
  recipe_options o;
  o.join_timeout_ms = 5000;
  auto recipe = write_recipe("recipe.yaml", o);
  auto victim = spawn_trainer(recipe, 0);
  auto res = read_json(*victim, 30s);
  impostor.join();
  ::close(lfd);
  EXPECT_EQ(res["event"], "error") << res.dump();
  EXPECT_EQ(res["error"]["code"], "unauthorized") << res.dump();
  EXPECT_EQ(res["error"]["where"], "handshake.token");
  EXPECT_THAT(res["error"]["message"].get<std::string>(), HasSubstr("did not prove"));
  EXPECT_TRUE(reflected);
  EXPECT_EQ(captured.size(), refit::auth::client_hello_bytes)
    << "the trainer sent its hello (a random nonce) and nothing after the failed proof";
  EXPECT_EQ(captured.find(token), std::string::npos) << "the secret never crossed the wire";
  EXPECT_EQ(captured.substr(0, 4), "RFA1");
  EXPECT_EQ(victim->wait(10s), 3);
}

TEST_F(ServeHostile, ThousandUnauthenticatedConnectionsStayBoundedAndTrainersStillJoin) {
  // The test process holds 1,000 sockets: raise its own descriptor limit.
  rlimit rl{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &rl), 0);
  if (rl.rlim_max < 1200)
    GTEST_SKIP() << "RLIMIT_NOFILE hard limit " << rl.rlim_max << " < 1200";
  rl.rlim_cur = rl.rlim_max;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &rl), 0);
  recipe_options o;
  o.join_timeout_ms = 30000;
  o.serve_extra = ", handshake_timeout_ms: 2000, max_pending_handshakes: 64";
  auto recipe = write_recipe("recipe.yaml", o);
  start_coordinator(recipe);
  const auto before = peak_rss(coordinator->pid());
  // 1,000 connections: most silent, every fifth sends half a hello, every tenth the 4 GiB
  // BASP header. All are held open until the handshake timeout has passed.
  std::vector<int> held;
  const auto h = basp_header_asking_4gib();
  for (int i = 0; i < 1000; ++i) {
    int fd = tcp_to(port, true);
    ASSERT_GE(fd, 0) << "connection " << i << ": " << std::strerror(errno);
    held.push_back(fd);
  }
  for (std::size_t i = 0; i < held.size(); ++i) {
    pollfd p{held[i], POLLOUT, 0};
    ::poll(&p, 1, 1000);
    if (i % 10 == 0)
      ::send(held[i], h.data(), h.size(), MSG_NOSIGNAL);
    else if (i % 5 == 0)
      ::send(held[i], "RFA1abcdefgh", 12, MSG_NOSIGNAL);
  }
  // Real trainers start while the slots are taken: they are closed at once (over the cap) and
  // retry until the attackers' handshakes time out.
  auto t0 = spawn_trainer(recipe, 0);
  auto t1 = spawn_trainer(recipe, 1);
  std::this_thread::sleep_for(2500ms); // one handshake timeout (2 s) and a margin
  const auto during = peak_rss(coordinator->pid());
  EXPECT_EQ(read_json(*t0, 60s)["event"], "connected") << t0->stderr_text();
  EXPECT_EQ(read_json(*t1, 60s)["event"], "connected") << t1->stderr_text();
  auto res = publish_all({t0.get(), t1.get()}, 1);
  expect_byte_exact(res[0], 1, 0);
  expect_byte_exact(res[1], 1, 0);
  for (int fd : held)
    ::close(fd);
  std::printf("[ measured ] coordinator VmHWM %.1f MiB before, %.1f MiB with 1,000 "
              "unauthenticated connections held (bound: +16 MiB)\n",
              before / 1048576.0, during / 1048576.0);
  EXPECT_LT(during, before + (16u << 20));
  auto log = coordinator->stderr_text();
  EXPECT_THAT(log, HasSubstr("no complete handshake within 2000 ms"));
  EXPECT_THAT(log, HasSubstr("unauthenticated connections were already waiting"));
  EXPECT_THAT(log, HasSubstr("membership complete: 2 ranks, epoch 1"));
  quit_and_stop(t0, t1);
}

// A recipe whose KV cache is beyond the machine: `serve` refuses it before anything is
// allocated, naming the key and both numbers, without four spawn attempts ending in SIGKILL.
TEST_F(ServeHostile, AKvCacheBeyondTheMachineIsRefusedAtStartupNamingTheKey) {
  recipe_options o;
  o.runtime_extra = ", kv_cache_bytes: 4611686018427387904"; // 2^62 per worker
  auto recipe = write_recipe("recipe.yaml", o);
  coordinator = std::make_unique<child_process>(
    std::vector<std::string>{coordinator_exe, "serve", "-c", recipe, "--port", "0"},
    dir + "coordinator-preflight.stderr",
    std::vector<std::pair<std::string, std::string>>{{"REFIT_TEST_TOKEN", token}});
  auto rc = coordinator->wait(60s);
  ASSERT_TRUE(rc) << "refit-coordinator serve did not exit";
  EXPECT_EQ(*rc, 1);
  auto log = coordinator->stderr_text();
  EXPECT_THAT(log, HasSubstr("preflight_failed at runtime.kv_cache_bytes"));
  EXPECT_THAT(log, HasSubstr("4611686018427387904 bytes each"));
  EXPECT_THAT(log, HasSubstr("available (MemAvailable)"));
  EXPECT_THAT(log, HasSubstr("not retried"));
  EXPECT_THAT(log, Not(HasSubstr("serving tp="))) << "no runtime was started";
  EXPECT_THAT(log, Not(HasSubstr("signal 9")));
  coordinator.reset();
}

} // namespace
