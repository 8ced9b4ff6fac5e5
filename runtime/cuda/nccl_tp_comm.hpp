// The TP group of refit-runtime over NCCL (inference::tp_comm, runtime/inference/tp_comm.hpp):
// one non-blocking NCCL communicator per rank, rank r on CUDA device ordinals[r] (the ranks
// are threads of one process), created once for the life of the runtime.
//
// Device collectives (on_device() is true): all_reduce_sum_device / all_gather_device enqueue
// ncclAllReduce / ncclAllGather (float32 or bfloat16) on the caller's stream and return once
// NCCL has enqueued them; they are legal inside a CUDA-graph capture. wait_device() records an
// event on the stream and polls it against the timeout and the abort flag.
//
// Host collectives (all_reduce_sum / all_gather on host float*, the fp32 reference forward):
// copied to a per-rank device scratch, reduced or gathered by NCCL on a per-rank stream, waited
// for with the same deadline, copied back.
//
// Failure, as inproc_comm: a rank that waits longer than the timeout, or sees an NCCL error,
// aborts the group; abort() (any thread) fails every waiting and later call with comm_error. A
// rank that notices the abort while waiting ncclCommAbort's its own communicator on its own
// thread (which ends its NCCL kernels); reset() (no rank in a collective) aborts the rest,
// creates a fresh set of communicators and bumps device_epoch(), so graphs captured on the
// old ones are dropped. Mismatched element counts are not detected (NCCL cannot): the engine is SPMD.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "runtime/inference/tp_comm.hpp"

namespace refit::cuda {

// `ordinals[r]`: TP rank r's CUDA device (distinct, at least 2). `timeout`: how long a rank
// waits for its collectives. Creates and waits for the communicators (at most
// max(timeout, 1 min)); throws cuda::error naming the devices when NCCL cannot create them.
std::unique_ptr<inference::tp_comm> make_nccl_tp_comm(std::vector<int> ordinals,
                                                      std::chrono::milliseconds timeout);

} // namespace refit::cuda
