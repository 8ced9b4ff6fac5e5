// Trainer side of direct publication, by device kind: opening a TP worker's exported resident
// arena for writing, and the writer that executes a chunk's direct moves. CPU devices: the
// arena is the runtime's sealed memfd, opened through /proc/<runtime pid>/fd and mapped
// read-write; a move is one bulk copy (memcpy semantics, streaming stores). CUDA devices: the
// arena is opened with cudaIpcOpenMemHandle on the rank's own GPU (another GPU's arena over
// peer access); a chunk's moves are one batched copy kernel on the rank's stream, its
// descriptors uploaded once per publication (cuda::copy_plan).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/device/device.hpp"

namespace refit::publication {

class resident_target {
public:
  virtual ~resident_target() = default;
  virtual std::byte* data() const = 0; // device pointer on GPUs
  virtual std::uint64_t size() const = 0;
};

// Opens `handle` (size `size`) from a rank on `rank_device`. On CPU the handle must name
// `runtime_pid` and a memfd sealed against shrinking and growing. Throws std::runtime_error
// naming the handle when it cannot be opened.
std::unique_ptr<resident_target> open_resident_target(const device::spec& rank_device,
                                                      const std::string& handle,
                                                      std::uint64_t size, int runtime_pid);

// One strided copy of a direct move: rows of row_bytes, src + r * src_stride ->
// dst + r * dst_stride (dst inside an opened resident_target).
struct direct_copy {
  std::byte* dst = nullptr;
  std::uint64_t dst_stride = 0;
  const std::byte* src = nullptr;
  std::uint64_t src_stride = 0;
  std::uint64_t row_bytes = 0;
  std::uint64_t rows = 0;
};

class direct_writer {
public:
  virtual ~direct_writer() = default;
  // Every chunk's copies, planned once per publication (prepare). On a GPU their descriptors
  // go to the device here, so a chunk's write is one kernel launch with no host wait before it.
  virtual void plan(const std::vector<std::vector<direct_copy>>& chunks) = 0;
  // Starts the first `limit` copies of planned chunk `chunk` (all of them but in fault tests);
  // on a GPU it returns before they complete.
  virtual void start(std::size_t chunk, std::size_t limit) = 0;
  // Returns once every copy started so far is complete and visible to the runtime.
  virtual void finish() = 0;
};

std::unique_ptr<direct_writer> make_direct_writer(const device::spec& rank_device);

// Open CUDA IPC handles of resident arenas in this process (0 on CPU builds).
std::uint64_t open_resident_targets();

} // namespace refit::publication
