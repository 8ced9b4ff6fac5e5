#include "runtime/tokenizer/json_file.hpp"

#include <cstdint>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sys/stat.h>

namespace refit::tokenizer {

namespace {

std::string join(const std::string& file, const std::string& field, const std::string& msg) {
  std::string out;
  if (!file.empty())
    out += file + ": ";
  if (!field.empty())
    out += field + ": ";
  return out + msg;
}

const char* kind_of(mode_t m) {
  if (S_ISDIR(m))
    return "a directory";
  if (S_ISCHR(m))
    return "a character device";
  if (S_ISBLK(m))
    return "a block device";
  if (S_ISFIFO(m))
    return "a fifo";
  if (S_ISSOCK(m))
    return "a socket";
  return "not a regular file";
}

std::string child_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

} // namespace

tokenizer_error::tokenizer_error(std::string f, std::string fld, const std::string& message)
    : std::runtime_error(join(f, fld, message)), file(std::move(f)), field(std::move(fld)) {}

std::string read_regular_file(const std::filesystem::path& path, std::uintmax_t cap) {
  const std::string name = path.string();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw tokenizer_error(name, "", std::string("cannot open: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    throw tokenizer_error(name, "", std::string("is ") + kind_of(st.st_mode) +
                                        ", expected a regular file");
  if (static_cast<std::uintmax_t>(st.st_size) > cap)
    throw tokenizer_error(name, "", "file is " + std::to_string(st.st_size) +
                                        " bytes, over the cap of " + std::to_string(cap));
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw tokenizer_error(name, "", std::string("cannot open: ") + std::strerror(errno));
  std::string bytes(static_cast<std::size_t>(st.st_size), '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (in.gcount() != static_cast<std::streamsize>(bytes.size()) || in.peek() != EOF)
    throw tokenizer_error(name, "", "file changed size while being read");
  return bytes;
}

nlohmann::json parse_json(std::string_view bytes, const std::string& file) {
  try {
    return nlohmann::json::parse(bytes.begin(), bytes.end());
  } catch (const nlohmann::json::parse_error& e) {
    throw tokenizer_error(file, "", "invalid JSON at byte offset " +
                                        std::to_string(e.byte > 0 ? e.byte - 1 : 0) + ": " +
                                        e.what());
  } catch (const nlohmann::json::exception& e) { // e.g. a number out of range
    throw tokenizer_error(file, "", std::string("invalid JSON: ") + e.what());
  }
}

bool json_node::has(const char* key) const {
  return value_->is_object() && value_->contains(key);
}

json_node json_node::at(const char* key) const {
  if (!value_->is_object())
    fail("expected an object");
  auto it = value_->find(key);
  if (it == value_->end())
    fail_at(key, "missing field");
  return json_node(*it, child_path(path_, key), *file_);
}

std::optional<json_node> json_node::find(const char* key) const {
  if (!value_->is_object())
    fail("expected an object");
  auto it = value_->find(key);
  if (it == value_->end() || it->is_null())
    return std::nullopt;
  return json_node(*it, child_path(path_, key), *file_);
}

json_node json_node::at(std::size_t index) const {
  if (!value_->is_array() || index >= value_->size())
    fail("expected an array with an element " + std::to_string(index));
  return json_node((*value_)[index], path_ + "[" + std::to_string(index) + "]", *file_);
}

std::size_t json_node::size() const {
  if (!value_->is_array() && !value_->is_object())
    fail("expected an array or an object");
  return value_->size();
}

const std::string& json_node::str() const {
  if (!value_->is_string())
    fail(std::string("expected a string, got ") + value_->type_name());
  return value_->get_ref<const std::string&>();
}

bool json_node::boolean() const {
  if (!value_->is_boolean())
    fail(std::string("expected a boolean, got ") + value_->type_name());
  return value_->get<bool>();
}

std::int64_t json_node::integer() const {
  if (value_->is_number_unsigned()) {
    auto v = value_->get<std::uint64_t>();
    if (v > static_cast<std::uint64_t>(INT64_MAX))
      fail("integer out of range");
    return static_cast<std::int64_t>(v);
  }
  if (!value_->is_number_integer())
    fail(std::string("expected an integer, got ") + value_->type_name());
  return value_->get<std::int64_t>();
}

bool json_node::flag(const char* key, bool dflt) const {
  auto n = find(key);
  return n ? n->boolean() : dflt;
}

std::string json_node::string_or_empty(const char* key) const {
  auto n = find(key);
  return n ? n->str() : std::string();
}

void json_node::fail(const std::string& message) const {
  throw tokenizer_error(*file_, path_, message);
}

void json_node::fail_at(const char* key, const std::string& message) const {
  throw tokenizer_error(*file_, child_path(path_, key), message);
}

} // namespace refit::tokenizer
