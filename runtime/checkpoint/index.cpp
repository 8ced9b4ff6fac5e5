#include "runtime/checkpoint/index.hpp"

#include "runtime/checkpoint/json_strict.hpp"

#include <map>

#include <sys/stat.h>

namespace refit::checkpoint {

namespace {

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// A shard must be a plain file name inside the model directory.
void check_shard_name(const std::string& index, const std::string& tensor,
                      const std::string& shard) {
  if (shard.empty() || shard.find('/') != std::string::npos
      || shard.find('\\') != std::string::npos || shard.find('\0') != std::string::npos
      || shard.find("..") != std::string::npos || shard == ".")
    throw checkpoint_error(index, tensor, "weight_map",
                           "shard '" + shard + "' is not a plain file name inside the directory");
}

} // namespace

void checkpoint_files::add_file(std::unique_ptr<safetensors_file> f) {
  for (const auto& t : f->tensors()) {
    const auto [it, fresh] = by_name_.emplace(t.name, &t);
    if (!fresh)
      throw checkpoint_error(f->path(), t.name, "",
                             "the same tensor is also in " + it->second->file);
    tensors_.push_back(&t);
  }
  files_.push_back(std::move(f));
}

checkpoint_files checkpoint_files::open(const std::string& dir_in) {
  checkpoint_files c;
  c.dir_ = dir_in;
  while (c.dir_.size() > 1 && c.dir_.back() == '/')
    c.dir_.pop_back();
  struct stat st {};
  if (::stat(c.dir_.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw checkpoint_error(c.dir_, "", "", "not a model directory");
  const std::string single = c.dir_ + "/" + single_file_name;
  const std::string index = c.dir_ + "/" + index_file_name;
  const bool has_single = exists(single);
  const bool has_index = exists(index);
  if (has_single && has_index)
    throw checkpoint_error(c.dir_, "", "",
                           std::string("both ") + single_file_name + " and " + index_file_name
                             + " are present: which one holds the weights is ambiguous");
  if (!has_single && !has_index)
    throw checkpoint_error(c.dir_, "", "",
                           std::string("no ") + single_file_name + " or " + index_file_name);
  if (has_single) {
    c.add_file(safetensors_file::open(single));
    return c;
  }

  c.index_path_ = index;
  const auto j = read_json_file(index, 3);
  if (!j.is_object())
    throw checkpoint_error(index, "", "", "must be a JSON object");
  const auto wm = j.find("weight_map");
  if (wm == j.end() || !wm->is_object())
    throw checkpoint_error(index, "", "weight_map", "missing or not an object");
  const auto md = j.find("metadata");
  if (md != j.end() && !md->is_object() && !md->is_null())
    throw checkpoint_error(index, "", "metadata", "must be an object");
  // shard -> tensors the index places there
  std::map<std::string, std::vector<std::string>> shards;
  for (const auto& item : wm->items()) {
    if (!item.value().is_string())
      throw checkpoint_error(index, item.key(), "weight_map", "shard must be a string");
    const std::string shard = item.value().get<std::string>();
    check_shard_name(index, item.key(), shard);
    shards[shard].push_back(item.key());
  }
  if (shards.empty())
    throw checkpoint_error(index, "", "weight_map", "lists no tensors");
  for (const auto& [shard, names] : shards) {
    const std::string path = c.dir_ + "/" + shard;
    if (!exists(path))
      throw checkpoint_error(index, names.front(), "weight_map",
                             "shard file '" + shard + "' is missing (" + path + ")");
    auto f = safetensors_file::open(path);
    for (const auto& name : names)
      if (f->find(name) == nullptr)
        throw checkpoint_error(index, name, "weight_map",
                               "listed in shard '" + shard + "', which does not hold it ("
                                 + path + ")");
    for (const auto& t : f->tensors()) {
      const auto listed = wm->find(t.name);
      if (listed == wm->end())
        throw checkpoint_error(path, t.name, "",
                               std::string("not listed in ") + index_file_name);
      if (listed->get<std::string>() != shard)
        throw checkpoint_error(path, t.name, "",
                               std::string("the index places it in shard '")
                                 + listed->get<std::string>() + "'");
    }
    c.add_file(std::move(f));
  }
  return c;
}

const tensor_view* checkpoint_files::find(const std::string& name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

} // namespace refit::checkpoint
