// The control server of refit-runtime: reads Request frames from the control socket,
// dispatches each command to all TP workers (waiting for every one of them), and answers
// with one Response per Request. Owns the runtime-wide state (sleep level, committed model
// version, weight validity, prefix cache); weight publication runs through weight_transfer.
// Also applies the test-only faults of --fault.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "messages/control.pb.h"
#include "runtime/child/load_progress.hpp"
#include "runtime/child/weight_transfer.hpp"
#include "runtime/child/worker.hpp"
#include "runtime/device/device.hpp"
#include "runtime/inference/generator.hpp"
#include "runtime/inference/tp_comm.hpp"
#include "runtime/model/qwen3_moe.hpp"

namespace refit::child {

namespace pb = refit::control::v1;

// One log line on stderr, prefixed "refit-runtime[pid]: ".
void log_line(const std::string& message);

// The TP group over `devices` (rank r on devices[r]); see server::comm_. Throws naming the
// devices when NCCL cannot create the communicators, and naming REFIT_TP_COMM when it is
// neither 'inproc' nor 'nccl' or asks for NCCL where it cannot work.
std::unique_ptr<inference::tp_comm> make_tp_comm(const std::vector<device::spec>& devices,
                                                 std::chrono::milliseconds timeout);

enum class fault_kind {
  stall,         // never answer; stay alive
  exit,          // _exit(3) without answering
  sigkill,       // raise(SIGKILL)
  error,         // ok=false, ERROR_CODE_INJECTED
  bad_frame,     // 16 bytes that are not a frame header
  wrong_id,      // echo request_id + 1
  wrong_command, // echo another command
  wrong_result,  // ok=true with the result case of another command
  wrong_version, // echo protocol_version 99
  forge_receipt, // run the command, then forge the last receipt's device UUID (finish only)
  skew_logprobs, // run the command, then add 0.5 to every reported logprob (generate only)
};

// A fault applied to the (after+1)-th occurrence of `command`, instead of running it.
struct fault_spec {
  pb::Command command = pb::COMMAND_UNSPECIFIED;
  fault_kind kind = fault_kind::error;
  std::uint32_t after = 0;
};

// Parses "COMMAND:KIND[:AFTER]" (e.g. "sleep:stall", "describe:error:1").
// Throws std::invalid_argument saying which part is wrong.
fault_spec parse_fault(const std::string& text);

struct server_options {
  int control_fd = -1;
  std::vector<device::spec> devices; // one per TP rank, in rank order
  model::model_config model;
  std::uint64_t kv_cache_bytes = 0;  // per worker
  model::dtype compute_dtype = model::dtype::float32; // resolved (never "auto")
  std::uint32_t max_batch = 256;
  std::size_t max_frame_bytes = 0;
  std::uint64_t seed = 0;            // synthetic checkpoint weights
  float init_scale = 0.02f;          // their scale (the trainer's trainer.init_scale)
  std::string checkpoint_dir;        // "" = synthetic weights; else a Hugging Face model dir
  bool exportable_weights = false;   // --publication-mode direct
  std::vector<fault_spec> faults;
};

class server {
public:
  // Starts one worker per device, allocates weights and KV cache and loads the checkpoint
  // (synthetic weights at step 0). Throws on failure.
  explicit server(server_options options);
  server(const server&) = delete;
  server& operator=(const server&) = delete;
  // Frees all memory and joins the workers.
  ~server();

  // Serves requests until shutdown or until the parent closes the channel (returns 0), or
  // until the channel breaks (returns 1).
  int serve();

private:
  // A parsed request, or the error response that answers an unusable frame.
  struct decoded {
    std::optional<pb::Request> request;
    pb::Response rejection;
  };

  decoded decode(const std::string& frame) const;
  pb::Response execute(const pb::Request& request);
  // What a fault puts on the channel instead of the normal answer: a response, raw bytes,
  // or nothing (faults that stall or end the process never return).
  struct fault_reply {
    std::optional<pb::Response> response;
    std::string raw_bytes;
  };

  // Counts an occurrence of `command`; returns the fault that applies to it, if any.
  const fault_spec* take_fault(pb::Command command);
  fault_reply apply_fault(const fault_spec& fault, const pb::Request& request);
  bool send(const pb::Response& response);
  bool send_raw(const std::string& bytes);

  void load_checkpoint();
  // Version 0's weights as describe reports them (path empty: synthetic).
  checkpoint_info checkpoint_;
  std::vector<worker_report> worker_reports();
  // Throws INVALID_STATE naming `command` unless every worker's weights are resident.
  void require_weights_awake(const std::string& command);
  pb::DescribeResult describe();
  pb::MemoryResult sleep(const pb::SleepRequest& request);
  pb::MemoryResult wake_up(const pb::WakeUpRequest& request);
  // Drops every worker's prefix cache (entries dropped: rank 0's count).
  pb::ResetPrefixCacheResult reset_prefix_cache();
  // Runs the request on every TP worker (SPMD), checks that all ranks produced identical
  // samples and answers rank 0's. Refused while the weights or the KV cache sleep, while the
  // weights are invalid and while a publication is open.
  pb::GenerateResult generate(const pb::GenerateRequest& request);
  // Teacher-forced fp32 logprobs of the request's sequences (inference::engine::score) on
  // every TP worker; refused exactly when generate is.
  pb::ScoreResult score(const pb::ScoreRequest& request);
  // The refusals generate and score share: an open publication, weights or KV cache not
  // resident, weights not valid (INVALID_STATE at `command`).
  void require_generation_state(const std::string& command);
  // Runs fn on every TP worker at once (SPMD over comm_) and waits for all of them. A failing
  // worker aborts the comm so the others throw instead of hanging; the comm is reset. The
  // first failure that is not such a consequence is rethrown (after on_failure) as a
  // command_error: a request_error as INVALID_ARGUMENT at `command.<where>`.
  void run_on_workers(const std::string& command, const std::function<void(worker&)>& fn,
                      const std::function<void()>& on_failure);
  pb::InitWeightTransferResult init_weight_transfer(const pb::InitWeightTransferRequest& request);
  // A started publication makes the weights invalid until it finishes.
  pb::StartWeightUpdateResult start_weight_update(const pb::StartWeightUpdateRequest& request);
  // Commits a validated publication: model version, valid weights, prefix cache reset.
  pb::FinishWeightUpdateResult finish_weight_update(const pb::FinishWeightUpdateRequest& request);

  server_options options_;
  const std::shared_ptr<const model::tp_layout> layout_;
  // Connects the TP workers during generate; reset after every request. NCCL
  // (cuda::make_nccl_tp_comm) when tp > 1 on distinct CUDA devices of a CUDA build, else the
  // in-process host-memory group; REFIT_TP_COMM=inproc|nccl forces one. Declared before
  // workers_: the workers' engines (CUDA graphs holding NCCL calls) go before the comm.
  std::unique_ptr<inference::tp_comm> comm_;
  std::vector<std::unique_ptr<worker>> workers_;
  weight_transfer transfer_; // after workers_: refers to them
  std::uint32_t sleep_level_ = 0;
  bool weights_valid_ = false;
  std::uint64_t model_version_ = 0;
  std::map<pb::Command, std::uint32_t> occurrences_; // requests seen per command
};

} // namespace refit::child
