// refit-bench publish --source registered: the registered-vs-synthetic comparison of one run.
// Each round publishes --iterations times from the synthetic shard store, then --iterations
// times from the registered FSDP2 memory, on the same runtime; this turns the timed
// publications into medians, spreads and ratios, and says honestly whether "registered within
// `tolerance` of synthetic" holds, fails, or cannot be told apart from the noise.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace refit::bench {

struct source_sample {
  std::string source; // "synthetic" or "registered"
  unsigned round = 0;
  double seconds = 0; // publication_result.seconds
  std::optional<std::uint64_t> device_extra; // GPU: peak extra device bytes in it
};

// {synthetic: {...}, registered: {...}, ratio, round_ratios, verdict, ...}. ratio is
// registered median seconds / synthetic median seconds (1.03 = registered 3% slower).
// verdict: "within" when every round's ratio is <= 1 + tolerance, "outside" when every
// round's ratio is above it, else "undetermined" (the rounds disagree: noise larger than the
// difference). Throws std::invalid_argument when a source has no sample.
nlohmann::ordered_json compare_sources(const std::vector<source_sample>& samples,
                                       double tolerance = 0.05);

} // namespace refit::bench
