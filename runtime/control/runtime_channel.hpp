// The blocking half of vLLMRuntimeProxy: a thread that owns the runtime child process and its
// control socket. It spawns the child, writes one request frame and reads its response
// frame under a deadline, watches for the child dying while idle, and terminates + reaps the
// process group. Results come back as events through a callback (the proxy turns them into
// actor messages), so no blocking syscall ever runs on a CAF scheduler thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "runtime/control/framing.hpp"
#include "runtime/control/process.hpp"

namespace refit::proc {

struct channel_event {
  enum class kind : std::uint8_t {
    spawned,      // pid valid
    spawn_failed, // detail says why
    response,     // request_id + payload (one complete frame)
    io_failed,    // request_id + code + detail (timeout, eof, bad frame, ...)
    exited,       // the child died while no request was on the wire; detail = exit status
    reaped,       // after terminate(): the group is gone; detail = exit status
  };
  kind k = kind::spawned;
  std::uint64_t request_id = 0;
  pid_t pid = -1;
  wire::frame_errc code = wire::frame_errc::ok;
  std::string payload;
  std::string detail;
};

class runtime_channel {
public:
  using callback = std::function<void(channel_event)>;

  // Starts the thread, which spawns the child first thing.
  runtime_channel(spawn_options opts, std::size_t max_frame_bytes, callback on_event);
  // Interrupts any wait, SIGKILLs and reaps a still-running group, joins the thread.
  ~runtime_channel();

  runtime_channel(const runtime_channel&) = delete;
  runtime_channel& operator=(const runtime_channel&) = delete;

  // Writes `frame_payload` and reads the response under `timeout`.
  void transact(std::uint64_t request_id, std::string frame_payload,
                std::chrono::milliseconds timeout);

  // Ends the child: waits up to `natural` for it to exit on its own (after a shutdown
  // command), then SIGTERM to the group, `grace`, SIGKILL, reap. Emits `reaped`.
  void terminate(std::chrono::milliseconds natural, std::chrono::milliseconds grace);

  // Aborts the request currently on the wire (its io_failed event says `interrupted`).
  void interrupt();

private:
  void run();
  void do_transact(std::uint64_t id, const std::string& bytes, std::chrono::milliseconds t);
  void do_terminate(std::chrono::milliseconds natural, std::chrono::milliseconds grace);
  void drain_interrupt();

  spawn_options opts_;
  std::size_t max_frame_bytes_;
  callback on_event_;
  child_process child_;
  bool child_alive_ = false;
  int interrupt_fd_ = -1; // eventfd
  std::mutex mtx_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

} // namespace refit::proc
