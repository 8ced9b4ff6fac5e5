// The serve handshake: what a trainer process and the coordinator exchange on a fresh TCP
// connection before either speaks BASP. Mutual, and the secret never crosses the wire:
//
//   client -> server  hello   "RFA1" | client nonce (32 random bytes)                 36 bytes
//   server -> client  proof   server nonce (32) | HMAC(token, "refit-serve-v1 server" | nc | ns)
//                                                                                     64 bytes
//   client            checks the server's proof; a listener that cannot compute it learns
//                     nothing and gets nothing more (the client closes)
//   client -> server  proof   HMAC(token, "refit-serve-v1 client" | nc | ns)          32 bytes
//   server -> client  verdict 'A' (admitted: BASP starts now) or 'R' (refused)        1 byte
//
// Every message has a fixed size, so neither side ever buffers more than 64 bytes or reads a
// byte of the BASP stream that follows. Both nonces go into both MACs, with the role in the
// label, so a proof can be neither replayed nor reflected. The MACs are compared in constant
// time. Passive eavesdroppers learn nonces and MACs only; a token of >= 16 random characters
// (config::min_token_chars) keeps an offline guess infeasible.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace refit::auth {

constexpr std::size_t nonce_bytes = 32;
constexpr std::size_t mac_bytes = 32;
constexpr std::size_t client_hello_bytes = 4 + nonce_bytes;
constexpr std::size_t server_proof_bytes = nonce_bytes + mac_bytes;
constexpr std::size_t client_proof_bytes = mac_bytes;
constexpr char magic[4] = {'R', 'F', 'A', '1'};
constexpr char admitted = 'A';
constexpr char refused = 'R';

using nonce = std::array<unsigned char, nonce_bytes>;
using mac = std::array<unsigned char, mac_bytes>;

// 32 bytes from OpenSSL's CSPRNG; throws std::runtime_error when it has none.
nonce random_nonce();

// HMAC-SHA256(token, label | nc | ns) with label "refit-serve-v1 server" or "... client".
mac server_mac(const std::string& token, const nonce& nc, const nonce& ns);
mac client_mac(const std::string& token, const nonce& nc, const nonce& ns);

// Constant-time equality of two MACs.
bool same_mac(const unsigned char* a, const unsigned char* b);

// How the client side ended.
enum class client_outcome {
  admitted,       // both proofs held: the socket is ready for BASP
  unreachable,    // no answer within the deadline, or the connection closed first
  impostor,       // the listener's proof is wrong: not a coordinator that knows our token
  refused,        // the coordinator refused our proof (its token differs)
};

struct client_result {
  client_outcome outcome = client_outcome::unreachable;
  std::string detail; // for the error message; never contains the token
};

// Runs the client side on a connected blocking-or-not socket `fd`, never past `deadline`.
// The fd stays open either way; the caller closes it on anything but `admitted`.
client_result run_client(int fd, const std::string& token,
                         std::chrono::steady_clock::time_point deadline);

// The server side as a state machine over a non-blocking socket, for a poll loop: feed it
// readiness, it never blocks and never holds more than 64 bytes.
class server_session {
public:
  enum class state { await_hello, send_proof, await_proof, send_verdict, admitted, failed };

  server_session(int fd, const std::string& token);

  // Reads/writes what the socket allows. Returns the state afterwards.
  state on_readable();
  state on_writable();
  state current() const { return state_; }
  bool wants_write() const { return state_ == state::send_proof || state_ == state::send_verdict; }
  int fd() const { return fd_; }
  // Why the session failed ("" otherwise): for the coordinator's log, never the token.
  const std::string& failure() const { return failure_; }
  // Whether the failure was a wrong proof (a peer that tried and had another secret).
  bool wrong_proof() const { return wrong_proof_; }

private:
  state fail(std::string why, bool wrong_proof = false);
  state flush();

  int fd_;
  const std::string& token_;
  state state_ = state::await_hello;
  nonce nc_{};
  nonce ns_{};
  unsigned char in_[client_hello_bytes] = {};
  std::size_t in_len_ = 0;
  unsigned char out_[server_proof_bytes] = {};
  std::size_t out_len_ = 0;
  std::size_t out_sent_ = 0;
  bool admit_ = false;
  std::string failure_;
  bool wrong_proof_ = false;
};

} // namespace refit::auth
