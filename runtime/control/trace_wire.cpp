#include "runtime/control/trace_wire.hpp"

#include <utility>
#include <vector>

#include "runtime/trace/trace.hpp"

namespace refit::wire {

namespace pb = control::v1;

namespace {

constexpr std::size_t max_events_per_response = 200000;
constexpr std::size_t max_name_bytes = 256;
constexpr std::size_t max_args = 32;
constexpr std::size_t max_string_bytes = 1024;
constexpr std::uint32_t max_worker_tid = 999; // TP ranks; runtime_server_tid = 1000

std::uint64_t reported_dropped = 0; // the child's drops already sent (main thread only)

char phase_char(const std::string& p) { return p.size() == 1 ? p[0] : '\0'; }

void to_wire(const trace::event& e, pb::TraceEvent& out) {
  out.set_name(e.name);
  out.set_phase(std::string(1, static_cast<char>(e.ph)));
  out.set_ts_ns(e.ts_ns);
  out.set_dur_ns(e.dur_ns);
  out.set_tid(e.where.tid);
  for (const auto& a : e.args) {
    auto* w = out.add_args();
    w->set_key(a.key);
    if (const auto* i = std::get_if<std::int64_t>(&a.v))
      w->set_int_value(*i);
    else if (const auto* d = std::get_if<double>(&a.v))
      w->set_double_value(*d);
    else if (const auto* b = std::get_if<bool>(&a.v))
      w->set_bool_value(*b);
    else
      w->set_string_value(std::get<std::string>(a.v));
  }
}

std::string bounded(const std::string& s, std::size_t max) {
  return s.size() <= max ? s : s.substr(0, max);
}

} // namespace

void append_trace(std::string& payload, std::size_t max_frame_bytes) {
  if (!trace::enabled())
    return;
  std::vector<trace::event> events = trace::drain(max_events_per_response);
  const std::uint64_t dropped_total = trace::statistics().dropped;
  std::uint64_t dropped = dropped_total - reported_dropped;
  reported_dropped = dropped_total;
  if (events.empty() && dropped == 0)
    return;
  // What is left for the trace: the frame's bound minus the response and a margin for the
  // field tags and lengths of the batch itself.
  const std::size_t reserve = 64;
  const std::size_t budget =
    max_frame_bytes > payload.size() + reserve ? max_frame_bytes - payload.size() - reserve : 0;
  pb::Response extra;
  pb::TraceBatch* batch = extra.mutable_trace();
  std::size_t used = 0;
  for (std::size_t i = 0; i < events.size(); ++i) {
    pb::TraceEvent w;
    to_wire(events[i], w);
    const std::size_t size = w.ByteSizeLong() + 6; // tag + length prefix
    if (used + size > budget) {
      dropped += events.size() - i;
      break;
    }
    used += size;
    *batch->add_events() = std::move(w);
  }
  batch->set_dropped(dropped);
  payload += extra.SerializeAsString();
}

std::size_t ingest_trace(const pb::Response& response) {
  if (!trace::enabled() || !response.has_trace())
    return 0;
  const pb::TraceBatch& batch = response.trace();
  std::vector<trace::event> events;
  events.reserve(static_cast<std::size_t>(batch.events_size()));
  std::uint64_t refused = 0;
  for (const pb::TraceEvent& w : batch.events()) {
    const char ph = phase_char(w.phase());
    const bool known = ph == static_cast<char>(trace::phase::complete)
                       || ph == static_cast<char>(trace::phase::instant)
                       || ph == static_cast<char>(trace::phase::counter);
    if (!known || w.ts_ns() <= 0 || w.dur_ns() < 0
        || (w.tid() > max_worker_tid && w.tid() != trace::tracks::runtime_server_tid)) {
      ++refused;
      continue;
    }
    trace::event e;
    e.ph = static_cast<trace::phase>(ph);
    e.name = bounded(w.name(), max_name_bytes);
    e.ts_ns = w.ts_ns();
    e.dur_ns = e.ph == trace::phase::complete ? w.dur_ns() : 0;
    e.where = {trace::tracks::runtime_pid, w.tid()};
    for (int i = 0; i < w.args_size() && static_cast<std::size_t>(i) < max_args; ++i) {
      const pb::TraceArg& a = w.args(i);
      trace::arg out;
      out.key = bounded(a.key(), max_name_bytes);
      switch (a.value_case()) {
        case pb::TraceArg::kIntValue: out.v = a.int_value(); break;
        case pb::TraceArg::kDoubleValue: out.v = a.double_value(); break;
        case pb::TraceArg::kBoolValue: out.v = a.bool_value(); break;
        case pb::TraceArg::kStringValue:
          out.v = bounded(a.string_value(), max_string_bytes);
          break;
        default: continue;
      }
      e.args.push_back(std::move(out));
    }
    events.push_back(std::move(e));
  }
  const std::size_t n = events.size();
  trace::ingest(std::move(events), batch.dropped() + refused);
  return n;
}

} // namespace refit::wire
