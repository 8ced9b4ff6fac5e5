#include "runtime/control/process.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <csignal>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <fstream>
#include <poll.h>
#include <sstream>
#include <stdexcept>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <system_error>
#include <thread>
#include <unistd.h>

namespace refit::proc {

namespace {

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

exit_info to_exit_info(int status) {
  exit_info info;
  if (WIFEXITED(status)) {
    info.exited = true;
    info.code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    info.signal = WTERMSIG(status);
  }
  return info;
}

} // namespace

std::string exit_info::describe() const {
  if (exited)
    return "exited with code " + std::to_string(code);
  if (signal != 0)
    return std::string("killed by signal ") + std::to_string(signal) + " ("
           + ::strsignal(signal) + ")";
  return "still running";
}

bool is_secret_env_name(const std::string& name) {
  std::string upper;
  for (char c : name)
    upper.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
  for (const char* word : {"SECRET", "PASSWORD", "PASSPHRASE"})
    if (upper.find(word) != std::string::npos)
      return true;
  // TOKEN, but not TOKENS: a count such as REFIT_ROUTE_BUCKET_MAX_TOKENS is no secret.
  for (std::size_t at = upper.find("TOKEN"); at != std::string::npos;
       at = upper.find("TOKEN", at + 1))
    if (at + 5 == upper.size() || upper[at + 5] != 'S')
      return true;
  return false;
}

std::vector<std::string> scrubbed_environment(char** env, const std::vector<std::string>& scrub) {
  std::vector<std::string> out;
  for (char** e = env; e && *e; ++e) {
    std::string entry = *e;
    std::string name = entry.substr(0, entry.find('='));
    if (is_secret_env_name(name) || std::find(scrub.begin(), scrub.end(), name) != scrub.end())
      continue;
    out.push_back(std::move(entry));
  }
  return out;
}

child_process spawn_child(const spawn_options& opts) {
  if (opts.executable.empty())
    throw std::invalid_argument("spawn_child: empty executable path");
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    throw_errno("socketpair");

  // Build argv before fork: no allocation in the child.
  std::vector<std::string> storage;
  storage.reserve(opts.args.size() + 1);
  storage.push_back(opts.executable);
  for (const auto& a : opts.args)
    storage.push_back(a);
  std::vector<char*> argv;
  for (auto& s : storage)
    argv.push_back(s.data());
  argv.push_back(nullptr);

  // The child's environment, built before fork (nothing allocates after it): the parent's
  // without its secrets (the shared secret of serve.token_env, anything named like a token).
  std::vector<std::string> env_storage = scrubbed_environment(environ, opts.scrub_env);
  std::vector<char*> envp;
  for (auto& e : env_storage)
    envp.push_back(e.data());
  envp.push_back(nullptr);

  // A pipe that reports exec failure (close-on-exec: EOF means exec succeeded).
  int exec_pipe[2];
  if (::pipe2(exec_pipe, O_CLOEXEC) != 0) {
    int e = errno;
    ::close(sv[0]);
    ::close(sv[1]);
    errno = e;
    throw_errno("pipe2");
  }
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    int e = errno;
    for (int fd : {sv[0], sv[1], exec_pipe[0], exec_pipe[1]})
      ::close(fd);
    errno = e;
    throw_errno("fork");
  }
  if (pid == 0) {
    // Child: own process group, die with the parent, control fd at a fixed number.
    ::setpgid(0, 0);
    if (opts.die_with_parent) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent)
        ::_exit(127);
    }
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::signal(SIGPIPE, SIG_DFL);
    int ctl = sv[1];
    if (ctl == opts.child_control_fd) {
      int flags = ::fcntl(ctl, F_GETFD);
      ::fcntl(ctl, F_SETFD, flags & ~FD_CLOEXEC);
    } else if (::dup2(ctl, opts.child_control_fd) < 0) {
      int e = errno;
      (void)!::write(exec_pipe[1], &e, sizeof(e));
      ::_exit(127);
    }
    // Keep exec_pipe[1] open across the close loop (it is close-on-exec anyway). close_range
    // covers every fd number, however high RLIMIT_NOFILE was raised (the serve listener
    // raises it); the loop is the fallback for kernels without it.
    const int keep_lo = std::min(opts.child_control_fd, exec_pipe[1]);
    const int keep_hi = std::max(opts.child_control_fd, exec_pipe[1]);
    bool closed = false;
#if defined(SYS_close_range)
    closed = (keep_lo <= 3 || ::syscall(SYS_close_range, 3u, static_cast<unsigned>(keep_lo - 1), 0u) == 0)
             && (keep_hi - keep_lo <= 1
                 || ::syscall(SYS_close_range, static_cast<unsigned>(keep_lo + 1),
                              static_cast<unsigned>(keep_hi - 1), 0u) == 0)
             && ::syscall(SYS_close_range, static_cast<unsigned>(keep_hi + 1), ~0u, 0u) == 0;
