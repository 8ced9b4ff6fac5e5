#include "runtime/checkpoint/json_strict.hpp"

#include <fstream>
#include <iterator>
#include <set>
#include <vector>

#include <sys/stat.h>

namespace refit::checkpoint {

using json = nlohmann::json;

json parse_json_strict(const char* begin, const char* end, const std::string& file,
                       int max_depth, bool root_keys_are_tensors) {
  std::vector<std::set<std::string>> keys; // one set per open object
  std::vector<std::string> path;           // the key of each open level
  std::string tensor;                      // the last root key (root_keys_are_tensors)
  const auto where = [&] {
    std::string s;
    for (std::size_t i = root_keys_are_tensors ? 1 : 0; i < path.size(); ++i)
      s += (s.empty() ? "" : ".") + path[i];
    return s;
  };
  const auto on_event = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= max_depth)
          throw checkpoint_error(file, tensor, where(),
                                 "JSON nested deeper than " + std::to_string(max_depth)
                                   + " levels");
        if (event == json::parse_event_t::object_start)
          keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty())
          keys.pop_back();
        break;
      case json::parse_event_t::key: {
        const std::string& k = parsed.get_ref<const std::string&>();
        path.resize(static_cast<std::size_t>(depth > 0 ? depth - 1 : 0));
        if (depth == 1 && root_keys_are_tensors)
          tensor = k;
        if (!keys.empty() && !keys.back().insert(k).second) {
          if (depth == 1 && root_keys_are_tensors)
            throw checkpoint_error(file, k, "header", "duplicate tensor name");
          path.push_back(k);
          throw checkpoint_error(file, tensor, where(), "duplicate key");
        }
        path.push_back(k);
        break;
      }
      default: break;
    }
    return true;
  };
  try {
    return json::parse(begin, end, on_event);
  } catch (const json::exception& e) {
    throw checkpoint_error(file, "", root_keys_are_tensors ? "header" : "",
                           std::string("not valid JSON: ") + e.what());
  }
}

json read_json_file(const std::string& path, int max_depth) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw checkpoint_error(path, "", "", "missing");
  if (!S_ISREG(st.st_mode))
    throw checkpoint_error(path, "", "", "not a regular file");
  if (static_cast<std::uint64_t>(st.st_size) > max_header_bytes)
    throw checkpoint_error(path, "", "", "larger than " + std::to_string(max_header_bytes)
                                           + " bytes");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw checkpoint_error(path, "", "", "cannot read");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_json_strict(text.data(), text.data() + text.size(), path, max_depth, false);
}

} // namespace refit::checkpoint
