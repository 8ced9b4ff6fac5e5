// Runs a command line (a refit executable under test) and captures its stdout and exit code.
#pragma once

#include <cstdio>
#include <string>
#include <sys/wait.h>

namespace refit::testing {

struct command_result {
  int exit_code = -1; // -1: did not exit normally (or could not start)
  std::string out;
};

inline command_result run_command(const std::string& cmd) {
  command_result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr)
    return r;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0)
    r.out.append(buf, n);
  int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

} // namespace refit::testing
