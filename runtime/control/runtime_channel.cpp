#include "runtime/control/runtime_channel.hpp"

#include <cerrno>
#include <csignal>
#include <cstring>
#include <sys/eventfd.h>
#include <system_error>
#include <unistd.h>

namespace refit::proc {

runtime_channel::runtime_channel(spawn_options opts, std::size_t max_frame_bytes,
                                 callback on_event)
  : opts_(std::move(opts)), max_frame_bytes_(max_frame_bytes), on_event_(std::move(on_event)) {
  interrupt_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (interrupt_fd_ < 0)
    throw std::system_error(errno, std::generic_category(), "eventfd");
  thread_ = std::thread([this] { run(); });
}

runtime_channel::~runtime_channel() {
  {
    std::lock_guard<std::mutex> guard(mtx_);
    stop_ = true;
    jobs_.clear();
  }
  interrupt();
  cv_.notify_all();
  if (thread_.joinable())
    thread_.join();
  ::close(interrupt_fd_);
}

void runtime_channel::transact(std::uint64_t request_id, std::string frame_payload,
                               std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> guard(mtx_);
  jobs_.emplace_back([this, request_id, bytes = std::move(frame_payload), timeout] {
    do_transact(request_id, bytes, timeout);
  });
  cv_.notify_all();
}

void runtime_channel::terminate(std::chrono::milliseconds natural,
                                std::chrono::milliseconds grace) {
  std::lock_guard<std::mutex> guard(mtx_);
  jobs_.emplace_back([this, natural, grace] { do_terminate(natural, grace); });
  cv_.notify_all();
}

void runtime_channel::interrupt() {
  std::uint64_t one = 1;
  (void)!::write(interrupt_fd_, &one, sizeof(one));
}

void runtime_channel::drain_interrupt() {
  std::uint64_t value = 0;
  (void)!::read(interrupt_fd_, &value, sizeof(value));
}

void runtime_channel::run() {
  try {
    child_ = spawn_child(opts_);
    child_alive_ = true;
    channel_event ev;
    ev.k = channel_event::kind::spawned;
    ev.pid = child_.pid;
    on_event_(std::move(ev));
  } catch (const std::exception& e) {
    channel_event ev;
    ev.k = channel_event::kind::spawn_failed;
    ev.detail = e.what();
    on_event_(std::move(ev));
  }
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mtx_);
      cv_.wait_for(lock, std::chrono::milliseconds(50), [this] { return stop_ || !jobs_.empty(); });
      if (stop_)
        break;
      if (!jobs_.empty()) {
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
    }
    if (job) {
      job();
      continue;
    }
    // Idle: notice a child that died between requests.
    if (child_alive_) {
      if (auto status = try_reap(child_.pid)) {
        child_alive_ = false;
        ::kill(-child_.pid, SIGKILL); // anything else left in its group
        channel_event ev;
        ev.k = channel_event::kind::exited;
        ev.pid = child_.pid;
        ev.detail = status->describe();
        on_event_(std::move(ev));
      }
    }
  }
  // Stopping: never leave the group behind.
  if (child_.pid > 0 && child_alive_)
    terminate_group(child_.pid, std::chrono::milliseconds(0));
  if (child_.control_fd >= 0) {
    ::close(child_.control_fd);
    child_.control_fd = -1;
  }
}

void runtime_channel::do_transact(std::uint64_t id, const std::string& bytes,
                                  std::chrono::milliseconds timeout) {
  channel_event ev;
  ev.request_id = id;
  ev.pid = child_.pid;
  auto fail = [&](wire::frame_status st, const char* phase) {
    ev.k = channel_event::kind::io_failed;
    ev.code = st.code;
    ev.detail = std::string(phase) + ": " + st.message;
    on_event_(std::move(ev));
  };
  if (child_.control_fd < 0) {
    fail({wire::frame_errc::eof, "the runtime process is not running"}, "send");
    return;
  }
  auto deadline = wire::clock::now() + timeout;
  if (auto st = wire::write_frame(child_.control_fd, bytes, max_frame_bytes_, deadline,
                                  interrupt_fd_);
      !st)
    return fail(st, "send");
  std::string payload;
  if (auto st = wire::read_frame(child_.control_fd, payload, max_frame_bytes_, deadline,
                                 interrupt_fd_);
      !st)
    return fail(st, "receive");
  ev.k = channel_event::kind::response;
  ev.payload = std::move(payload);
  on_event_(std::move(ev));
}

void runtime_channel::do_terminate(std::chrono::milliseconds natural,
                                   std::chrono::milliseconds grace) {
  drain_interrupt(); // an earlier interrupt() must not skip this grace period
  channel_event ev;
  ev.k = channel_event::kind::reaped;
  ev.pid = child_.pid;
  if (child_.pid <= 0 || !child_alive_) {
    ev.detail = child_.pid <= 0 ? "never started" : "already exited";
    on_event_(std::move(ev));
    return;
  }
  std::optional<exit_info> status;
  auto until = std::chrono::steady_clock::now() + natural;
  while (!(status = try_reap(child_.pid)) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  if (status)
    ::kill(-child_.pid, SIGKILL); // stragglers in the group
  else
    status = terminate_group(child_.pid, grace, interrupt_fd_);
  child_alive_ = false;
  if (child_.control_fd >= 0) {
    ::close(child_.control_fd);
    child_.control_fd = -1;
  }
  ev.detail = status->describe();
  on_event_(std::move(ev));
}

} // namespace refit::proc
