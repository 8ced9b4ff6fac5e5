#include "runtime/bench/source_compare.hpp"

#include <algorithm>
#include <map>
#include <stdexcept>

namespace refit::bench {

namespace {

using json = nlohmann::ordered_json;

double median_of(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  const std::size_t n = xs.size();
  return n % 2 ? xs[n / 2] : (xs[n / 2 - 1] + xs[n / 2]) / 2;
}

// Linear-interpolated quantile q of sorted xs.
double quantile(const std::vector<double>& sorted, double q) {
  if (sorted.size() == 1)
    return sorted[0];
  const double at = q * static_cast<double>(sorted.size() - 1);
  const std::size_t lo = static_cast<std::size_t>(at);
  const std::size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (at - static_cast<double>(lo));
}

json summary(const std::vector<double>& xs) {
  std::vector<double> s = xs;
  std::sort(s.begin(), s.end());
  const double med = median_of(s);
  json j;
  j["publications"] = s.size();
  j["seconds_median"] = med;
  j["seconds_min"] = s.front();
  j["seconds_max"] = s.back();
  j["seconds_q1"] = quantile(s, 0.25);
  j["seconds_q3"] = quantile(s, 0.75);
  // Relative spread: (q3 - q1) / median, the noise floor a difference must beat.
  j["relative_iqr"] = med > 0 ? (quantile(s, 0.75) - quantile(s, 0.25)) / med : 0.0;
  j["seconds_all"] = xs;
  return j;
}

} // namespace

json compare_sources(const std::vector<source_sample>& samples, double tolerance) {
  std::map<std::string, std::vector<double>> all;
  std::map<std::string, std::map<unsigned, std::vector<double>>> by_round;
  std::map<std::string, std::uint64_t> device_peak;
  for (const auto& s : samples) {
    all[s.source].push_back(s.seconds);
    by_round[s.source][s.round].push_back(s.seconds);
    if (s.device_extra)
      device_peak[s.source] = std::max(device_peak[s.source], *s.device_extra);
  }
  for (const char* src : {"synthetic", "registered"})
    if (all[src].empty())
      throw std::invalid_argument(std::string("compare_sources: no ") + src + " publication");
  json out;
  for (const char* src : {"synthetic", "registered"}) {
    json j = summary(all[src]);
    json rounds = json::array();
    for (const auto& [round, xs] : by_round[src])
      rounds.push_back(median_of(xs));
    j["round_medians"] = rounds;
    if (device_peak.count(src))
      j["peak_extra_device_bytes"] = device_peak[src];
    out[src] = j;
  }
  const double ratio = median_of(all["registered"]) / median_of(all["synthetic"]);
  json round_ratios = json::array();
  unsigned within = 0, outside = 0;
  for (const auto& [round, reg] : by_round["registered"]) {
    auto syn = by_round["synthetic"].find(round);
    if (syn == by_round["synthetic"].end())
      continue;
    const double r = median_of(reg) / median_of(syn->second);
    round_ratios.push_back(r);
    (r <= 1.0 + tolerance ? within : outside) += 1;
  }
  out["ratio"] = ratio;
  out["ratio_meaning"] = "registered median seconds / synthetic median seconds over every "
                         "publication of the run (1.03: registered 3% slower)";
  out["round_ratios"] = round_ratios;
  if (!round_ratios.empty()) {
    std::vector<double> rr = round_ratios.get<std::vector<double>>();
    out["round_ratio_min"] = *std::min_element(rr.begin(), rr.end());
    out["round_ratio_max"] = *std::max_element(rr.begin(), rr.end());
  }
  out["tolerance"] = tolerance;
  out["within_tolerance"] = ratio <= 1.0 + tolerance;
  const char* verdict = outside == 0 && within > 0  ? "within"
                        : within == 0 && outside > 0 ? "outside"
                                                     : "undetermined";
  out["verdict"] = verdict;
  out["verdict_rule"] = "within: every round's registered median is <= (1 + tolerance) x that "
                        "round's synthetic median; outside: every round's is above; "
                        "undetermined: the rounds disagree";
  return out;
}

} // namespace refit::bench