#endif
    if (!closed) {
      long max_fd = ::sysconf(_SC_OPEN_MAX);
      if (max_fd < 0 || max_fd > 65536)
        max_fd = 65536;
      for (int fd = 3; fd < max_fd; ++fd)
        if (fd != opts.child_control_fd && fd != exec_pipe[1])
          ::close(fd);
    }
    ::execve(argv[0], argv.data(), envp.data());
    int e = errno;
    (void)!::write(exec_pipe[1], &e, sizeof(e));
    ::_exit(127);
  }
  // Parent: also set the group from this side to avoid a race with an early kill(-pid).
  ::setpgid(pid, pid);
  ::close(sv[1]);
  ::close(exec_pipe[1]);
  int child_errno = 0;
  ssize_t n;
  do {
    n = ::read(exec_pipe[0], &child_errno, sizeof(child_errno));
  } while (n < 0 && errno == EINTR);
  ::close(exec_pipe[0]);
  if (n > 0) {
    ::close(sv[0]);
    int status = 0;
    ::waitpid(pid, &status, 0);
    errno = child_errno;
    throw_errno("exec " + opts.executable);
  }
  return child_process{pid, sv[0]};
}

std::optional<exit_info> try_reap(pid_t pid) {
  int status = 0;
  pid_t r;
  do {
    r = ::waitpid(pid, &status, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == pid)
    return to_exit_info(status);
  if (r < 0 && errno == ECHILD) {
    exit_info gone;
    gone.exited = true;
    gone.code = -1; // already reaped elsewhere
    return gone;
  }
  return std::nullopt;
}

exit_info terminate_group(pid_t pgid, std::chrono::milliseconds grace, int interrupt_fd) {
  if (auto done = try_reap(pgid)) {
    ::kill(-pgid, SIGKILL); // leftovers of the group, if any
    return *done;
  }
  ::kill(-pgid, SIGTERM);
  auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto done = try_reap(pgid)) {
      ::kill(-pgid, SIGKILL);
      return *done;
    }
    pollfd p{interrupt_fd, POLLIN, 0};
    if (interrupt_fd >= 0 && ::poll(&p, 1, 5) > 0)
      break; // asked to hurry: escalate now
    if (interrupt_fd < 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ::kill(-pgid, SIGKILL);
  int status = 0;
  pid_t r;
  do {
    r = ::waitpid(pgid, &status, 0);
  } while (r < 0 && errno == EINTR);
  if (r == pgid)
    return to_exit_info(status);
  exit_info gone;
  gone.exited = true;
  gone.code = -1;
  return gone;
}

namespace {

// Reads /proc/<pid>/stat: returns (state, pgid) or false if unreadable.
bool read_stat(pid_t pid, char& state, pid_t& pgid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!in || !std::getline(in, line))
    return false;
  auto close_paren = line.rfind(')');
  if (close_paren == std::string::npos)
    return false;
  std::istringstream rest(line.substr(close_paren + 2));
  pid_t ppid = 0;
  rest >> state >> ppid >> pgid;
  return static_cast<bool>(rest);
}

} // namespace

std::vector<pid_t> processes_in_group(pid_t pgid) {
  std::vector<pid_t> out;
  DIR* dir = ::opendir("/proc");
  if (!dir)
    return out;
  while (auto* ent = ::readdir(dir)) {
    char* end = nullptr;
    long pid = std::strtol(ent->d_name, &end, 10);
    if (!end || *end != '\0' || pid <= 0)
      continue;
    char state = 0;
    pid_t group = 0;
    if (read_stat(static_cast<pid_t>(pid), state, group) && group == pgid && state != 'Z'
        && state != 'X')
      out.push_back(static_cast<pid_t>(pid));
  }
  ::closedir(dir);
  return out;
}

std::vector<std::string> open_fds(pid_t pid) {
  std::vector<std::string> out;
  std::string base = "/proc/" + std::to_string(pid) + "/fd";
  DIR* dir = ::opendir(base.c_str());
  if (!dir)
    return out;
  int own = ::dirfd(dir);
  while (auto* ent = ::readdir(dir)) {
    if (ent->d_name[0] == '.')
      continue;
    if (pid == ::getpid() && std::atoi(ent->d_name) == own)
      continue;
    char target[512];
    std::string link = base + "/" + ent->d_name;
    ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
    target[n > 0 ? n : 0] = '\0';
    out.push_back(std::string(ent->d_name) + " -> " + target);
  }
  ::closedir(dir);
  std::sort(out.begin(), out.end());
  return out;
}

std::uint64_t rss_anon_bytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("RssAnon:", 0) == 0) {
      std::istringstream fields(line.substr(8));
      std::uint64_t kb = 0;
      fields >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

std::string resolve_executable(const std::string& name) {
  if (name.empty())
    throw std::runtime_error("runtime.executable is empty");
  if (name.front() == '/') {
    if (::access(name.c_str(), X_OK) != 0)
      throw std::runtime_error("runtime executable '" + name + "' is not executable");
    return name;
  }
  std::string tried;
  char self[4096];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    self[n] = '\0';
    std::string dir(self);
    dir = dir.substr(0, dir.rfind('/'));
    for (const std::string& candidate : {dir + "/" + name, dir + "/../runtime/" + name}) {
      tried += " " + candidate;
      if (::access(candidate.c_str(), X_OK) == 0)
        return candidate;
    }
  }
  if (name.find('/') == std::string::npos) {
    const char* path = std::getenv("PATH");
    std::istringstream dirs(path ? path : "");
    std::string d;
    while (std::getline(dirs, d, ':')) {
      if (d.empty())
        continue;
      std::string candidate = d + "/" + name;
      tried += " " + candidate;
      if (::access(candidate.c_str(), X_OK) == 0)
        return candidate;
    }
  }
  throw std::runtime_error("runtime executable '" + name + "' not found (tried:" + tried + ")");
}

} // namespace refit::proc
