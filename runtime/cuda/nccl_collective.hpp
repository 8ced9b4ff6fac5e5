// The GPU collective: one NCCL communicator per trainer rank (one device each; the ranks are
// threads of one process), behind publication::collective. Materializing a chunk all-gathers
// the dim-0 shards of its tensors straight into the packed device buffer: one
// ncclGroupStart/End per chunk with one ncclAllGather per tensor inside it (one fused launch,
// not one per tensor). Communicators are non-blocking, so every wait polls against the
// deadline and the abort flag: a rank that never arrives or a gate abort ends in
// ncclCommAbort and an error, never a hang. Communicators live across publications and are
// replaced by the registry only after an abort.
#pragma once

#include <memory>
#include <vector>

#include "runtime/publication/collective_registry.hpp"

namespace refit::cuda {

// `ordinals[r]` is trainer rank r's CUDA device.
std::shared_ptr<publication::collective_registry> make_nccl_registry(std::vector<int> ordinals);

} // namespace refit::cuda
