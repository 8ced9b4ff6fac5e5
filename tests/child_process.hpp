// A child process the multi-process tests steer: stdin and stdout are pipes (lines in, lines
// out, every read with a deadline), stderr goes to a file. The child dies with the test
// (PR_SET_PDEATHSIG), and the destructor kills and reaps it: no test leaves a process behind.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern "C" char** environ;

namespace refit::testing {

class child_process {
public:
  child_process(std::vector<std::string> argv, std::string stderr_path,
                std::vector<std::pair<std::string, std::string>> env = {})
    : stderr_path_(std::move(stderr_path)) {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0)
      throw std::runtime_error("pipe2");
    std::vector<char*> args;
    for (auto& a : argv)
      args.push_back(a.data());
    args.push_back(nullptr);
    // The environment is built before fork: the child only dup2s and execs.
    std::vector<std::string> env_text;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string entry = *e;
      bool replaced = false;
      for (const auto& [k, v] : env)
        replaced |= entry.compare(0, k.size() + 1, k + "=") == 0;
      if (!replaced)
        env_text.push_back(entry);
    }
    for (const auto& [k, v] : env)
      env_text.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& e : env_text)
      envp.push_back(e.data());
    envp.push_back(nullptr);
    int err = ::open(stderr_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    pid_ = ::fork();
    if (pid_ < 0)
      throw std::runtime_error("fork");
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      if (err >= 0)
        ::dup2(err, 2);
      ::execve(args[0], args.data(), envp.data());
      ::_exit(127);
    }
    if (err >= 0)
      ::close(err);
    ::close(in[0]);
    ::close(out[1]);
    to_child_ = in[1];
    from_child_ = out[0];
  }

  ~child_process() {
    if (to_child_ >= 0)
      ::close(to_child_);
    if (from_child_ >= 0)
      ::close(from_child_);
    if (!reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;

  pid_t pid() const { return pid_; }

  void send(const std::string& line) {
    std::string text = line + "\n";
    if (::write(to_child_, text.data(), text.size()) != static_cast<ssize_t>(text.size()))
      throw std::runtime_error("write to child " + std::to_string(pid_) + " failed");
  }

  // The next stdout line within `timeout`, or nullopt (timeout or EOF).
  std::optional<std::string> read_line(std::chrono::milliseconds timeout) {
    auto until = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (auto nl = buffer_.find('\n'); nl != std::string::npos) {
        auto line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0)
        return std::nullopt;
      pollfd p{from_child_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0)
        continue;
      char buf[4096];
      auto n = ::read(from_child_, buf, sizeof(buf));
      if (n <= 0)
        return std::nullopt;
      buffer_.append(buf, static_cast<std::size_t>(n));
    }
  }

  void signal(int sig) { ::kill(pid_, sig); }

  // Waits for the exit within `timeout`: the exit code, 128 + signal, or nullopt (still running).
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    if (reaped_)
      return status_;
    auto until = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      int status = 0;
      auto r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        reaped_ = true;
        status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        return status_;
      }
      if (std::chrono::steady_clock::now() >= until)
        return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  std::string stderr_text() const {
    std::ifstream in(stderr_path_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buffer_;
  std::string stderr_path_;
  bool reaped_ = false;
  int status_ = -1;
};

// A live (not zombie) process?
inline bool process_alive(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(in, text))
    return false;
  auto close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() && text[close + 2] != 'Z';
}

// Live children of `parent` whose command name is `comm`.
inline std::vector<pid_t> children_named(pid_t parent, const std::string& comm) {
  std::vector<pid_t> out;
  DIR* d = ::opendir("/proc");
  if (!d)
    return out;
  while (auto* e = ::readdir(d)) {
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (*end != '\0' || pid <= 0)
      continue;
    std::ifstream in(std::string("/proc/") + e->d_name + "/stat");
    std::string text;
    if (!std::getline(in, text))
      continue;
    auto open = text.find('(');
    auto close = text.rfind(')');
    if (open == std::string::npos || close == std::string::npos || close + 4 >= text.size())
      continue;
    std::string name = text.substr(open + 1, close - open - 1);
    std::istringstream rest(text.substr(close + 2));
    char state;
    long ppid;
    rest >> state >> ppid;
    if (ppid == parent && name == comm && state != 'Z')
      out.push_back(static_cast<pid_t>(pid));
  }
  ::closedir(d);
  return out;
}

} // namespace refit::testing
