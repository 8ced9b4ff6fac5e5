// The byte-exact verifier's expected resident digests (sync_coordinator.hpp): predicted from
// the synthetic weights, or summed from the digest terms registered-weight ranks report.
#include "actors/sync_coordinator.hpp"

#include <stdexcept>

#include "runtime/device/device.hpp"
#include "runtime/model/digest.hpp"
#include "runtime/publication/backend.hpp"

namespace refit {

std::vector<receipt> expected_resident_checksums(const model::model_config& model,
                                                 std::uint32_t tp,
                                                 const model::synthetic_weights& weights,
                                                 std::uint64_t step, const std::string& device) {
  const auto on = device::parse(device, "verifier device");
  const auto digests = publication::expected_resident_digests(model, tp, weights, step, on);
  const model::tp_layout layout(model, tp);
  const auto& residents = layout.residents();
  std::vector<receipt> out(tp);
  for (std::uint32_t r = 0; r < tp; ++r) {
    out[r].tp_rank = r;
    for (std::size_t i = 0; i < residents.size(); ++i)
      out[r].checksums.push_back(
        tensor_checksum{residents[i].name, model::digest_hex(digests[r][i])});
  }
  return out;
}

std::vector<receipt> expected_from_terms(const model::model_config& model, std::uint32_t tp,
                                         const std::vector<rank_report>& reports) {
  const model::tp_layout layout(model, tp);
  const auto& residents = layout.residents();
  std::vector<std::uint64_t> sums(std::size_t{tp} * residents.size(), 0);
  for (const auto& r : reports) {
    if (r.digest_terms.size() != sums.size())
      throw std::runtime_error("rank " + std::to_string(r.rank) + " reported "
                               + std::to_string(r.digest_terms.size()) + " digest terms, "
                               + std::to_string(tp) + " TP workers hold "
                               + std::to_string(sums.size()) + " resident tensors in all");
    for (std::size_t i = 0; i < sums.size(); ++i)
      sums[i] += r.digest_terms[i];
  }
  std::vector<receipt> out(tp);
  for (std::uint32_t t = 0; t < tp; ++t) {
    out[t].tp_rank = t;
    for (std::size_t i = 0; i < residents.size(); ++i) {
      const auto n = residents[i].nbytes / model::dtype_size(residents[i].dt);
      out[t].checksums.push_back(tensor_checksum{
        residents[i].name,
        model::digest_hex(model::zero_digest(n) + sums[std::size_t{t} * residents.size() + i])});
    }
  }
  return out;
}

} // namespace refit
