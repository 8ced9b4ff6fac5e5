// A model directory's weights: `model.safetensors`, or `model.safetensors.index.json`
// (`{"metadata": {...}, "weight_map": {tensor: shard file}}`) and its shards, every file
// mapped zero-copy (safetensors.hpp).
//
// Refused (checkpoint_error naming the file, tensor and field): neither or both of the two
// forms present; an index that is not a JSON object with a weight_map of strings; a shard name
// that is not a plain file name inside the directory (empty, containing '/' or '..'); a
// missing or invalid shard file; a tensor the index places in a shard that does not hold it;
// a tensor in a shard that the index does not list (or lists in another shard); the same
// tensor in two shards.
#pragma once

#include "runtime/checkpoint/safetensors.hpp"

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace refit::checkpoint {

inline constexpr const char* single_file_name = "model.safetensors";
inline constexpr const char* index_file_name = "model.safetensors.index.json";

class checkpoint_files {
public:
  // Opens the weights of model directory `dir`. Throws checkpoint_error.
  static checkpoint_files open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  // The index file's path, empty for a one-file model.
  const std::string& index_path() const { return index_path_; }
  // The mapped files, in shard-name order.
  const std::vector<std::unique_ptr<safetensors_file>>& files() const { return files_; }
  // Every tensor once (file order, then offset order). Views stay valid while this lives.
  const std::vector<const tensor_view*>& tensors() const { return tensors_; }
  // nullptr when absent.
  const tensor_view* find(const std::string& name) const;

private:
  void add_file(std::unique_ptr<safetensors_file> f);

  std::string dir_;
  std::string index_path_;
  std::vector<std::unique_ptr<safetensors_file>> files_;
  std::vector<const tensor_view*> tensors_;
  std::unordered_map<std::string, const tensor_view*> by_name_;
};

} // namespace refit::checkpoint
