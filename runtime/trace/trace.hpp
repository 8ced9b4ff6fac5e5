// refit's trace recorder: spans ("X" complete events), instants and counters of where a
// publication or a generation spends its time, written as a Chrome trace-event JSON
// (runtime/trace/chrome_json.hpp; opens in Perfetto and chrome://tracing).
//
// The lowest layer of refit (no other refit module, no LibTorch, no protobuf): publication/,
// child/, inference/ and the actors all record into one process-wide recorder. Tracing is off
// unless a tool enables it (--trace FILE); off, every call below is one relaxed atomic load.
//
// Recording from any thread (the recorder is thread-safe and bounded: past `max_events` the
// newest events are dropped and counted):
//
//   trace::span s("decode_step", {{"batch", 64}});        // on this thread's track
//   trace::span s(trace::tracks::tp_worker(r), "load chunk", {{"chunk", k}});
//   s.arg("bytes", n);                                     // added when the span ends
//   trace::instant(trace::tracks::sync_coordinator(), "poisoned", {{"error", why}});
//   trace::counter(trace::tracks::trainer_rank(r), "packed bytes rank 0", {{"bytes", held}});
//   auto t0 = trace::start(); ... trace::complete(track, "commit", t0);   // async intervals
//
// Timestamps are CLOCK_MONOTONIC nanoseconds, shared by every process of a host, so events
// the refit-runtime child records line up with the parent's without any clock exchange.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

namespace refit::trace {

// One row of the viewer: `pid` groups rows (a "process" in Perfetto), `tid` is the row.
struct track {
  std::uint32_t pid = 0;
  std::uint32_t tid = 0;
  friend bool operator==(const track& a, const track& b) { return a.pid == b.pid && a.tid == b.tid; }
  friend bool operator<(const track& a, const track& b) {
    return a.pid != b.pid ? a.pid < b.pid : a.tid < b.tid;
  }
};

// refit's tracks. The pids are logical (the same in every run), not OS process ids.
namespace tracks {
inline constexpr std::uint32_t other_pid = 0;       // threads that set no track
inline constexpr std::uint32_t coordinator_pid = 1; // the parent's coordinator-side actors
inline constexpr std::uint32_t trainer_pid = 2;     // one row per trainer rank
inline constexpr std::uint32_t runtime_pid = 3;     // refit-runtime: one row per TP worker
inline constexpr std::uint32_t runtime_server_tid = 1000;

constexpr track sync_coordinator() { return {coordinator_pid, 0}; }
// The ConsensusGate's rounds: materialize rounds, transfer rounds and the other phases
// (prepare, manifest, final) each on their own row (rounds of different kinds overlap).
constexpr track gate_materialize() { return {coordinator_pid, 1}; }
constexpr track gate_transfer() { return {coordinator_pid, 2}; }
constexpr track gate_other() { return {coordinator_pid, 3}; }
constexpr track runtime_proxy() { return {coordinator_pid, 4}; } // control-plane requests
constexpr track trainer_rank(std::uint32_t rank) { return {trainer_pid, rank}; }
constexpr track tp_worker(std::uint32_t rank) { return {runtime_pid, rank}; }
constexpr track runtime_server() { return {runtime_pid, runtime_server_tid}; }

// The names the writer gives rows and groups ("trainer rank 0", "tp worker 1", ...).
std::string process_name(std::uint32_t pid);
std::string thread_name(track t);
} // namespace tracks

using value = std::variant<std::int64_t, double, bool, std::string>;
struct arg {
  std::string key;
  value v;
};

// An argument as the hot path passes it: nothing is allocated unless tracing is on.
class arg_view {
public:
  template <class I, std::enable_if_t<std::is_integral_v<I> && !std::is_same_v<I, bool>, int> = 0>
  constexpr arg_view(const char* key, I v) noexcept
    : key_(key), kind_(kind::integer), i_(clamp(v)) {}
  constexpr arg_view(const char* key, double v) noexcept : key_(key), kind_(kind::real), d_(v) {}
  constexpr arg_view(const char* key, float v) noexcept : key_(key), kind_(kind::real), d_(v) {}
  constexpr arg_view(const char* key, bool v) noexcept : key_(key), kind_(kind::boolean), b_(v) {}
  constexpr arg_view(const char* key, const char* v) noexcept
    : key_(key), kind_(kind::text), s_(v ? v : "") {}
  constexpr arg_view(const char* key, std::string_view v) noexcept
    : key_(key), kind_(kind::text), s_(v) {}
  arg_view(const char* key, const std::string& v) noexcept
    : key_(key), kind_(kind::text), s_(v) {}

