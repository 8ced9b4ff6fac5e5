// The Chrome trace-event JSON of recorded events ({"traceEvents": [...]}: Perfetto and
// chrome://tracing open it), and the --trace FILE output of the tools.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/trace/trace.hpp"

namespace refit::trace {

// The trace of `events`: a process_name / thread_name (and sort index) metadata event for
// every track that has events, then the events sorted by time. Timestamps are microseconds
// (ns precision) since the earliest event; "otherData" holds the clock, that origin in
// CLOCK_MONOTONIC ns and the events lost to the bound. Names and strings are JSON-escaped;
// invalid UTF-8 is replaced (U+FFFD).
nlohmann::json to_chrome_json(std::vector<event> events, std::uint64_t dropped = 0);
std::string dump(const nlohmann::json& trace);

// The file behind --trace FILE. Opening creates (or truncates) it at once, so a path that
// cannot be written is refused before anything runs: std::runtime_error "cannot write the
// trace file 'FILE': <reason>".
class output_file {
public:
  explicit output_file(std::string path);
  ~output_file();
  output_file(const output_file&) = delete;
  output_file& operator=(const output_file&) = delete;

  const std::string& path() const { return path_; }
  // Writes everything the process-wide recorder holds (drained) and closes the file; returns
  // the number of events written (metadata not counted). Throws std::runtime_error naming
  // the path. A second call writes nothing and returns 0.
  std::size_t write();

private:
  std::string path_;
  int fd_ = -1;
};

// What a tool's main holds for --trace FILE: open() opens the file (throws as output_file
// does) and starts recording; the destructor (when main returns, after the actor system and
// the runtime are gone, so the runtime's last events are in) writes it and prints
// "<program>: trace of N events written to 'FILE'" or the write error on stderr.
class tool_trace {
public:
  explicit tool_trace(std::string program) : program_(std::move(program)) {}
  ~tool_trace();
  tool_trace(const tool_trace&) = delete;
  tool_trace& operator=(const tool_trace&) = delete;
  void open(const std::string& path);

private:
  std::string program_;
  std::optional<output_file> file_;
};

} // namespace refit::trace
