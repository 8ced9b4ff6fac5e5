// The process-wide trace recorder: a mutex-guarded, bounded vector of events.
#include "runtime/trace/trace.hpp"

#include <mutex>
#include <time.h>

namespace refit::trace {

namespace detail {
std::atomic<bool> on{false};
}

namespace {

struct recorder {
  std::mutex mutex;
  std::vector<event> events;
  std::size_t max_events = default_max_events;
  std::uint64_t dropped = 0;

  void add(event&& e) {
    std::lock_guard<std::mutex> lock(mutex);
    if (events.size() >= max_events) {
      ++dropped;
      return;
    }
    events.push_back(std::move(e));
  }
};

recorder& global() {
  static recorder r; // never destroyed before a thread that still records: see enable()
  return r;
}

// A thread that never set its track gets a row of its own under "other threads" (rows are
// nested per thread, so two threads must not share one).
std::atomic<std::uint32_t> next_other_tid{0};
thread_local bool has_thread_track = false;
thread_local track this_thread_track{tracks::other_pid, 0};

void add_args(event& e, std::initializer_list<arg_view> args) {
  e.args.reserve(args.size());
  for (const auto& a : args)
    e.args.push_back(a.materialize());
}

} // namespace

arg arg_view::materialize() const {
  switch (kind_) {
    case kind::integer: return {key_, i_};
    case kind::real: return {key_, d_};
    case kind::boolean: return {key_, b_};
    case kind::text: break;
  }
  return {key_, std::string(s_)};
}

std::int64_t now_ns() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

void enable(std::size_t max_events) {
  auto& r = global();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.events.clear();
    r.dropped = 0;
    r.max_events = max_events;
  }
  detail::on.store(true, std::memory_order_relaxed);
}

void disable() { detail::on.store(false, std::memory_order_relaxed); }

stats statistics() {
  auto& r = global();
  std::lock_guard<std::mutex> lock(r.mutex);
  return {r.events.size(), r.dropped};
}

std::vector<event> drain(std::size_t max) {
  auto& r = global();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<event> out;
  if (max >= r.events.size()) {
    out.swap(r.events);
    return out;
  }
  out.assign(std::make_move_iterator(r.events.begin()),
             std::make_move_iterator(r.events.begin() + static_cast<std::ptrdiff_t>(max)));
  r.events.erase(r.events.begin(), r.events.begin() + static_cast<std::ptrdiff_t>(max));
  return out;
}

void ingest(std::vector<event> events, std::uint64_t dropped_elsewhere) {
  auto& r = global();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.dropped += dropped_elsewhere;
  for (auto& e : events) {
    if (r.events.size() >= r.max_events) {
      ++r.dropped;
      continue;
    }
    r.events.push_back(std::move(e));
  }
}

namespace {

// Records one event; out of memory while tracing, the event is lost and the traced work is not
// disturbed.
void record(phase ph, track where, std::string_view name, std::int64_t ts_ns,
            std::int64_t dur_ns, std::initializer_list<arg_view> args) noexcept {
  try {
    event e;
    e.ph = ph;
    e.name = std::string(name);
    e.ts_ns = ts_ns;
    e.dur_ns = dur_ns;
    e.where = where;
    add_args(e, args);
    global().add(std::move(e));
  } catch (...) {
  }
}

} // namespace

void complete(track where, std::string_view name, std::int64_t start_ns,
              std::initializer_list<arg_view> args) noexcept {
  if (start_ns == 0 || !enabled())
    return;
  record(phase::complete, where, name, start_ns, now_ns() - start_ns, args);
}

void instant(track where, std::string_view name, std::initializer_list<arg_view> args) noexcept {
  if (enabled())
    record(phase::instant, where, name, now_ns(), 0, args);
}

void counter(track where, std::string_view name, std::initializer_list<arg_view> args) noexcept {
  if (enabled())
    record(phase::counter, where, name, now_ns(), 0, args);
}

void set_thread_track(track t) noexcept {
  this_thread_track = t;
  has_thread_track = true;
}

track thread_track() noexcept {
  if (!has_thread_track) {
    this_thread_track = {tracks::other_pid, next_other_tid.fetch_add(1) + 1};
    has_thread_track = true;
  }
  return this_thread_track;
}

span::span(std::string_view name, std::initializer_list<arg_view> args) noexcept
  : span(enabled() ? thread_track() : track{}, name, args) {}

span::span(track where, std::string_view name, std::initializer_list<arg_view> args) noexcept {
  if (!enabled())
    return;
  try {
    ev_ = std::make_unique<event>();
    ev_->ph = phase::complete;
    ev_->name = std::string(name);
    ev_->where = where;
    add_args(*ev_, args);
    ev_->ts_ns = now_ns(); // last: the span measures the work, not its own set-up
  } catch (...) {
    ev_.reset();
  }
}

span::~span() {
  if (!ev_)
    return;
  ev_->dur_ns = now_ns() - ev_->ts_ns;
  if (enabled())
    global().add(std::move(*ev_));
}

void span::arg(arg_view a) noexcept {
  if (!ev_)
    return;
  try {
    ev_->args.push_back(a.materialize());
  } catch (...) {
  }
}

namespace tracks {

std::string process_name(std::uint32_t pid) {
  switch (pid) {
    case coordinator_pid: return "coordinator";
    case trainer_pid: return "trainer ranks";
    case runtime_pid: return "refit-runtime";
    default: return "other threads";
  }
}

std::string thread_name(track t) {
  switch (t.pid) {
    case coordinator_pid:
      switch (t.tid) {
        case 0: return "sync coordinator";
        case 1: return "gate: materialize rounds";
        case 2: return "gate: transfer rounds";
        case 3: return "gate: prepare / manifest / final";
        case 4: return "runtime proxy (control requests)";
        default: return "coordinator " + std::to_string(t.tid);
      }
    case trainer_pid: return "trainer rank " + std::to_string(t.tid);
    case runtime_pid:
      return t.tid == runtime_server_tid ? std::string("control server")
                                         : "tp worker " + std::to_string(t.tid);
    default: return "thread " + std::to_string(t.tid);
  }
}

} // namespace tracks

} // namespace refit::trace
