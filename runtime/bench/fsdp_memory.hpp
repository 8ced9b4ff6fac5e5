// One trainer rank's own tensors the way an FSDP2 trainer holds them, for refit-bench publish
// --source registered: per parameter an unpadded Shard(0) row range (transformers 5 fused
// experts: <layer>.mlp.experts.gate_up_proj / down_proj, sharded over experts), filled with the
// synthetic weights at a step so the bytes are those of the synthetic source.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/model/synthetic.hpp"
#include "runtime/publication/registered.hpp"

namespace refit::bench {

class fsdp_memory {
public:
  // Allocates and fills this rank's rows of every parameter (fused experts).
  fsdp_memory(const model::model_config& cfg, std::uint32_t world, std::uint32_t rank,
              const model::synthetic_weights& w, std::uint64_t step);
  // The registered set over this memory, sealed (valid while this object lives).
  std::shared_ptr<const publication::registered_weights> registered() const { return reg_; }
  std::uint64_t bytes() const { return bytes_; }

private:
  std::vector<std::unique_ptr<std::byte[]>> storage_;
  std::shared_ptr<publication::registered_weights> reg_;
  std::uint64_t bytes_ = 0;
};

} // namespace refit::bench
