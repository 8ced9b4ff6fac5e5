// FSDP2-style dim-0 sharding of canonical tensors and a trainer rank's shard storage.
// Rank r of `world` holds rows [r*s, r*s + s) of a tensor with dim0 rows, s = ceil(dim0/world);
// rows past dim0 are zero padding, so every rank's shard has the same size and an all-gather
// of the shards yields the full tensor followed by the padding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/device/device.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/model/synthetic.hpp"

namespace refit::publication {

struct shard_spec {
  std::uint64_t row_bytes = 0;    // bytes of one dim-0 row (whole tensor for 0-d/1-d: see below)
  std::uint64_t rows_per_rank = 0;
  std::uint64_t row_begin = 0;    // first global row of this rank
  std::uint64_t real_rows = 0;    // rows of this rank inside dim0 (<= rows_per_rank)
  std::uint64_t padded_bytes() const { return row_bytes * rows_per_rank; }
  std::uint64_t real_bytes() const { return row_bytes * real_rows; }
};

// 1-d tensors shard their single dimension (row = one element).
shard_spec shard_of(const model::param_meta& p, std::uint32_t world, std::uint32_t rank);

// All canonical tensors' shards of one rank, contiguous per tensor, with synthetic weights,
// in host memory (cpu:N) or in the device memory of cuda:N (REFIT_CUDA builds; values are
// generated and stepped by kernels, bit-identical to the host's). data() points into that
// memory.
class shard_store {
public:
  shard_store(std::vector<model::param_meta> params, std::uint32_t world, std::uint32_t rank,
              model::synthetic_weights weights, device::spec device = {},
              bool allocate_now = true);
  // Allocates the storage and fills it with the step-0 weights: done by the constructor
  // unless allocate_now is false (a trainer rank does it on its worker thread: on a GPU it is
  // a large cudaMalloc and thousands of kernels). Throws on failure; ready() tells.
  void allocate();
  bool ready() const { return storage_ != nullptr; }
  std::uint32_t world() const { return world_; }
  std::uint32_t rank() const { return rank_; }
  std::uint64_t step() const { return step_; }
  const std::vector<model::param_meta>& params() const { return params_; }
  // Index of a canonical tensor by name; throws model::model_error if unknown.
  std::size_t index_of(const std::string& name) const;
  const shard_spec& spec(std::size_t i) const { return specs_[i]; }
  // Padded shard bytes of tensor i (padding rows are zero).
  const std::byte* data(std::size_t i) const;
  std::byte* mutable_data(std::size_t i);
  // One synthetic optimizer step on every shard (step_ + 1).
  void apply_step();
  std::uint64_t bytes() const { return storage_size_; }
  const device::spec& device() const { return device_; }

private:
  std::vector<model::param_meta> params_;
  std::vector<shard_spec> specs_;
  std::vector<std::uint64_t> offsets_;
  std::unordered_map<std::string, std::size_t> index_by_name_;
  std::uint32_t world_;
  std::uint32_t rank_;
  model::synthetic_weights weights_;
  std::uint64_t step_ = 0;
  device::spec device_;
  std::shared_ptr<void> owner_; // the host array or the device allocation
  std::byte* storage_ = nullptr;
  std::uint64_t storage_size_ = 0;
};

// The full canonical tensor at `step` (what an all-gather of every rank's shard yields,
// without the padding): used by tests and the byte-exact verifier.
std::vector<std::byte> full_tensor(const model::param_meta& p, const model::synthetic_weights& w,
                                   std::uint64_t step);

} // namespace refit::publication
