// Test helpers: tiny safetensors files and HF model directories written by the test itself.
#pragma once

#include "runtime/checkpoint/safetensors.hpp"
#include "runtime/model/qwen3_moe.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace refit::testing {

// Runs `f`, expecting a checkpoint_error whose text contains every one of `parts`.
template <class F>
inline checkpoint::checkpoint_error expect_refused(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
  } catch (const checkpoint::checkpoint_error& e) {
    const std::string text = e.what();
    for (const auto& p : parts)
      EXPECT_NE(text.find(p), std::string::npos) << "'" << p << "' not in: " << text;
    return e;
  }
  ADD_FAILURE() << "expected a checkpoint_error";
  return checkpoint::checkpoint_error("", "", "", "");
}


struct tensor_spec {
  std::string name;
  std::string dtype; // "BF16", "F16", "F32"
  std::vector<std::int64_t> shape;
  std::string bytes;
};

inline std::string u64_le(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i)
    s[i] = static_cast<char>((v >> (8 * i)) & 0xffu);
  return s;
}

// 8-byte length + header (padded with spaces to a multiple of 8) + buffer.
inline std::string raw_safetensors(std::string header, const std::string& buffer) {
  while ((8 + header.size()) % 8 != 0)
    header += ' ';
  return u64_le(header.size()) + header + buffer;
}

// A well-formed file: tensors laid out back to back in the given order.
inline std::string make_safetensors(const std::vector<tensor_spec>& tensors,
                                    const nlohmann::json& metadata = nullptr) {
  nlohmann::json h = nlohmann::json::object();
  std::string buffer;
  for (const auto& t : tensors) {
    h[t.name] = {{"dtype", t.dtype},
                 {"shape", t.shape},
                 {"data_offsets", {buffer.size(), buffer.size() + t.bytes.size()}}};
    buffer += t.bytes;
  }
  if (!metadata.is_null())
    h["__metadata__"] = metadata;
  return raw_safetensors(h.dump(), buffer);
}

inline void write_file(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string temp_prefix() { return "refit-ckpt-" + std::to_string(::getpid()) + "-"; }

// Removes this process's directories from fresh_dir when the test program ends.
struct temp_dir_cleanup : ::testing::Environment {
  void TearDown() override {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(std::filesystem::temp_directory_path(), ec))
      if (e.path().filename().string().rfind(temp_prefix(), 0) == 0)
        std::filesystem::remove_all(e.path(), ec);
  }
};
inline ::testing::Environment* const temp_dir_cleanup_env =
  ::testing::AddGlobalTestEnvironment(new temp_dir_cleanup);

// A fresh directory under the test temp dir.
inline std::filesystem::path fresh_dir(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() / (temp_prefix() + name);
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p;
}

// Deterministic, name-dependent element bytes (every byte differs between tensors).
inline std::string pattern_bytes(const std::string& name, std::uint64_t nbytes) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : name)
    h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  std::string s(nbytes, '\0');
  for (std::uint64_t i = 0; i < nbytes; ++i) {
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    s[i] = static_cast<char>(h >> 56);
  }
  return s;
}

// bf16 bytes of finite values (random bit patterns could be NaN, which conversion would
// not round-trip bit-exactly).
inline std::string bf16_values(const std::string& name, std::uint64_t numel) {
  const std::string r = pattern_bytes(name, numel);
  std::string s(2 * numel, '\0');
  for (std::uint64_t i = 0; i < numel; ++i) {
    const float f = (static_cast<float>(static_cast<unsigned char>(r[i])) - 128.0f) / 64.0f;
    const std::uint16_t b = model::float_to_bf16(f);
    std::memcpy(&s[2 * i], &b, 2);
  }
  return s;
}

} // namespace refit::testing
