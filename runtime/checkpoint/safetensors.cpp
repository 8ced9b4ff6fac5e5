#include "runtime/checkpoint/safetensors.hpp"

#include "runtime/checkpoint/json_strict.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace refit::checkpoint {

namespace {

std::string error_text(const std::string& file, const std::string& tensor,
                       const std::string& field, const std::string& what) {
  std::string s = file + ": ";
  if (!tensor.empty())
    s += "tensor '" + tensor + "': ";
  if (!field.empty())
    s += field + ": ";
  return s + what;
}

} // namespace

checkpoint_error::checkpoint_error(std::string file_, std::string tensor_, std::string field_,
                                   const std::string& what)
  : std::runtime_error(error_text(file_, tensor_, field_, what)), file(std::move(file_)),
    tensor(std::move(tensor_)), field(std::move(field_)) {}

std::uint64_t tensor_view::numel() const {
  std::uint64_t n = 1;
  for (auto d : shape)
    n *= static_cast<std::uint64_t>(d); // validated at load: no overflow
  return n;
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

namespace {

using json = nlohmann::json;

// The safetensors dtype names and their sizes; refit reads BF16, F16 and F32.
struct st_dtype {
  const char* name;
  bool supported;
  model::dtype dt;
};
constexpr st_dtype known_dtypes[] = {
  {"BF16", true, model::dtype::bfloat16}, {"F16", true, model::dtype::float16},
  {"F32", true, model::dtype::float32},   {"F64", false, {}},
  {"F8_E4M3", false, {}},                 {"F8_E5M2", false, {}},
  {"F8_E8M0", false, {}},                 {"F6_E2M3", false, {}},
  {"F6_E3M2", false, {}},                 {"F4", false, {}},
  {"BOOL", false, {}},                    {"U8", false, {}},
  {"I8", false, {}},                      {"I16", false, {}},
  {"U16", false, {}},                     {"I32", false, {}},
  {"U32", false, {}},                     {"I64", false, {}},
  {"U64", false, {}},                     {"C64", false, {}},
};

struct entry {
  std::size_t index; // into tensors
  std::uint64_t begin;
  std::uint64_t end;
};

std::uint64_t read_u64_le(const std::byte* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i)
    v = (v << 8) | static_cast<std::uint64_t>(p[i]);
  return v;
}

tensor_view parse_entry(const std::string& file, const std::string& name, const json& info,
                        std::uint64_t buffer_size, std::uint64_t& begin, std::uint64_t& end) {
  if (!info.is_object())
    throw checkpoint_error(file, name, "header",
                           std::string("entry must be an object (got ") + info.type_name() + ")");
  for (const auto& item : info.items())
    if (item.key() != "dtype" && item.key() != "shape" && item.key() != "data_offsets")
      throw checkpoint_error(file, name, item.key(), "unknown field");
  tensor_view t;
  t.name = name;
  t.file = file;

  const auto dtype_it = info.find("dtype");
  if (dtype_it == info.end() || !dtype_it->is_string())
    throw checkpoint_error(file, name, "dtype", "missing or not a string");
  const std::string& dname = dtype_it->get_ref<const std::string&>();
  const st_dtype* known = nullptr;
  for (const auto& d : known_dtypes)
    if (dname == d.name)
      known = &d;
  if (known == nullptr || !known->supported)
    throw checkpoint_error(file, name, "dtype",
                           std::string("dtype '") + dname + "' "
                             + (known ? "not supported" : "unknown") + " (BF16, F16, F32)");
  t.dt = known->dt;

  const auto shape_it = info.find("shape");
  if (shape_it == info.end() || !shape_it->is_array())
    throw checkpoint_error(file, name, "shape", "missing or not an array");
  std::uint64_t numel = 1;
  for (const auto& d : *shape_it) {
    if (!d.is_number_unsigned()
        || d.get<std::uint64_t>() > static_cast<std::uint64_t>(
             std::numeric_limits<std::int64_t>::max()))
      throw checkpoint_error(file, name, "shape",
                             "dimension " + d.dump() + " is not a non-negative integer");
    const auto dim = d.get<std::uint64_t>();
    if (__builtin_mul_overflow(numel, dim, &numel))
      throw checkpoint_error(file, name, "shape",
                             "element count of " + shape_it->dump() + " overflows 64 bits");
    t.shape.push_back(static_cast<std::int64_t>(dim));
  }
  std::uint64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, std::uint64_t{model::dtype_size(t.dt)}, &nbytes))
    throw checkpoint_error(file, name, "shape",
                           "byte count of " + shape_it->dump() + " overflows 64 bits");
  t.nbytes = nbytes;

  const auto off_it = info.find("data_offsets");
  if (off_it == info.end() || !off_it->is_array() || off_it->size() != 2
      || !(*off_it)[0].is_number_unsigned() || !(*off_it)[1].is_number_unsigned())
    throw checkpoint_error(file, name, "data_offsets",
                           "must be [begin, end] of non-negative integers (got "
                             + (off_it == info.end() ? std::string("nothing") : off_it->dump())
                             + ")");
  begin = (*off_it)[0].get<std::uint64_t>();
  end = (*off_it)[1].get<std::uint64_t>();
  if (begin > end)
    throw checkpoint_error(file, name, "data_offsets",
                           "begin " + std::to_string(begin) + " > end " + std::to_string(end));
  if (end - begin != nbytes)
    throw checkpoint_error(file, name, "data_offsets",
                           "[" + std::to_string(begin) + ", " + std::to_string(end) + ") holds "
                             + std::to_string(end - begin) + " bytes, but shape "
                             + shape_string(t.shape) + " of " + dname + " needs "
                             + std::to_string(nbytes));
  if (end > buffer_size)
    throw checkpoint_error(file, name, "data_offsets",
                           "end " + std::to_string(end) + " is beyond the data buffer ("
                             + std::to_string(buffer_size) + " bytes)");
  return t;
}

} // namespace

