#include "runtime/tokenizer/tokenize_bench.hpp"

#include <cstdint>
#include <chrono>
#include <cstdio>

namespace refit::tokenizer {

nlohmann::json run_tokenize_bench(const tokenizer& tok, const std::vector<std::string>& texts,
                                  double min_seconds) {
  using clock = std::chrono::steady_clock;
  std::size_t bytes = 0;
  for (const auto& t : texts)
    bytes += t.size();
  std::uint64_t digest = 1469598103934665603ull;
  std::size_t passes = 0, tokens = 0;
  auto t0 = clock::now();
  double secs = 0;
  do {
    std::uint64_t h = 1469598103934665603ull;
    std::size_t n = 0;
    for (const auto& t : texts) {
      auto ids = tok.encode(t);
      n += ids.size();
      for (auto id : ids) {
        h ^= static_cast<std::uint32_t>(id);
        h *= 1099511628211ull;
      }
      h ^= 0xFFFFFFFFull; // text boundary
      h *= 1099511628211ull;
    }
    if (passes == 0) {
      digest = h;
      tokens = n;
    } else if (h != digest) {
      throw tokenizer_error(tok.source(), "", "encode gave different ids on a repeated pass");
    }
    ++passes;
    secs = std::chrono::duration<double>(clock::now() - t0).count();
  } while (secs < min_seconds);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(digest));
  return {{"mb_per_s", secs > 0 ? static_cast<double>(bytes) * passes / secs / 1e6 : 0.0},
          {"bytes_per_pass", bytes},
          {"passes", passes},
          {"seconds", secs},
          {"tokens_per_pass", tokens},
          {"ids_digest", hex},
          {"threads", 1}};
}

} // namespace refit::tokenizer
