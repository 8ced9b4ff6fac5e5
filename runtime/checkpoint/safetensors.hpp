// A safetensors file, read zero-copy: the file is mapped read-only (mmap, MAP_PRIVATE) and
// every tensor is a view into the mapping; the file is never copied into host memory.
//
// Everything a hostile file can get wrong is refused with a checkpoint_error that names the
// file and the tensor or header field: a short file, a header length beyond the file or above
// 100,000,000 bytes, a header that is not a JSON object (or has duplicate keys, which JSON
// parsers otherwise accept silently), a bad __metadata__, per tensor a bad dtype / shape /
// data_offsets, byte counts that do not match numel * dtype size, and over all tensors any
// overlap, hole or trailing bytes in the data buffer.
//
// Pure C++ (no LibTorch, no CAF).
#pragma once

#include "runtime/model/qwen3_moe.hpp"

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace refit::checkpoint {

// An error in a checkpoint file. Text: "<file>: tensor '<tensor>': <field>: <what>" (the
// tensor part is left out when `tensor` is empty, the field part when `field` is empty).
struct checkpoint_error : std::runtime_error {
  checkpoint_error(std::string file, std::string tensor, std::string field,
                   const std::string& what);
  std::string file;
  std::string tensor;
  std::string field;
};

// The header length limit HF's reader enforces.
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

// One tensor of a safetensors file. `data` points into the mapping (or the caller's bytes
// for parse_safetensors) and is not necessarily aligned: copy with memcpy.
struct tensor_view {
  std::string name;
  model::dtype dt = model::dtype::bfloat16;
  std::vector<std::int64_t> shape;
  const std::byte* data = nullptr;
  std::uint64_t nbytes = 0;
  std::string file;             // the file (or label) it came from
  std::uint64_t file_offset = 0; // byte offset of `data` in the file: 8 + N + begin
  std::uint64_t numel() const;
};

// "[2, 3]".
std::string shape_string(const std::vector<std::int64_t>& shape);

class safetensors_file {
public:
  // Maps and validates `path`. Refuses anything but a regular file (directories, fifos,
  // devices) with the path named. Throws checkpoint_error.
  static std::unique_ptr<safetensors_file> open(const std::string& path);
  // Validates `size` bytes at `data` (not copied: they must outlive the result). `label`
  // stands for the file name in errors and views. Throws checkpoint_error.
  static std::unique_ptr<safetensors_file> parse(const std::byte* data, std::size_t size,
                                                 std::string label);

  ~safetensors_file();
  safetensors_file(const safetensors_file&) = delete;
  safetensors_file& operator=(const safetensors_file&) = delete;

  const std::string& path() const { return path_; }
  std::uint64_t file_size() const { return size_; }
  std::uint64_t header_bytes() const { return header_bytes_; }
  // Tensors in buffer order (ascending data offset).
  const std::vector<tensor_view>& tensors() const { return tensors_; }
  // nullptr when absent.
  const tensor_view* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

private:
  safetensors_file() = default;
  void load(const std::byte* data, std::size_t size);

  std::string path_;
  void* map_ = nullptr; // owned mapping (open), nullptr for parse
  std::size_t map_size_ = 0;
  std::uint64_t size_ = 0;
  std::uint64_t header_bytes_ = 0;
  std::vector<tensor_view> tensors_;
  std::unordered_map<std::string, std::size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

} // namespace refit::checkpoint