void safetensors_file::load(const std::byte* data, std::size_t size) {
  const std::string& file = path_;
  size_ = size;
  if (size < 8)
    throw checkpoint_error(file, "", "header length",
                           "file is " + std::to_string(size)
                             + " bytes, shorter than the 8-byte header length");
  const std::uint64_t n = read_u64_le(data);
  if (n > max_header_bytes)
    throw checkpoint_error(file, "", "header length",
                           std::to_string(n) + " bytes exceeds the limit of "
                             + std::to_string(max_header_bytes));
  if (n > size - 8)
    throw checkpoint_error(file, "", "header length",
                           std::to_string(n) + " bytes is beyond the end of the file ("
                             + std::to_string(size) + " bytes)");
  header_bytes_ = n;
  const auto* text = reinterpret_cast<const char*>(data + 8);
  // root {  tensor {  shape [ ] } }: 3 levels.
  const json header = parse_json_strict(text, text + n, file, 3, true);
  if (!header.is_object())
    throw checkpoint_error(file, "", "header",
                           std::string("must be a JSON object (got ") + header.type_name() + ")");

  const std::uint64_t buffer_size = size - 8 - n;
  const std::byte* buffer = data + 8 + n;
  std::vector<entry> entries;
  for (const auto& item : header.items()) {
    if (item.key() == "__metadata__") {
      if (item.value().is_null())
        continue;
      if (!item.value().is_object())
        throw checkpoint_error(file, "", "__metadata__", "must be an object of strings");
      for (const auto& m : item.value().items()) {
        if (!m.value().is_string())
          throw checkpoint_error(file, "", "__metadata__." + m.key(),
                                 std::string("value must be a string (got ")
                                   + m.value().type_name() + ")");
        metadata_.emplace(m.key(), m.value().get<std::string>());
      }
      continue;
    }
    std::uint64_t begin = 0, end = 0;
    tensors_.push_back(parse_entry(file, item.key(), item.value(), buffer_size, begin, end));
    tensors_.back().data = buffer + begin;
    tensors_.back().file_offset = 8 + n + begin;
    entries.push_back({tensors_.size() - 1, begin, end});
  }

  // The tensors must tile the buffer: sorted by offset, each begins where the last ended.
  std::sort(entries.begin(), entries.end(), [](const entry& a, const entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t covered = 0;
  const tensor_view* last = nullptr;
  for (const auto& e : entries) {
    const tensor_view& t = tensors_[e.index];
    if (e.begin < covered)
      throw checkpoint_error(file, t.name, "data_offsets",
                             "[" + std::to_string(e.begin) + ", " + std::to_string(e.end)
                               + ") overlaps tensor '" + last->name + "' (ends at "
                               + std::to_string(covered) + ")");
    if (e.begin > covered)
      throw checkpoint_error(file, t.name, "data_offsets",
                             "hole: bytes [" + std::to_string(covered) + ", "
                               + std::to_string(e.begin) + ") of the data buffer before it "
                               + "belong to no tensor");
    covered = e.end;
    last = &t;
  }
  if (covered != buffer_size)
    throw checkpoint_error(file, last ? last->name : std::string(), "data_offsets",
                           "the tensors cover " + std::to_string(covered)
                             + " bytes of a data buffer of " + std::to_string(buffer_size)
                             + " (file size " + std::to_string(size) + " != 8 + "
                             + std::to_string(n) + " + " + std::to_string(covered) + ")");

  std::vector<tensor_view> ordered;
  ordered.reserve(entries.size());
  for (const auto& e : entries)
    ordered.push_back(std::move(tensors_[e.index]));
  tensors_ = std::move(ordered);
  by_name_.reserve(tensors_.size());
  for (std::size_t i = 0; i < tensors_.size(); ++i)
    by_name_.emplace(tensors_[i].name, i);
}

std::unique_ptr<safetensors_file> safetensors_file::parse(const std::byte* data,
                                                          std::size_t size, std::string label) {
  std::unique_ptr<safetensors_file> f(new safetensors_file());
  f->path_ = std::move(label);
  f->load(data, size);
  return f;
}

std::unique_ptr<safetensors_file> safetensors_file::open(const std::string& path) {
  std::unique_ptr<safetensors_file> f(new safetensors_file());
  f->path_ = path;
  // O_NONBLOCK: opening a fifo must not wait for a writer before we can refuse it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0)
    throw checkpoint_error(path, "", "", std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw checkpoint_error(path, "", "", std::string("cannot stat: ") + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a fifo"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "not a regular file";
    throw checkpoint_error(path, "", "", std::string("not a regular file (") + kind + ")");
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    f->load(nullptr, static_cast<std::size_t>(size)); // throws the short-file error
  }
  void* map = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED)
    throw checkpoint_error(path, "", "", std::string("cannot mmap: ") + std::strerror(map_errno));
  f->map_ = map;
  f->map_size_ = static_cast<std::size_t>(size);
  f->load(static_cast<const std::byte*>(map), f->map_size_);
  return f;
}

safetensors_file::~safetensors_file() {
  if (map_ != nullptr)
    ::munmap(map_, map_size_);
}

const tensor_view* safetensors_file::find(const std::string& name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

} // namespace refit::checkpoint
