// A thread an actor owns for blocking work (collectives, large copies, hashing): jobs run in
// order; the destructor finishes the running job, drops queued ones and joins.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace refit {

class worker_thread {
public:
  worker_thread() : thread_([this] { run(); }) {}
  ~worker_thread() {
    {
      std::lock_guard<std::mutex> guard(mtx_);
      stop_ = true;
      jobs_.clear();
    }
    cv_.notify_all();
    thread_.join();
  }
  worker_thread(const worker_thread&) = delete;
  worker_thread& operator=(const worker_thread&) = delete;

  void post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> guard(mtx_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
  }

private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mtx_);
        cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
        if (stop_)
          return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mtx_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_; // last: started after the other members exist
};

} // namespace refit