  arg materialize() const;

private:
  enum class kind : std::uint8_t { integer, real, boolean, text };
  template <class I>
  static constexpr std::int64_t clamp(I v) noexcept {
    if constexpr (std::is_unsigned_v<I> && sizeof(I) >= sizeof(std::int64_t))
      return v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())
               ? std::numeric_limits<std::int64_t>::max()
               : static_cast<std::int64_t>(v);
    else
      return static_cast<std::int64_t>(v);
  }
  const char* key_;
  kind kind_;
  std::int64_t i_ = 0;
  double d_ = 0;
  bool b_ = false;
  std::string_view s_;
};

enum class phase : char { complete = 'X', instant = 'i', counter = 'C' };

struct event {
  phase ph = phase::complete;
  std::string name;
  std::int64_t ts_ns = 0;  // CLOCK_MONOTONIC
  std::int64_t dur_ns = 0; // complete events only
  track where;
  std::vector<arg> args;
};

namespace detail {
extern std::atomic<bool> on;
}

// True while this process records.
inline bool enabled() noexcept { return detail::on.load(std::memory_order_relaxed); }
// CLOCK_MONOTONIC in nanoseconds.
std::int64_t now_ns() noexcept;
// The beginning of an interval ended by complete(): now_ns() while tracing, else 0.
inline std::int64_t start() noexcept { return enabled() ? now_ns() : 0; }

inline constexpr std::size_t default_max_events = std::size_t{1} << 20;
// Starts recording (clearing what was recorded before) / stops it (what is recorded stays).
void enable(std::size_t max_events = default_max_events);
void disable();

struct stats {
  std::size_t recorded = 0; // held now
  std::uint64_t dropped = 0; // lost to the bound (here or, ingested, in another process)
};
stats statistics();
// Takes up to `max` of the recorded events, oldest first (the child ships them to the parent).
std::vector<event> drain(std::size_t max = std::numeric_limits<std::size_t>::max());
// Adds events recorded elsewhere (the refit-runtime child's, already checked), and events
// another process lost to its bound. Recorded even after disable(), while the bound allows.
void ingest(std::vector<event> events, std::uint64_t dropped_elsewhere = 0);

// A complete event on `where` from `start_ns` (start()) to now; nothing if start_ns is 0.
void complete(track where, std::string_view name, std::int64_t start_ns,
              std::initializer_list<arg_view> args = {}) noexcept;
void instant(track where, std::string_view name, std::initializer_list<arg_view> args = {}) noexcept;
// A counter sample: every argument is one series of the counter `name` (numbers only).
void counter(track where, std::string_view name, std::initializer_list<arg_view> args) noexcept;

// The track spans without an explicit track use on this thread (a TP worker thread sets
// tracks::tp_worker(rank) once); unset: a row of its own, {other_pid, n}, "thread n".
void set_thread_track(track t) noexcept;
track thread_track() noexcept;

// A complete event from construction to destruction (RAII). Inactive (a null pointer, no
// allocation) when tracing is off at construction.
class span {
public:
  explicit span(std::string_view name, std::initializer_list<arg_view> args = {}) noexcept;
  span(track where, std::string_view name, std::initializer_list<arg_view> args = {}) noexcept;
  ~span();
  span(const span&) = delete;
  span& operator=(const span&) = delete;
  span(span&&) noexcept = default;

  // Adds an argument to the event (e.g. a count known only at the end).
  void arg(arg_view a) noexcept;
  template <class V>
  void arg(const char* key, V&& v) noexcept {
    if (ev_)
      arg(arg_view(key, std::forward<V>(v)));
  }
  bool active() const noexcept { return ev_ != nullptr; }

private:
  std::unique_ptr<event> ev_;
};

} // namespace refit::trace
