// Length-delimited frames over a stream fd (socketpair / pipe).
//
// Frame layout: 4-byte magic "RFT1" | uint32 little-endian payload length | payload.
// Readers check the magic and the length against a maximum *before* allocating, so
// garbage, truncation and oversized lengths are clear errors, never crashes or hangs.
// Every call takes a deadline; a peer that stops talking yields frame_errc::timeout.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace refit::wire {

inline constexpr std::uint32_t frame_magic = 0x31544652u; // bytes 'R','F','T','1'
inline constexpr std::size_t frame_header_size = 8;
inline constexpr std::size_t default_max_frame_bytes = 64u << 20;

enum class frame_errc {
  ok = 0,
  eof,        // peer closed before the first header byte
  truncated,  // peer closed mid-header or mid-payload
  bad_magic,  // header does not start with "RFT1" (garbage on the channel)
  oversized,  // announced or offered length exceeds the maximum
  timeout,    // deadline passed
  interrupted,// the optional interrupt fd became readable
  io_error,   // read/write/poll failed (errno in message)
};

const char* to_string(frame_errc code);

struct frame_status {
  frame_errc code = frame_errc::ok;
  std::string message;
  explicit operator bool() const { return code == frame_errc::ok; }
};

using clock = std::chrono::steady_clock;

// Writes one frame. `interrupt_fd` (or -1) aborts the wait when it becomes readable.
frame_status write_frame(int fd, const std::string& payload, std::size_t max_frame_bytes,
                         clock::time_point deadline, int interrupt_fd = -1);

// Reads one frame into `payload`.
frame_status read_frame(int fd, std::string& payload, std::size_t max_frame_bytes,
                        clock::time_point deadline, int interrupt_fd = -1);

// Encodes a frame header + payload into one buffer (used by tests and fuzzers).
std::string encode_frame(const std::string& payload);

// Decodes a complete in-memory buffer holding exactly one frame (fuzzer entry point).
frame_status decode_frame(const std::string& buffer, std::string& payload,
                          std::size_t max_frame_bytes);

} // namespace refit::wire
