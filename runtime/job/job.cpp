#include "runtime/job/job.hpp"

#include <cmath>
#include <limits>

#include "runtime/inference/reference.hpp"
#include "runtime/publication/shard.hpp"

namespace refit::job {

inference::sampling_config sampling(const config::job_config& job, std::uint64_t seed) {
  inference::sampling_config sc;
  sc.n = job.n;
  sc.max_tokens = job.max_tokens;
  sc.temperature = job.temperature;
  sc.top_k = job.top_k;
  sc.top_p = job.top_p;
  sc.seed = seed;
  sc.max_prompt_length = job.max_prompt_length;
  return sc;
}

generate_request batch(const config::job_config& job, const inference::sampling_config& sc,
                       const text_codec& codec) {
  generate_request req;
  for (const auto& p : job.prompts)
    req.prompts.push_back(codec.encode(p));
  req.params = {sc.n,     sc.max_tokens, sc.temperature,    sc.top_k,
                sc.top_p, sc.seed,       codec.stop_ids(),  sc.max_prompt_length};
  return req;
}

double parity_max_abs(const config::refit_config& cfg, std::uint64_t step,
                      const std::vector<sample>& samples, const inference::sampling_config& sc) {
  std::vector<inference::scored_sequence> seqs;
  for (const auto& s : samples)
    seqs.push_back({s.prompt_token_ids, s.token_ids});
  auto params = model::expected_key_stream(cfg.model);
  const model::synthetic_weights w = config::trainer_weights(cfg);
  std::vector<std::vector<std::byte>> full;
  std::vector<const std::byte*> ptrs;
  full.reserve(params.size());
  for (const auto& p : params) {
    full.push_back(publication::full_tensor(p, w, step));
    ptrs.push_back(full.back().data());
  }
  auto ref = inference::reference_logprobs(cfg.model, params, ptrs, seqs, sc);
  constexpr double unmatched = std::numeric_limits<double>::infinity();
  double worst = 0;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& lp = samples[i].logprobs;
    if (i >= ref.size() || ref[i].size() != lp.size())
      return unmatched;
    for (std::size_t t = 0; t < lp.size(); ++t) {
      double d = std::fabs(double(lp[t]) - ref[i][t]);
      if (std::isnan(d))
        return unmatched;
      worst = std::max(worst, d);
    }
  }
  return worst;
}

} // namespace refit::job
