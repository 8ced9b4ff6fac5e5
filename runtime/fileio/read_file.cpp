#include "runtime/fileio/read_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace refit::fileio {

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode))
    return "a directory";
  if (S_ISCHR(mode))
    return "a character device";
  if (S_ISBLK(mode))
    return "a block device";
  if (S_ISFIFO(mode))
    return "a FIFO";
  if (S_ISSOCK(mode))
    return "a socket";
  return "not a regular file";
}

} // namespace

std::string read_regular_file(const std::string& path, std::uint64_t max_bytes, const std::string& what) {
  const auto fail = [&](const std::string& why) {
    return file_error(what + " '" + path + "': " + why);
  };
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    throw fail(std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw fail(std::string("cannot stat: ") + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw fail(std::string("is ") + kind_of(st.st_mode) + ", not a regular file");
  }
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    throw fail("has " + std::to_string(st.st_size) + " bytes, more than the " + std::to_string(max_bytes)
               + "-byte cap for a " + what);
  }
  std::string out;
  out.resize(static_cast<std::size_t>(st.st_size));
  std::size_t got = 0;
  for (;;) {
    if (got == out.size()) {
      // Past the size fstat gave: read on in small steps, up to the cap.
      if (out.size() > max_bytes) {
        ::close(fd);
        throw fail("grew past the " + std::to_string(max_bytes) + "-byte cap for a " + what
                   + " while it was read");
      }
      out.resize(out.size() + 4096);
    }
    ssize_t n = ::read(fd, &out[got], out.size() - got);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw fail(std::string("cannot read: ") + std::strerror(err));
    }
    if (n == 0)
      break;
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  out.resize(got);
  if (got > max_bytes)
    throw fail("grew past the " + std::to_string(max_bytes) + "-byte cap for a " + what
               + " while it was read");
  return out;
}

} // namespace refit::fileio
