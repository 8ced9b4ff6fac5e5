#include "runtime/control/framing.hpp"

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace refit::wire {

const char* to_string(frame_errc code) {
  switch (code) {
    case frame_errc::ok: return "ok";
    case frame_errc::eof: return "eof";
    case frame_errc::truncated: return "truncated";
    case frame_errc::bad_magic: return "bad_magic";
    case frame_errc::oversized: return "oversized";
    case frame_errc::timeout: return "timeout";
    case frame_errc::interrupted: return "interrupted";
    case frame_errc::io_error: return "io_error";
  }
  return "unknown";
}

namespace {

frame_status fail(frame_errc code, std::string msg) {
  return frame_status{code, std::move(msg)};
}

void put_u32(char* out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i)
    out[i] = static_cast<char>((v >> (8 * i)) & 0xffu);
}

std::uint32_t get_u32(const char* in) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<std::uint32_t>(static_cast<unsigned char>(in[i])) << (8 * i);
  return v;
}

// Waits until `fd` is ready for `events` or the deadline/interrupt hits.
frame_status wait_ready(int fd, short events, clock::time_point deadline, int interrupt_fd) {
  for (;;) {
    auto now = clock::now();
    if (now >= deadline)
      return fail(frame_errc::timeout, "deadline passed while waiting for the peer");
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
    int ms = left > 1000 * 60 * 60 ? 1000 * 60 * 60 : static_cast<int>(left) + 1;
    pollfd fds[2] = {{fd, events, 0}, {interrupt_fd, POLLIN, 0}};
    int n = ::poll(fds, interrupt_fd >= 0 ? 2 : 1, ms);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return fail(frame_errc::io_error, std::string("poll: ") + std::strerror(errno));
    }
    if (n == 0)
      continue; // re-check the deadline
    if (interrupt_fd >= 0 && (fds[1].revents & POLLIN))
      return fail(frame_errc::interrupted, "interrupted");
    if (fds[0].revents & (events | POLLHUP | POLLERR | POLLNVAL))
      return {};
  }
}

// Reads exactly `len` bytes. `got_any` reports whether any byte of this frame arrived.
frame_status read_exact(int fd, char* out, std::size_t len, clock::time_point deadline,
                        int interrupt_fd, bool& got_any, const char* what) {
  std::size_t done = 0;
  while (done < len) {
    if (auto st = wait_ready(fd, POLLIN, deadline, interrupt_fd); !st)
      return st;
    ssize_t n = ::read(fd, out + done, len - done);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN)
        continue;
      if (errno != ECONNRESET)
        return fail(frame_errc::io_error,
                    std::string("read ") + what + ": " + std::strerror(errno));
      n = 0; // a reset is the peer going away, exactly like EOF
    }
    if (n == 0) {
      if (!got_any)
        return fail(frame_errc::eof, "peer closed the channel");
      return fail(frame_errc::truncated, std::string("peer closed the channel inside the frame ")
                                           + what + " after " + std::to_string(done) + " of "
                                           + std::to_string(len) + " bytes");
    }
    got_any = true;
    done += static_cast<std::size_t>(n);
  }
  return {};
}

frame_status check_header(const char* header, std::size_t max_frame_bytes, std::uint32_t& len) {
  std::uint32_t magic = get_u32(header);
  if (magic != frame_magic) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "frame header magic 0x%08x, expected 0x%08x ('RFT1')", magic,
                  frame_magic);
    return fail(frame_errc::bad_magic, buf);
  }
  len = get_u32(header + 4);
  if (len > max_frame_bytes)
    return fail(frame_errc::oversized, "frame length " + std::to_string(len)
                                         + " exceeds the maximum frame size "
                                         + std::to_string(max_frame_bytes));
  return {};
}

} // namespace

frame_status write_frame(int fd, const std::string& payload, std::size_t max_frame_bytes,
                         clock::time_point deadline, int interrupt_fd) {
  if (payload.size() > max_frame_bytes || payload.size() > UINT32_MAX)
    return fail(frame_errc::oversized, "outgoing frame of " + std::to_string(payload.size())
                                         + " bytes exceeds the maximum frame size "
                                         + std::to_string(max_frame_bytes));
  std::string buf = encode_frame(payload);
  std::size_t done = 0;
  while (done < buf.size()) {
    if (auto st = wait_ready(fd, POLLOUT, deadline, interrupt_fd); !st)
      return st;
    // MSG_NOSIGNAL: a closed peer must become an error, not a SIGPIPE. Falls back to
    // write() for non-socket fds (pipes), where the caller ignores SIGPIPE.
    ssize_t n = ::send(fd, buf.data() + done, buf.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == ENOTSOCK)
      n = ::write(fd, buf.data() + done, buf.size() - done);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN)
        continue;
      if (errno == EPIPE || errno == ECONNRESET)
        return fail(frame_errc::eof, "peer closed the channel while writing");
      return fail(frame_errc::io_error, std::string("write: ") + std::strerror(errno));
    }
    done += static_cast<std::size_t>(n);
  }
  return {};
}

frame_status read_frame(int fd, std::string& payload, std::size_t max_frame_bytes,
                        clock::time_point deadline, int interrupt_fd) {
  char header[frame_header_size];
  bool got_any = false;
  if (auto st = read_exact(fd, header, sizeof(header), deadline, interrupt_fd, got_any, "header");
      !st)
    return st;
  std::uint32_t len = 0;
  if (auto st = check_header(header, max_frame_bytes, len); !st)
    return st;
  payload.resize(len);
  if (len == 0)
    return {};
  return read_exact(fd, payload.data(), len, deadline, interrupt_fd, got_any, "payload");
}

std::string encode_frame(const std::string& payload) {
  std::string buf(frame_header_size + payload.size(), '\0');
  put_u32(buf.data(), frame_magic);
  put_u32(buf.data() + 4, static_cast<std::uint32_t>(payload.size()));
  std::memcpy(buf.data() + frame_header_size, payload.data(), payload.size());
  return buf;
}

frame_status decode_frame(const std::string& buffer, std::string& payload,
                          std::size_t max_frame_bytes) {
  if (buffer.empty())
    return fail(frame_errc::eof, "empty buffer");
  if (buffer.size() < frame_header_size)
    return fail(frame_errc::truncated, "buffer of " + std::to_string(buffer.size())
                                         + " bytes is shorter than the frame header");
  std::uint32_t len = 0;
  if (auto st = check_header(buffer.data(), max_frame_bytes, len); !st)
    return st;
  if (buffer.size() - frame_header_size < len)
    return fail(frame_errc::truncated, "frame announces " + std::to_string(len)
                                         + " payload bytes but only "
                                         + std::to_string(buffer.size() - frame_header_size)
                                         + " are present");
  if (buffer.size() - frame_header_size > len)
    return fail(frame_errc::oversized, "trailing bytes after the frame payload");
  payload.assign(buffer.data() + frame_header_size, len);
  return {};
}

} // namespace refit::wire
