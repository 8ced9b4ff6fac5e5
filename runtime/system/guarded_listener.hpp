// The serve port's own listener (plain TCP mode): it accepts connections, runs the bounded
// mutual handshake of runtime/auth/handshake.hpp on each, and only hands an admitted socket
// to CAF (the `admit` callback gives it to the BASP broker). Before that, a peer can make the
// coordinator hold at most 64 bytes of input and one small session per connection:
//   - at most `max_pending` unauthenticated connections at once; a connection beyond the cap
//     is accepted and closed at once (counted, logged once per second at most);
//   - each has `handshake_timeout` to finish, then it is closed;
//   - a peer that sends anything but the handshake's fixed-size messages is closed at once.
// One thread, one poll loop; stopping (the destructor) closes every unadmitted connection.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace refit::net {

struct listener_options {
  std::string host = "127.0.0.1";
  std::uint16_t port = 0; // 0: a free port
  std::string token;      // the shared secret (kept in this process only)
  std::chrono::milliseconds handshake_timeout{5000};
  std::size_t max_pending = 64;
  std::function<void(const std::string&)> log;  // one line per refusal (may be empty)
  std::function<void(int fd)> admit;            // takes ownership of an admitted socket
};

struct listener_counters {
  std::atomic<std::uint64_t> admitted{0};
  std::atomic<std::uint64_t> refused{0};   // failed handshakes (wrong proof, garbage, closed, timed out)
  std::atomic<std::uint64_t> timed_out{0}; // of those, the ones that ran out of time
  std::atomic<std::uint64_t> over_cap{0};  // closed at once: max_pending were already waiting
  std::atomic<std::uint64_t> peak_pending{0};
};

class guarded_listener {
public:
  // Binds and listens (SO_REUSEADDR), starts the thread. Throws std::runtime_error naming the
  // address when it cannot bind. Raises this process's RLIMIT_NOFILE soft limit to the hard one.
  explicit guarded_listener(listener_options opts);
  ~guarded_listener();
  guarded_listener(const guarded_listener&) = delete;
  guarded_listener& operator=(const guarded_listener&) = delete;

  // Stops the loop and closes the port and every unadmitted connection (idempotent; the
  // destructor calls it). Admitted sockets belong to CAF and stay.
  void stop();

  std::uint16_t port() const { return port_; }
  const listener_counters& counters() const { return *counters_; }
  std::shared_ptr<const listener_counters> shared_counters() const { return counters_; }

private:
  void run();

  listener_options opts_;
  std::mutex stop_mutex_;
  int listen_fd_ = -1;
  int wake_fd_ = -1; // eventfd: the destructor wakes the loop
  std::uint16_t port_ = 0;
  std::shared_ptr<listener_counters> counters_ = std::make_shared<listener_counters>();
  std::thread thread_;
};

// Connects a TCP socket to host:port before `deadline` (non-blocking connect + poll). Returns
// the connected fd, or -1 with `error` set (refused, unreachable, timed out, bad address).
int connect_tcp(const std::string& host, std::uint16_t port,
                std::chrono::steady_clock::time_point deadline, std::string& error);

} // namespace refit::net
