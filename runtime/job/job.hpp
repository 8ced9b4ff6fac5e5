// The main job's generation batch and parity check, shared by refit-coordinator and
// `refit-bench soak`: both sample the recipe's prompts and score the samples with the
// trainer's own unsharded reference computed from its full (synthetic) weights.
#pragma once

#include <cstdint>
#include <vector>

#include "messages/types.hpp"
#include "runtime/config/config.hpp"
#include "runtime/inference/sampling.hpp"
#include "runtime/job/text.hpp"

namespace refit::job {

// job.* sampling settings, with `seed` as the sampling seed.
inference::sampling_config sampling(const config::job_config& job, std::uint64_t seed);

// The job's prompts, tokenized by `codec`, with `sc` as sampling parameters and the
// codec's stop ids as stop tokens.
generate_request batch(const config::job_config& job, const inference::sampling_config& sc,
                       const text_codec& codec);

// Max |runtime logprob - trainer reference logprob| over every sampled token, the reference
// computed from the trainer's full weights at optimizer `step` with the same processing.
// Infinity when a sample's logprobs cannot be matched (count mismatch or NaN).
double parity_max_abs(const config::refit_config& cfg, std::uint64_t step,
                      const std::vector<sample>& samples, const inference::sampling_config& sc);

} // namespace refit::job
