// libFuzzer target: untrusted bytes as a safetensors file. The reader must either accept
// them, with every tensor view inside the input, or refuse them with a checkpoint_error;
// never crash, hang, read out of bounds or throw anything else.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "runtime/checkpoint/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  try {
    const auto f = refit::checkpoint::safetensors_file::parse(bytes, size, "<fuzz>");
    std::uint64_t covered = 0;
    unsigned sum = 0;
    for (const auto& t : f->tensors()) {
      if (t.data < bytes || t.nbytes > size || t.data + t.nbytes > bytes + size
          || t.file_offset != static_cast<std::uint64_t>(t.data - bytes)
          || f->find(t.name) != &t)
        std::abort();
      for (std::uint64_t i = 0; i < t.nbytes; ++i) // touch every byte (ASan checks bounds)
        sum += static_cast<unsigned>(t.data[i]);
      covered += t.nbytes;
    }
    if (8 + f->header_bytes() + covered != size) // the tensors tile the data buffer
      std::abort();
    (void)sum;
  } catch (const refit::checkpoint::checkpoint_error&) {
  }
  return 0;
}
