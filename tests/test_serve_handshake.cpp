// The serve handshake (runtime/auth/handshake.hpp) over socketpairs: admitted only when both
// sides hold the same secret, an impostor server learns nothing and a wrong client proof is
// refused, garbage is dropped at its first bytes, and neither side reads past its messages.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include <gtest/gtest.h>

#include "runtime/auth/handshake.hpp"

namespace {

using namespace refit::auth;
using namespace std::chrono_literals;
using server_state = server_session::state;

const std::string secret = "a-sixteen-plus-character-secret";

struct pair_fds {
  int client = -1, server = -1;
  pair_fds() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    client = fds[0];
    server = fds[1];
    ::fcntl(server, F_SETFL, O_NONBLOCK);
  }
  ~pair_fds() {
    ::close(client);
    ::close(server);
  }
};

// Drives a server session until it is admitted or failed (or 5 s).
server_state drive(server_session& s) {
  auto until = std::chrono::steady_clock::now() + 5s;
  while (std::chrono::steady_clock::now() < until) {
    if (s.current() == server_state::admitted || s.current() == server_state::failed)
      break;
    pollfd p{s.fd(), static_cast<short>(POLLIN | (s.wants_write() ? POLLOUT : 0)), 0};
    if (::poll(&p, 1, 50) <= 0)
      continue;
    if (p.revents & (POLLIN | POLLHUP | POLLERR))
      s.on_readable();
    if (s.current() != server_state::failed && (p.revents & POLLOUT))
      s.on_writable();
  }
  return s.current();
}

TEST(ServeHandshake, SameSecretIsAdmittedAndNothingPastTheHandshakeIsRead) {
  pair_fds p;
  server_session s(p.server, secret);
  std::thread server([&] { drive(s); });
  auto r = run_client(p.client, secret, std::chrono::steady_clock::now() + 5s);
  server.join();
  EXPECT_EQ(r.outcome, client_outcome::admitted) << r.detail;
  EXPECT_EQ(s.current(), server_state::admitted) << s.failure();
  // What follows (BASP) is left in the socket for CAF.
  ASSERT_EQ(::write(p.client, "BASP", 4), 4);
  char buf[8] = {};
  ASSERT_EQ(::read(p.server, buf, sizeof(buf)), 4);
  EXPECT_EQ(std::string(buf, 4), "BASP");
}

TEST(ServeHandshake, DifferentSecretsFailOnBothSidesWithoutAClientProof) {
  pair_fds p;
  server_session s(p.server, secret);
  std::thread server([&] { drive(s); });
  auto r = run_client(p.client, "another-secret-of-enough-length", std::chrono::steady_clock::now() + 5s);
  ::shutdown(p.client, SHUT_RDWR); // the client closes after the failed server proof
  server.join();
  EXPECT_EQ(r.outcome, client_outcome::impostor);
  EXPECT_NE(r.detail.find("did not prove"), std::string::npos) << r.detail;
  EXPECT_EQ(s.current(), server_state::failed);
  EXPECT_NE(s.failure().find("instead of proving"), std::string::npos) << s.failure();
}

TEST(ServeHandshake, AWrongClientProofIsRefusedWithAVerdict) {
  pair_fds p;
  server_session s(p.server, secret);
  std::thread server([&] { drive(s); });
  // A client that knows the protocol but not the secret: a valid hello, a made-up proof.
  unsigned char hello[client_hello_bytes] = {'R', 'F', 'A', '1'};
  ASSERT_EQ(::write(p.client, hello, sizeof(hello)), static_cast<ssize_t>(sizeof(hello)));
  unsigned char proof[server_proof_bytes];
  std::size_t got = 0;
  while (got < sizeof(proof)) {
    auto n = ::read(p.client, proof + got, sizeof(proof) - got);
    ASSERT_GT(n, 0);
    got += static_cast<std::size_t>(n);
  }
  unsigned char forged[client_proof_bytes] = {};
  ASSERT_EQ(::write(p.client, forged, sizeof(forged)), static_cast<ssize_t>(sizeof(forged)));
  char verdict = 0;
  ASSERT_EQ(::read(p.client, &verdict, 1), 1);
  server.join();
  EXPECT_EQ(verdict, refused);
  EXPECT_EQ(s.current(), server_state::failed);
  EXPECT_TRUE(s.wrong_proof());
}

TEST(ServeHandshake, GarbageIsDroppedAtItsFirstBytes) {
  pair_fds p;
  server_session s(p.server, secret);
  unsigned char basp[32] = {1, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF};
  ASSERT_EQ(::write(p.client, basp, sizeof(basp)), 32);
  EXPECT_EQ(drive(s), server_state::failed);
  EXPECT_NE(s.failure().find("not a refit serve handshake"), std::string::npos) << s.failure();
}

TEST(ServeHandshake, MacsBindRoleAndBothNonces) {
  auto nc = random_nonce();
  auto ns = random_nonce();
  EXPECT_NE(nc, ns);
  auto sm = server_mac(secret, nc, ns);
  EXPECT_FALSE(same_mac(sm.data(), client_mac(secret, nc, ns).data())) << "no reflection";
  EXPECT_FALSE(same_mac(sm.data(), server_mac(secret, ns, nc).data())) << "order matters";
  EXPECT_FALSE(same_mac(sm.data(), server_mac(secret + "x", nc, ns).data()));
  EXPECT_TRUE(same_mac(sm.data(), server_mac(secret, nc, ns).data()));
}

TEST(ServeHandshake, ASilentListenerEndsAtTheDeadline) {
  pair_fds p;
  auto r = run_client(p.client, secret, std::chrono::steady_clock::now() + 200ms);
  EXPECT_EQ(r.outcome, client_outcome::unreachable);
  EXPECT_NE(r.detail.find("join timeout"), std::string::npos) << r.detail;
}

} // namespace
