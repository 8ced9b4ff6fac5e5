#include "runtime/system/guarded_listener.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <list>
#include <stdexcept>
#include <vector>

#include "runtime/auth/handshake.hpp"

namespace refit::net {

namespace {

using clock_type = std::chrono::steady_clock;

std::string peer_name(const sockaddr_storage& a) {
  char host[INET6_ADDRSTRLEN] = "?";
  std::uint16_t port = 0;
  if (a.ss_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (a.ss_family == AF_INET6) {
    auto* in = reinterpret_cast<const sockaddr_in6*>(&a);
    ::inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof(host));
    port = ntohs(in->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

void raise_nofile_limit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
}

struct pending {
  int fd;
  std::string peer;
  clock_type::time_point deadline;
  auth::server_session session;
  pending(int f, std::string p, clock_type::time_point d, const std::string& token)
    : fd(f), peer(std::move(p)), deadline(d), session(f, token) {}
};

} // namespace

int connect_tcp(const std::string& host, std::uint16_t port, clock_type::time_point deadline,
                std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    error = std::string("cannot resolve '") + host + "': " + ::gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  error = "no address";
  for (auto* ai = res; ai; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      error = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
      break;
    if (errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now());
      int r = left.count() > 0 ? ::poll(&p, 1, static_cast<int>(left.count())) : 0;
      int so = 0;
      socklen_t len = sizeof(so);
      if (r == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &len) == 0 && so == 0)
        break;
      error = r == 0 ? "connect timed out" : std::string("connect: ") + std::strerror(so ? so : errno);
    } else {
      error = std::string("connect: ") + std::strerror(errno);
    }
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  if (fd >= 0) {
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  return fd;
}

guarded_listener::guarded_listener(listener_options opts) : opts_(std::move(opts)) {
  raise_nofile_limit();
  const std::string address = opts_.host + ":" + std::to_string(opts_.port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(opts_.host.c_str(), std::to_string(opts_.port).c_str(), &hints, &res);
  if (rc != 0)
    throw std::runtime_error("cannot resolve " + address + ": " + ::gai_strerror(rc));
  std::string why = "no address";
  for (auto* ai = res; ai && listen_fd_ < 0; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0)
      continue;
    int one = 1;
    // A restarted coordinator binds its port again while old connections linger.
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 512) == 0) {
      listen_fd_ = fd;
      break;
    }
    why = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  if (listen_fd_ < 0)
    throw std::runtime_error("cannot listen on " + address + ": " + why);
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
  port_ = a.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port)
                                  : ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    ::close(listen_fd_);
    throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
  }
  thread_ = std::thread([this] { run(); });
}

guarded_listener::~guarded_listener() {
  stop();
}

void guarded_listener::stop() {
  std::lock_guard<std::mutex> guard(stop_mutex_);
  if (listen_fd_ < 0)
    return;
  std::uint64_t one = 1;
  while (::write(wake_fd_, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
  if (thread_.joinable())
    thread_.join();
  ::close(wake_fd_);
  ::close(listen_fd_);
  wake_fd_ = listen_fd_ = -1;
}

void guarded_listener::run() {
  std::list<pending> sessions;
  auto last_cap_log = clock_type::now() - std::chrono::seconds(2);
  std::uint64_t cap_logged = 0;
  auto log = [&](const std::string& line) {
    if (opts_.log)
      opts_.log(line);
  };
  auto drop = [&](std::list<pending>::iterator it, const std::string& why, bool timed_out) {
    // Counted and logged before the close, so a peer that sees EOF finds the log written.
    ++counters_->refused;
    if (timed_out)
      ++counters_->timed_out;
    log("refused a connection from " + it->peer + ": " + why);
    ::close(it->fd);
    return sessions.erase(it);
  };
  std::vector<pollfd> fds;
  std::vector<std::list<pending>::iterator> index;
  // Out of descriptors (EMFILE/ENFILE): the listening socket stays readable, so it is left out
  // of the poll for a moment instead of spinning; the backlog waits in the kernel meanwhile.
  auto accept_paused_until = clock_type::now() - std::chrono::seconds(1);
  for (;;) {
    auto now = clock_type::now();
    // Expired handshakes go first.
    for (auto it = sessions.begin(); it != sessions.end();)
      it = it->deadline <= now ? drop(it, "no complete handshake within "
                                            + std::to_string(opts_.handshake_timeout.count()) + " ms",
                                      true)
                               : std::next(it);
    fds.clear();
    index.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    const bool accepting = now >= accept_paused_until;
    fds.push_back({listen_fd_, static_cast<short>(accepting ? POLLIN : 0), 0});
    auto next = accepting ? now + std::chrono::seconds(1) : accept_paused_until;
    for (auto it = sessions.begin(); it != sessions.end(); ++it) {
      short ev = POLLIN;
      if (it->session.wants_write())
        ev |= POLLOUT;
      fds.push_back({it->fd, ev, 0});
      index.push_back(it);
      next = std::min(next, it->deadline);
    }
    auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
    int r = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(wait, 1)));
    if (r < 0 && errno != EINTR)
      break;
    if (r <= 0)
      continue;
    if (fds[0].revents)
      break;
    for (std::size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents)
        continue;
      auto it = index[i - 2];
      auto st = it->session.current();
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR))
        st = it->session.on_readable();
      if (st != auth::server_session::state::failed && (fds[i].revents & POLLOUT))
        st = it->session.on_writable();
      if (st == auth::server_session::state::failed) {
        drop(it, it->session.failure(), false);
      } else if (st == auth::server_session::state::admitted) {
        ++counters_->admitted;
        int fd = it->fd;
        sessions.erase(it);
        if (opts_.admit)
          opts_.admit(fd);
        else
          ::close(fd);
      }
    }
    if (fds[1].revents & POLLIN) {
      for (;;) {
        sockaddr_storage a{};
        socklen_t len = sizeof(a);
        int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE)
            accept_paused_until = clock_type::now() + std::chrono::milliseconds(100);
          break; // EAGAIN (nothing more), or out of descriptors
        }
        if (sessions.size() >= opts_.max_pending) {
          ::close(fd);
          ++counters_->over_cap;
          continue;
        }
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        sessions.emplace_back(fd, peer_name(a), clock_type::now() + opts_.handshake_timeout, opts_.token);
        counters_->peak_pending = std::max<std::uint64_t>(counters_->peak_pending, sessions.size());
      }
    }
    auto over = counters_->over_cap.load();
    if (over != cap_logged && clock_type::now() - last_cap_log >= std::chrono::seconds(1)) {
      log("closed " + std::to_string(over - cap_logged) + " connection(s) at once: "
          + std::to_string(opts_.max_pending)
          + " unauthenticated connections were already waiting (serve.max_pending_handshakes)");
      cap_logged = over;
      last_cap_log = clock_type::now();
    }
  }
  for (auto& p : sessions)
    ::close(p.fd);
}

} // namespace refit::net
