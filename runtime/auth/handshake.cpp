#include "runtime/auth/handshake.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

namespace refit::auth {

namespace {

constexpr char server_label[] = "refit-serve-v1 server";
constexpr char client_label[] = "refit-serve-v1 client";

mac compute(const std::string& token, const char* label, const nonce& nc, const nonce& ns) {
  unsigned char msg[sizeof(server_label) + 2 * nonce_bytes];
  std::size_t n = std::strlen(label);
  std::memcpy(msg, label, n);
  std::memcpy(msg + n, nc.data(), nonce_bytes);
  std::memcpy(msg + n + nonce_bytes, ns.data(), nonce_bytes);
  mac out{};
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), msg, n + 2 * nonce_bytes,
            out.data(), &len)
      || len != mac_bytes)
    throw std::runtime_error("HMAC-SHA256 failed");
  return out;
}

int millis_left(std::chrono::steady_clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
    deadline - std::chrono::steady_clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(std::min<long long>(left.count(), 1 << 30));
}

// Reads or writes exactly `len` bytes before `deadline`. Returns "" or what went wrong.
std::string transfer(int fd, unsigned char* buf, std::size_t len, bool write,
                     std::chrono::steady_clock::time_point deadline) {
  std::size_t done = 0;
  while (done < len) {
    pollfd p{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    int ms = millis_left(deadline);
    if (ms == 0)
      return "no answer within the join timeout";
    int r = ::poll(&p, 1, ms);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return std::string("poll: ") + std::strerror(errno);
    if (r == 0)
      return "no answer within the join timeout";
    ssize_t n = write ? ::send(fd, buf + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT)
                      : ::recv(fd, buf + done, len - done, MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
      continue;
    if (n < 0)
      return std::string(write ? "send: " : "recv: ") + std::strerror(errno);
    if (n == 0)
      return "the listener closed the connection during the handshake";
    done += static_cast<std::size_t>(n);
  }
  return {};
}

} // namespace

nonce random_nonce() {
  nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1)
    throw std::runtime_error("no random bytes from OpenSSL (RAND_bytes)");
  return n;
}

mac server_mac(const std::string& token, const nonce& nc, const nonce& ns) {
  return compute(token, server_label, nc, ns);
}

mac client_mac(const std::string& token, const nonce& nc, const nonce& ns) {
  return compute(token, client_label, nc, ns);
}

bool same_mac(const unsigned char* a, const unsigned char* b) {
  return CRYPTO_memcmp(a, b, mac_bytes) == 0;
}

client_result run_client(int fd, const std::string& token,
                         std::chrono::steady_clock::time_point deadline) {
  client_result res;
  nonce nc = random_nonce();
  unsigned char hello[client_hello_bytes];
  std::memcpy(hello, magic, 4);
  std::memcpy(hello + 4, nc.data(), nonce_bytes);
  if (auto e = transfer(fd, hello, sizeof(hello), true, deadline); !e.empty()) {
    res.detail = e;
    return res;
  }
  unsigned char proof[server_proof_bytes];
  if (auto e = transfer(fd, proof, sizeof(proof), false, deadline); !e.empty()) {
    res.detail = e;
    return res;
  }
  nonce ns;
  std::memcpy(ns.data(), proof, nonce_bytes);
  auto expected = server_mac(token, nc, ns);
  if (!same_mac(expected.data(), proof + nonce_bytes)) {
    res.outcome = client_outcome::impostor;
    res.detail = "the listener did not prove that it knows this process's shared secret";
    return res;
  }
  auto mine = client_mac(token, nc, ns);
  if (auto e = transfer(fd, mine.data(), mine.size(), true, deadline); !e.empty()) {
    res.detail = e;
    return res;
  }
  unsigned char verdict = 0;
  if (auto e = transfer(fd, &verdict, 1, false, deadline); !e.empty()) {
    // A coordinator that refuses may close before its verdict arrives.
    res.detail = e;
    return res;
  }
  if (verdict == static_cast<unsigned char>(admitted)) {
    res.outcome = client_outcome::admitted;
  } else {
    res.outcome = client_outcome::refused;
    res.detail = "the coordinator refused this process's proof of the shared secret";
  }
  return res;
}

server_session::server_session(int fd, const std::string& token) : fd_(fd), token_(token) {}

server_session::state server_session::fail(std::string why, bool wrong_proof) {
  failure_ = std::move(why);
  wrong_proof_ = wrong_proof;
  return state_ = state::failed;
}

server_session::state server_session::flush() {
  while (out_sent_ < out_len_) {
    ssize_t n = ::send(fd_, out_ + out_sent_, out_len_ - out_sent_, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      return state_;
    if (n <= 0)
      return fail(std::string("send: ") + std::strerror(errno));
    out_sent_ += static_cast<std::size_t>(n);
  }
  if (state_ == state::send_proof) {
    in_len_ = 0;
    return state_ = state::await_proof;
  }
  if (state_ == state::send_verdict)
    return admit_ ? state_ = state::admitted
                  : fail("wrong proof of the shared secret (the peer's token differs)", true);
  return state_;
}

server_session::state server_session::on_readable() {
  std::size_t want = state_ == state::await_hello ? client_hello_bytes
                     : state_ == state::await_proof ? client_proof_bytes
                                                    : 0;
  if (want == 0) {
    // A peer that talks out of turn (e.g. BASP before being admitted) is dropped.
    unsigned char b;
    ssize_t n = ::recv(fd_, &b, 1, MSG_DONTWAIT | MSG_PEEK);
    if (n == 0)
      return fail("the peer closed the connection");
    if (n > 0)
      return fail("the peer sent data out of turn");
    return state_;
  }
  for (;;) {
    ssize_t n = ::recv(fd_, in_ + in_len_, want - in_len_, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      return state_;
    if (n < 0)
      return fail(std::string("recv: ") + std::strerror(errno));
    if (n == 0)
      return fail(state_ == state::await_proof
                    ? "the peer closed the connection instead of proving the shared secret (its "
                      "token differs, or it is no refit trainer)"
                    : "the peer closed the connection before its hello");
    in_len_ += static_cast<std::size_t>(n);
    if (state_ == state::await_hello && in_len_ >= 4 && std::memcmp(in_, magic, 4) != 0)
      return fail("not a refit serve handshake (first bytes are no 'RFA1' hello)");
    if (in_len_ < want)
      continue;
    break;
  }
  if (state_ == state::await_hello) {
    std::memcpy(nc_.data(), in_ + 4, nonce_bytes);
    ns_ = random_nonce();
    auto m = server_mac(token_, nc_, ns_);
    std::memcpy(out_, ns_.data(), nonce_bytes);
    std::memcpy(out_ + nonce_bytes, m.data(), mac_bytes);
    out_len_ = server_proof_bytes;
    out_sent_ = 0;
    state_ = state::send_proof;
    return flush();
  }
  auto expected = client_mac(token_, nc_, ns_);
  admit_ = same_mac(expected.data(), in_);
  out_[0] = static_cast<unsigned char>(admit_ ? admitted : refused);
  out_len_ = 1;
  out_sent_ = 0;
  state_ = state::send_verdict;
  return flush();
}

server_session::state server_session::on_writable() {
  if (wants_write())
    return flush();
  return state_;
}

} // namespace refit::auth
