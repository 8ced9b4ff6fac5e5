// Dim-0 shards of canonical tensors and one rank's synthetic shard storage (see shard.hpp).
#include "runtime/publication/shard.hpp"

#include <algorithm>
#include <stdexcept>

#if REFIT_HAVE_CUDA
#include "runtime/cuda/cuda.hpp"
#endif

namespace refit::publication {

namespace {

// Every tensor's shard starts on a cache line inside the store.
constexpr std::uint64_t shard_alignment = 64;

std::uint64_t align_up(std::uint64_t value, std::uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

} // namespace

// A row is one index of dim 0: dtype size times the product of the other dims. For a 1-d
// tensor that is one element; a 0-d tensor is a single row of one element.
shard_spec shard_of(const model::param_meta& p, std::uint32_t world, std::uint32_t rank) {
  if (world == 0)
    throw model::model_error(p.name, "cannot shard over world 0 (world must be >= 1)");
  if (rank >= world)
    throw model::model_error(p.name, "rank " + std::to_string(rank) + " is out of range for world "
                                         + std::to_string(world));
  p.numel(); // rejects negative dimensions, naming the tensor
  const std::uint64_t dim0 = p.shape.empty() ? 1 : static_cast<std::uint64_t>(p.shape.front());
  std::uint64_t row_bytes = model::dtype_size(p.dt);
  for (std::size_t d = 1; d < p.shape.size(); ++d)
    row_bytes *= static_cast<std::uint64_t>(p.shape[d]);

  shard_spec spec;
  spec.row_bytes = row_bytes;
  spec.rows_per_rank = (dim0 + world - 1) / world;
  spec.row_begin = rank * spec.rows_per_rank;
  spec.real_rows = spec.row_begin >= dim0 ? 0 : std::min(dim0 - spec.row_begin, spec.rows_per_rank);
  return spec;
}

shard_store::shard_store(std::vector<model::param_meta> params, std::uint32_t world,
                         std::uint32_t rank, model::synthetic_weights weights,
                         device::spec device, bool allocate_now)
  : params_(std::move(params)), world_(world), rank_(rank), weights_(weights), device_(device) {
  specs_.reserve(params_.size());
  offsets_.reserve(params_.size());
  index_by_name_.reserve(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    if (!index_by_name_.emplace(p.name, i).second)
      throw model::model_error(p.name, "tensor appears twice in the shard store's key stream");
    specs_.push_back(shard_of(p, world_, rank_));
    storage_size_ = align_up(storage_size_, shard_alignment);
    offsets_.push_back(storage_size_);
    storage_size_ += specs_.back().padded_bytes();
  }
  if (allocate_now)
    allocate();
}

void shard_store::allocate() {
  if (storage_ != nullptr)
    return;
  std::byte* base = nullptr;
  std::shared_ptr<void> owner;
  std::vector<std::uint64_t> offsets = offsets_;
  if (device_.k == device::kind::cuda) {
#if REFIT_HAVE_CUDA
    // cudaMalloc aligns to 256 bytes; the allocation is zero-filled (the padding rows).
    auto alloc = std::make_shared<cuda::device_allocation>(
      device_.index, std::max<std::uint64_t>(storage_size_, 1),
      "the shards of trainer rank " + std::to_string(rank_));
    base = alloc->data();
    owner = std::move(alloc);
#else
    throw std::invalid_argument(device::to_string(device_)
                                + ": trainer shards on CUDA devices need a build with REFIT_CUDA=ON");
#endif
  } else {
    // new[] only guarantees alignof(max_align_t): over-allocate and shift every offset so
    // that each shard starts on a shard_alignment boundary in memory.
    std::shared_ptr<std::byte> host(new std::byte[storage_size_ + shard_alignment](),
                                    std::default_delete<std::byte[]>());
    const auto address = reinterpret_cast<std::uintptr_t>(host.get());
    const std::uint64_t shift = align_up(address, shard_alignment) - address;
    for (auto& offset : offsets)
      offset += shift;
    base = host.get();
    owner = std::move(host);
  }

  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& spec = specs_[i];
    const std::uint64_t elements_per_row = spec.row_bytes / model::dtype_size(params_[i].dt);
    const std::uint64_t begin = spec.row_begin * elements_per_row;
    const std::uint64_t count = spec.real_rows * elements_per_row;
#if REFIT_HAVE_CUDA
    if (device_.k == device::kind::cuda) {
      cuda::fill_synthetic(device_.index, params_[i], weights_, 0, begin, count,
                           base + offsets[i]);
      continue;
    }
#endif
    model::fill_synthetic(params_[i], weights_, 0, begin, count, base + offsets[i]);
  }
  // Published only once every shard holds its values.
  offsets_ = std::move(offsets);
  owner_ = std::move(owner);
  storage_ = base;
}

std::size_t shard_store::index_of(const std::string& name) const {
  const auto it = index_by_name_.find(name);
  if (it == index_by_name_.end())
    throw model::model_error(name, "tensor is not in the shard store of rank "
                                       + std::to_string(rank_) + " (" + std::to_string(params_.size())
                                       + " tensors)");
  return it->second;
}

const std::byte* shard_store::data(std::size_t i) const { return storage_ + offsets_.at(i); }

std::byte* shard_store::mutable_data(std::size_t i) { return storage_ + offsets_.at(i); }

void shard_store::apply_step() {
  if (storage_ == nullptr)
    throw std::logic_error("shard store of rank " + std::to_string(rank_)
                           + ": optimizer step before the storage was allocated");
  const std::uint64_t next_step = step_ + 1;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& spec = specs_[i];
    const std::uint64_t elements_per_row = spec.row_bytes / model::dtype_size(params_[i].dt);
    const std::uint64_t begin = spec.row_begin * elements_per_row;
    const std::uint64_t count = spec.real_rows * elements_per_row;
#if REFIT_HAVE_CUDA
    if (device_.k == device::kind::cuda) {
      cuda::apply_synthetic_step(device_.index, params_[i], weights_, next_step, begin, count,
                                 storage_ + offsets_[i]);
      continue;
    }
#endif
    model::apply_synthetic_step(params_[i], weights_, next_step, begin, count,
                                storage_ + offsets_[i]);
  }
  step_ = next_step;
}

std::vector<std::byte> full_tensor(const model::param_meta& p, const model::synthetic_weights& w,
                                   std::uint64_t step) {
  std::vector<std::byte> bytes(p.nbytes());
  model::fill_synthetic(p, w, step, 0, p.numel(), bytes.data());
  return bytes;
}

} // namespace refit::publication
