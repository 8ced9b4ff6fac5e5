#include "runtime/trace/chrome_json.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <set>
#include <stdexcept>
#include <unistd.h>

namespace refit::trace {

namespace {

using json = nlohmann::json;

json to_json(const value& v) {
  return std::visit([](const auto& x) { return json(x); }, v);
}

double micros(std::int64_t ns) { return static_cast<double>(ns) / 1000.0; }

json metadata(const char* name, track t, json args) {
  return json{{"ph", "M"}, {"name", name}, {"pid", t.pid}, {"tid", t.tid}, {"args", std::move(args)}};
}

} // namespace

json to_chrome_json(std::vector<event> events, std::uint64_t dropped) {
  // By time; an enclosing span (same start, longer) before the spans it contains.
  std::stable_sort(events.begin(), events.end(), [](const event& a, const event& b) {
    if (a.ts_ns != b.ts_ns)
      return a.ts_ns < b.ts_ns;
    return a.dur_ns > b.dur_ns;
  });
  const std::int64_t origin = events.empty() ? 0 : events.front().ts_ns;

  json out = json::array();
  std::set<std::uint32_t> pids;
  std::set<track> rows;
  for (const auto& e : events) {
    pids.insert(e.where.pid);
    rows.insert(e.where);
  }
  for (std::uint32_t pid : pids) {
    out.push_back(metadata("process_name", {pid, 0}, {{"name", tracks::process_name(pid)}}));
    out.push_back(metadata("process_sort_index", {pid, 0}, {{"sort_index", pid}}));
  }
  for (const track& t : rows) {
    out.push_back(metadata("thread_name", t, {{"name", tracks::thread_name(t)}}));
    out.push_back(metadata("thread_sort_index", t, {{"sort_index", t.tid}}));
  }
  for (const auto& e : events) {
    json j{{"name", e.name},
           {"cat", "refit"},
           {"ph", std::string(1, static_cast<char>(e.ph))},
           {"ts", micros(e.ts_ns - origin)},
           {"pid", e.where.pid},
           {"tid", e.where.tid}};
    if (e.ph == phase::complete)
      j["dur"] = micros(std::max<std::int64_t>(0, e.dur_ns));
    if (e.ph == phase::instant)
      j["s"] = "t"; // thread-scoped: drawn on its track
    json args = json::object();
    for (const auto& a : e.args)
      args[a.key] = to_json(a.v);
    if (!args.empty())
      j["args"] = std::move(args);
    out.push_back(std::move(j));
  }
  return json{{"traceEvents", std::move(out)},
              {"displayTimeUnit", "ms"},
              {"otherData",
               {{"clock", "CLOCK_MONOTONIC"},
                {"origin_ns", origin},
                {"dropped_events", dropped},
                {"writer", "refit"}}}};
}

std::string dump(const json& trace) {
  return trace.dump(-1, ' ', false, json::error_handler_t::replace);
}

output_file::output_file(std::string path) : path_(std::move(path)) {
  if (path_.empty())
    throw std::runtime_error("cannot write the trace file '': the path is empty");
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw std::runtime_error("cannot write the trace file '" + path_ + "': "
                             + std::strerror(errno));
}

output_file::~output_file() {
  if (fd_ >= 0)
    ::close(fd_);
}

std::size_t output_file::write() {
  if (fd_ < 0)
    return 0;
  const stats before = statistics();
  std::vector<event> events = drain();
  const std::size_t count = events.size();
  const std::string text = dump(to_chrome_json(std::move(events), before.dropped)) + "\n";
  const int fd = fd_;
  fd_ = -1;
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw std::runtime_error("cannot write the trace file '" + path_ + "': "
                               + std::strerror(err));
    }
    done += static_cast<std::size_t>(n);
  }
  if (::close(fd) != 0)
    throw std::runtime_error("cannot write the trace file '" + path_ + "': "
                             + std::strerror(errno));
  return count;
}

void tool_trace::open(const std::string& path) {
  file_.emplace(path);
  enable();
}

tool_trace::~tool_trace() {
  if (!file_)
    return;
  disable();
  std::string line;
  try {
    const std::size_t n = file_->write();
    line = program_ + ": trace of " + std::to_string(n) + " events written to '" + file_->path()
           + "'\n";
  } catch (const std::exception& e) {
    line = program_ + ": " + e.what() + "\n";
  }
  (void)!::write(STDERR_FILENO, line.data(), line.size());
}

} // namespace refit::trace
