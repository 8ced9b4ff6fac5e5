#include "runtime/publication/memfd.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

namespace refit::publication {

namespace {

std::string seal_names(int seals) {
  std::string out;
  auto add = [&](int bit, const char* name) {
    if (seals & bit)
      out += (out.empty() ? "" : "|") + std::string(name);
  };
  add(F_SEAL_SEAL, "SEAL");
  add(F_SEAL_SHRINK, "SHRINK");
  add(F_SEAL_GROW, "GROW");
  add(F_SEAL_WRITE, "WRITE");
  return out.empty() ? "none" : out;
}

} // namespace

int create_sealable_memfd(const char* name, const std::string& what) {
  int fd = ::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    throw std::system_error(errno, std::generic_category(), what + ": memfd_create");
  return fd;
}

void add_seals(int fd, unsigned seals, const std::string& what) {
  if (::fcntl(fd, F_ADD_SEALS, static_cast<int>(seals)) != 0)
    throw std::system_error(errno, std::generic_category(), what + ": F_ADD_SEALS");
}

std::string check_seals(int fd, unsigned required) {
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0)
    return "is not a memfd (F_GET_SEALS: " + std::string(std::strerror(errno)) + ")";
  if ((static_cast<unsigned>(seals) & required) != required)
    return "is a memfd without the required seals (has " + seal_names(seals) + ", needs "
           + seal_names(static_cast<int>(required))
           + "): its producer could shrink it under the mapping";
  return {};
}

int open_pidfd(int pid) {
#if defined(SYS_pidfd_open)
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

bool pidfd_alive(int pidfd) {
#if defined(SYS_pidfd_send_signal)
  return ::syscall(SYS_pidfd_send_signal, pidfd, 0, nullptr, 0) == 0;
#else
  (void)pidfd;
  return true;
#endif
}

int open_peer_fd(int pid, int fd, std::string& error, bool writable) {
  if (pid <= 0 || fd < 0) {
    error = "pid " + std::to_string(pid) + " / fd " + std::to_string(fd) + " is out of range";
    return -1;
  }
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int pidfd = open_pidfd(pid);
  if (pidfd < 0 && errno == ESRCH) {
    error = "process " + std::to_string(pid) + " is not running: the producer of " + path
            + " is gone";
    return -1;
  }
  // O_NONBLOCK: a handle naming a FIFO must fail later, not block in open().
  int local = ::open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NONBLOCK);
  const int open_errno = errno;
  const bool same_process = pidfd < 0 || pidfd_alive(pidfd);
  if (pidfd >= 0)
    ::close(pidfd);
  if (local < 0) {
    error = "cannot open " + path + " (" + std::strerror(open_errno)
            + "): the producer process or its buffer fd is gone";
    return -1;
  }
  if (!same_process) {
    ::close(local);
    error = "process " + std::to_string(pid) + " exited while " + path
            + " was opened (the pid may name another process now)";
    return -1;
  }
  return local;
}

} // namespace refit::publication
