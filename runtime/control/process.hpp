// Child-process ownership: spawn in its own process group with a control socketpair,
// terminate the whole group (SIGTERM, grace, SIGKILL), reap, and inspect /proc.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <sys/types.h>
#include <vector>

namespace refit::proc {

struct spawn_options {
  std::string executable;          // absolute path (see resolve_executable)
  std::vector<std::string> args;   // argv[1..]
  int child_control_fd = 3;        // the child's end of the socketpair is dup2'd here
  bool die_with_parent = true;     // PR_SET_PDEATHSIG(SIGKILL) in the child
  // Environment variables the child must not inherit (e.g. serve.token_env). Besides these,
  // every variable whose name looks like a secret (see is_secret_env_name) is dropped.
  std::vector<std::string> scrub_env;
};

// Whether an environment variable name looks like it holds a secret: REFIT_TOKEN, or a name
// containing TOKEN (but not as TOKENS, a count), SECRET, PASSWORD or PASSPHRASE (any case).
bool is_secret_env_name(const std::string& name);

// `env` (NAME=value entries) without the variables named in `scrub` and without secrets.
std::vector<std::string> scrubbed_environment(char** env, const std::vector<std::string>& scrub);

struct child_process {
  pid_t pid = -1;        // also the process group id
  int control_fd = -1;   // parent's end of the socketpair (close-on-exec)
};

// Spawns the child. Every fd other than 0, 1, 2 and `child_control_fd` is closed in the
// child. Throws std::system_error on failure (and leaves nothing behind).
child_process spawn_child(const spawn_options& opts);

struct exit_info {
  bool exited = false;  // normal exit (code valid)
  int code = 0;
  int signal = 0;       // terminating signal (if !exited)
  std::string describe() const;
};

// Non-blocking reap of `pid`; nullopt while it is still running.
std::optional<exit_info> try_reap(pid_t pid);

// SIGTERM to the group `pgid`, waits up to `grace` for the leader to exit (returns early
// when `interrupt_fd` becomes readable), then SIGKILL to the group, then reaps the leader.
// Blocking: call it from a thread that may block, never from a CAF scheduler thread.
exit_info terminate_group(pid_t pgid, std::chrono::milliseconds grace, int interrupt_fd = -1);

// Live (non-zombie) processes whose process group is `pgid`, from /proc.
std::vector<pid_t> processes_in_group(pid_t pgid);

// Open fds of process `pid` (from /proc/<pid>/fd), as "fd -> target" strings.
std::vector<std::string> open_fds(pid_t pid);

// Resident anonymous memory (RssAnon, bytes) of `pid`, from /proc/<pid>/status; 0 if gone.
std::uint64_t rss_anon_bytes(pid_t pid);

// `name` if absolute; else the file next to the running executable if it exists; else
// `name` searched on PATH. Throws std::runtime_error naming what was tried.
std::string resolve_executable(const std::string& name);

} // namespace refit::proc
