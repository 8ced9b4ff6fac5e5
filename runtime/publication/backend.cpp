#include "runtime/publication/backend.hpp"

#include <cstring>
#include <stdexcept>

#include "runtime/model/digest.hpp"
#include "runtime/publication/host_buffer.hpp"
#include "runtime/publication/shard.hpp"

#if REFIT_HAVE_CUDA
#include "runtime/cuda/cuda.hpp"
#include "runtime/cuda/nccl_collective.hpp"
#endif

namespace refit::publication {

namespace {

[[noreturn, maybe_unused]] void no_cuda(const device::spec& device, const std::string& what) {
  throw std::invalid_argument(device::to_string(device) + ": " + what
                              + " on CUDA devices needs a build with REFIT_CUDA=ON");
}

class host_pool final : public buffer_pool {
public:
  host_pool(std::uint32_t count, std::uint64_t bytes) : pool_(count, bytes) {}
  std::uint32_t count() const override { return pool_.count(); }
  std::uint64_t bytes() const override { return pool_.bytes(); }
  std::byte* data(std::uint32_t i) const override { return pool_.data(i); }
  std::string handle(std::uint32_t i) const override { return pool_.handle(i); }

private:
  host_buffer_pool pool_;
};

#if REFIT_HAVE_CUDA
class cuda_pool final : public buffer_pool {
public:
  cuda_pool(int ordinal, std::uint32_t count, std::uint64_t bytes) : bytes_(bytes) {
    for (std::uint32_t i = 0; i < count; ++i) {
      buffers_.emplace_back(ordinal, bytes, "packed buffer " + std::to_string(i));
      handles_.push_back(cuda::export_ipc_handle(buffers_.back())); // exported once
    }
  }
  std::uint32_t count() const override { return static_cast<std::uint32_t>(buffers_.size()); }
  std::uint64_t bytes() const override { return bytes_; }
  std::byte* data(std::uint32_t i) const override { return buffers_.at(i).data(); }
  std::string handle(std::uint32_t i) const override { return handles_.at(i); }

private:
  std::uint64_t bytes_;
  std::vector<cuda::device_allocation> buffers_;
  std::vector<std::string> handles_;
};
#endif

} // namespace

std::string device_uuid(const device::spec& device) {
  if (device.k == device::kind::cpu)
    return device::cpu_uuid(device.index);
#if REFIT_HAVE_CUDA
  return cuda::device_uuid(device.index);
#else
  no_cuda(device, "device identity");
#endif
}

std::uint64_t device_free_bytes(const device::spec& device) {
  if (device.k == device::kind::cpu)
    return device::host_available_bytes();
#if REFIT_HAVE_CUDA
  return cuda::free_bytes(device.index);
#else
  no_cuda(device, "free memory");
#endif
}

std::unique_ptr<buffer_pool> make_buffer_pool(const device::spec& device, std::uint32_t count,
                                              std::uint64_t bytes) {
  if (device.k == device::kind::cpu)
    return std::make_unique<host_pool>(count, bytes);
#if REFIT_HAVE_CUDA
  return std::make_unique<cuda_pool>(device.index, count, bytes);
#else
  no_cuda(device, "packed buffers");
#endif
}

std::shared_ptr<collective_registry> make_collective_registry(
  const std::vector<device::spec>& rank_devices) {
  if (rank_devices.empty())
    throw std::invalid_argument("a collective needs at least one rank");
  const auto kind = rank_devices.front().k;
  for (const auto& d : rank_devices)
    if (d.k != kind)
      throw std::invalid_argument("trainer ranks mix CPU and CUDA devices ("
                                  + device::to_string(rank_devices.front()) + ", "
                                  + device::to_string(d) + "): one collective needs one kind");
  if (kind == device::kind::cpu)
    return std::make_shared<local_collective_registry>(
      static_cast<std::uint32_t>(rank_devices.size()));
#if REFIT_HAVE_CUDA
  std::vector<int> ordinals;
  for (const auto& d : rank_devices)
    ordinals.push_back(d.index);
  return cuda::make_nccl_registry(std::move(ordinals));
#else
  no_cuda(rank_devices.front(), "the trainer collective");
#endif
}

std::vector<std::vector<std::uint64_t>> expected_resident_digests(
  const model::model_config& cfg, std::uint32_t tp, const model::synthetic_weights& weights,
  std::uint64_t step, const device::spec& on) {
  // Weights that start from a checkpoint are recomputed on the host (the device twin only
  // generates the seeded init).
  if (on.k == device::kind::cuda && !weights.initial) {
#if REFIT_HAVE_CUDA
    return cuda::expected_resident_digests(on.index, cfg, tp, weights, step);
#else
    no_cuda(on, "the verifier");
#endif
  }
  model::tp_layout layout(cfg, tp);
  const auto& residents = layout.residents();
  std::vector<std::vector<std::uint64_t>> out(tp, std::vector<std::uint64_t>(residents.size()));
  for (std::uint32_t r = 0; r < tp; ++r)
    for (std::size_t i = 0; i < residents.size(); ++i)
      out[r][i] = model::zero_digest(residents[i].nbytes / model::dtype_size(residents[i].dt));
  // Each placed element e at resident index d turns element_term(d, 0) into
  // element_term(d, bits(e)).
  for (const auto& p : model::expected_key_stream(cfg)) {
    const auto full = full_tensor(p, weights, step);
    const std::uint64_t es = model::dtype_size(p.dt);
    for (std::uint32_t r = 0; r < tp; ++r) {
      for (const auto& pl : layout.place(p, r)) {
        std::uint64_t sum = 0;
        for (std::uint64_t row = 0; row < pl.rows; ++row) {
          const std::byte* src = full.data() + pl.src_offset + row * pl.src_stride;
          const std::uint64_t dst = (pl.dst_offset + row * pl.dst_stride) / es;
          for (std::uint64_t c = 0; c < pl.row_bytes / es; ++c) {
            std::uint32_t bits = 0;
            if (es == 2) {
              std::uint16_t b;
              std::memcpy(&b, src + c * 2, 2);
              bits = b;
            } else {
              std::memcpy(&bits, src + c * 4, 4);
            }
            sum += model::element_term(dst + c, bits) - model::element_term(dst + c, 0);
          }
        }
        out[r][pl.resident_index] += sum;
      }
    }
  }
  return out;
}

} // namespace refit::publication
