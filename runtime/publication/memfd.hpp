// memfd hygiene shared by the producer pools (host_buffer.cpp) and the cross-process
// all-gather (shm_collective.cpp): producers seal their memfds before a handle leaves the
// process, consumers require the seals and that the handle's pid is still the process they
// were told about (pidfd) before they map anything. A mapping of a sealed memfd cannot lose
// its pages under the reader (no SIGBUS): F_SEAL_SHRINK forbids ftruncate below the size.
#pragma once

#include <string>

namespace refit::publication {

// Creates a memfd that accepts seals (MFD_CLOEXEC | MFD_ALLOW_SEALING). Throws
// std::system_error naming `what`.
int create_sealable_memfd(const char* name, const std::string& what);

// Adds `seals` (F_SEAL_*); throws std::system_error naming `what`.
void add_seals(int fd, unsigned seals, const std::string& what);

// "" if `fd` is a memfd carrying every seal of `required`, else what is wrong ("is not a
// memfd", "is not sealed against shrinking (seals: ...)").
std::string check_seals(int fd, unsigned required);

// pidfd_open(pid): -1 with errno (ESRCH: not running; ENOSYS: an old kernel).
int open_pidfd(int pid);
// Whether the process behind `pidfd` is still running (pidfd_send_signal with signal 0).
bool pidfd_alive(int pidfd);

// Opens /proc/<pid>/fd/<fd> read-only for the process `pid` and makes sure the file belongs
// to that very process: a pidfd is taken first and checked after the open, so a pid that was
// reused in between is noticed. Returns the fd, or -1 with `error` set.
// `writable`: O_RDWR instead (direct publication opens the runtime's resident arena).
int open_peer_fd(int pid, int fd, std::string& error, bool writable = false);

} // namespace refit::publication
